"""Requests for the batching scheduler from plain data: the items of Model.generate_batch and
the lines of `minillm generate --batch-file` (one JSON object each). Every field is checked
here, so a bad item is refused with a message that names it."""
from __future__ import annotations

import math
from dataclasses import replace

from ..errors import MinillmError
from ..sampling import SamplingParams
from .scheduler import Request

# field -> (type check, what it must be)
SAMPLING_FIELDS = {
    "temperature": (lambda v: is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "top_k": (lambda v: is_integer(v) and v >= 0, "an integer >= 0"),
    "min_p": (lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "seed": (lambda v: is_integer(v) and 0 <= v < 2 ** 64, "an integer in [0, 2^64)"),
    "repeat_penalty": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "repeat_last_n": (lambda v: is_integer(v) and v >= -1, "an integer >= -1 (-1: all)"),
    "presence_penalty": (lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
}
FIELDS = ("id", "prompt", "messages", "max_tokens", "stop", "priority", "lookup", "draft", *SAMPLING_FIELDS)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def make_request(item, max_tokens: int = 128, sampling: SamplingParams | None = None, stop=(),
                 ignore_eos: bool = False, id=None, lookup: bool = False, draft: bool = False) -> Request:
    """A Request from a prompt (text, or a list of messages) or from a dict with `prompt` or
    `messages` and any of FIELDS; the arguments are the defaults its fields override."""
    sampling = sampling or SamplingParams()
    if not isinstance(item, dict):
        return Request(_prompt(item, "prompt"), max_tokens, sampling, list(stop), 0, ignore_eos, id,
                       lookup=lookup, draft=draft)
    unknown = [k for k in item if k not in FIELDS]
    if unknown:
        raise MinillmError(f"unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})")
    if ("prompt" in item) == ("messages" in item):
        raise MinillmError("give exactly one of 'prompt' and 'messages'")
    prompt = _prompt(item["prompt"], "prompt") if "prompt" in item else _prompt(item["messages"], "messages")
    n = item.get("max_tokens", max_tokens)
    if not is_integer(n) or not 0 <= n <= 1 << 20:
        raise MinillmError(f"'max_tokens' must be an integer in [0, {1 << 20}], not {n!r}")
    priority = item.get("priority", 0)
    if not is_integer(priority) or abs(priority) > 1 << 31:
        raise MinillmError(f"'priority' must be an integer, not {priority!r}")
    stops = item.get("stop", list(stop))
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise MinillmError("'stop' must be a string or a list of strings")
    lookup, draft = item.get("lookup", lookup), item.get("draft", draft)
    for name, value in (("lookup", lookup), ("draft", draft)):
        if not isinstance(value, bool):
            raise MinillmError(f"'{name}' must be true or false, not {value!r}")
    overrides = {}
    for key, (ok, what) in SAMPLING_FIELDS.items():
        if key in item:
            if not ok(item[key]):
                raise MinillmError(f"'{key}' must be {what}, not {item[key]!r}")
            overrides[key] = item[key]
    return Request(prompt, n, replace(sampling, **overrides), stops, priority, ignore_eos, item.get("id", id),
                   lookup=lookup, draft=draft)


def _prompt(value, name: str):
    if isinstance(value, str):
        return value
    if name == "messages" and isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return value
    if name == "messages":
        raise MinillmError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    raise MinillmError(f"'{name}' must be a string")
