"""PEFT's per-module `rank_pattern` / `alpha_pattern`, matched with bounds.

PEFT gives a module the value of the first pattern that matches the end of its name at a
dot (`re.match(rf"(.*\\.)?({pattern})$", name)`). The patterns come from the adapter's
config file, so they are untrusted: a pattern with nested quantifiers such as `(a+)+$`
backtracks for ages on a long name, and Python's `re` cannot be stopped from another
thread. So patterns are checked before use (a mapping of str -> number, at most
`MAX_PATTERN_CHARS` characters, valid regex, no quantified group holding a quantifier),
and the matching itself runs in a short-lived child interpreter that is killed after
`MATCH_TIMEOUT_S` seconds (a ValueError then).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

MAX_PATTERN_CHARS = 256
MAX_PATTERNS = 1024
MATCH_TIMEOUT_S = 5.0

_QUANTIFIER = re.compile(r"[*+]|\{\d*,?\d*\}")
_MATCHER = """
import json, re, sys
job = json.load(sys.stdin)
out = {}
for field, patterns in job["patterns"].items():
    out[field] = {}
    for key in job["keys"]:
        out[field][key] = next((p for p in patterns if re.match(rf"(.*\\.)?({p})$", key)), None)
json.dump(out, sys.stdout)
"""


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def has_nested_quantifier(pattern: str) -> bool:
    """Whether a group that repeats (`*`, `+`, `{m,n}`) holds a repeat itself: the shape of
    catastrophic backtracking. A structural scan (escapes and character classes skipped),
    stricter than needed, which is fine for PEFT's module-name patterns."""
    stack: list[bool] = []  # per open group: does it hold a quantifier?
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a character class: skip to its closing bracket
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            continue
        if c == "(":
            stack.append(False)
        elif c == ")":
            inner = stack.pop() if stack else False
            quantified = _QUANTIFIER.match(pattern, i + 1) is not None
            if inner and quantified:
                return True
            if stack and (inner or quantified):
                stack[-1] = True
        elif _QUANTIFIER.match(pattern, i) and stack:
            stack[-1] = True
        i += 1
    return False


def check_patterns(patterns: object, field: str, value_type: type, where: str) -> None:
    """ValueError naming `field` unless `patterns` is absent or a mapping of bounded, valid,
    non-backtracking regexes to positive finite numbers (ints for `rank_pattern`)."""
    if patterns is None:
        return
    if not isinstance(patterns, dict):
        raise ValueError(f"{where}: {field} must map module patterns to values, not {type(patterns).__name__}")
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"{where}: {field} has {len(patterns)} patterns (at most {MAX_PATTERNS})")
    for pattern, value in patterns.items():
        if len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"{where}: {field} pattern of {len(pattern)} characters (at most {MAX_PATTERN_CHARS})")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{where}: {field} pattern {pattern!r} is not a valid regex ({exc})") from None
        if has_nested_quantifier(pattern):
            raise ValueError(
                f"{where}: {field} pattern {pattern!r} has a repeated group holding a repeat "
                "(nested quantifiers backtrack catastrophically)"
            )
        integral = value_type is int and (isinstance(value, int) or (isinstance(value, float) and value.is_integer()))
        if not is_number(value) or not 0 < value < math.inf or (value_type is int and not integral):
            kind = "positive integer" if value_type is int else "positive finite number"
            raise ValueError(f"{where}: {field}[{pattern!r}] must be a {kind}, got {value!r}")


def match_patterns(patterns: dict[str, dict], keys: list[str], where: str) -> dict[str, dict[str, str | None]]:
    """field -> module key -> the first pattern of that field matching the key (PEFT's
    `get_pattern_key`), or None. Runs in a child interpreter bounded by `MATCH_TIMEOUT_S`."""
    patterns = {field: list(p) for field, p in patterns.items() if p}
    if not patterns:
        return {}
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _MATCHER],
            input=json.dumps({"patterns": patterns, "keys": keys}),
            capture_output=True,
            text=True,
            timeout=MATCH_TIMEOUT_S,
            check=True,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"{where}: matching rank_pattern / alpha_pattern against the module names took over "
            f"{MATCH_TIMEOUT_S:g} s (a backtracking regex?)"
        ) from None
    except subprocess.CalledProcessError as exc:
        raise ValueError(f"{where}: cannot match rank_pattern / alpha_pattern ({exc.stderr.strip()[-200:]})") from None
    return json.loads(done.stdout)
