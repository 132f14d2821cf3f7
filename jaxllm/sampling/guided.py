"""Structured output: `GuidedDecodingParams` (TensorRT-LLM's name) and their grammars.

A request constrained by a JSON schema, a regular expression, a Lark / GBNF grammar, a list
of choices, "any JSON object" or structural tags gets a grammar in llguidance's format
(`compile_grammar`), checked without a tokenizer and cached by its text (an LRU), so a
schema sent by many requests is translated once. The engine builds one llguidance matcher
per request from it (`jaxllm.engine.guided_matchers`), which gives each step's token mask.

Compile work is bounded by llguidance's parser limits (`parser_limits`): a grammar past
them does not compile and is refused with llguidance's message, like any other bad one.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Optional, Union

import llguidance

if TYPE_CHECKING:  # pragma: no cover
    from llguidance._lib import JsonCompileOptions

GUIDED_DECODING_BACKENDS = ("llguidance",)
"""Values of `guided_decoding_backend` (`LLM`, `EngineConfig`)."""

GRAMMAR_CACHE_SIZE = 256
"""Grammars kept by `compile_grammar` (least recently used dropped first)."""

MAX_GRAMMAR_SIZE = 500_000
"""llguidance's limit on grammar symbols; with the lexer fuel below it bounds compile time."""
INITIAL_LEXER_FUEL = 1_000_000  # about 20 ms of lexer construction
STEP_LEXER_FUEL = 200_000  # lexer work per token mask

# JSON is written as json.dumps writes it (", " and ": "), with no other whitespace: a model
# cannot spend its tokens on blank space inside the structure. A schema may override this
# with llguidance's "x-guidance" options.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_FIELDS = ("json", "regex", "grammar", "choice", "json_object", "structural_tag")


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SIZE, initial_lexer_fuel=INITIAL_LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL
    )


@dataclass(frozen=True)
class ReasoningSpan:
    """Thinking the constraint leaves free: text up to the first `end` (from the output's start,
    which may repeat `start`; or, when not `required`, an optional `start` ... `end` block),
    then optional whitespace, then the constrained output. A reasoning model's answer is
    held to the schema while its thinking is not."""

    start: str = "<think>"
    end: str = "</think>"
    required: bool = True  # DeepSeek-R1: the prompt opens the thinking; Qwen3: optional

    def lark_rules(self) -> str:
        start, end = _lark_regex_literal(self.start), _lark_regex_literal(self.end)
        if self.required:
            return f"start: think gap? @constraint\nthink[lazy]: /(.|\\n)*{end}/\ngap: /[ \\t\\r\\n]+/\n"
        return f"start: (think gap?)? @constraint\nthink[lazy]: /{start}(.|\\n)*{end}/\ngap: /[ \\t\\r\\n]+/\n"


def _lark_regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}/" else c for c in text)


