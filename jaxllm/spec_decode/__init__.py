"""Draft proposers of speculative decoding (host side; the engine verifies the drafts)."""

from jaxllm.spec_decode.ngram import NGramProposer

__all__ = ["NGramProposer"]
