"""The SGLang client against a fake SGLang server on 127.0.0.1 (FastAPI + uvicorn in a thread).

The fake answers in SGLang's native shapes (GenerateReqInput in, meta_info with
output_token_logprobs / finish_reason / weight_version out; UpdateWeightFromDiskReqInput in,
{"success", "message"} out) and rejects requests that SGLang would not accept, so the tests check
what the client sends as well as how it reads the answers. No real SGLang runs here.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from factory.core.rollout.base import RolloutEngine, SamplingParams
from factory.core.sglang.client import SGLangEngine, SGLangError, SGLangTimeout
from tests.ports import refusing_port

EOS = 2
# every request carries these, so no server-side default (generation_config.json) applies
NEUTRAL = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
           "min_new_tokens": 0}
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed",
                 "skip_special_tokens", "ignore_eos", "stop", "no_stop_trim", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty", "min_new_tokens", "n"}
GENERATE_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                 "return_text_in_logprobs", "stream", "rid"}
UPDATE_KEYS = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
               "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache"}


class FakeState:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.version = "default"
        self.requests: list[tuple[str, Any]] = []
        self.fail_generate: int | None = None  # HTTP status to answer /generate with
        self.delay_s = 0.0
        self.finish_override: dict | None = None
        self.drop_logprobs = False
        self.corrupt_output_ids = False
        self.report_version: str | None = None  # a version label other than the loaded one (in-flight update)
        self.loaded: list[str] = []


def fake_tokens(prompt: list[int], k: int, max_new: int) -> tuple[list[int], dict]:
    """Deterministic output: prompts with an even sum stop with EOS after 2 tokens, others hit the limit."""
    if sum(prompt) % 2 == 0 and max_new >= 3:
        return [10 + (sum(prompt) + k) % 50, 11, EOS], {"type": "stop", "matched": EOS}
    return [10 + (sum(prompt) + k + j) % 50 for j in range(max_new)], {"type": "length", "length": max_new}


def make_app(state: FakeState, started: threading.Event) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        started.set()
        yield

    app = FastAPI(lifespan=lifespan)

    def bad(msg: str) -> JSONResponse:
        return JSONResponse({"error": {"message": msg}}, status_code=400)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        state.requests.append(("/generate", body))
        if state.delay_s:
            await asyncio.sleep(state.delay_s)
        if state.fail_generate:
            return JSONResponse({"error": {"message": "CUDA out of memory (fake)"}}, status_code=state.fail_generate)
        if set(body) - GENERATE_KEYS:
            return bad(f"unknown fields {sorted(set(body) - GENERATE_KEYS)}")
        ids = body.get("input_ids")
        single = bool(ids) and isinstance(ids[0], int)
        batch = [ids] if single else ids
        if not batch or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in batch):
            return bad("input_ids must be a list of token id lists")
        sps = body.get("sampling_params", {})
        sps = sps if isinstance(sps, list) else [sps] * len(batch)
        if len(sps) != len(batch):
            return bad("sampling_params list length must match the batch")
        outs = []
        for k, (p, sp) in enumerate(zip(batch, sps, strict=True)):
            if set(sp) - SAMPLING_KEYS:
                return bad(f"unknown sampling params {sorted(set(sp) - SAMPLING_KEYS)}")
            tokens, finish = fake_tokens(p, k, int(sp.get("max_new_tokens", 128)))
            meta = {"id": uuid.uuid4().hex, "finish_reason": state.finish_override or finish,
                    "prompt_tokens": len(p), "weight_version": state.report_version or state.version,
                    "completion_tokens": len(tokens), "cached_tokens": 0, "e2e_latency": 0.01}
            if body.get("return_logprob") and not state.drop_logprobs:
                meta["output_token_logprobs"] = [[-0.1 * (j + 1), t, None] for j, t in enumerate(tokens)]
                if body.get("top_logprobs_num"):
                    meta["output_top_logprobs"] = [[[-0.1 * (j + 1) - r, t + r, None]
                                                    for r in range(body["top_logprobs_num"])]
                                                   for j, t in enumerate(tokens)]
            out_ids = [t + 1 for t in tokens] if state.corrupt_output_ids else tokens
            outs.append({"text": " ".join(map(str, tokens)), "output_ids": out_ids, "meta_info": meta})
        return JSONResponse(outs[0] if single else outs)

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> Response:
        body = await request.json()
        state.requests.append(("/update_weights_from_disk", body))
        if set(body) - UPDATE_KEYS or not isinstance(body.get("model_path"), str):
            return bad(f"bad update request {body}")
        path = body["model_path"]
        if not (path.startswith("ok/") or Path(path, "model.safetensors").is_file()):
            return JSONResponse({"success": False, "message": f"Failed to get weights iterator: {path} "
                                 "(repository not found).", "num_paused_requests": 0}, status_code=400)
        state.loaded.append(path)
        if body.get("weight_version") is not None:
            state.version = body["weight_version"]
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": 0})

    @app.post("/flush_cache")
    async def flush() -> Response:
        state.requests.append(("/flush_cache", None))
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details.\n")

    @app.get("/get_model_info")
    async def model_info() -> Response:
        return JSONResponse({"model_path": "fake/model", "tokenizer_path": "fake/model", "is_generation": True,
                             "preferred_sampling_params": None, "weight_version": state.version,
                             "has_image_understanding": False, "has_audio_understanding": False})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


@pytest.fixture(scope="module")
def server():
    state, started = FakeState(), threading.Event()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # Listening before uvicorn starts: the lifespan event below fires before uvicorn listens, and a bound socket
    # that does not listen yet refuses connections (CI saw the first test refused); the backlog holds them instead.
    sock.listen(128)
    srv = uvicorn.Server(uvicorn.Config(make_app(state, started), log_level="warning",
                                        timeout_graceful_shutdown=1))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert started.wait(10), "fake SGLang server did not start"
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def fake(server):
    url, state = server
    state.reset()
    engine = SGLangEngine(url, weight_version=0, timeout=5.0)
    yield engine, state
    engine.close()


def test_generate_sends_sglang_requests_and_reads_tokens_and_logprobs(fake):
    engine, state = fake
    as_protocol: RolloutEngine = engine  # the interface (the Protocol is not runtime-checkable)
    assert callable(as_protocol.generate) and callable(as_protocol.load_weights)
    groups = engine.generate([[1, 2], [2, 4, 6]], SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=4))
    # one /generate call: each prompt sent n times with n=1, logprobs requested
    (endpoint, body), = state.requests
    assert endpoint == "/generate" and body["return_logprob"] is True
    assert body["input_ids"] == [[1, 2]] * 3 + [[2, 4, 6]] * 3
    assert body["sampling_params"] == {**NEUTRAL, "max_new_tokens": 4, "top_p": 0.9, "temperature": 0.7}
    assert [len(g) for g in groups] == [3, 3]
    # The fake's tokens for batch row k: odd prompt sum runs to the limit, 10 + (sum + k + j) % 50;
    # even sum stops after [10 + (sum + k) % 50, 11, EOS], and the EOS token is kept.
    c = groups[0][1]  # row 1: 10 + (3 + 1 + j)
    assert c.prompt_ids == [1, 2] and c.token_ids == [14, 15, 16, 17] and c.finish_reason == "length"
    assert c.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    stop = groups[1][0]  # row 3: 10 + (12 + 3)
    assert stop.token_ids == [25, 11, EOS] and stop.finish_reason == "stop"
    assert stop.text == " ".join(map(str, stop.token_ids))
    assert stop.weight_version == 0 and stop.meta["weight_versions"] == [0]  # "default" label: no number


def test_batches_are_split_at_max_batch_and_regrouped_in_order(fake):
    engine, state = fake
    engine.max_batch = 4
    groups = engine.generate([[1], [3], [5]], SamplingParams(n=2, max_new_tokens=2))
    assert [len(b["input_ids"]) for _, b in state.requests] == [4, 2]
    assert [[c.prompt_ids for c in g] for g in groups] == [[[1], [1]], [[3], [3]], [[5], [5]]]


def test_greedy_seed_and_stop_tokens(server):
    url, state = server
    state.reset()
    with SGLangEngine(url, stop_token_ids=[EOS, 7], send_seed=True) as engine:
        engine.generate([[1]], SamplingParams(n=2, greedy=True, max_new_tokens=2, seed=100))
    sp = state.requests[0][1]["sampling_params"]
    assert sp == [{**NEUTRAL, "max_new_tokens": 2, "top_p": 1.0, "temperature": 0.0, "stop_token_ids": [EOS, 7],
                   "sampling_seed": 100 + i} for i in range(2)]


def test_weight_update_tags_later_completions(fake):
    engine, state = fake
    engine.update_weights_from_disk("ok/step-3", version=3)
    assert state.requests[-1] == ("/update_weights_from_disk", {"model_path": "ok/step-3", "weight_version": "3"})
    assert engine.weight_version == 3 and engine.model_info()["weight_version"] == "3"
    c = engine.generate([[1]], SamplingParams(max_new_tokens=1))[0][0]
    assert c.weight_version == 3 and c.meta["weight_versions"] == [3] and c.meta["server_weight_version"] == "3"


def test_update_landing_mid_request_keeps_the_oldest_version(fake):
    engine, state = fake
    engine.update_weights_from_disk("ok/step-2", version=2)
    state.report_version = "3"  # the server moved to 3 while this request was in flight
    c = engine.generate([[1]], SamplingParams(max_new_tokens=1))[0][0]
    assert c.weight_version == 2 and c.meta["weight_versions"] == [2, 3]


def test_refused_update_is_an_error_naming_the_endpoint(fake):
    engine, _ = fake
    with pytest.raises(SGLangError, match=r"SGLang /update_weights_from_disk: server refused weights missing/x "
                                          r"as version 5: Failed to get weights iterator"):
        engine.update_weights_from_disk("missing/x", version=5)
    assert engine.weight_version == 0  # unchanged


def test_update_reporting_success_without_the_version_fails_loudly(fake, monkeypatch):
    engine, _ = fake
    monkeypatch.setattr(engine, "model_info", lambda: {"weight_version": "default"})
    with pytest.raises(SGLangError, match="reports weight_version 'default', expected '4'"):
        engine.update_weights_from_disk("ok/step-4", version=4)


def test_load_weights_writes_safetensors_the_server_loads(fake, tmp_path):
    engine, state = fake
    engine.weights_dir = tmp_path / "published"
    emb = torch.arange(6.0).view(3, 2)
    engine.load_weights({"model.embed_tokens.weight": emb, "lm_head.weight": emb}, version=7)  # tied: shared
    path = tmp_path / "published" / "v00000007"
    assert state.loaded == [str(path)] and engine.weight_version == 7
    from safetensors.torch import load_file

    loaded = load_file(str(path / "model.safetensors"))
    assert torch.equal(loaded["lm_head.weight"], emb)
    assert [p.name for p in (tmp_path / "published").iterdir()] == ["v00000007"]  # no temp dirs left
    engine.weights_dir = None
    with pytest.raises(SGLangError, match="needs weights_dir"):
        engine.load_weights({}, version=8)


def test_http_500_names_the_endpoint_and_the_server_message(fake):
    engine, state = fake
    state.fail_generate = 500
    with pytest.raises(SGLangError, match=r"SGLang /generate: HTTP 500 from http://127.0.0.1:\d+: "
                                          r"CUDA out of memory \(fake\)") as e:
        engine.generate([[1]], SamplingParams())
    assert e.value.status == 500 and e.value.endpoint == "/generate"


def test_timeout_is_a_clear_error(server):
    url, state = server
    state.reset()
    state.delay_s = 0.5
    with SGLangEngine(url, timeout=0.05) as engine:
        with pytest.raises(SGLangTimeout, match=r"/generate: no answer .* within 0.05 s"):
            engine.generate([[1]], SamplingParams())


def test_unreachable_server():
    port = refusing_port()
    with SGLangEngine(f"http://127.0.0.1:{port}", timeout=1.0, connect_timeout=1.0) as engine:
        assert engine.health() is False
        with pytest.raises(SGLangError, match="cannot reach"):
            engine.generate([[1]], SamplingParams())


@pytest.mark.parametrize("breakage, message", [
    ("abort", "was aborted by the server: weights updating"),
    ("no_logprobs", "output_token_logprobs is missing"),
    ("output_ids", "disagree with the token ids"),
    ("odd_finish", "unexpected finish_reason"),
])
def test_malformed_or_aborted_outputs_are_refused(fake, breakage, message):
    engine, state = fake
    if breakage == "abort":
        state.finish_override = {"type": "abort", "message": "weights updating"}
    elif breakage == "no_logprobs":
        state.drop_logprobs = True
    elif breakage == "output_ids":
        state.corrupt_output_ids = True
    else:
        state.finish_override = {"type": "eos"}
    with pytest.raises(SGLangError, match=message):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))


def test_health_flush_and_model_info(fake):
    engine, state = fake
    assert engine.health() is True
    engine.flush_cache()
    assert state.requests[-1] == ("/flush_cache", None)
    assert engine.model_info()["is_generation"] is True


NEW_FIELDS = hasattr(SamplingParams(), "stop_token_ids") and hasattr(SamplingParams(), "top_logprobs")


@pytest.mark.skipif(not NEW_FIELDS, reason="SamplingParams without stop/ignore_eos/top_logprobs fields")
def test_stop_ignore_eos_and_top_logprobs_are_forwarded(server):
    url, state = server
    state.reset()
    params = SamplingParams(max_new_tokens=3, stop=("\n\n",), stop_token_ids=(9,), ignore_eos=True, top_logprobs=2)
    with SGLangEngine(url, stop_token_ids=[EOS]) as engine:
        c = engine.generate([[1, 2]], params)[0][0]
    body = state.requests[0][1]
    assert body["top_logprobs_num"] == 2
    assert body["sampling_params"] == {**NEUTRAL, "max_new_tokens": 3, "top_p": 1.0, "temperature": 1.0,
                                       "stop_token_ids": [EOS, 9], "stop": ["\n\n"], "ignore_eos": True}
    # per token: (token, logprob) of the sampled token, then the runner-up one lower
    assert c.token_ids == [13, 14, 15]
    assert c.top_logprobs[0] == [(13, pytest.approx(-0.1)), (14, pytest.approx(-1.1))]
    assert len(c.top_logprobs) == 3
