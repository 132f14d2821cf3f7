"""DeepSeek-V3 / R1 format:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

The content is the text before `<｜tool▁calls▁begin｜>`. The markers are added tokens: a tokenizer
that marks them special drops them from the text unless the request sets
`skip_special_tokens: false`.
"""

from __future__ import annotations

import json
import re

from jaxllm.server.text_markers import held_back
from jaxllm.server.tool_parsers.base import (
    CallDeltas,
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from jaxllm.server.tool_parsers.json_scan import CallEvents, ContainerEnd, skip_ws

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALLS_END = "<｜tool▁calls▁end｜>"

_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"[^\n]*?" + re.escape(SEP) + r"(?P<name>[^\n]*)\n```json\n(?P<args>.*?)\n```"
    r"\s*" + re.escape(CALL_END),
    re.DOTALL,
)
_DECODER = json.JSONDecoder()


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(CALLS_BEGIN)
        if first < 0:
            return ExtractedToolCalls(text or None)
        calls = []
        for match in _CALL.finditer(text, first):
            args = match["args"]
            start = skip_ws(args, 0)
            try:
                value, end = _DECODER.raw_decode(args, start)
            except ValueError:
                return ExtractedToolCalls(text)
            if not isinstance(value, dict) or args[end:].strip():
                return ExtractedToolCalls(text)
            calls.append(ToolCall(match["name"], args[start:end]))
        if not calls:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(text[:first] or None, calls)

    def stream(self) -> ToolCallStream:
        return DeepSeekV3Stream()


class DeepSeekV3Stream(ToolCallStream):
    def __init__(self) -> None:
        # "content" -> "calls" (looking for a call) -> "header" (its name) -> "body" (before the
        # JSON) -> "args" (the JSON object) -> "calls" ...
        self.state = "content"
        self.pending = ""
        self.scanner = ContainerEnd()
        self.index = 0
        self.calls = CallDeltas()

    def feed(self, text: str) -> DeltaMessage:
        out = DeltaMessage()
        self.pending += text
        while self.pending:
            if self.state in ("content", "calls"):
                marker = CALLS_BEGIN if self.state == "content" else CALL_BEGIN
                found = self.pending.find(marker)
                if found < 0:
                    keep = held_back(self.pending, marker)
                    if self.state == "content":
                        out.content += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                if self.state == "content":
                    out.content += self.pending[:found]
                self.pending = self.pending[found + len(marker) :]
                self.state = "calls" if self.state == "content" else "header"
            elif self.state == "header":
                sep = self.pending.find(SEP)
                line_end = self.pending.find("\n", sep + len(SEP)) if sep >= 0 else -1
                if line_end < 0:
                    break
                self.index = self.calls.start()
                name = self.pending[sep + len(SEP) : line_end]
                out.tool_calls += self.calls.entries(self.index, CallEvents(name=name))
                self.pending, self.state = self.pending[line_end + 1 :], "body"
            elif self.state == "body":
                brace = self.pending.find("{")
                if brace < 0:
                    self.pending = ""
                    break
                self.pending, self.state, self.scanner = self.pending[brace:], "args", ContainerEnd()
            else:  # "args"
                end = self.scanner.feed(self.pending)
                cut = len(self.pending) if end is None else end
                out.tool_calls += self.calls.entries(self.index, CallEvents(arguments=self.pending[:cut]))
                self.pending = self.pending[cut:]
                if end is not None:
                    self.state = "calls"
        return _merge(out)

    def finish(self) -> DeltaMessage:
        out = DeltaMessage(content=self.pending if self.state == "content" else "")
        self.pending = ""
        return out


def _merge(out: DeltaMessage) -> DeltaMessage:
    """One `delta.tool_calls` entry per call and step (the name's entry takes the arguments that follow)."""
    merged: list[dict] = []
    for entry in out.tool_calls:
        if merged and merged[-1]["index"] == entry["index"] and "id" not in entry:
            merged[-1]["function"]["arguments"] += entry["function"]["arguments"]
        else:
            merged.append(entry)
    out.tool_calls = merged
    return out
