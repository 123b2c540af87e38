"""`SGLangRouter` over two fake SGLang servers (real processes on 127.0.0.1, tests/core/fake_sglang_server.py):
routing, token ids / logprobs / versions, weight updates by disk, tensor and a gloo group, version checks,
a server killed mid-run. No real SGLang runs here."""

from __future__ import annotations

import pytest
import torch

from factory.config import SGLangSpec
from factory.core.rollout.base import SamplingParams
from factory.core.sglang.client import SGLangError
from factory.core.sglang.router import SGLangRouter, SGLangVersionMismatch, prefix_key
from factory.core.sglang.servers import SGLangServers
from factory.core.sglang.weights import (
    DiskUpdate,
    DistributedUpdate,
    TensorUpdate,
    buckets,
    serialize_named_tensors,
)
from tests.core.fake_sglang_server import EOS, fake_state, python_wrapper, reserve_ports
from tests.ports import refusing_port


def expected_tokens(prompt: list[int], copy: int, max_new: int) -> list[int]:
    """The fake's output for the `copy`-th sample of `prompt` in one request."""
    tokens = [10 + (sum(prompt) + copy + j) % 50 for j in range(max_new)]
    return tokens[:1] + [EOS] if sum(prompt) % 2 == 0 else tokens


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(8, 4, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
            "lm_head.weight": torch.randn(8, 4, generator=g)}


def sums(state: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: pytest.approx(float(v.double().sum()), rel=1e-6) for k, v in state.items()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "tokenizer.json").write_text("{}")
    spec = SGLangSpec(servers=2, python=python_wrapper(tmp), base_port=reserve_ports(2), startup_timeout_s=60)
    servers = SGLangServers(spec, model, tmp / "logs").start()
    yield servers, model, tmp
    servers.stop()


def test_a_batch_is_routed_by_prefix_and_comes_back_exact(cluster):
    servers, _, _ = cluster
    prompts = [[1, 2, 3], [4, 4], [5, 9, 1], [7], [2, 2, 2, 2], [3, 8]]
    with SGLangRouter(servers.urls, prefix_tokens=2) as router:
        before = [len(fake_state(u)["requests"]) for u in servers.urls]
        groups = router.generate(prompts, SamplingParams(n=3, max_new_tokens=4))
        homes = [prefix_key(p, 2) % 2 for p in prompts]
        assert len(set(homes)) == 2  # both servers get work
        for p, g, home in zip(prompts, groups, homes, strict=True):
            assert [c.meta["server"] for c in g] == [home] * 3  # a group's samples meet one server's cache
            assert [c.token_ids for c in g] == [expected_tokens(p, k, 4) for k in range(3)]
            assert all(c.prompt_ids == p and c.weight_version == 0 for c in g)
            assert g[0].logprobs == pytest.approx([-0.1 * (j + 1) for j in range(len(g[0].token_ids))])
            assert g[0].finish_reason == ("stop" if sum(p) % 2 == 0 else "length")
        for i, u in enumerate(servers.urls):  # one /generate per server, each prompt's n copies together
            reqs = [r for r in fake_state(u)["requests"][before[i]:] if r["endpoint"] == "/generate"]
            assert len(reqs) == 1
            assert reqs[0]["input_ids"] == [p for p, h in zip(prompts, homes, strict=True) if h == i for _ in range(3)]
        assert router.outstanding == [0, 0] and sum(router.routed) == len(prompts)


def test_a_busy_home_server_sends_the_prompt_to_the_least_loaded(cluster):
    servers, _, _ = cluster
    with SGLangRouter(servers.urls, balance_slack=4) as router:
        p = [1, 2, 3]
        home = prefix_key(p, 64) % 2
        assert router.pick(p, n=4) == home  # 4 ahead: within the slack
        assert router.pick(p, n=4) == home  # 4 vs 0 -> still within
        assert router.pick(p, n=4) == 1 - home  # 8 vs 0: too far ahead
        assert router.outstanding[home] == 8 and router.outstanding[1 - home] == 4


