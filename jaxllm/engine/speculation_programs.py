"""Speculative decoding's device programs across the processes of a multi-host run.

Besides the step itself (which the followers already make, `jaxllm.engine.followers`), a
speculating engine runs two programs of its own: the verification of a step's drafts over
the logits that step returned, and, for MTP / a draft model / EAGLE-3, the drafter's program
over the step just read back. Both take global arrays (the step's logits, the target's hidden
states, the drafter's weights and pool on the mesh), so every process must launch them in the
leader's order. `SpeculationPrograms` is one process's half: the leader's are wrapped by
`MirroredSpeculation`, which sends each call to the followers first; a follower builds its own
(`jaxllm.engine.followers`) and makes the calls it receives. The host inputs of each program go onto
the mesh piece by piece (`put_on_mesh`), and the leader alone reads the results back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.engine.host_transfer import put_on_mesh
from jaxllm.sampling.rejection import VerifyOutput, verify_drafts
from jaxllm.speculative_config import MTPDecodingConfig, SpeculativeConfig


def relaxed_options(config: SpeculativeConfig) -> dict:
    """The relaxed-acceptance options of `config` for the verifier (empty: exact acceptance)."""
    if isinstance(config, MTPDecodingConfig) and config.use_relaxed_acceptance_for_thinking:
        return dict(relaxed_topk=config.relaxed_topk, relaxed_delta=config.relaxed_delta)
    return {}


class SpeculationPrograms:
    """One process's verification program and drafter (None: n-gram drafts, made on the host)."""

    def __init__(self, runner: Any, drafter: Any, relaxed: dict) -> None:
        self.runner, self.drafter = runner, drafter
        self._verify = jax.jit(functools.partial(verify_drafts, **relaxed))
        self._replicated = jax.sharding.NamedSharding(runner.mesh, jax.sharding.PartitionSpec())

    def verify(
        self, context_logits: jax.Array, tensors: Any, draft_ids: np.ndarray, thinking: Optional[np.ndarray]
    ) -> VerifyOutput:
        host = put_on_mesh((tensors, draft_ids, thinking), self._replicated)
        return self._verify(context_logits, *host)

    def draft(self, batch: Any, last_tokens: np.ndarray) -> jax.Array:
        """The drafter's program over the step the runner ran last (its hidden states)."""
        return self.drafter.launch(batch, last_tokens, self.runner.last_hidden)


class MirroredSpeculation:
    """The leader's `SpeculationPrograms`: each call is sent to the followers, then made here.
    `send(method, args)`; `reference(array)`: how a follower finds a device array of the
    leader's (the latest output of a mirrored runner call)."""

    def __init__(self, programs: SpeculationPrograms, send: Callable[[str, tuple], None], reference: Any) -> None:
        self.programs, self._send, self._reference = programs, send, reference

    def verify(
        self, context_logits: jax.Array, tensors: Any, draft_ids: np.ndarray, thinking: Optional[np.ndarray]
    ) -> VerifyOutput:
        self._send("verify", (self._reference(context_logits), tensors, draft_ids, thinking))
        return self.programs.verify(context_logits, tensors, draft_ids, thinking)

    def draft(self, batch: Any, last_tokens: np.ndarray, hidden: Optional[jax.Array]) -> jax.Array:
        """A `StepDrafter.launcher`: the followers draft from their own last hidden states,
        which are the step's only if it is the step the runner ran last."""
        if hidden is not self.programs.runner.last_hidden:
            raise RuntimeError("a multi-host drafter runs only over the step the runner ran last")
        self._send("draft", (batch, last_tokens))
        return self.programs.draft(batch, last_tokens)
