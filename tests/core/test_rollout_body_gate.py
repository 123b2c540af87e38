"""The byte-level bound of `/v1/completions` bodies (`body_gate.py`): commas inside strings (escaped quotes and
backslashes included) are told apart from those between values exactly, the largest acceptable bodies pass, and
bodies with more values or strings than any acceptable request are refused naming `prompt`."""

from __future__ import annotations

import json
import random

from factory.core.rollout.server.api_models import MAX_PROMPTS
from factory.core.rollout.server.body_gate import (
    MAX_OTHER_VALUES,
    MAX_STRINGS,
    body_problem,
    commas_outside_strings,
    max_values,
)

TRICKY = [",", '"', "\\", '\\"', '\\\\"', ",\\", "\\,", "\u00e9", "\u2028", "\n", "\x00", "[", "]", "{", "}", ":",
          "a", " ", "0"]


def _random_string(rng: random.Random) -> str:
    return "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 6)))


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randint(0, 6 if depth < 4 else 3)
    if kind == 0:
        return rng.randint(-10**6, 10**6)
    if kind == 1:
        return rng.random()
    if kind == 2:
        return _random_string(rng)
    if kind == 3:
        return rng.choice([True, False, None])
    if kind in (4, 5):
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {_random_string(rng): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def _separators(value: object) -> int:
    """The reference: commas between the elements of every container."""
    if isinstance(value, list):
        return max(len(value) - 1, 0) + sum(_separators(v) for v in value)
    if isinstance(value, dict):
        return max(len(value) - 1, 0) + sum(_separators(v) for v in value.values())
    return 0


def test_commas_outside_strings_match_the_parsed_structure():
    rng = random.Random(0)
    for i in range(2000):
        value = _random_value(rng)
        for ensure_ascii in (True, False):
            text = json.dumps(value, ensure_ascii=ensure_ascii, separators=(",", ":") if i % 2 else (", ", ": "))
            body = text.encode()
            assert json.loads(body) == value or value != value  # a valid JSON text of `value`
            assert commas_outside_strings(body) == _separators(value), text


def test_the_largest_acceptable_bodies_pass():
    ctx = 128
    ids = [[7] * (ctx - 1) for _ in range(MAX_PROMPTS)]  # the longest prompts that leave room for one token
    other = {"stop_token_ids": [3] * (MAX_OTHER_VALUES - 32), "stop": ["a"], "n": 2, "temperature": 1.0,
             "note": "," * 500_000}  # commas in strings cost nothing: unknown fields are ignored
    body = json.dumps({"prompt": ids, "max_tokens": 1, **other}).encode()
    assert body.count(b",") > max_values(ctx)  # the precise count is what lets it pass
    assert body_problem(body, ctx) is None
    texts = json.dumps({"prompt": [',"\\' * 10_000] * MAX_PROMPTS, "max_tokens": 1}).encode()
    assert body_problem(texts, ctx) is None


def test_too_many_values_are_refused_naming_prompt():
    ctx = 128
    over = max_values(ctx) + 1
    body = ('{"max_tokens": 1, "prompt": [' + ",".join(["5"] * (over + 1)) + "]}").encode()
    problem = body_problem(body, ctx)
    assert problem is not None and problem.startswith("prompt: ") and str(max_values(ctx)) in problem
    at_limit = ('{"max_tokens": 1, "prompt": [' + ",".join(["5"] * (over - 1)) + "]}").encode()
    assert body_problem(at_limit, ctx) is None  # the bound is on commas: `over - 1` values have `limit - 1`


def test_too_many_strings_are_refused_before_splitting():
    # past the comma count (max_values(1) == MAX_STRINGS), the strings are counted before the body is split
    body = ('{"prompt": [' + ",".join(['""'] * (MAX_STRINGS + 10)) + "]}").encode()
    assert body.count(b",") > max_values(1)
    problem = body_problem(body, 1)
    assert problem is not None and "strings" in problem and str(MAX_STRINGS) in problem