def test_disk_update_reaches_every_server_and_tags_later_completions(cluster):
    servers, model, tmp = cluster
    state = weights(1)
    with SGLangRouter(servers.urls, DiskUpdate(tmp / "published", config_dir=model)) as router:
        router.load_weights(state, version=1)
        router.load_weights(weights(2), version=2)
        router.load_weights(state, version=3)
        assert router.weight_version == 3
        for u in servers.urls:
            st = fake_state(u)
            assert st["version"] == "3" and st["weights"] == sums(state)
            assert st["requests"][-1]["model_path"] == str(tmp / "published" / "v00000003")
        published = tmp / "published" / "v00000003"
        assert sorted(p.name for p in published.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
        assert sorted(p.name for p in (tmp / "published").iterdir()) == ["v00000002", "v00000003"]  # keep=2
        c = router.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0][0]
        assert c.weight_version == 3 and c.meta["weight_versions"] == [3]


def test_tensor_update_in_buckets(cluster):
    servers, _, _ = cluster
    state = weights(4)
    assert len(buckets(state, 128)) == 3  # 128 B, 48 B and 128 B tensors: one per bucket
    with SGLangRouter(servers.urls, TensorUpdate(tp_size=1, bucket_bytes=128), weight_version=3) as router:
        router.load_weights(state, version=4)
        for u in servers.urls:
            st = fake_state(u)
            posts = [r for r in st["requests"] if r["endpoint"] == "/update_weights_from_tensor"][-3:]
            assert [r["names"] for r in posts] == [[k] for k in state]
            # the version moves, and the cache is flushed, only with the last bucket
            assert [(r["weight_version"], r["flush_cache"]) for r in posts] == [(None, False), (None, False),
                                                                                ("4", True)]
            assert st["version"] == "4" and st["weights"] == sums(state)


def test_tensor_payload_is_base64_pickle_of_named_tensors():
    import base64
    import pickle

    t = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    named = pickle.loads(base64.b64decode(serialize_named_tensors([("w", t)])))
    assert named[0][0] == "w" and torch.equal(named[0][1], t) and named[0][1].dtype == torch.bfloat16


def test_a_refused_tensor_update_names_the_server(cluster):
    servers, _, _ = cluster
    with SGLangRouter(servers.urls, TensorUpdate(tp_size=2)) as router:  # the servers run tp_size 1
        with pytest.raises(SGLangError, match=r"^SGLang /update_weights_from_tensor: sglang server 0 at (\S+): \1 "
                                              r"refused bucket 1/1 of version 5: serialized_named_tensors has 2 "
                                              r"entries, tp_size is 1"):
            router.load_weights(weights(5), version=5)
        assert router.weight_version == 0


def test_distributed_update_over_a_gloo_group(cluster):
    servers, _, _ = cluster
    state = weights(6)
    update = DistributedUpdate("127.0.0.1", 0, [1, 1], backend="gloo", group_name="factory_test",
                               bucket_bytes=200, timeout_s=60)
    with SGLangRouter(servers.urls, update, weight_version=4) as router:
        router.load_weights(state, version=6)
        state2 = weights(7)
        router.load_weights(state2, version=7)
        for i, u in enumerate(servers.urls):
            st = fake_state(u)
            init = [r for r in st["requests"] if r["endpoint"] == "/init_weights_update_group"]
            assert len(init) == 1 and init[0]["rank_offset"] == 1 + i and init[0]["world_size"] == 3
            assert init[0]["master_port"] > 0  # the port the trainer's store bound (asked for 0)
            posts = [r for r in st["requests"] if r["endpoint"] == "/update_weights_from_distributed"][-2:]
            assert [r["names"] for r in posts] == [list(state2)[:2], list(state2)[2:]]
            assert posts[0]["dtypes"] == ["float32", "bfloat16"]
            assert st["version"] == "7" and st["weights"] == sums(state2)  # the broadcast values arrived


