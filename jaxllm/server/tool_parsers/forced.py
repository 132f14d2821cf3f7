"""Output of `tool_choice="required"` and of a named function: plain JSON that guided decoding
holds to `tool_choice_schema`, not the model's own tool-call format (as in vLLM).

Required: `[{"name": ..., "parameters": {...}}, ...]` (`"arguments"` is accepted too), or one
such object without parallel tool calls; a named
function: the arguments object alone. Nothing of such a message is content.
"""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import (
    CallDeltas,
    CallEvents,
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from jaxllm.server.tool_parsers.json_scan import CallObjectStream, call_from_json, skip_ws


class RequiredCallsParser(ToolParser):
    """A JSON array of calls, or one call object."""

    name = "required"

    def extract(self, text: str) -> ExtractedToolCalls:
        at = skip_ws(text, 0)
        if text.startswith("{", at):
            found = call_from_json(text, at)
            if found is None or text[found[2] :].strip():
                return ExtractedToolCalls(text)
            return ExtractedToolCalls(None, [ToolCall(found[0], found[1])])
        if not text.startswith("[", at):
            return ExtractedToolCalls(text or None)
        calls = []
        at = skip_ws(text, at + 1)
        while not text.startswith("]", at):
            found = call_from_json(text, at)
            if found is None:
                return ExtractedToolCalls(text)
            calls.append(ToolCall(found[0], found[1]))
            at = skip_ws(text, found[2])
            if text.startswith(",", at):
                at = skip_ws(text, at + 1)
            elif not text.startswith("]", at):
                return ExtractedToolCalls(text)
        if text[at + 1 :].strip() or not calls:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(None, calls)

    def stream(self) -> ToolCallStream:
        return RequiredCallsStream()


class RequiredCallsStream(ToolCallStream):
    def __init__(self) -> None:
        self.state = "open"  # then "item" / "call" / "after", and "done" or "failed"
        self.single = False  # one call object rather than an array
        self.pending = ""
        self.walker: CallObjectStream | None = None
        self.index = 0
        self.calls = CallDeltas()

    def feed(self, text: str) -> DeltaMessage:
        out = DeltaMessage()
        self.pending += text
        while self.pending and self.state not in ("done", "failed"):
            if self.state == "call":
                assert self.walker is not None
                chunk, self.pending = self.pending, ""
                out.tool_calls += self.calls.entries(self.index, self.walker.feed(chunk))
                if self.walker.failed:
                    self.state = "failed"
                elif self.walker.end is not None:
                    self.pending = self.walker.text[self.walker.end :]
                    self.state = "done" if self.single else "after"
                continue
            at = skip_ws(self.pending, 0)
            if at >= len(self.pending):
                self.pending = ""
                break
            ch, self.pending = self.pending[at], self.pending[at:]
            if self.state == "open" and ch == "{":
                self.single, self.state, self.walker, self.index = True, "call", CallObjectStream(), self.calls.start()
            elif self.state == "open":
                self.state = "item" if ch == "[" else "failed"
                self.pending = self.pending[1:]
            elif self.state == "item" and ch == "{":
                self.state, self.walker, self.index = "call", CallObjectStream(), self.calls.start()
            elif self.state == "after" and ch in ",]":
                self.state = "item" if ch == "," else "done"
                self.pending = self.pending[1:]
            else:
                self.state = "failed"
        return out

    def finish(self) -> DeltaMessage:
        return DeltaMessage()


class NamedFunctionParser(ToolParser):
    """The whole message is the arguments of one named function."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def extract(self, text: str) -> ExtractedToolCalls:
        if not text:
            return ExtractedToolCalls(None)
        return ExtractedToolCalls(None, [ToolCall(self.function_name, text)])

    def stream(self) -> ToolCallStream:
        return NamedFunctionStream(self.function_name)


class NamedFunctionStream(ToolCallStream):
    def __init__(self, function_name: str) -> None:
        self.function_name = function_name
        self.calls = CallDeltas()

    def feed(self, text: str) -> DeltaMessage:
        if not text:
            return DeltaMessage()
        if not self.calls.count:
            self.calls.start()
            return DeltaMessage(tool_calls=self.calls.entries(0, CallEvents(self.function_name, text)))
        return DeltaMessage(tool_calls=self.calls.entries(0, CallEvents(arguments=text)))

    def finish(self) -> DeltaMessage:
        return DeltaMessage()
