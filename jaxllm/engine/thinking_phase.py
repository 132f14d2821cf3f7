"""Which verification entries lie inside a request's thinking span (relaxed MTP acceptance).

`MTPDecodingConfig(use_relaxed_acceptance_for_thinking=True)` relaxes the acceptance of drafts
while a reasoning model thinks: after its begin-thinking token `<think>` and before
`</think>` (ids looked up in the tokenizer). An entry that verifies draft j + 1 of a row sees
the row's sequence followed by drafts 1..j, so its flag is the thinking state after those
tokens: a draft `<think>` opens the span for the entries after it, a draft `</think>` closes it.

Each request's state is kept with the length of sequence it was computed over, so a step scans
only the tokens that arrived since (prompt and output alike: DeepSeek-R1's chat template ends
the prompt with `<think>`).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from jaxllm.llm_request import LlmRequest

BEGIN_THINKING = "<think>"
END_THINKING = "</think>"


@dataclass(frozen=True)
class ThinkingTokens:
    """The token ids that open and close a thinking span."""

    begin: int
    end: int


def thinking_tokens(tokenizer: Any) -> ThinkingTokens:
    """The ids of `<think>` and `</think>` in `tokenizer`; ValueError when it has none."""
    where = "MTPDecodingConfig.use_relaxed_acceptance_for_thinking"
    if tokenizer is None:
        raise ValueError(f"{where} needs the model's tokenizer (for its {BEGIN_THINKING} and {END_THINKING} tokens)")
    vocab = tokenizer.get_vocab()
    missing = [t for t in (BEGIN_THINKING, END_THINKING) if t not in vocab]
    if missing:
        raise ValueError(f"{where} needs a reasoning model: its tokenizer has no {' or '.join(missing)} token")
    return ThinkingTokens(int(vocab[BEGIN_THINKING]), int(vocab[END_THINKING]))


class ThinkingPhases:
    """Per request, whether its sequence ends inside a thinking span (engine thread only)."""

    def __init__(self, tokens: ThinkingTokens) -> None:
        self.tokens = tokens
        self._states: dict[int, tuple[int, bool]] = {}  # request id -> (tokens scanned, thinking)

    def _step(self, thinking: bool, token: int) -> bool:
        if token == self.tokens.begin:
            return True
        if token == self.tokens.end:
            return False
        return thinking

    def thinking(self, request: LlmRequest) -> bool:
        """Whether `request`'s whole sequence (prompt and output) ends inside a thinking span."""
        scanned, state = self._states.get(request.request_id, (0, False))
        n = request.num_tokens
        if scanned > n:  # the sequence got shorter: scan it again
            scanned, state = 0, False
        if n > scanned:
            begin, end = self.tokens.begin, self.tokens.end
            new = request.get_tokens(scanned, n)
            # The last begin or end token decides.
            for token in reversed(new):
                if token == begin or token == end:
                    state = token == begin
                    break
        self._states[request.request_id] = (n, state)
        return state

    def entry_flags(self, request: LlmRequest, draft: list[int]) -> list[bool]:
        """For each of the row's len(draft) + 1 verification entries, whether it is inside a
        thinking span (entry j: after the sequence and drafts 1..j)."""
        state = self.thinking(request)
        flags = [state]
        for token in draft:
            state = self._step(state, token)
            flags.append(state)
        return flags

    def forget(self, active: Container[int]) -> None:
        """Drop the states of requests no longer active."""
        for rid in [rid for rid in self._states if rid not in active]:
            del self._states[rid]
