"""Tool calling and reasoning through a live server and the official `openai` client, on a tiny
random checkpoint whose tokenizer carries a tool-aware (Qwen-style) chat template.

Random weights never write tool-call text, so end to end this checks what they allow: the
tools reach the template (prompt token counts against Hugging Face's own rendering), each
choice is read as the server's parsers read the same text from /v1/completions, the stream
adds up to the message, and bad tool requests get 400s naming the field while serving goes on.
The parsers themselves are tested on reference text in test_tool_parsers.py.
"""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest

from jaxllm.executor import GenerationExecutor
from jaxllm.server.app import build_app
from jaxllm.server.chat_output import ChatOutput
from jaxllm.server.reasoning import get_reasoning_parser
from jaxllm.server.server_config import ServerConfig
from jaxllm.server.tool_parsers import get_tool_parser
from jaxllm.tokenizer import load_tokenizer

from conftest import tiny_engine
from server_helpers import LiveServer, assert_no_thread_left, wait_idle
from server_helpers import live_threads as _threads

MODEL = "tiny-tools"

# Written for this test in the shape of Qwen2.5's: tools listed in the system turn, calls in
# <tool_call> tags with their arguments as JSON, tool results in <tool_response> tags.
TOOL_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "user", "content": "And now?"},
]
GREEDY = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


def for_template(messages: list[dict]) -> list[dict]:
    """What Hugging Face templates take: a call's arguments as an object, no null content."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from jaxllm.models import materialize_preset

    path = tmp_path_factory.mktemp("ckpt") / MODEL
    shutil.copytree(materialize_preset("tiny-moe"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def servers(checkpoint):
    """Two servers over one engine: with --enable-auto-tool-choice --tool-call-parser hermes
    --reasoning-parser qwen3, and with no tool flags."""
    before = _threads()
    executor = GenerationExecutor(tiny_engine(str(checkpoint), max_seq_len=768))
    tools_config = ServerConfig(
        MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    with_flags = LiveServer(build_app(executor, tools_config))
    plain = LiveServer(build_app(executor, ServerConfig(MODEL)))
    yield with_flags, plain
    with_flags.stop()
    plain.stop()
    wait_idle(executor)
    executor.shutdown()
    assert_no_thread_left(before)


@pytest.fixture
def client(servers):
    with openai.OpenAI(base_url=servers[0].url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_tools_and_history_reach_the_template(client, hf_tokenizer):
    def prompt_tokens(**kwargs) -> int:
        return client.chat.completions.create(model=MODEL, messages=HISTORY, **GREEDY, **kwargs).usage.prompt_tokens

    def hf_tokens(**kwargs) -> int:
        text = hf_tokenizer.apply_chat_template(
            for_template(HISTORY), add_generation_prompt=True, tokenize=False, **kwargs
        )
        return len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])

    with_tools = client.chat.completions.create(
        model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="none", **GREEDY
    )
    assert with_tools.usage.prompt_tokens == hf_tokens(tools=TOOLS)
    assert prompt_tokens() == hf_tokens() < hf_tokens(tools=TOOLS)
    thinking_off = {"extra_body": {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}}
    off = client.chat.completions.create(model=MODEL, messages=HISTORY, max_tokens=2, temperature=0, **thinking_off)
    assert off.usage.prompt_tokens == hf_tokens(enable_thinking=False) > hf_tokens()
    choice = with_tools.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls  # "none": no calls


def test_choices_are_read_by_the_parsers_and_streams_add_up(client, servers, hf_tokenizer):
    """The chat message is the configured parsers' reading of the text /v1/completions gives for
    the same rendered prompt; the stream (openai's own chunk types) adds up to it."""
    rendered = hf_tokenizer.apply_chat_template(
        for_template(HISTORY), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    raw = client.completions.create(model=MODEL, prompt=rendered, **GREEDY).choices[0].text
    expected, _ = ChatOutput(get_reasoning_parser("qwen3"), get_tool_parser("hermes")).message(raw, "length")
    full = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="auto", **GREEDY)
    message = full.choices[0].message
    assert message.content == expected["content"]
    assert message.model_extra["reasoning_content"] == expected["reasoning_content"]
    assert (message.tool_calls or None) == expected.get("tool_calls")
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="auto", stream=True, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == (message.content or "")
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert (reasoning or None) == message.model_extra["reasoning_content"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_text_parts_and_plain_chat_without_parsers(servers):
    with openai.OpenAI(base_url=servers[1].url + "/v1", api_key="x", max_retries=0) as plain:
        parts = [
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]}
        ]
        joined = [{"role": "user", "content": "Weather in Paris?"}]
        a = plain.chat.completions.create(model=MODEL, messages=parts, **GREEDY)
        b = plain.chat.completions.create(model=MODEL, messages=joined, **GREEDY)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
        assert "reasoning_content" not in (a.choices[0].message.model_extra or {})
        none = plain.chat.completions.create(model=MODEL, messages=joined, tools=TOOLS, tool_choice="none", **GREEDY)
        assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


