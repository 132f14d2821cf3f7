"""What every tool-call parser gives: the calls of a whole message (`ToolParser.extract`) and,
for streaming, a `ToolCallStream` turning text deltas into content and `delta.tool_calls`.

A call's `arguments` is the JSON text the model wrote; the streamed fragments of a call add
up to exactly that text, and the streamed content to the message's content.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from jaxllm.server.tool_parsers.json_scan import CallEvents


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=make_tool_call_id)

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    """A message split into its content (None when there is none) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class DeltaMessage:
    """One streamed step: content and reasoning text, and OpenAI `delta.tool_calls` entries."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


class CallDeltas:
    """Numbers the calls of one stream and turns their events into `delta.tool_calls` entries:
    the first entry of a call carries its index, id, type and name, later ones argument text."""

    def __init__(self) -> None:
        self.count = 0

    def start(self) -> int:
        self.count += 1
        return self.count - 1

    def entries(self, index: int, events: CallEvents) -> list[dict]:
        if events.name is not None:
            return [
                {
                    "index": index,
                    "id": make_tool_call_id(),
                    "type": "function",
                    "function": {"name": events.name, "arguments": events.arguments},
                }
            ]
        if events.arguments:
            return [{"index": index, "function": {"arguments": events.arguments}}]
        return []


class ToolCallStream(ABC):
    """Incremental parsing of one choice's text."""

    @abstractmethod
    def feed(self, text: str) -> DeltaMessage: ...

    @abstractmethod
    def finish(self) -> DeltaMessage:
        """The generation ended: whatever was held back."""


class ToolParser(ABC):
    """One model family's tool-call format."""

    name: ClassVar[str]

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def stream(self) -> ToolCallStream: ...