@dataclass
class GuidedDecodingParams:
    """What a request's output must match; exactly one field is set.

    json: a JSON schema (a dict, or its JSON text); regex: a regular expression the whole
    output matches; grammar: a Lark grammar (llguidance's dialect) or a GBNF grammar;
    choice: the output is one of these strings; json_object: any JSON object;
    structural_tag: tagged JSON segments in free text, as a dict or JSON text
    `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    choice: Optional[list[str]] = None
    json_object: bool = False
    structural_tag: Optional[Union[str, dict]] = None
    # Not a constraint of its own: thinking that comes before the constrained output (set by a
    # server with a reasoning parser, so the constraint applies after the reasoning ends).
    reasoning: Optional[ReasoningSpan] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> GuidedDecodingParams:
        """Check the field types and that exactly one is set (ValueError naming the field);
        whether the constraint compiles is `compile_grammar`'s check."""
        set_fields = [name for name in _FIELDS if self._is_set(name)]
        if len(set_fields) != 1:
            found = ", ".join(set_fields) if set_fields else "none"
            raise ValueError(f"guided_decoding: exactly one of {', '.join(_FIELDS)} must be set, got {found}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"guided_decoding.json_object must be a bool, got {type(self.json_object).__name__}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, dict)):
                raise ValueError(f"guided_decoding.{name} must be a dict or a JSON string, got {type(value).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"guided_decoding.{name} must be a non-empty string")
        if self.choice is not None and not (
            isinstance(self.choice, (list, tuple))
            and self.choice
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("guided_decoding.choice must be a non-empty list of non-empty strings")
        return self

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return bool(value) if name == "json_object" else value is not None

    @property
    def field(self) -> str:
        """The name of the field that is set."""
        return next(name for name in _FIELDS if self._is_set(name))

    def cache_key(self) -> tuple[str, str]:
        """(field, canonical text of its value): equal constraints share one grammar. JSON is
        re-serialised compactly but keeps its key order (a schema's property order is the
        order the output writes them in)."""
        name = self.field
        value = getattr(self, name)
        if name == "json_object":
            return name, ""
        if isinstance(value, str) and name in ("json", "structural_tag"):
            try:
                value = _json.loads(value)
            except ValueError:
                return name, value  # refused by the compile, with the parser's message
        if isinstance(value, (dict, list, tuple)):
            return name, _json.dumps(value, separators=(",", ":"))
        return name, value


def compile_grammar(guided: GuidedDecodingParams) -> str:
    """The llguidance grammar of `guided`, checked (ValueError `guided_decoding.<field>: <why>`
    when it does not compile), cached by the constraint's text."""
    guided.validate()
    if guided.reasoning is not None:
        return _after_reasoning_cached(guided.cache_key(), guided.reasoning)
    return _compile_cached(*guided.cache_key())


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _after_reasoning_cached(key: tuple[str, str], reasoning: ReasoningSpan) -> str:
    """The constraint's grammar as a sub-grammar after free thinking (`ReasoningSpan`)."""
    text = _compile_cached(*key)
    # llguidance grammars are either its JSON form (a list of grammars, the first the start)
    # or plain Lark text.
    inner = _json.loads(text)["grammars"] if text.lstrip().startswith("{") else [{"lark_grammar": text}]
    inner[0] = dict(inner[0], name="constraint")
    grammar = _json.dumps({"grammars": [{"lark_grammar": reasoning.lark_rules()}, *inner]})
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        raise ValueError(f"guided_decoding.{key[0]}: after reasoning: {_one_line(error)}")
    return grammar


def grammar_cache_info() -> Any:
    """Hits, misses and size of the grammar cache (functools' cache info)."""
    return _compile_cached.cache_info()


def clear_grammar_cache() -> None:
    _compile_cached.cache_clear()
    _after_reasoning_cached.cache_clear()


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _compile_cached(field: str, text: str) -> str:
    try:
        grammar = _to_grammar(field, text)
    except (ValueError, TypeError, KeyError, AssertionError) as exc:
        raise ValueError(f"guided_decoding.{field}: {_one_line(exc)}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        raise ValueError(f"guided_decoding.{field}: {_one_line(error)}")
    return grammar


def _to_grammar(field: str, text: str) -> str:
    matcher = llguidance.LLMatcher
    if field == "json":
        schema = _json.loads(text)
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if field == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if field == "regex":
        return matcher.grammar_from_regex(text)
    if field == "grammar":
        return llguidance.grammar_from("grammar", text)  # Lark as is, GBNF converted to Lark
    if field == "choice":
        return llguidance.grammar_from("choice", text)
    if field == "structural_tag":
        return _structural_tag_grammar(_json.loads(text))
    raise ValueError(f"unknown constraint {field!r}")


def _structural_tag_grammar(spec: Any) -> str:
    """TensorRT-LLM / vLLM structural tags: each structure's begin text starts with one of the
    triggers; the JSON between begin and end follows its schema, text elsewhere is free."""
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not spec["structures"]:
        raise ValueError('expected {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}')
    triggers = spec.get("triggers") or []
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers must be a list of non-empty strings")
    tags = []
    for i, s in enumerate(spec["structures"]):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError(f"structures[{i}] needs string begin and end and a schema")
        schema = s.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError(f"structures[{i}].schema must be a JSON object")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)


def _one_line(message: Any) -> str:
    return " ".join(str(message).split())