def test_disk_and_distributed_updates_publish_in_the_served_dtype(cluster):
    servers, model, tmp = cluster
    state = weights(8)  # fp32 master weights, one bf16 tensor
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    for version, update in ((8, DiskUpdate(tmp / "pub-bf16", config_dir=model, dtype="bfloat16")),
                            (9, DistributedUpdate("127.0.0.1", 0, [1, 1], backend="gloo", group_name="factory_bf16",
                                                  timeout_s=60, dtype=torch.bfloat16))):
        with SGLangRouter(servers.urls, update, weight_version=version - 1) as router:
            router.load_weights(state, version=version)
        for u in servers.urls:
            st = fake_state(u)
            assert st["version"] == str(version) and st["weights"] == sums(bf16)
            assert {st["dtypes"][k] for k in state} == {"bfloat16"}
        if version == 9:
            (post,) = [r for r in st["requests"] if r["endpoint"] == "/update_weights_from_distributed"
                       and r["weight_version"] == "9"]
            assert post["dtypes"] == ["bfloat16"] * 3
    assert state["model.embed_tokens.weight"].dtype == torch.float32  # the trainer's tensors are not touched


def test_in_flight_updates_pause_and_continue_generation(cluster):
    servers, model, tmp = cluster
    with SGLangRouter(servers.urls, DiskUpdate(tmp / "pub-inflight", config_dir=model),
                      update_mode="in_flight") as router:
        router.load_weights(weights(8), version=8)
    for u in servers.urls:
        tail = [r["endpoint"] for r in fake_state(u)["requests"][-3:]]
        assert tail == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert fake_state(u)["requests"][-3]["mode"] == "retract" and not fake_state(u)["paused"]


@pytest.mark.slow
def test_a_server_reporting_another_version_is_named(cluster, tmp_path):
    servers, model, _ = cluster
    spec = SGLangSpec(servers=1, python=python_wrapper(tmp_path), base_port=reserve_ports(1),
                      extra_args=["--fake-stale-version"])
    with SGLangServers(spec, model, tmp_path / "logs") as stale:
        with SGLangRouter([servers.urls[0], stale.urls[0]], DiskUpdate(tmp_path / "pub", config_dir=model)) as router:
            with pytest.raises(SGLangVersionMismatch, match=rf"after publishing version 9: sglang server 1 at "
                                                            rf"{stale.urls[0]} reports 'default'$"):
                router.load_weights(weights(9), version=9)
            assert router.weight_version == 0


def test_an_unreachable_server_without_a_supervisor_is_named():
    port = refusing_port()
    with SGLangRouter([f"http://127.0.0.1:{port}"], timeout=2) as router:
        with pytest.raises(SGLangError, match=rf"sglang server 0 at http://127.0.0.1:{port}: .*cannot reach"):
            router.generate([[1]], SamplingParams())


@pytest.mark.slow
def test_a_server_killed_mid_run_is_restarted_and_resynced(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = SGLangSpec(servers=2, python=python_wrapper(tmp_path), base_port=reserve_ports(2), startup_timeout_s=60)
    state = weights(10)
    with SGLangServers(spec, model, tmp_path / "logs") as servers, \
            SGLangRouter(servers.urls, DiskUpdate(tmp_path / "pub", config_dir=model), servers=servers) as router:
        router.load_weights(state, version=10)
        p = next([k] for k in range(100) if prefix_key([k], 64) % 2 == 1)  # a prompt whose home is server 1
        servers.kill(1)
        c = router.generate([p], SamplingParams(n=2, max_new_tokens=3))[0]
        assert servers.restarts() == [0, 1]
        assert [x.meta["server"] for x in c] == [1, 1] and [x.weight_version for x in c] == [10, 10]
        st = fake_state(servers.urls[1])
        assert st["version"] == "10" and st["weights"] == sums(state)  # back at the published weights
        assert [r["endpoint"] for r in st["requests"]] == ["/update_weights_from_disk", "/generate"]
