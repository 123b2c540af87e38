"""The rollout server over real HTTP on 127.0.0.1, driven by the real openai client (sync and async)."""

from __future__ import annotations

import asyncio
import io
import re
import subprocess
import sys
import threading

import httpx
import openai
import pytest
import torch

from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.engine_control import EngineControl
from factory.core.rollout.engines.paged.engine import make_engine as build_engine
from factory.core.rollout.server.app import launch_server
from factory.models.build import build_model
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer

PROMPTS = ["1+2=", "123+456=", "99*9=", "7", "5555+5555=", "1-1=", "2*3*4*5=", "31-4*1="]


ENGINES = ["continuous", "paged"]  # a few tests run over both engines (`server` takes the engine as its param)


def make_engine(seed: int = 0, max_batch: int = 16, engine: str = "continuous") -> EngineControl:
    tok = build_tokenizer()
    return build_engine(build_model("micro", tok, seed=seed), tok, engine, max_batch=max_batch, name="micro")


@pytest.fixture
def server(request):
    with launch_server(make_engine(engine=getattr(request, "param", "continuous"))) as handle:
        yield handle


def client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.mark.slow
def test_health_models_and_model_info(server):
    assert server.url.startswith("http://127.0.0.1:")
    assert httpx.get(server.url + "/health").status_code == 200
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["micro", "policy"]  # its name, and the one environments use
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["weight_version"] == 0 and info["config"]["model_type"] == "qwen2" and info["max_seq_len"] == 64


@pytest.mark.parametrize("server", ENGINES, indirect=True)
def test_completions_return_exact_tokens_and_openai_logprobs(server):
    tok = server.engine.tokenizer
    r = client(server).completions.create(model="micro", prompt=PROMPTS[:2], max_tokens=6, n=2, logprobs=2,
                                          temperature=0.8, seed=3)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, c in enumerate(r.choices):
        assert c.prompt_token_ids == tok(PROMPTS[i // 2]).input_ids
        # the OpenAI shape lists the tokens of the text (not bos/pad/eos); the extension field has them all
        listed = [i for i, t in enumerate(c.token_ids) if t not in tok.all_special_ids]
        assert c.logprobs.token_logprobs == [c.token_logprobs[i] for i in listed]
        assert c.logprobs.tokens == [tok.decode([c.token_ids[i]]) for i in listed]
        assert "".join(c.logprobs.tokens) == c.text
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
        assert tok.decode(c.token_ids, skip_special_tokens=True) == c.text
        assert c.weight_version == 0 and c.token_versions == [0] * len(c.token_ids)
        assert 1 <= len(c.token_ids) <= 6
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    # token-id prompts give the same seeded samples as the text they encode
    again = client(server).completions.create(model="micro", prompt=[tok(PROMPTS[0]).input_ids], max_tokens=6, n=2,
                                              temperature=0.8, seed=3)
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in r.choices[:2]]


def test_chat_completions_with_logprobs(server):
    tok = server.engine.tokenizer
    r = client(server).chat.completions.create(
        model="micro", messages=[{"role": "user", "content": "12+3="}], max_tokens=5, logprobs=True, top_logprobs=3,
        temperature=0.9, seed=1)
    (c,) = r.choices
    assert c.message.role == "assistant"
    # the built-in template: <bos> + content for a lone user message, i.e. the completions prompt of its text
    assert c.prompt_token_ids == tok("12+3=").input_ids
    listed = [i for i, t in enumerate(c.token_ids) if t not in tok.all_special_ids]  # not in the content: unlisted
    assert [x.logprob for x in c.logprobs.content] == [c.token_logprobs[i] for i in listed]
    assert [x.token for x in c.logprobs.content] == [tok.decode([c.token_ids[i]]) for i in listed]
    assert all(len(x.top_logprobs) == 3 for x in c.logprobs.content)
    assert tok.decode(c.token_ids, skip_special_tokens=True) == c.message.content


@pytest.mark.parametrize("server", ENGINES, indirect=True)
def test_async_clients_are_batched_together(server):
    eng = server.engine

    async def main():
        async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.post("/pause_generation", json={"mode": "drain"})).json()["paused"] == "drain"
            calls = [async_client.completions.create(model="micro", prompt=p, max_tokens=8, seed=i)
                     for i, p in enumerate(PROMPTS[:4])]
            calls += [async_client.chat.completions.create(model="micro", messages=[{"role": "user", "content": p}],
                                                           max_tokens=8, seed=i) for i, p in enumerate(PROMPTS[4:])]
            tasks = [asyncio.ensure_future(c) for c in calls]
            # all eight requests wait in the engine's queue while it is paused
            assert await asyncio.to_thread(eng.wait_until, lambda: eng.queued == 8, 10)
            assert eng.running == 0
            assert (await http.post("/continue_generation")).status_code == 200
            return await asyncio.gather(*tasks)

    prefills = eng.stats.prefills
    results = asyncio.run(main())
    assert len(results) == 8 and all(len(r.choices[0].token_ids) >= 1 for r in results)
    assert eng.stats.prefills == prefills + 1 and eng.stats.max_running == 8  # one admission, one batch


