"""N-gram (prompt lookup) drafts: the text that followed the last n tokens the last time.

For each request the proposer keeps an index from every n-gram (n = 1 ..
`max_matching_ngram_size`) of its prompt and output to the positions just after it, updated
incrementally as tokens arrive, so a proposal costs a few dictionary look-ups whatever the
length of the text. A proposal matches the longest suffix of the text first (n from
`max_matching_ngram_size` down to 1) and copies up to `max_draft_len` tokens that followed
it. `is_use_oldest` picks the first occurrence (else the most recent one); `is_keep_all`
keeps every occurrence (else only the one `is_use_oldest` would pick). With `is_public_pool`
the n-grams of every request go into one pool, mapped to the continuations seen after them
(TensorRT-LLM's shared pool): a request can draft text another one produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from jaxllm.speculative_config import NGramDecodingConfig


@dataclass
class _Text:
    """One request's tokens and the n-gram index over them."""

    tokens: list[int] = field(default_factory=list)
    # n-gram -> positions (in `tokens`) right after its occurrences, oldest first.
    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)


class NGramProposer:
    """Proposes drafts from each request's own text (and a shared pool when public)."""

    def __init__(self, config: NGramDecodingConfig) -> None:
        self.config = config
        self._texts: dict[int, _Text] = {}
        # Shared pool: n-gram -> continuations (tuples of up to max_draft_len tokens).
        self._pool: dict[tuple[int, ...], list[tuple[int, ...]]] = {}

    def _extend(self, text: _Text, tokens: Sequence[int]) -> None:
        """Append the tokens that are new since the last call and index the n-grams they end."""
        cfg = self.config
        have = len(text.tokens)
        if len(tokens) < have or list(tokens[: min(have, 8)]) != text.tokens[: min(have, 8)]:
            text.tokens, text.index, have = [], {}, 0  # the text was rewritten (a pause folds outputs into the prompt)
        own = text.tokens
        keep_all, oldest = cfg.is_keep_all, cfg.is_use_oldest
        for token in tokens[have:]:
            own.append(int(token))
            end = len(own)
            # n-grams ending at end - 1 are followed by position `end` (known once it is appended,
            # so index the n-grams ending one before the new token).
            for n in range(1, cfg.max_matching_ngram_size + 1):
                start = end - 1 - n
                if start < 0:
                    break
                key = tuple(own[start : end - 1])
                positions = text.index.get(key)
                if positions is None:
                    text.index[key] = [end - 1]
                elif keep_all:
                    positions.append(end - 1)
                elif not oldest:
                    positions[0] = end - 1

    def _publish(self, text: _Text, start: int) -> None:
        """Put the continuations of the n-grams ending at or after `start` into the shared pool."""
        cfg = self.config
        own = text.tokens
        for end in range(max(start, 1), len(own)):
            follow = tuple(own[end : end + cfg.max_draft_len])
            if len(follow) < cfg.max_draft_len:
                break
            for n in range(1, cfg.max_matching_ngram_size + 1):
                if end - n < 0:
                    break
                conts = self._pool.setdefault(tuple(own[end - n : end]), [])
                if follow in conts:
                    continue
                if cfg.is_keep_all or not conts:
                    conts.append(follow)
                elif not cfg.is_use_oldest:
                    conts[0] = follow

    def propose(self, request_id: int, tokens: Sequence[int], max_len: Optional[int] = None) -> list[int]:
        """Up to `max_len` (default `max_draft_len`) draft tokens continuing `tokens` (the
        request's prompt and output so far); [] when no n-gram matches."""
        cfg = self.config
        limit = cfg.max_draft_len if max_len is None else min(max_len, cfg.max_draft_len)
        text = self._texts.get(request_id)
        if text is None:
            text = self._texts[request_id] = _Text()
        before = len(text.tokens)
        self._extend(text, tokens)
        if cfg.is_public_pool:
            self._publish(text, max(0, before - cfg.max_draft_len))
        if limit <= 0:
            return []
        own = text.tokens
        end = len(own)
        for n in range(min(cfg.max_matching_ngram_size, end - 1), 0, -1):
            key = tuple(own[end - n :])
            if cfg.is_public_pool:
                conts = self._pool.get(key)
                if conts:
                    return list((conts[0] if cfg.is_use_oldest else conts[-1])[:limit])
                continue
            positions = text.index.get(key)
            if not positions:
                continue
            # The match must start before the suffix itself (its own position is `end`, never indexed yet).
            pos = positions[0] if cfg.is_use_oldest else positions[-1]
            draft = own[pos : pos + limit]
            if draft:
                return draft
        return []

    def request_ids(self) -> list[int]:
        """The requests whose text the proposer keeps."""
        return list(self._texts)

    def release(self, request_id: int) -> None:
        """Forget a finished request's text (the shared pool keeps what it published)."""
        self._texts.pop(request_id, None)
