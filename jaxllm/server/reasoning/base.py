"""Reasoning parsers: the text between `<think>` and `</think>` becomes `reasoning_content`, the
rest `content`. `extract` splits a whole message; `stream()` splits text deltas the same way,
holding back a partial tag until the next delta shows what it is."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from jaxllm.sampling.guided import ReasoningSpan
from jaxllm.server.text_markers import held_back

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning_content: str = ""
    content: str = ""


class ReasoningStream:
    """A streamed message's reasoning/content split.

    States: "opening" (the message may start with `<think>`, which is dropped), "thinking",
    "content" (before any `<think>`, without `starts_thinking`), "answer" (after `</think>`).
    """

    def __init__(self, starts_thinking: bool) -> None:
        self.state = "opening" if starts_thinking else "content"
        self.pending = ""

    def feed(self, text: str) -> ReasoningSplit:
        out = ReasoningSplit()
        self.pending += text
        while self.pending:
            if self.state == "answer":
                out.content += self.pending
                self.pending = ""
            elif self.state == "opening":
                if THINK_START.startswith(self.pending) and self.pending != THINK_START:
                    break  # could still become the opening tag
                if self.pending.startswith(THINK_START):
                    self.pending = self.pending[len(THINK_START) :]
                self.state = "thinking"
            else:
                marker = THINK_END if self.state == "thinking" else THINK_START
                found = self.pending.find(marker)
                cut = found if found >= 0 else len(self.pending) - held_back(self.pending, marker)
                if self.state == "thinking":
                    out.reasoning_content += self.pending[:cut]
                else:
                    out.content += self.pending[:cut]
                if found < 0:
                    self.pending = self.pending[cut:]
                    break
                self.pending = self.pending[found + len(marker) :]
                self.state = "answer" if self.state == "thinking" else "thinking"
        return out

    def finish(self) -> ReasoningSplit:
        """The end of the message: held-back text goes where it was heading."""
        pending, self.pending = self.pending, ""
        if self.state in ("opening", "thinking"):
            return ReasoningSplit(reasoning_content=pending)
        return ReasoningSplit(content=pending)


class ReasoningParser(ABC):
    name: ClassVar[str]
    span: ClassVar[ReasoningSpan]  # where the thinking is, for constraints that apply after it

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole message; None for an empty part."""

    @abstractmethod
    def stream(self) -> ReasoningStream: ...
