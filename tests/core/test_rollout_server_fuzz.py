"""Schemathesis against the rollout server's OpenAPI schema (a real server on 127.0.0.1): requests generated from
it, valid and invalid, never get a 5xx; refusals have the error shape; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.server.app import launch_server
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from tests.schema_fuzz import fuzz_service, schemathesis


@pytest.mark.slow
@pytest.mark.skipif(schemathesis is None, reason="schemathesis (dev extra) not installed")
def test_schema_fuzzing_finds_no_server_error():
    tok = build_tokenizer()
    engine = ContinuousEngine(build_model("micro", tok, seed=0), tok, max_batch=16, name="micro")
    with launch_server(engine, max_body_bytes=1 << 20, max_update_bytes=1 << 20) as handle:
        # a fuzzed pause must not leave the next request waiting
        counts = fuzz_service(handle.url, max_examples=20,
                              after=lambda: httpx.post(handle.url + "/continue_generation", timeout=30))
    assert counts["POST /v1/chat/completions"] > 10 and counts["POST /v1/completions"] > 10, counts
