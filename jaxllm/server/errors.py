"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

400 for bad input (naming the field in `param`), 401 for a wrong API key, 404 for an
unknown model or route, 408 for a body that arrives too slowly, 413 for an oversized body,
503 while shutting down or with an unhealthy engine; anything else is a JSON 500.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}

# Request fields an error message may start with (it then names them in `param`).
REQUEST_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "best_of",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "seed",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "stream_options",
        "include_stop_str_in_output",
        "ignore_eos",
        "skip_special_tokens",
        "echo",
        "suffix",
        "logit_bias",
        "tools",
        "tool_choice",
        "response_format",
        "chat_template",
        "chat_template_kwargs",
        "stream",
        "add_special_tokens",
        "add_generation_prompt",
        "kv_cache_retention_config",
        "use_beam_search",
        "length_penalty",
        "early_stopping",
        "prompt_logprobs",
        "logits_processors",
        "logits_processor",
        "logits_post_processor_name",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    }
)


class APIError(Exception):
    """An error response: HTTP status, message, the request field it is about, OpenAI's type."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _DEFAULT_TYPES.get(status, "server_error")


def error_body(status: int, message: str, param: str | None = None, err_type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


_BODY_LEFT_UNREAD = (408, 413)


def error_response(err: APIError) -> JSONResponse:
    """The error in OpenAI's shape. After a 408 or 413 the rest of the body may still be on the
    wire, so the connection is closed rather than reused for the client's next request."""
    headers = {"connection": "close"} if err.status in _BODY_LEFT_UNREAD else None
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.err_type), status_code=err.status, headers=headers
    )


def param_of(message: str, candidates: Iterable[str] = REQUEST_FIELDS) -> str | None:
    """The request field a ValueError message is about (messages start with the field name,
    or a path into it such as `response_format.json_schema`)."""
    head = message.split(":", 1)[0].split(" ", 1)[0].strip("'\"`")
    return head if head.split(".", 1)[0] in candidates else None


def bad_request(exc: ValueError, default_param: str | None = None) -> APIError:
    """A 400 for a ValueError of the request's checks, naming the field its message starts with."""
    message = str(exc)
    return APIError(400, message, param_of(message) or default_param)


def validation_error(exc: ValidationError) -> APIError:
    """A 400 for the first error pydantic found in a request body."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    field = loc[0] if loc else None
    path = ".".join(loc)
    message = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        message = "unknown or unsupported field"
    elif err.get("type") == "missing":
        message = "field required"
    return APIError(400, f"{path}: {message}" if path else message, field)
