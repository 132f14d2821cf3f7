"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Unknown and unsupported fields are rejected rather than ignored, so a typo gets a 400
naming it instead of silently changing nothing. Types are strict (pydantic strict mode):
`"16"` is not an integer and `true` is not a token id, as in OpenAI's API. Responses are built
as plain dicts by the routes (`completions.py`, `chat.py`): on the streaming path that is much
cheaper than pydantic models per chunk.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jaxllm.kv_cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig
from jaxllm.llm_args import DisaggregatedParams
from jaxllm.sampling import GuidedDecodingParams, SamplingParams


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _refuse_if_set(field: str, message: Optional[str] = None):
    """A validator refusing any truthy value of an unsupported `field` (its default is accepted)."""

    def check(cls, v):
        if v:
            raise ValueError(message or f"{field} is not supported")
        return v

    return field_validator(field)(classmethod(check))


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    _continuous = _refuse_if_set("continuous_usage_stats")


class TokenRangeRetentionBody(StrictModel):
    token_start: int
    token_end: Optional[int] = None
    priority: int
    duration_ms: Optional[int] = None


class KvCacheRetentionBody(StrictModel):
    """`kv_cache_retention_config` extension field: TensorRT-LLM's KvCacheRetentionConfig as JSON."""

    token_range_retention_priorities: list[TokenRangeRetentionBody] = []
    decode_retention_priority: int = 35
    decode_duration_ms: Optional[int] = None

    def to_config(self) -> KvCacheRetentionConfig:
        """The engine's config (ValueError naming the problem for invalid ranges or priorities)."""
        try:
            return KvCacheRetentionConfig(
                [
                    TokenRangeRetentionConfig(r.token_start, r.token_end, r.priority, r.duration_ms)
                    for r in self.token_range_retention_priorities
                ],
                self.decode_retention_priority,
                self.decode_duration_ms,
            )
        except ValueError as exc:
            raise ValueError(f"kv_cache_retention_config: {exc}") from None


