"""Qwen3: thinking only where the model writes `<think>`; text before it and after `</think>` is
content. With `chat_template_kwargs={"enable_thinking": false}` the template closes an empty
thinking block in the prompt and the whole message is content. Thinking cut off before
`</think>` (max_tokens) is reasoning."""

from __future__ import annotations

from jaxllm.sampling.guided import ReasoningSpan
from jaxllm.server.reasoning.base import THINK_END, THINK_START, ReasoningParser, ReasoningStream


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    # Structured output and tool calls are held to their grammar after the thinking.
    span = ReasoningSpan(THINK_START, THINK_END, required=False)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        before, opened, rest = text.partition(THINK_START)
        if not opened:
            return None, text or None
        reasoning, _, after = rest.partition(THINK_END)
        return reasoning or None, (before + after) or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(starts_thinking=False)