@pytest.mark.parametrize("server", ENGINES, indirect=True)
def test_update_weights_from_disk_changes_version_and_outputs(server, tmp_path):
    tok = server.engine.tokenizer
    ckpt = tmp_path / "ckpt"
    save_checkpoint(build_model("micro", tok, seed=5), tok, ckpt)
    c = client(server)
    before = c.completions.create(model="micro", prompt="1+2=", max_tokens=6, temperature=0).choices[0]
    r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(ckpt), "version": 7}, timeout=30)
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == 7
    assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == 7
    after = c.completions.create(model="micro", prompt="1+2=", max_tokens=6, temperature=0).choices[0]
    assert after.weight_version == 7 and set(after.token_versions) == {7}
    # random-init models may agree on the argmax; their probabilities cannot
    assert after.token_logprobs != before.token_logprobs
    bad = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert bad.status_code == 400 and "not a directory" in bad.json()["message"]


@pytest.mark.parametrize("engine", ENGINES)
def test_update_weights_from_delta_with_the_weights_codec(engine):
    weights = pytest.importorskip("factory.core.weights")
    tok = build_tokenizer()
    base, target = build_model("micro", tok, seed=0).state_dict(), build_model("micro", tok, seed=5).state_dict()
    eng = make_engine(seed=0, engine=engine)
    with launch_server(eng) as handle:
        delta = weights.encode_delta(base, target, version=1, base_version=0).to_bytes()
        r = httpx.post(handle.url + "/update_weights_from_delta", content=bytes(delta), timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == 1
        assert all(torch.equal(eng.model.state_dict()[k], v) for k, v in target.items())
        again = httpx.post(handle.url + "/update_weights_from_delta", content=bytes(delta), timeout=30)
        assert again.status_code == 409 and "base" in again.json()["message"]  # the engine is at v1 now
        full = weights.encode_full(base, version=2).to_bytes()
        r = httpx.post(handle.url + "/update_weights_from_delta", params={"mode": "in_flight"}, content=bytes(full))
        assert r.status_code == 200 and r.json()["weight_version"] == 2
        assert httpx.post(handle.url + "/update_weights_from_delta", content=b"junk").status_code == 400


def test_update_weights_from_delta_with_a_custom_decoder():
    def decoder(payload: bytes, current, current_version: int):
        return {**current, **torch.load(io.BytesIO(payload))}, None

    eng = make_engine()
    with launch_server(eng, delta_decoder=decoder) as handle:
        name = "model.norm.weight"
        buf = io.BytesIO()
        torch.save({name: torch.full_like(eng.model.state_dict()[name], 2.0)}, buf)
        r = httpx.post(handle.url + "/update_weights_from_delta", params={"version": 3, "mode": "in_flight"},
                       content=buf.getvalue(), timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == 3
        assert torch.equal(eng.model.state_dict()[name], torch.full_like(eng.model.state_dict()[name], 2.0))


@pytest.mark.slow
def test_session_records_turns_and_continues_exact_ids(server):
    tok = server.engine.tokenizer
    c = client(server)
    first = [{"role": "user", "content": "12+3="}]
    t1 = c.chat.completions.create(model="micro", messages=first, max_tokens=6, seed=2,
                                   extra_headers={"X-Session-Id": "ep-1"}).choices[0]
    second = [*first, {"role": "assistant", "content": t1.message.content}, {"role": "user", "content": "4*5="}]
    t2 = c.chat.completions.create(model="micro", messages=second, max_tokens=6, seed=2,
                                   extra_body={"session_id": "ep-1"}).choices[0]
    # turn 2's prompt is turn 1's exact ids followed by the new message: nothing was re-tokenized
    assert t2.prompt_token_ids == t1.prompt_token_ids + t1.token_ids + tok("4*5=", add_special_tokens=False).input_ids
    rec = httpx.get(server.url + "/sessions/ep-1").json()
    assert [t["turn"] for t in rec["turns"]] == [0, 1]
    r1, r2 = rec["turns"]
    assert (r1["prompt_ids"], r1["completion_ids"], r1["logprobs"]) == (t1.prompt_token_ids, t1.token_ids,
                                                                       t1.token_logprobs)
    assert r2["continues_turn"] == 0 and r2["completion_ids"] == t2.token_ids
    episode = r2["prompt_ids"] + r2["completion_ids"]
    assert episode[: len(r1["prompt_ids"]) + len(r1["completion_ids"])] == r1["prompt_ids"] + r1["completion_ids"]
    assert r1["token_versions"] == [0] * len(t1.token_ids)
    # completions requests are recorded too; unknown sessions are 404
    c.completions.create(model="micro", prompt="7", max_tokens=2, extra_body={"session_id": "ep-2"})
    assert len(httpx.get(server.url + "/sessions/ep-2").json()["turns"]) == 1
    assert httpx.get(server.url + "/sessions/nope").status_code == 404
    assert httpx.delete(server.url + "/sessions/ep-2").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("server", ENGINES, indirect=True)
def test_pause_wait_continue_and_flush(server):
    r = httpx.post(server.url + "/pause_generation", json={"mode": "drain", "wait": True, "timeout": 10})
    assert r.status_code == 200 and r.json()["drained"] is True
    assert httpx.get(server.url + "/get_server_info").json()["paused"] == "drain"
    assert httpx.post(server.url + "/continue_generation").json()["paused"] is None
    assert client(server).completions.create(model="micro", prompt="7", max_tokens=2).choices[0].token_ids
    assert httpx.post(server.url + "/flush_cache").status_code == 200
    assert httpx.post(server.url + "/pause_generation", json={"mode": "abort"}).status_code == 400
    # no body: drain mode; an in-place pause with running requests refuses a finish_old update
    assert httpx.post(server.url + "/pause_generation").json()["paused"] == "drain"
    eng = server.engine
    eng.resume()
    fut = eng.submit([1, 4], SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert eng.wait_until(lambda: eng.running == 1, timeout=10)
    assert httpx.post(server.url + "/pause_generation", json={"mode": "in_place"}).json()["running"] == 1
    r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": "/nonexistent", "mode": "finish_old"})
    assert r.status_code == 400 and "paused in place" in r.json()["message"]
    httpx.post(server.url + "/continue_generation")
    assert len(fut.result(timeout=30).token_ids) == 50


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 100}, "maximum context length is 64"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"prompt": "abc"}, "cannot encode"),
    ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
])
def test_bad_completion_requests_are_400_with_a_clear_message(server, kwargs, needle):
    args = {"model": "micro", "prompt": "1+2=", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(**args)
    assert e.value.status_code == 400 and needle in e.value.message


@pytest.mark.parametrize("server", ENGINES, indirect=True)
def test_bad_chat_requests_and_bodies(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model="micro", messages=[{"role": "robot", "content": "1"}])
    with pytest.raises(openai.BadRequestError, match="messages must not be empty"):
        c.chat.completions.create(model="micro", messages=[])
    with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
        c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "1"}], stream=True)
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid request")