def _body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


BAD = [
    (0, _body(tools=[TOOLS[0], {"type": "function", "function": {"name": "get weather"}}]), "tools[1].function.name"),
    (
        0,
        _body(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
        "tools[0].function.parameters",
    ),
    (0, _body(tools=[{"type": "code_interpreter"}]), "tools[0].type"),
    (
        0,
        _body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "sleep"}}),
        "tool_choice.function.name",
    ),
    (0, _body(tool_choice="auto"), "tool_choice"),
    (0, _body(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    (0, _body(messages=[{"role": "tool", "content": "18 C"}]), "messages[0].tool_call_id"),
    (1, _body(tools=TOOLS, tool_choice="auto"), "tool_choice"),
    (1, _body(tools=TOOLS), "tool_choice"),  # tools alone mean "auto"
]


@pytest.mark.parametrize("server,body,param", BAD, ids=[f"{s}-{p}-{i}" for i, (s, _, p) in enumerate(BAD)])
def test_bad_tool_requests_get_400_naming_the_field(servers, server, body, param):
    resp = httpx.post(servers[server].url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if server == 1:
        assert "--enable-auto-tool-choice and --tool-call-parser" in error["message"]
    ok = httpx.post(servers[server].url + "/v1/chat/completions", json=_body(), timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


# Schemas whose every valid output is short, so that a guided random model finishes within max_tokens.
BOUNDED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "additionalProperties": False}}},
]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_choice(client, choice):
    """Guided decoding holds random weights to the tools' schemas: the call always parses and validates."""
    request = dict(model=MODEL, messages=HISTORY, tools=BOUNDED_TOOLS, tool_choice=choice, parallel_tool_calls=False)
    full = client.chat.completions.create(**request, max_tokens=64)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    calls = full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    if isinstance(choice, dict):
        assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])


def test_required_tool_choice_with_parallel_calls_and_conflicts(client):
    """`required` with parallel calls: one or more calls, each naming a tool and validating against
    its schema; combined with response_format it is a 400 naming tool_choice."""
    request = dict(model=MODEL, messages=HISTORY, tools=BOUNDED_TOOLS, tool_choice="required")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    # Random weights may keep the array open until max_tokens ("length"); sampled choices
    # close it on most seeds, and every closed array must hold valid calls.
    finished = 0
    for seed in range(4):
        full = client.chat.completions.create(**request, max_tokens=128, temperature=1.0, seed=seed)
        if full.choices[0].finish_reason == "length":
            continue
        calls = full.choices[0].message.tool_calls
        assert full.choices[0].finish_reason == "tool_calls" and calls, full
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        finished += 1
    assert finished, "no sampled call array closed within 128 tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request, max_tokens=8, response_format={"type": "json_object"})
    assert info.value.body["param"] == "tool_choice"
