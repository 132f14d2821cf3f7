"""Llama 3.1-3.3 JSON format: the message is one or more `{"name": ..., "parameters": {...}}`
objects (`"arguments"` is accepted too), separated by `;`, optionally after `<|python_tag|>`.

Only a message that starts (after whitespace) with `{` or `<|python_tag|>` holds calls, and then
it has no content; anything else, or objects that are not calls, is plain content.
"""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import (
    CallDeltas,
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from jaxllm.server.tool_parsers.json_scan import CallObjectStream, call_from_json, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract(self, text: str) -> ExtractedToolCalls:
        at = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, at):
            at = skip_ws(text, at + len(PYTHON_TAG))
        elif not text.startswith("{", at):
            return ExtractedToolCalls(text or None)
        calls = []
        while at < len(text):
            found = call_from_json(text, at)
            if found is None:
                return ExtractedToolCalls(text)
            calls.append(ToolCall(found[0], found[1]))
            at = skip_ws(text, found[2])
            if text.startswith(";", at):
                at = skip_ws(text, at + 1)
        if not calls:
            return ExtractedToolCalls(text or None)
        return ExtractedToolCalls(None, calls)

    def stream(self) -> ToolCallStream:
        return Llama3JsonStream()


class Llama3JsonStream(ToolCallStream):
    def __init__(self) -> None:
        self.state = "start"  # then "content", or "between" / "call" / "failed" for calls
        self.pending = ""
        self.head = ""  # text before the first call, content if no call follows
        self.walker: CallObjectStream | None = None
        self.index = 0
        self.calls = CallDeltas()

    def feed(self, text: str) -> DeltaMessage:
        out = DeltaMessage()
        if self.state == "content":
            out.content = text
            return out
        if self.state == "failed":
            return out
        self.pending += text
        if self.state == "start":
            at = skip_ws(self.pending, 0)
            rest = self.pending[at:]
            if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
                return out
            if rest.startswith(PYTHON_TAG):
                cut = at + len(PYTHON_TAG)
            elif rest.startswith("{"):
                cut = at
            else:
                self.state, out.content, self.pending = "content", self.pending, ""
                return out
            self.head, self.pending, self.state = self.pending[:cut], self.pending[cut:], "between"
        while self.pending:
            if self.state == "between":
                at = skip_ws(self.pending, 0)
                if at < len(self.pending) and self.pending[at] == ";" and self.calls.count:
                    at = skip_ws(self.pending, at + 1)
                if at >= len(self.pending):
                    self.head += self.pending if not self.calls.count else ""
                    self.pending = ""
                    break
                if self.pending[at] != "{":
                    self.state, self.pending = "failed", ""
                    break
                self.pending = self.pending[at:]
                self.state, self.walker, self.index = "call", CallObjectStream(), self.calls.start()
            assert self.walker is not None
            chunk, self.pending = self.pending, ""
            out.tool_calls += self.calls.entries(self.index, self.walker.feed(chunk))
            if self.walker.failed:
                self.state = "failed"
                break
            if self.walker.end is not None:
                self.pending, self.state = self.walker.text[self.walker.end :], "between"
        return out

    def finish(self) -> DeltaMessage:
        if self.state == "start" or (self.state == "between" and not self.calls.count):
            return DeltaMessage(content=self.head + self.pending)
        return DeltaMessage()
