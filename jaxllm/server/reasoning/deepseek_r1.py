"""DeepSeek-R1: the message starts in thinking mode (its chat template ends the prompt with
`<think>\n`, so the model's own `<think>` may be absent) until `</think>`; the rest is content.
A message that never closes its thinking is all reasoning."""

from __future__ import annotations

from jaxllm.sampling.guided import ReasoningSpan
from jaxllm.server.reasoning.base import THINK_END, THINK_START, ReasoningParser, ReasoningStream


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    # Structured output and tool calls are held to their grammar after the thinking.
    span = ReasoningSpan(THINK_START, THINK_END, required=True)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        if text.startswith(THINK_START):
            text = text[len(THINK_START) :]
        reasoning, _, content = text.partition(THINK_END)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(starts_thinking=True)
