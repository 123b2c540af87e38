"""What Factory asks of an SGLang server on a GPU (issue 22), against fake SGLang server processes
(tests/core/fake_sglang_server.py, real processes on 127.0.0.1): explicit sampling parameters, weights in the
served dtype, the minimum sglang version, flush_cache's busy answer, a multi-bucket update atomic for
generation, NCCL staging kept off the servers' GPUs, and CUDA IPC tensors addressed by device UUID.

The GPU-only parts are checked with mocked device objects here (`torch.cuda.is_available`, device
properties, torch's CUDA reduction); a real NCCL group, CUDA IPC and real SGLang need a GPU node."""

from __future__ import annotations

import io
import json
import logging
import pickle
import threading
from types import SimpleNamespace

import pytest
import torch

from factory.config import SGLangSpec, parse_spec
from factory.core.rollout.base import SamplingParams
from factory.core.sglang.client import MIN_SGLANG_VERSION, SGLangEngine, SGLangError, _release
from factory.core.sglang.producer import make_sglang_engine, make_updater
from factory.core.sglang.router import SGLangRouter
from factory.core.sglang.servers import SGLangServers
from factory.core.sglang.weights import DistributedUpdate, TensorUpdate, _UUIDPickler, cuda_ipc_reduction
from tests.core.fake_sglang_server import fake_state, python_wrapper, reserve_ports

# What a Qwen-like generation_config.json makes SGLang's `--sampling-defaults model` fill in.
MODEL_DEFAULTS = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5}


def _start(tmp_path, name: str, *fake_args: str, servers: int = 1) -> SGLangServers:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    spec = SGLangSpec(servers=servers, python=python_wrapper(tmp_path), base_port=reserve_ports(servers),
                      startup_timeout_s=60, extra_args=list(fake_args))
    return SGLangServers(spec, model, tmp_path / name).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    servers = _start(tmp_path_factory.mktemp("sglang"), "logs", "--fake-sampling-defaults",
                     json.dumps(MODEL_DEFAULTS), "--fake-flush-busy", "3")
    yield servers
    servers.stop()


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),
            "lm_head.weight": torch.randn(16, 8, generator=g)}


# ------------------------------------------------------------------ sampling parameters


