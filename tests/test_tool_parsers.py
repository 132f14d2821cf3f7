"""Tool-call and reasoning parsers on reference text in each model family's format: the calls
are checked with `json`, the messages and chunks with the official `openai` types, the
required/named tool-choice schema with `jsonschema`; every stream is split at every character
boundary and in random pieces and must add up to the non-streamed message."""

from __future__ import annotations

import json
import random

import jsonschema
import openai.types.chat as oai
import pytest

from jaxllm.server.chat_output import ChatOutput
from jaxllm.server.errors import APIError
from jaxllm.server.reasoning import get_reasoning_parser
from jaxllm.server.server_config import ServerConfig
from jaxllm.server.tool_parsers import NamedFunctionParser, RequiredCallsParser, get_tool_parser
from jaxllm.server.tool_request import plan_tools, template_messages, tool_choice_schema

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"q": 'a "quoted" }{ string\\', "opts": {"k": [1, 2.5, None, True, {"x": "]"}]}, "emoji": "日本 ✓"}

# (text, expected content, expected [(name, arguments as an object)])
REFERENCE = {
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            "Let me look both up.\n<tool_call>\n"
            + json.dumps({"name": "search", "arguments": NESTED}, ensure_ascii=False)
            + "\n</tool_call>\n<tool_call>\n"
            + '{"arguments": {}, "name": "now"}'
            + "\n</tool_call>",
            "Let me look both up.\n",
            [("search", NESTED), ("now", {})],
        ),
        ("No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
        ('<tool_call>{"name": "now", "arguments": {"tz": "UTC"}}', None, [("now", {"tz": "UTC"})]),  # cut off
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            '<|python_tag|>{"name": "search", "parameters": '
            + json.dumps(NESTED)
            + '}; {"name": "now", "arguments": {}}',
            None,
            [("search", NESTED), ("now", {})],
        ),
        ('  \n{"name": "now", "parameters": {"tz": "UTC"}}', None, [("now", {"tz": "UTC"})]),
        ("The answer is {42}.", "The answer is {42}.", []),
        ("<|python", "<|python", []),
    ],
    "deepseek_v3": [
        (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
            + json.dumps(NESTED, ensure_ascii=False, indent=2)
            + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "Checking.",
            [("search", NESTED), ("now", {})],
        ),
        ("Plain <｜tool answer.", "Plain <｜tool answer.", []),
    ],
}
CASES = [(name, *case) for name, cases in REFERENCE.items() for case in cases]


