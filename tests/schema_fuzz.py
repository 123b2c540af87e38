"""Schemathesis-driven fuzzing of a running Factory service (a helper for the services' fuzz tests).

Every operation in the service's OpenAPI schema gets requests generated from it, valid and invalid
(schemathesis' positive and negative modes), derandomized so a run is repeatable. Each response must be below
500, and a refusal must carry Factory's error shape. Schemathesis' own pytest integration is not used: its
lazy-fixture loader reaches into pytest internals that pytest 9 removed.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

try:
    import schemathesis
    from schemathesis.generation.modes import GenerationMode
except ImportError:  # a dev extra; the fuzz tests skip without it
    schemathesis = None


def _import_all_now() -> None:
    """Import every module of schemathesis and hypothesis while the test process has one thread. Schemathesis
    imports many lazily during a fuzz run, and pytest's assertion rewriting parses a plugin's modules on import;
    on CPython 3.11.7 a parse racing a server thread's parse raises "AST constructor recursion depth mismatch"
    (gh-106905, fixed in 3.11.8)."""
    import hypothesis

    for package in (schemathesis, hypothesis):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if module.name.startswith("hypothesis.extra."):  # optional integrations (numpy, django, ...)
                continue
            try:
                importlib.import_module(module.name)
            except ImportError:  # a module for an optional dependency not installed
                pass


if schemathesis is not None:
    _import_all_now()


def fuzz_service(base_url: str, max_examples: int = 25, prepare: Callable[[Any], None] | None = None,
                 after: Callable[[], None] | None = None) -> dict[str, int]:
    """Fuzz every operation of the service at base_url; returns how many requests each got. `prepare(case)` may
    adjust a case before it is sent (e.g. keep URLs in it local), `after()` undoes what a request changed."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    counts: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        counts[label] = 0
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(base_url, op, mode, label, counts, max_examples, prepare, after)
    assert httpx.get(base_url + "/health", timeout=30).status_code == 200
    return counts


def _fuzz_operation(base_url: str, op: Any, mode: Any, label: str, counts: dict[str, int], max_examples: int,
                    prepare: Callable[[Any], None] | None, after: Callable[[], None] | None) -> None:
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(op.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        if prepare is not None:
            prepare(case)
        try:
            r = case.call(base_url=base_url, timeout=120)
            counts[label] += 1
            assert r.status_code < 500, f"{label}: {r.status_code} {r.text[:300]}\n{case.as_curl_command()}"
            if r.status_code >= 400:
                err = r.json()["error"]
                assert isinstance(err["message"], str) and len(err["message"]) <= 500, err
                assert "field" in err, err
        finally:
            if after is not None:
                after()

    try:
        check()
    except Unsatisfiable:
        if mode != GenerationMode.NEGATIVE:
            raise  # an operation without inputs has no invalid request to make
