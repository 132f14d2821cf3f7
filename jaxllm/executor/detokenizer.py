"""Incremental detokenization and stop-string matching for one generated sequence.

Decoding token by token cannot just concatenate `decode([t])`: byte-level BPE splits a
multi-byte character over several tokens, and tokenizers that mark word starts (a
leading "▁") decode a token differently at the start of a text than after other tokens.
So each step decodes a short window - a few tokens already emitted, as context, plus
the new ones - and emits only the characters past the context; while the window ends
in an incomplete character (U+FFFD) nothing is emitted and the tokens wait for the
next step. This is the algorithm of vLLM and TensorRT-LLM's detokenizers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

# Prompt tokens decoded as context for the first output token (vLLM uses the same 5).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def make_decoder(tokenizer: Any) -> Callable[[Sequence[int], bool], str]:
    """`decode(ids, skip_special_tokens)` for `tokenizer`, as cheap as it can be made exactly.

    A stock Hugging Face fast tokenizer decodes by calling its Rust backend and, unless it
    is a BPE model, optionally cleaning up spaces; its Python wrapper costs several times
    the decode itself. When nothing but the backend call would happen, call it directly.
    """
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # older transformers: no such class, use the public API
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    stock = (
        TokenizersBackend is not None
        and isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer).decode is TokenizersBackend.decode
        and type(tokenizer)._decode is TokenizersBackend._decode
    )
    if stock and backend is not None:
        cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        is_bpe = type(backend.model).__name__ == "BPE" and not getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
        )
        if not cleanup or is_bpe:
            return lambda ids, skip_special_tokens: backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return lambda ids, skip_special_tokens: tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, never splitting a character."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        decoder: Optional[Callable[[Sequence[int], bool], str]] = None,
    ) -> None:
        self._decoder = decoder or make_decoder(tokenizer)
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the context window
        self._read_offset = len(self._ids)  # tokens before this are already in `text`
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._decoder(ids, self._skip_special)

    def add(self, token_ids: Sequence[int]) -> int:
        """Append tokens; returns how many characters were appended to `text`."""
        if not token_ids:
            return 0
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # An incomplete character (or a token that decodes to nothing yet): wait.
            return 0
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return len(delta)

    def flush(self) -> int:
        """At the end of the sequence emit whatever is pending, even an incomplete character."""
        if self._read_offset >= len(self._ids):
            return 0
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.text += delta
        return len(delta)

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]


def find_stop_string(
    text: str, new_char_count: int, stop: Sequence[str], include_stop_str_in_output: bool
) -> Optional[tuple[str, int]]:
    """Search the last `new_char_count` characters (and the overlap before them) for a stop string.

    Returns (stop_string, cut) where `text[:cut]` is the text to keep (cut == -1: keep all),
    or None. Only new text is searched, so each step costs O(new + longest stop string).
    """
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        start = max(0, len(text) - new_char_count - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index == -1:
            continue
        if include_stop_str_in_output:
            index += len(stop_str)
            if index >= len(text):
                return stop_str, -1
        return stop_str, index
    return None