def reassemble(deltas: list[dict]) -> tuple[str | None, str | None, list[tuple[str, str]], list[str]]:
    """(reasoning, content, [(name, arguments)], ids) from OpenAI stream deltas, as a client adds them up."""
    reasoning, content, calls = "", "", {}
    for delta in deltas:
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in entry:
                assert call["id"] is None and entry["type"] == "function"
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            call["arguments"] += entry["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    ordered = [calls[i] for i in range(len(calls))]
    return (
        reasoning or None,
        content or None,
        [(c["name"], c["arguments"]) for c in ordered],
        [c["id"] for c in ordered],
    )


def stream_deltas(output: ChatOutput, text: str, cuts: list[int]) -> list[dict]:
    stream = output.stream()
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    deltas = [stream.step(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    for delta in deltas:
        oai.chat_completion_chunk.ChoiceDelta.model_validate(delta)
    return deltas


def splits(text: str, seed: int = 0) -> list[list[int]]:
    """One cut at every boundary, every character alone, and 30 random chunkings."""
    rng = random.Random(seed)
    out = [[k] for k in range(len(text) + 1)] + [list(range(1, len(text)))]
    for _ in range(30):
        out.append(sorted(rng.sample(range(1, len(text)), rng.randint(1, max(1, len(text) // 3)))))
    return out


def message_parts(message: dict) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return message.get("reasoning_content"), message["content"], calls


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_reference_text_parses_and_streams_to_the_same_message(parser, text, content, calls):
    extracted = get_tool_parser(parser).extract(text)
    assert extracted.content == content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == calls
    assert len({c.id for c in extracted.tool_calls}) == len(calls)
    assert all(c.id.startswith("call_") for c in extracted.tool_calls)

    output = ChatOutput(None, get_tool_parser(parser))
    message, finish = output.message(text, "stop")
    oai.ChatCompletionMessage.model_validate(message)
    assert finish == ("tool_calls" if calls else "stop")
    assert ("tool_calls" in message) == bool(calls)
    expected = message_parts(message)
    for cuts in splits(text):
        _, got_content, got_calls, ids = reassemble(stream_deltas(output, text, cuts))
        assert (None, got_content, got_calls) == expected, cuts
        assert len(set(ids)) == len(ids)


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = REFERENCE["hermes"][1][0]
    output = ChatOutput(None, get_tool_parser("hermes"), parallel_tool_calls=False)
    message, _ = output.message(text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["search"]
    assert reassemble(stream_deltas(output, text, [7, 60]))[2] == message_parts(message)[2]


# (text, deepseek_r1's (reasoning, content), qwen3's)
THINKING = [
    (
        "<think>\nFirst, 2+2.\n</think>\n\nIt is 4.",
        ("\nFirst, 2+2.\n", "\n\nIt is 4."),
        ("\nFirst, 2+2.\n", "\n\nIt is 4."),
    ),
    (
        "First, 2+2.\n</think>\n\nIt is 4.",
        ("First, 2+2.\n", "\n\nIt is 4."),
        (None, "First, 2+2.\n</think>\n\nIt is 4."),
    ),
    ("It is 4.", ("It is 4.", None), (None, "It is 4.")),
    (
        "<think>still thinking when cut off",
        ("still thinking when cut off", None),
        ("still thinking when cut off", None),
    ),
    ("<think></think>It is 4 < 5 </thin", (None, "It is 4 < 5 </thin"), (None, "It is 4 < 5 </thin")),
    ("<thin", ("<thin", None), (None, "<thin")),
]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("case", range(len(THINKING)))
def test_reasoning_splits_the_same_streamed_or_not(parser, case):
    text, r1, qwen3 = THINKING[case]
    expected = r1 if parser == "deepseek_r1" else qwen3
    reasoning = get_reasoning_parser(parser)
    assert reasoning.extract(text) == expected
    output = ChatOutput(reasoning, None)
    message, _ = output.message(text, "stop")
    assert (message["reasoning_content"], message["content"]) == expected
    for cuts in splits(text, seed=case):
        got = reassemble(stream_deltas(output, text, cuts))
        assert got[:2] == expected, cuts


def test_reasoning_is_split_off_before_tool_calls():
    text = (
        '<think>The user wants weather; call get_weather with {"city": "Paris"}.</think>\n\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    )
    output = ChatOutput(get_reasoning_parser("qwen3"), get_tool_parser("hermes"))
    message, finish = output.message(text, "stop")
    assert message["reasoning_content"] == 'The user wants weather; call get_weather with {"city": "Paris"}.'
    assert message["content"] == "\n\n" and finish == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == WEATHER
    for cuts in splits(text):
        assert reassemble(stream_deltas(output, text, cuts))[:3] == message_parts(message), cuts


# ---------------------------------------------------------------------------- required / named
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def test_required_schema_accepts_call_arrays_and_nothing_else():
    schema = tool_choice_schema(TOOLS, "required", True)
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": WEATHER}],
    ]
    invalid = [
        [],
        {"name": "now", "parameters": {}},
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "get_weather", "parameters": {"city": "Paris", "wind": 3}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],
        [{"name": "sleep", "parameters": {}}],
        [{"name": "now"}],
        [{"name": "now", "parameters": {}, "extra": 1}],
    ]
    for value in valid:
        jsonschema.validate(value, schema)
    for value in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    single = tool_choice_schema(TOOLS, "required", False)
    jsonschema.validate({"name": "now", "parameters": {}}, single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}], single)
    named = tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True)
    jsonschema.validate(WEATHER, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "celsius"}, named)


@pytest.mark.parametrize(
    "text,parallel",
    [
        ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]', True),
        (' {"name": "now", "parameters": {}}', False),
    ],
)
def test_required_output_is_read_as_schema_json(text, parallel):
    schema = tool_choice_schema(TOOLS, "required", parallel)
    value = json.loads(text)
    jsonschema.validate(value, schema)
    output = ChatOutput(None, RequiredCallsParser(), parallel)
    message, finish = output.message(text, "stop")
    expected = [(c["name"], c["parameters"]) for c in (value if parallel else [value])]
    assert [(n, json.loads(a)) for _, _, calls in [message_parts(message)] for n, a in calls] == expected
    assert message["content"] is None and finish == "tool_calls"
    for cuts in splits(text):
        assert reassemble(stream_deltas(output, text, cuts))[:3] == message_parts(message), cuts


def test_named_function_output_is_its_arguments():
    text = '{"city": "Paris"}'
    output = ChatOutput(None, NamedFunctionParser("get_weather"))
    message, _ = output.message(text, "stop")
    assert message_parts(message) == (None, None, [("get_weather", text)])
    for cuts in splits(text):
        assert reassemble(stream_deltas(output, text, cuts))[:3] == message_parts(message)


# ---------------------------------------------------------------------------- request checks
AUTO = ServerConfig("m", enable_auto_tool_choice=True, tool_call_parser="hermes")
BAD_TOOLS = [
    ([TOOLS[0], {"type": "function", "function": {"name": "bad name"}}], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "f", "parameters": 5}}], None, "tools[0].function.parameters"),
    (
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
        None,
        "tools[0].function.parameters",
    ),
    (
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        None,
        "tools[0].function.parameters",
    ),
    ([{"type": "function", "function": {"name": "f", "arguments": {}}}], None, "tools[0].function.arguments"),
    ([TOOLS[1], TOOLS[1]], None, "tools[1].function.name"),
    (TOOLS, {"type": "function", "function": {"name": "sleep"}}, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
]


@pytest.mark.parametrize("tools,choice,param", BAD_TOOLS, ids=[b[2] + str(i) for i, b in enumerate(BAD_TOOLS)])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(APIError) as info:
        plan_tools(tools, choice, None, AUTO)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(param + ": ")


def test_tool_choice_plans():
    assert plan_tools(None, None, None, ServerConfig("m")).parser is None
    assert plan_tools(TOOLS, "none", None, ServerConfig("m")).parser is None
    with pytest.raises(APIError, match="--enable-auto-tool-choice and --tool-call-parser"):
        plan_tools(TOOLS, None, None, ServerConfig("m"))  # tools without tool_choice mean "auto"
    plan = plan_tools(TOOLS, "auto", False, AUTO)
    assert plan.parser is not None and plan.parser.name == "hermes" and not plan.parallel_tool_calls
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "now"}}, None, AUTO)
    assert named.schema == {"type": "object", "properties": {}} and named.parallel_tool_calls


