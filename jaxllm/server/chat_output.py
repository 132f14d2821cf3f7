"""A chat choice's message, and its stream deltas, from the generated text: reasoning split off
first (`--reasoning-parser`), then tool calls parsed from what is left (the request's
`ToolPlan`). The chat route builds every choice through `ChatOutput`, and so do the tests that
feed it the text of each model family's format."""

from __future__ import annotations

from jaxllm.server.reasoning import ReasoningParser, ReasoningSplit, ReasoningStream
from jaxllm.server.tool_parsers import DeltaMessage, ToolCallStream, ToolParser


def tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """A choice that stopped after making calls finished with "tool_calls" (OpenAI's reason)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class ChatOutput:
    """How one request's choices are read: reasoning parser, tool parser, parallel calls."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel_tool_calls: bool = True
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The choice's `message` and its finish reason."""
        if self.reasoning is None and self.tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        reasoning, content = self.reasoning.extract(text) if self.reasoning is not None else (None, text or None)
        message: dict = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        called = False
        if self.tools is not None and content is not None:
            extracted = self.tools.extract(content)
            calls = extracted.tool_calls if self.parallel_tool_calls else extracted.tool_calls[:1]
            message["content"] = extracted.content
            if calls:
                message["tool_calls"] = [call.to_dict() for call in calls]
                called = True
        return message, tool_finish_reason(finish_reason, called)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: text deltas in, OpenAI `delta` objects out."""

    def __init__(self, output: ChatOutput) -> None:
        self.reasoning: ReasoningStream | None = output.reasoning.stream() if output.reasoning else None
        self.tools: ToolCallStream | None = output.tools.stream() if output.tools else None
        self.parallel_tool_calls = output.parallel_tool_calls
        self.called = False  # some tool call was streamed

    def step(self, text: str, final: bool) -> dict:
        """The delta for new text; `final`: the choice has ended, so nothing is held back."""
        if self.reasoning is None and self.tools is None:
            return {"content": text} if text else {}
        split = self.reasoning.feed(text) if self.reasoning is not None else ReasoningSplit(content=text)
        if final and self.reasoning is not None:
            rest = self.reasoning.finish()
            split.reasoning_content += rest.reasoning_content
            split.content += rest.content
        out = DeltaMessage(reasoning_content=split.reasoning_content)
        if self.tools is not None:
            parsed = self.tools.feed(split.content)
            if final:
                rest_calls = self.tools.finish()
                parsed.content += rest_calls.content
                parsed.tool_calls += rest_calls.tool_calls
            out.content = parsed.content
            out.tool_calls = [e for e in parsed.tool_calls if self.parallel_tool_calls or e["index"] == 0]
        else:
            out.content = split.content
        self.called = self.called or bool(out.tool_calls)
        delta: dict = {}
        if out.reasoning_content:
            delta["reasoning_content"] = out.reasoning_content
        if out.content:
            delta["content"] = out.content
        if out.tool_calls:
            delta["tool_calls"] = out.tool_calls
        return delta