@pytest.mark.slow
def test_factory_serve_command_serves_the_openai_api():
    # port 0: the server binds a port the kernel picks and names it (a port found free first can be taken before)
    proc = subprocess.Popen([sys.executable, "-m", "factory.cli", "serve", "--preset", "micro", "--port", "0",
                             "--threads", "1"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(60, proc.kill)  # bounds the wait for the startup line below
    watchdog.start()
    try:
        for line in proc.stderr:
            if "Uvicorn running on" in line:
                break
        else:
            pytest.fail(f"factory serve exited with {proc.wait()} before listening")
        port = int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))
        assert port > 0
        cl = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        r = cl.chat.completions.create(model="micro", messages=[{"role": "user", "content": "1+1="}], max_tokens=3)
        assert 1 <= len(r.choices[0].token_ids) <= 3
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(10)


def test_server_info_names_the_device_and_decoders_get_host_copies():
    seen = {}

    def decoder(payload: bytes, current, current_version: int):
        seen["devices"] = {t.device.type for t in current.values()}
        name = "model.norm.weight"
        current[name].fill_(3.0)  # patched in place: the served weights must not change until the update applies
        seen["served_meanwhile"] = eng.model.state_dict()[name].clone()
        return current, None

    eng = make_engine()
    with launch_server(eng, delta_decoder=decoder) as handle:
        assert httpx.get(handle.url + "/get_server_info").json()["device"] == "cpu"
        r = httpx.post(handle.url + "/update_weights_from_delta", params={"version": 4}, content=b"x", timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == 4
    assert seen["devices"] == {"cpu"} and not torch.equal(seen["served_meanwhile"], torch.full_like(
        seen["served_meanwhile"], 3.0))
    assert torch.equal(eng.model.state_dict()["model.norm.weight"], torch.full_like(seen["served_meanwhile"], 3.0))