def test_every_sampling_parameter_is_sent_so_no_model_default_applies(server):
    url = server.urls[0]
    with SGLangEngine(url) as engine:
        engine.generate([[3, 4, 5]], SamplingParams(n=2, temperature=0.7, top_p=0.9, max_new_tokens=3))
        engine.generate([[3, 4]], SamplingParams(greedy=True, max_new_tokens=2))
    sampled, greedy = [r for r in fake_state(url)["requests"] if r["endpoint"] == "/generate"][-2:]
    for sp in sampled["sampling_params"]:  # what the server's sampler ran with, defaults filled in
        assert {k: sp[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty", "min_new_tokens")} == {
            "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_new_tokens": 0}
    (sp,) = greedy["sampling_params"]
    assert sp["temperature"] == 0.0 and sp["top_k"] == -1 and sp["repetition_penalty"] == 1.0


# ------------------------------------------------------------------ version and flush_cache


def test_release_numbers_compare_as_sglang_versions():
    assert _release("0.5.6") == (0, 5, 6) and _release("0.5.6.post2") == (0, 5, 6)
    assert _release("0.5.10rc0") == (0, 5, 10) > _release(MIN_SGLANG_VERSION)
    assert _release("0.5.5") < _release(MIN_SGLANG_VERSION) and _release("dev") is None


def test_a_current_server_passes_the_version_check(server):
    with SGLangEngine(server.urls[0]) as engine:
        assert engine.check_server_version() == "0.5.23"


def test_an_old_server_is_refused_at_start_naming_its_version(tmp_path):
    with _start(tmp_path, "old", "--fake-version", "0.5.5") as old:
        with SGLangEngine(old.urls[0]) as engine, pytest.raises(SGLangError) as refused:
            engine.check_server_version()
        assert "'0.5.5'" in str(refused.value) and f">= {MIN_SGLANG_VERSION}" in str(refused.value)
        s = parse_spec({"seed": 0, "model": {"preset": "micro"},
                        "rollout": {"engine": "sglang", "sglang": {"urls": old.urls, "weight_update": "tensor"}},
                        "schedule": {"mode": "one_step_off", "wait_timeout_s": 30}})
        with pytest.raises(SGLangError, match=r"runs sglang '0\.5\.5'"):
            make_sglang_engine(s, None, tmp_path / "work", 0, weights(0))
        assert not [r for r in fake_state(old.urls[0])["requests"] if r["endpoint"].startswith("/update_weights")]


def test_flush_cache_retries_the_busy_answer_with_bounded_backoff(server):
    waits: list[float] = []
    with SGLangEngine(server.urls[0]) as engine:
        with pytest.raises(SGLangError, match="stayed busy .* through 2 attempts"):
            engine.flush_cache(attempts=2, wait=waits.append)  # busy (400) twice: given up
        assert waits == [0.05]
        waits.clear()
        assert engine.flush_cache(wait=waits.append) == 1  # the third call is busy too, the fourth flushes
        assert waits == [0.05]
        assert engine.flush_cache(wait=waits.append, first_wait_s=1.0, max_wait_s=1.5) == 0
    assert fake_state(server.urls[0])["flushes"] == 5


# ------------------------------------------------------------------ weights in the served dtype


def test_updates_reach_the_server_in_the_dtype_it_serves(tmp_path):
    with _start(tmp_path, "dtype") as started:
        s = parse_spec({"seed": 0, "model": {"preset": "micro"},
                        "rollout": {"engine": "sglang", "sglang": {"urls": started.urls, "weight_update": "tensor"}},
                        "schedule": {"mode": "one_step_off", "wait_timeout_s": 30}})
        state = weights(1)
        router = make_sglang_engine(s, None, tmp_path / "work", 3, state)
        try:
            st = fake_state(started.urls[0])
            assert st["dtype"] == "bfloat16"  # started with --dtype bfloat16
            assert set(st["dtypes"].values()) == {"bfloat16"}
            expected = {k: pytest.approx(float(v.to(torch.bfloat16).double().sum()), rel=1e-6)
                        for k, v in state.items()}
            assert st["weights"] == expected
        finally:
            router.close()
    for how in ("disk", "tensor", "distributed"):
        sg = SGLangSpec(weight_update=how)
        upd = make_updater(parse_spec({"model": {"preset": "micro"}, "rollout": {"engine": "sglang",
                                                                                "sglang": sg.model_dump()}}),
                           tmp_path, None, staging="cpu")
        assert upd.dtype == "bfloat16", how
    upd = make_updater(parse_spec({"model": {"preset": "micro"}, "rollout": {"engine": "sglang", "sglang": {
        "extra_args": ["--dtype", "auto"]}}}), tmp_path, None)
    assert upd.dtype is None  # the checkpoint's own dtype: published as it is


# ------------------------------------------------------------------ a multi-bucket update is atomic


def test_no_generation_runs_between_the_buckets_of_one_update(tmp_path):
    with _start(tmp_path, "atomic") as started:
        url = started.urls[0]
        state = weights(2)
        updater = TensorUpdate(bucket_bytes=16 * 8 * 4)  # one tensor per bucket: 3 requests for one version
        router = SGLangRouter([url], updater, update_mode="finish_old")
        client = router.clients[0]
        sent = client.post_checked
        results: list = []
        done, fired = threading.Event(), threading.Event()

        def generate() -> None:
            try:
                results.append(router.generate([[3, 5]], SamplingParams(max_new_tokens=2)))
            finally:
                done.set()

        def post_checked(endpoint, payload, what):
            out = sent(endpoint, payload, what)
            if "weight_version" not in payload and not fired.is_set():
                # after the first bucket: a producer thread asks for a generation now
                fired.set()
                threading.Thread(target=generate, daemon=True).start()
                while not done.is_set() and getattr(router, "held", 0) == 0:
                    done.wait(0.005)  # until the router holds it, or it ran
            return out

        client.post_checked = post_checked
        try:
            router.load_weights(state, 1)
            assert done.wait(30)
        finally:
            router.close()
        gens = [r for r in fake_state(url)["requests"] if r["endpoint"] == "/generate"]
        updates = [r for r in fake_state(url)["requests"] if r["endpoint"] == "/update_weights_from_tensor"]
        assert len(updates) == 3
        assert [(g["version"], g["partial_buckets"]) for g in gens] == [("1", 0)]  # after all buckets
        assert results[0][0][0].weight_version == 1


# ------------------------------------------------------------------ NCCL staging and CUDA IPC (GPU routing, mocked)


def _gpu_spec(devices, servers: int = 1, tp: int = 1):
    rollout = {"engine": "sglang", "sglang": {"servers": servers, "tp_size": tp, "weight_update": "distributed"}}
    if devices is not None:
        rollout["devices"] = devices
    return parse_spec({"model": {"preset": "micro"}, "rollout": rollout})


def test_nccl_staging_on_a_servers_gpu_falls_back_to_tensors(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="factory.core.sglang.producer"):
        shared = make_updater(_gpu_spec([0]), tmp_path, None, staging="cuda:0")
    assert isinstance(shared, TensorUpdate) and shared.dtype == "bfloat16"
    assert "NCCL refuses two ranks on one GPU" in caplog.text and "cuda:0" in caplog.text
    # unset rollout.devices: SGLang takes GPUs 0.. itself (2 servers x tp 2: 0-3)
    assert isinstance(make_updater(_gpu_spec(None, servers=2, tp=2), tmp_path, None, staging="cuda:3"),
                      TensorUpdate)
    apart = make_updater(_gpu_spec([1]), tmp_path, None, staging="cuda:0")
    assert isinstance(apart, DistributedUpdate)
    assert apart.backend == "nccl" and apart.device == torch.device("cuda:0")
    assert isinstance(make_updater(_gpu_spec(None, servers=2), tmp_path, None, staging="cuda:2"), DistributedUpdate)


def _rebuild(*args):  # stands in for torch's rebuild_cuda_tensor on the server side
    return args


def test_cuda_ipc_tensors_name_their_device_by_uuid(monkeypatch):
    uuids = {0: "GPU-aaaa", 1: "GPU-bbbb", 2: "GPU-cccc"}  # the trainer sees three GPUs
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))

    def reduce(t):  # torch's CUDA reduction: rebuild_cuda_tensor and its 15 arguments, the device index 7th
        return _rebuild, (type(t), t.size(), t.stride(), 0, None, t.dtype, 2, b"handle", 64, 0, False,
                          b"ref", 0, b"event", True)

    fn, args = cuda_ipc_reduction(torch.zeros(4), reduce=reduce)
    assert fn is _rebuild and args[6] == "GPU-cccc" and args[7] == b"handle"

    # through the pickler serialize_named_tensors uses for CUDA tensors
    monkeypatch.setattr("torch.multiprocessing.reductions.reduce_tensor", reduce)
    monkeypatch.setattr(_UUIDPickler, "is_ipc", staticmethod(lambda t: True))
    buf = io.BytesIO()
    _UUIDPickler(buf).dump([("w", torch.zeros(4))])
    ((name, rebuilt),) = pickle.loads(buf.getvalue())
    assert name == "w" and rebuilt[6] == "GPU-cccc"
    # the server, started with CUDA_VISIBLE_DEVICES=<that GPU>, sees it as its device 0 (SGLang's patched
    # rebuild looks the UUID up among its own devices)
    server_devices = ["GPU-cccc"]
    assert server_devices.index(rebuilt[6]) == 0
