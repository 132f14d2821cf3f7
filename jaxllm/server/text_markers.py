"""Finding a marker (`<tool_call>`, `</think>`, ...) in text that arrives in pieces."""

from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`: they wait for the next
    piece before being passed on as text."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
