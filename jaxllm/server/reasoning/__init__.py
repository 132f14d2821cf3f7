"""Reasoning parsers by name (`jaxllm serve --reasoning-parser NAME`, vLLM's names)."""

from __future__ import annotations

from jaxllm.server.reasoning.base import ReasoningParser, ReasoningSplit, ReasoningStream
from jaxllm.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from jaxllm.server.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name` (ValueError listing the choices for an unknown one)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "ReasoningStream", "get_reasoning_parser"]
