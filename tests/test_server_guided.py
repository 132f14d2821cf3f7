"""Structured output through the OpenAI-compatible server, driven by the official `openai`
client: `response_format`, vLLM's `structured_outputs` and `guided_*` fields. The tiny random
model writes garbage when free, so a valid output is the constraint's doing; outputs are
checked with jsonschema and re.fullmatch."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from jaxllm.executor import GenerationExecutor
from jaxllm.server.app import build_app
from jaxllm.server.server_config import ServerConfig

from conftest import tiny_engine
from server_helpers import LiveServer, wait_idle

MODEL = "tiny-moe"

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        "kind": {"enum": ["cat", "dog"]},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 5},
                "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["x", "y"]}},
            },
            "required": ["name", "tags"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "kind", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def live():
    engine = tiny_engine(MODEL, max_seq_len=384)
    executor = GenerationExecutor(engine)
    server = LiveServer(build_app(executor, ServerConfig(served_model_name=MODEL), shutdown_executor=True))
    server.executor = executor
    yield server
    server.stop()
    executor.shutdown()
    assert engine.guided.num_active == 0


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _chat(client, max_tokens: int = 200, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}], max_tokens=max_tokens, **kwargs
    )


def test_json_schema_response_format_validates(client):
    for seed, temperature in ((None, None), (1, 1.0), (2, 0.7)):
        resp = _chat(
            client,
            seed=seed,
            temperature=temperature,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}},
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_streamed_validates(client):
    stream = _chat(
        client,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_response_format_is_an_object(client):
    # Any object may run on (long keys, numbers): a seed whose object closes within max_tokens.
    resp = _chat(client, response_format={"type": "json_object"}, max_tokens=300, temperature=1.0, seed=4)
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    completion = client.completions.create(
        model=MODEL,
        prompt="{",
        max_tokens=300,
        temperature=1.0,
        seed=9,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_text_response_format_is_free(client):
    resp = _chat(client, response_format={"type": "text"}, max_tokens=8)
    assert resp.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "extra",
    [{"guided_regex": r"[A-Z][a-z]{2,6} \d{2}"}, {"structured_outputs": {"regex": r"[A-Z][a-z]{2,6} \d{2}"}}],
)
def test_regex_outputs_fullmatch(client, extra):
    resp = client.completions.create(
        model=MODEL, prompt=["name and age:", "other:"], max_tokens=30, n=2, temperature=1.0, seed=3, extra_body=extra
    )
    assert len(resp.choices) == 4
    for choice in resp.choices:
        assert re.fullmatch(r"[A-Z][a-z]{2,6} \d{2}", choice.text), choice.text


@pytest.mark.parametrize(
    "extra", [{"guided_choice": ["left", "right", "up"]}, {"structured_outputs": {"choice": ["left", "right", "up"]}}]
)
def test_choice_outputs_are_in_the_set(client, extra):
    for seed in range(3):
        resp = _chat(client, temperature=1.0, seed=seed, extra_body=extra)
        assert resp.choices[0].message.content in ("left", "right", "up")


def test_guided_json_and_grammar_fields(client):
    resp = client.completions.create(model=MODEL, prompt="x", max_tokens=200, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(resp.choices[0].text), SCHEMA)
    grammar = 'start: "[" ITEM ("," ITEM)* "]"\nITEM: /[a-c]{1,3}/'
    resp = client.completions.create(model=MODEL, prompt="x", max_tokens=60, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\[[a-c]{1,3}(,[a-c]{1,3})*\]", resp.choices[0].text), resp.choices[0].text


def test_max_tokens_too_small_is_length(client):
    resp = _chat(
        client, max_tokens=4, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    )
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "route,body,param",
    [
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
        ),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("completions", {"guided_regex": "a(b"}, "guided_regex"),
        ("completions", {"guided_json": "{oops"}, "guided_json"),
        ("completions", {"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
        ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ("completions", {"guided_choice": []}, "guided_choice"),
        ("completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ("chat", {"guided_regex": "[a-z]+", "ignore_eos": True}, "ignore_eos"),
        ("completions", {"guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_constraints_are_400_naming_the_field_and_the_server_goes_on(live, client, route, body, param):
    url = live.url + ("/v1/chat/completions" if route == "chat" else "/v1/completions")
    base = {"model": MODEL, "max_tokens": 8}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"})
    resp = httpx.post(url, json={**base, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == param, error
    assert error["message"].startswith(param), error
    good = _chat(client, extra_body={"guided_choice": ["fine"]})
    assert good.choices[0].message.content == "fine"
    with pytest.raises(openai.BadRequestError):
        _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": 5}}})
    wait_idle(live.executor)
