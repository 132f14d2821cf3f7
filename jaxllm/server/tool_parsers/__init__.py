"""Tool-call parsers by name (`jaxllm serve --tool-call-parser NAME`, vLLM's names)."""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallStream, ToolParser
from jaxllm.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from jaxllm.server.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser
from jaxllm.server.tool_parsers.hermes import HermesToolParser
from jaxllm.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, DeepSeekV3ToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name` (ValueError listing the choices for an unknown one)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "ExtractedToolCalls",
    "NamedFunctionParser",
    "RequiredCallsParser",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
]