class DisaggregatedParamsBody(StrictModel):
    """`disaggregated_params` extension field: TensorRT-LLM's DisaggregatedParams as JSON (set by
    the `jaxllm disaggregated` router; a context worker's answer carries them back)."""

    request_type: Literal["context_only", "generation_only", "context_and_generation"]
    first_gen_tokens: Optional[list[int]] = None
    ctx_request_id: Optional[int] = None
    opaque_state: Optional[str] = Field(default=None, max_length=256)
    ctx_info_endpoint: Optional[str] = Field(default=None, max_length=512)
    draft_tokens: Optional[list[int]] = None
    # per first token: [token id, logprob, rank or null] of each of its entries
    first_gen_log_probs: Optional[list[list[list[Optional[float]]]]] = Field(default=None, max_length=1)

    def to_params(self) -> DisaggregatedParams:
        """The engine's params (ValueError naming the missing or unsupported field)."""
        return DisaggregatedParams(**self.model_dump())


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema` (OpenAI): the schema the output follows."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` extra field (exactly one constraint)."""

    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[dict[str, Any], str]] = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


# The fields that constrain the output; at most one may be set per request.
GUIDED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def _guided(kind: str, value: Any, field: str) -> GuidedDecodingParams:
    """GuidedDecodingParams(kind=value), its ValueError naming the request `field` instead."""
    try:
        return GuidedDecodingParams(**{kind: value})
    except ValueError as exc:
        raise ValueError(f"{field}: {strip_guided_prefix(str(exc))}") from None


def strip_guided_prefix(message: str) -> str:
    """A guided-decoding error message without its leading `guided_decoding.<field>` name."""
    return re.sub(r"^guided_decoding(\.\w+)?:?\s*", "", message)


class _SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    n: int = Field(default=1, ge=1, le=128)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # Extensions (as in vLLM and trtllm-serve).
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    # vLLM's beam-search extra fields (beam width: best_of, else n).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    kv_cache_retention_config: Optional[KvCacheRetentionBody] = None  # as in TensorRT-LLM's LLM API
    disaggregated_params: Optional[DisaggregatedParamsBody] = None  # as in trtllm-serve
    # Logits post-processors are Python callables (or device functions registered on the
    # engine): the Python API takes them, a request body cannot carry them.
    logits_processors: Optional[Any] = None
    logits_processor: Optional[Any] = None
    logits_post_processor_name: Optional[Any] = None
    # Structured output (jaxllm.sampling.guided): OpenAI's response_format, vLLM's extra fields.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def guided_decoding(self) -> tuple[Optional[GuidedDecodingParams], Optional[str]]:
        """The output constraint and the request field it came from (None, None without one);
        ValueError naming the field for a malformed one."""
        found = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        rf = self.response_format
        if rf is not None and rf.type == "text" and rf.json_schema is None:
            found.remove("response_format")  # free text: no constraint
        if len(found) > 1:
            raise ValueError(f"{found[1]}: only one of {', '.join(found)} may be set")
        if not found:
            return None, None
        name = found[0]
        if name == "response_format":
            return self._response_format_constraint()
        if name == "structured_outputs":
            return self._structured_outputs_constraint()
        return _guided(name.removeprefix("guided_"), getattr(self, name), name), name

    def _response_format_constraint(self) -> tuple[GuidedDecodingParams, str]:
        rf = self.response_format
        assert rf is not None
        if rf.type == "json_object":
            if rf.json_schema is not None:
                raise ValueError("response_format.json_schema: only allowed with type json_schema")
            return GuidedDecodingParams(json_object=True), "response_format"
        field = "response_format.json_schema"
        if rf.type != "json_schema" or rf.json_schema is None:
            raise ValueError(f"{field}: required with type json_schema (and only allowed with it)")
        schema = rf.json_schema.schema_
        # OpenAI: a json_schema without a schema allows any JSON value.
        return GuidedDecodingParams(json=schema if schema is not None else {}), field + ".schema"

    def _structured_outputs_constraint(self) -> tuple[GuidedDecodingParams, str]:
        so = self.structured_outputs
        assert so is not None
        values = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object or None,
            "structural_tag": so.structural_tag,
        }
        given = [k for k, v in values.items() if v is not None]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: exactly one of {', '.join(values)} must be set, got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        field = f"structured_outputs.{kind}"
        return _guided(kind, values[kind], field), field

    def retention_config(self) -> Optional[KvCacheRetentionConfig]:
        body = self.kv_cache_retention_config
        return None if body is None else body.to_config()

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    _logit_bias = _refuse_if_set("logit_bias")

    @field_validator("logits_processors", "logits_processor", "logits_post_processor_name")
    @classmethod
    def _no_post_processors(cls, v):
        if v is not None:
            raise ValueError(
                "logits post-processors are not accepted by the server; pass a Python callable "
                "as SamplingParams.logits_processor through the Python API (LLM / GenerationExecutor)"
            )
        return v

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")

    def sampling_kwargs(self) -> dict[str, Any]:
        return dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            guided_decoding=self.guided_decoding()[0],
        )


PromptField = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    max_tokens: Optional[int] = Field(default=16, ge=1)
    best_of: Optional[int] = Field(default=None, ge=1, le=128)
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None
    add_special_tokens: bool = True
    # vLLM's extension: logprobs of the prompt tokens (the actual token plus the top k).
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    _echo = _refuse_if_set("echo")
    _suffix = _refuse_if_set("suffix")

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(t, int) for t in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise ValueError("prompt: must not be empty")
        for item in prompts:
            if (isinstance(item, str) and not item) or (isinstance(item, list) and not item):
                raise ValueError("prompt: must not contain an empty prompt")
        return prompts

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError(
                "prompt_logprobs: not supported with stream (the prompt's logprobs come with the final output)"
            )
        return SamplingParams(
            max_tokens=max_tokens,
            best_of=self.best_of,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            add_special_tokens=self.add_special_tokens,
            **self.sampling_kwargs(),
        )


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ... are passed to the template
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[TextPart]]] = None

    def as_template_dict(self) -> dict:
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(part.text for part in self.content)
        return data


# Arguments of `apply_chat_template` that would change what the call returns, not the text.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "tokenize",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
    "return_assistant_tokens_mask",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "documents",
}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    # Checked by `tool_request.plan_tools` (400s naming e.g. `tools[1].function.name`).
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True
    chat_template: Optional[str] = None  # refused unless the server trusts request templates
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        reserved = sorted(set(v or ()) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(
                f"{', '.join(reserved)} cannot be set here: they are arguments of the template "
                "call, not template variables"
            )
        return v

    def requested_chat_template(self) -> Optional[str]:
        """A template the client supplied (the `chat_template` field or the kwargs' entry)."""
        if self.chat_template is not None:
            return self.chat_template
        value = (self.chat_template_kwargs or {}).get("chat_template")
        if value is not None and not isinstance(value, str):
            raise ValueError("chat_template_kwargs.chat_template must be a string")
        return value

    def template_variables(self) -> dict[str, Any]:
        return {k: v for k, v in (self.chat_template_kwargs or {}).items() if k != "chat_template"}

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, add_special_tokens=False, **self.sampling_kwargs()
        )
