"""The tool fields of a chat request: `tools`, `tool_choice` and `parallel_tool_calls` checked
(400 naming the field, e.g. `tools[1].function.name`), the messages' tool calls made ready for
the chat template, which parser reads the output, and the JSON schema that required and named
tool choice hold the output to (through guided decoding, as in vLLM)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from jaxllm.sampling.guided import GuidedDecodingParams
from jaxllm.server.errors import APIError
from jaxllm.server.server_config import ServerConfig
from jaxllm.server.tool_parsers import NamedFunctionParser, RequiredCallsParser, ToolParser, get_tool_parser

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
AUTO_NEEDS_FLAGS = 'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}


def _bad(param: str, problem: str) -> APIError:
    return APIError(400, f"{param}: {problem}", param)


@dataclass
class ToolPlan:
    """How a request uses tools: what the template gets and how its output is read."""

    tools: list[dict] | None  # for the chat template's `tools=`
    tool_choice: str  # "none", "auto", "required" or "function" (a named one)
    parallel_tool_calls: bool
    parser: ToolParser | None  # None: the output is plain content
    schema: dict | None  # what guided decoding holds the output to (required / named)


def check_tools(tools: list[dict]) -> None:
    """OpenAI function tools: `{"type": "function", "function": {"name", "description",
    "parameters" (a JSON schema of an object), "strict"}}` with distinct names."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        for key in tool:
            if key not in _TOOL_KEYS:
                raise _bad(f"{where}.{key}", "unknown or unsupported field")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", 'must be "function"')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{where}.function", "field required (an object)")
        for key in function:
            if key not in _FUNCTION_KEYS:
                raise _bad(f"{where}.function.{key}", "unknown or unsupported field")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise _bad(f"{where}.function.name", "must match ^[a-zA-Z0-9_-]{1,64}$")
        if name in seen:
            raise _bad(f"{where}.function.name", f"{name!r} is also the name of tools[{seen[name]}]")
        seen[name] = i
        if "description" in function and not isinstance(function["description"], str):
            raise _bad(f"{where}.function.description", "must be a string")
        if "strict" in function and not isinstance(function["strict"], (bool, type(None))):
            raise _bad(f"{where}.function.strict", "must be a boolean")
        if "parameters" in function:
            _check_parameters(function["parameters"], f"{where}.function.parameters")


def _check_parameters(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise _bad(where, "must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise _bad(where, 'must describe an object ("type": "object")')
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _bad(where, f"not a valid JSON schema: {exc.message}") from None


def _named_function(choice: dict, names: list[str]) -> str:
    if set(choice) != {"type", "function"} or choice.get("type") != "function":
        raise _bad("tool_choice", 'an object must be {"type": "function", "function": {"name": NAME}}')
    function = choice["function"]
    if not isinstance(function, dict) or set(function) != {"name"} or not isinstance(function["name"], str):
        raise _bad("tool_choice.function", 'must be {"name": NAME}')
    if function["name"] not in names:
        raise _bad("tool_choice.function.name", f"{function['name']!r} is not a function in tools")
    return function["name"]


def plan_tools(
    tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None, config: ServerConfig
) -> ToolPlan:
    """The request's use of tools (APIError 400 naming the field for a bad one)."""
    if tools is not None:
        check_tools(tools)
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    names = [t["function"]["name"] for t in tools or ()]
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str) and tool_choice not in TOOL_CHOICES:
        raise _bad(
            "tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": NAME}}'
        )
    if tool_choice != "none" and not tools:
        raise _bad("tool_choice", "requires tools")
    if isinstance(tool_choice, dict):
        name = _named_function(tool_choice, names)
        assert tools is not None
        return ToolPlan(
            tools, "function", parallel, NamedFunctionParser(name), tool_choice_schema(tools, tool_choice, parallel)
        )
    if tool_choice == "required":
        assert tools is not None
        return ToolPlan(
            tools, "required", parallel, RequiredCallsParser(), tool_choice_schema(tools, "required", parallel)
        )
    if tool_choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise APIError(400, AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan(tools, "auto", parallel, get_tool_parser(config.tool_call_parser), None)
    return ToolPlan(tools, "none", parallel, None, None)


def tool_choice_schema(tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool = True) -> dict:
    """The JSON schema of the output for `tool_choice="required"` (an array of
    `{"name", "parameters"}` calls, one object without parallel calls) or a named function
    (its parameters)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        function = next(t["function"] for t in tools if t["function"]["name"] == name)
        return function.get("parameters") or EMPTY_PARAMETERS
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output")
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or EMPTY_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    call = {"anyOf": calls}
    if not parallel_tool_calls:
        return call
    return {"type": "array", "minItems": 1, "items": call}


def guided_decoding_for_tool_choice(schema: dict) -> GuidedDecodingParams:
    """The sampling constraint that holds the output to `schema` (set as
    `SamplingParams.guided_decoding`): calls whose arguments always parse and validate."""
    return GuidedDecodingParams(json=schema)


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates expect them: an assistant's `tool_calls[].function.arguments`
    as an object rather than OpenAI's JSON text (templates write it with `tojson`), and each
    `tool` message answering a call by `tool_call_id` (APIError 400 naming the field)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise _bad(f"messages[{i}].tool_call_id", "field required (a string) in a tool message")
        if calls is None:
            out.append(message)
            continue
        if message["role"] != "assistant" or not isinstance(calls, list):
            raise _bad(f"messages[{i}].tool_calls", "only an assistant message has tool_calls (a list)")
        fixed = []
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise _bad(f"{where}.function", 'must be {"name": NAME, "arguments": JSON text}')
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    raise _bad(f"{where}.function.arguments", "is not JSON text") from None
            fixed.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": fixed})
    return out
