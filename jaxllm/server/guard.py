"""What stands between a client and the routes: the API key, body size and time limits
(`GuardMiddleware`), and a JSON body parser that refuses hostile nesting and strings
(`parse_json_body`)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import anyio

from jaxllm.server.errors import APIError, error_response

logger = logging.getLogger(__name__)


class BodyTooLarge(Exception):
    """A body without a (truthful) Content-Length grew past the limit while streaming in."""


class SlowClient(OSError):
    """The client did not take a response chunk within `send_timeout` (treated as gone)."""


class GuardMiddleware:
    """Checks the API key on /v1/ routes and /kv_cache_events and refuses bodies over the limit: by Content-Length
    at once, else while they stream in. Bounds slow clients: a body must arrive within
    `body_timeout` (else 408) and each response message must be taken within `send_timeout`
    (else the connection is dropped, which aborts its request). Pure ASGI, so streaming
    responses pass untouched."""

    def __init__(
        self, app, max_bytes: int, api_key: str | None, body_timeout: float = 30.0, send_timeout: float = 30.0
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.api_key = api_key
        self.body_timeout = body_timeout
        self.send_timeout = send_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        path = scope.get("path", "")
        if self.api_key and (path.startswith("/v1/") or path == "/kv_cache_events"):  # events carry prompt tokens
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                response = error_response(APIError(401, "invalid or missing API key", None, "authentication_error"))
                return await response(scope, receive, send)
        try:
            too_large = int(headers.get(b"content-length", b"0")) > self.max_bytes
        except ValueError:
            too_large = False
        if too_large:
            return await error_response(APIError(413, f"request body exceeds {self.max_bytes} bytes"))(
                scope, receive, send
            )
        received = 0
        body_done = False
        body_deadline = time.monotonic() + self.body_timeout

        async def limited_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                with anyio.fail_after(max(0.0, body_deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                raise APIError(
                    408, f"the request body did not arrive within {self.body_timeout:g}s", None, "invalid_request_error"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()
                body_done = not message.get("more_body", False)
            return message

        async def timed_send(message):
            try:
                with anyio.fail_after(self.send_timeout):
                    await send(message)
            except TimeoutError:
                raise SlowClient(f"the client took no data for {self.send_timeout:g}s") from None

        try:
            return await self.app(scope, limited_receive, timed_send)
        except SlowClient as exc:
            logger.warning("dropping a connection: %s", exc)


def _param_from_path(path: str) -> str | None:
    head = path.split(".", 1)[0]
    return head or None


def parse_json_body(body: bytes, max_depth: int) -> dict:
    """Parse a request body, refusing (400) what is not a JSON object, nests deeper than
    `max_depth`, or holds strings that are not valid Unicode (lone surrogates such as
    "\\ud800", which JSON escapes can spell but no tokenizer can encode)."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, f"request body nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as exc:
                    bad = value[exc.start]
                    raise APIError(
                        400,
                        f"{path or 'body'}: contains a lone surrogate (U+{ord(bad):04X}), which is not valid Unicode",
                        _param_from_path(path),
                    ) from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise APIError(400, f"{path}: request body nests deeper than {max_depth} levels", _param_from_path(path))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            child = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                stack.append((key, depth, child))
            if isinstance(item, (str, dict, list)):
                stack.append((item, depth + 1, child))
    return data
