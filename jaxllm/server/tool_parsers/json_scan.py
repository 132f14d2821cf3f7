"""The JSON of a tool call, scanned two ways: as its text arrives (`CallObjectStream`, for
streaming) and once complete (`call_from_json`, `member_spans`, for whole messages).

Arguments are reported as the exact text the model wrote for them (a JSON object), never
re-serialized, so the streamed fragments add up to the non-streamed `arguments` string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """The index past the closing quote of the JSON string opening at `text[i]` (None: not yet)."""
    escaped = False
    for j in range(i + 1, len(text)):
        ch = text[j]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return j + 1
    return None


class ContainerEnd:
    """Where a JSON object or array ends, found as its text arrives (bracket depth outside strings)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in `text` past the container's closing bracket, or None if it is still open."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class CallEvents:
    """What one piece of text revealed: the function's name (once) and new argument text."""

    name: str | None = None
    arguments: str = ""


class CallObjectStream:
    """Walks `{"name": "...", "arguments": {...}}` (or `"parameters"`) as its text arrives.

    Reports the name once its string is complete and the arguments object has begun (so a
    member that is not an object never starts a call), then the arguments' text as it comes,
    and `end`: the index in everything fed so far past the object's closing brace. Text that
    cannot be such an object sets `failed`.
    """

    def __init__(self, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self.argument_keys = argument_keys
        self.text = ""
        self.pos = 0
        self.state = "open"
        self.key = ""
        self.name: str | None = None
        self.name_sent = False
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_sent = 0
        self.scanner: ContainerEnd | None = None
        self.scan_pos = 0
        self.end: int | None = None
        self.failed = False

    @property
    def done(self) -> bool:
        return self.end is not None or self.failed

    def feed(self, delta: str) -> CallEvents:
        if self.done:
            return CallEvents()
        self.text += delta
        while not self.done and self._step():
            pass
        events = CallEvents()
        if self.failed:
            return events
        if self.name is not None and self.args_start is not None and not self.name_sent:
            self.name_sent = True
            events.name = self.name
        if self.name_sent and self.args_start is not None:
            upto = self.args_end if self.args_end is not None else len(self.text)
            start = max(self.args_sent, self.args_start)
            events.arguments = self.text[start:upto]
            self.args_sent = upto
        return events

    def _fail(self) -> bool:
        self.failed = True
        return False

    def _step(self) -> bool:
        """Advance over one piece of the object; False when more text is needed (or it failed)."""
        t = self.text
        i = skip_ws(t, self.pos)
        if self.state in ("args", "skip"):
            assert self.scanner is not None
            found = self.scanner.feed(t[self.scan_pos :])
            if found is None:
                self.scan_pos = len(t)
                return False
            closed = self.scan_pos + found
            if self.state == "args":
                self.args_end = closed
            self.pos, self.state = closed, "after"
            return True
        if i >= len(t):
            return False
        ch = t[i]
        if self.state == "open":
            if ch != "{":
                return self._fail()
            self.pos, self.state = i + 1, "first_key"
            return True
        if self.state in ("first_key", "key"):
            if ch == "}" and self.state == "first_key":
                return self._fail()  # an empty object names no function
            if ch != '"':
                return self._fail()
            end = string_end(t, i)
            if end is None:
                return False
            j = skip_ws(t, end)
            if j >= len(t):
                return False
            if t[j] != ":":
                return self._fail()
            try:
                self.key = json.loads(t[i:end])
            except ValueError:
                return self._fail()
            self.pos, self.state = j + 1, "value"
            return True
        if self.state == "value":
            return self._value(t, i, ch)
        # state "after": a member ended
        if ch == ",":
            self.pos, self.state = i + 1, "key"
            return True
        if ch == "}":
            self.end = i + 1
            if self.name is None or self.args_start is None:
                self.failed = True
            return False
        return self._fail()

    def _value(self, t: str, i: int, ch: str) -> bool:
        if self.key == "name" and self.name is None:
            if ch != '"':
                return self._fail()
            end = string_end(t, i)
            if end is None:
                return False
            try:
                self.name = json.loads(t[i:end])
            except ValueError:
                return self._fail()
            self.pos, self.state = end, "after"
            return True
        if self.key in self.argument_keys and self.args_start is None:
            if ch != "{":
                return self._fail()
            self.args_start, self.scan_pos, self.state = i, i, "args"
            self.scanner = ContainerEnd()
            return True
        # any other member: skip its value
        if ch == '"':
            end = string_end(t, i)
            if end is None:
                return False
            self.pos, self.state = end, "after"
            return True
        if ch in "{[":
            self.scanner, self.scan_pos, self.state = ContainerEnd(), i, "skip"
            return True
        stops = [k for k in (t.find(",", i), t.find("}", i)) if k >= 0]
        if not stops:
            return False
        end = min(stops)
        try:
            json.loads(t[i:end])
        except ValueError:
            return self._fail()
        self.pos, self.state = end, "after"
        return True


def member_spans(text: str, start: int) -> tuple[int, list[tuple[str, int, int]]] | None:
    """The members of the complete JSON object at `text[start]`: (end of the object,
    [(key, value start, value end), ...]), or None if it is not a JSON object."""
    if start >= len(text) or text[start] != "{":
        return None
    members: list[tuple[str, int, int]] = []
    i = skip_ws(text, start + 1)
    try:
        if text[i] == "}":
            return i + 1, members
        while True:
            end = string_end(text, i) if text[i] == '"' else None
            if end is None:
                return None
            key, i = json.loads(text[i:end]), end
            i = skip_ws(text, i)
            if text[i] != ":":
                return None
            i = skip_ws(text, i + 1)
            _value, end = _DECODER.raw_decode(text, i)
            members.append((key, i, end))
            i = skip_ws(text, end)
            if text[i] == "}":
                return i + 1, members
            if text[i] != ",":
                return None
            i = skip_ws(text, i + 1)
    except (ValueError, IndexError):
        return None


def call_from_json(
    text: str, start: int = 0, argument_keys: tuple[str, ...] = ARGUMENT_KEYS
) -> tuple[str, str, int] | None:
    """(name, the arguments' text, end) of the complete call object at `text[start]`, or None
    when it is not `{"name": str, "arguments"|"parameters": object}`."""
    found = member_spans(text, start)
    if found is None:
        return None
    end, members = found
    name = next((m for m in members if m[0] == "name"), None)
    args = next((m for m in members if m[0] in argument_keys), None)
    if name is None or args is None:
        return None
    name_value = json.loads(text[name[1] : name[2]])
    if not isinstance(name_value, str) or text[args[1]] != "{":
        return None
    return name_value, text[args[1] : args[2]], end