def test_template_messages_give_templates_argument_objects():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    assert template_messages(messages)[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    for bad, param in [
        ({"role": "tool", "content": "18 C"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
    ]:
        with pytest.raises(APIError) as info:
            template_messages([bad])
        assert info.value.param == param


# ---------------------------------------------------------------------------- random calls
def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "num", "lit", "list", "obj"] if depth < 3 else ["str", "num", "lit"])
    if kind == "str":
        return "".join(
            rng.choice(['"', "\\", "{", "}", "[", "]", ",", ":", " ", "\n", "a", "é", "日", "<", "/"])
            for _ in range(rng.randint(0, 8))
        )
    if kind == "num":
        return rng.choice([0, -3, 2.5, 1e21, 10**20])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["k" + str(i) + rng.choice(["", "}", '"']) for i in range(rng.randint(0, 3))]
    return {k: _random_value(rng, depth + 1) for k in keys}


def _dumps(rng: random.Random, value) -> str:
    return json.dumps(
        value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]), separators=rng.choice([None, (",", ":")])
    )


def _format(parser: str, rng: random.Random, calls: list[tuple[str, dict]], prefix: str) -> str:
    if parser == "hermes":
        blocks = [f"<tool_call>\n{_dumps(rng, {'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls]
        return prefix + "\n".join(blocks)
    if parser == "llama3_json":
        return rng.choice(["", "<|python_tag|>"]) + "; ".join(
            _dumps(rng, {"name": n, "parameters": a}) for n, a in calls
        )
    blocks = [
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{_dumps(rng, a)}\n```<｜tool▁call▁end｜>"
        for n, a in calls
    ]
    return prefix + "<｜tool▁calls▁begin｜>" + "\n".join(blocks) + "<｜tool▁calls▁end｜>"


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "deepseek_v3"])
def test_random_calls_round_trip_streamed_or_not(parser):
    rng = random.Random(parser)
    output = ChatOutput(get_reasoning_parser("deepseek_r1"), get_tool_parser(parser))
    for _ in range(60):
        calls = [
            (rng.choice(["f", "get_weather", "a-b_9"]), _random_value(rng, 2) or {"x": 1})
            for _ in range(rng.randint(1, 3))
        ]
        calls = [(n, a if isinstance(a, dict) else {"v": a}) for n, a in calls]
        prefix = rng.choice(["", "Sure. ", "{not a call} "]) if parser != "llama3_json" else ""
        thinking = rng.choice(["", "<think>", "<think>\n"]) + "Plan: call {it}.</think>"
        text = thinking + _format(parser, rng, calls, prefix)
        message, _ = output.message(text, "stop")
        assert message["reasoning_content"].endswith("Plan: call {it}.")
        assert message["content"] == (prefix or None)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
        for cuts in [sorted(rng.sample(range(1, len(text)), rng.randint(1, 20))) for _ in range(5)]:
            got = reassemble(stream_deltas(output, text, cuts))
            assert got[:3] == message_parts(message), cuts


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--tool-call-parser", "mistral"], "choose from 'deepseek_v3', 'hermes', 'llama3_json'"),
        (["--reasoning-parser", "r1"], "choose from 'deepseek_r1', 'qwen3'"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    ],
)
def test_serve_refuses_unknown_parsers_in_one_line(argv, expected, capsys):
    from jaxllm.cli.serve import main

    with pytest.raises(SystemExit) as info:
        main(["--model", "tiny-moe", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and expected in err and err.count("\n") == 1, err


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', ":", ",", '"f"',
    '"\\\\"', "\\", '"', " ", "\n", ";", "<|python_tag|>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
    "function", "<｜tool▁sep｜>", "```json\n", "\n```", "<｜tool▁call▁end｜>", "<think>", "</think>", "x", "1", "null",
]  # fmt: skip


def test_arbitrary_text_never_breaks_a_parser():
    """Malformed markup is content or is dropped, never an exception; every call's arguments is a JSON object."""
    rng = random.Random(7)
    parsers = [get_tool_parser(name) for name in REFERENCE] + [RequiredCallsParser()]
    for _ in range(1500):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 20)))
        for parser in parsers:
            output = ChatOutput(get_reasoning_parser("qwen3"), parser)
            message, _ = output.message(text, "stop")
            for call in message.get("tool_calls", []):
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
            stream_deltas(output, text, sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4))))


def test_guided_decoding_for_tool_choice():
    """The constraint for `required` / named tool choice is the JSON schema of the calls."""
    from jaxllm.sampling import GuidedDecodingParams
    from jaxllm.server.tool_request import guided_decoding_for_tool_choice

    schema = tool_choice_schema(TOOLS, "required", True)
    guided = guided_decoding_for_tool_choice(schema)
    assert isinstance(guided, GuidedDecodingParams) and guided.field == "json"
    assert guided_decoding_for_tool_choice(schema).json == schema
