"""Ragged paged attention: the Pallas GPU kernel and its plain-XLA reference (MHA/GQA caches, and
the latent cache of multi-head latent attention)."""

from pallas_kernels.ragged_paged_attention.kernel import (
    AttentionTiling,
    ragged_paged_attention,
    ragged_paged_latent_attention,
)
from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    ragged_paged_latent_attention_reference,
)

__all__ = [
    "AttentionTiling",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_latent_attention",
    "ragged_paged_latent_attention_reference",
]
