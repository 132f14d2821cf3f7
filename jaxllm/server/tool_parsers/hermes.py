"""Hermes format (Qwen2.5, Qwen3, Hermes 2/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, after optional content.

The message's content is the text before the first block; text after a block is not content
(as in vLLM). A block whose JSON is not a call makes the whole message content.
"""

from __future__ import annotations

from jaxllm.server.text_markers import held_back
from jaxllm.server.tool_parsers.base import (
    CallDeltas,
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from jaxllm.server.tool_parsers.json_scan import CallObjectStream, call_from_json, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(START)
        if first < 0:
            return ExtractedToolCalls(text or None)
        calls = []
        at = first
        while at >= 0:
            body_start = at + len(START)
            close = text.find(END, body_start)
            body = text[body_start : close if close >= 0 else len(text)]
            found = call_from_json(body, skip_ws(body, 0))
            if found is None or body[found[2] :].strip():
                return ExtractedToolCalls(text)
            calls.append(ToolCall(found[0], found[1]))
            at = text.find(START, close + len(END)) if close >= 0 else -1
        return ExtractedToolCalls(text[:first] or None, calls)

    def stream(self) -> ToolCallStream:
        return HermesStream()


class HermesStream(ToolCallStream):
    def __init__(self) -> None:
        self.state = "content"  # then "call" (inside a block) and "between" (looking for the next)
        self.pending = ""  # text not yet handed on
        self.walker: CallObjectStream | None = None
        self.index = 0
        self.calls = CallDeltas()

    def feed(self, text: str) -> DeltaMessage:
        out = DeltaMessage()
        self.pending += text
        while self.pending:
            if self.state == "call":
                assert self.walker is not None
                chunk, self.pending = self.pending, ""
                out.tool_calls += self.calls.entries(self.index, self.walker.feed(chunk))
                if not self.walker.done:
                    break
                tail = self.walker.end if self.walker.end is not None else self.walker.pos
                self.pending = self.walker.text[tail:]
                self.state = "between"
                continue
            found = self.pending.find(START)
            if found < 0:
                keep = held_back(self.pending, START)
                if self.state == "content":
                    out.content += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                break
            if self.state == "content":
                out.content += self.pending[:found]
            self.pending = self.pending[found + len(START) :]
            self.state, self.walker, self.index = "call", CallObjectStream(), self.calls.start()
        return out

    def finish(self) -> DeltaMessage:
        out = DeltaMessage(content=self.pending if self.state == "content" else "")
        self.pending = ""
        return out
