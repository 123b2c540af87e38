"""`rollout.engine: sglang` through `make_producer` and the GRPO loop, against fake SGLang server processes
(tests/core/fake_sglang_server.py, started through `rollout.sglang.python`). No real SGLang runs here: the fake's
tokens are deterministic, not sampled from the model, so these tests check the wiring (routing, weight
publication, version tags, staleness), not learning."""

from __future__ import annotations

import pytest
import torch

from factory.config import parse_spec
from factory.core.loop import make_producer, train_rl
from factory.core.rollout.base import SamplingParams
from factory.core.sglang.producer import SGLangProducer, make_sglang_engine
from factory.core.sglang.servers import SGLangServers
from factory.infra.device import run_device
from factory.models.build import build_model
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem
from tests.core.fake_sglang_server import fake_state, python_wrapper, reserve_ports

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(10)]


def spec(tmp_path, weight_update: str, steps: int = 3, ops: dict | None = None):
    return parse_spec({"ops": ops or {},
        "seed": 0, "model": {"preset": "micro"}, "algorithm": {"group_size": 4, "lr": 0.01},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 3, "engine": "sglang",
                    "sglang": {"servers": 2, "python": python_wrapper(tmp_path), "base_port": reserve_ports(2),
                               "startup_timeout_s": 60, "weight_update": weight_update,
                               "extra_args": ["--fake-vocab", "17"]}},
        "trainer": {"threads": 1}, "schedule": {"mode": "one_step_off", "steps": steps, "wait_timeout_s": 60}})


@pytest.fixture
def model_and_tok():
    tok = build_tokenizer()
    return build_model("micro", tok, seed=0), tok


@pytest.mark.slow
def test_the_producer_samples_from_sglang_and_publishes_versions(tmp_path, model_and_tok):
    model, tok = model_and_tok
    s = spec(tmp_path, "tensor")
    producer = make_producer(s, model, tok, PROBLEMS, start_version=0)
    try:
        assert isinstance(producer, SGLangProducer)
        urls = producer.engine.servers.urls
        assert [fake_state(u)["version"] for u in urls] == ["0", "0"]  # labelled with the start version
        batch = producer.next_batch(0)
        assert len(batch) == 4 and all(len(g.samples) == 4 for g in batch)
        assert all(s.versions == [0] for g in batch for s in g.samples)
        assert all(max(s.token_ids) < len(tok) for g in batch for s in g.samples)
        producer.publish(model, 1)
        expected = {k: pytest.approx(float(v.to(torch.bfloat16).double().sum()), rel=1e-6)
                    for k, v in model.state_dict().items()}
        for u in urls:
            st = fake_state(u)
            assert st["version"] == "1" and st["weights"] == expected
            assert set(st["dtypes"].values()) == {"bfloat16"} and st["dtype"] == "bfloat16"  # what it serves
        later = producer.next_batch(1)
        assert all(g.oldest_version >= 0 and 1 - g.oldest_version <= 1 for g in later)  # one_step_off's bound
        assert sum(producer.engine.routed) >= 8 and min(producer.engine.routed) > 0  # both servers used
        assert producer.metrics()["sglang_restarts"] == 0.0
    finally:
        producer.close()
    assert not any(producer.engine.servers.alive(i) for i in range(2))


@pytest.mark.slow
def test_a_short_grpo_run_on_sglang_servers(tmp_path, model_and_tok):
    model, tok = model_and_tok
    s = spec(tmp_path, "disk", steps=3, ops={"max_logprob_gap": 100.0})  # the fake's log-probs are not a model's
    producer = make_producer(s, model, tok, PROBLEMS, start_version=0)
    records = train_rl(s, model, tok, PROBLEMS, producer=producer)
    assert [r.step for r in records] == [1, 2, 3]
    assert max(r.staleness_max for r in records) <= 1 and all(r.rejected == 0 for r in records)
    for service in producer.engine.servers.services:  # every server loaded each published version from disk
        log = service.log_path.read_text()
        assert [f"(disk), version {v}" in log for v in (1, 2, 3)] == [True, True, True], log


@pytest.mark.slow
def test_external_servers_get_the_trainers_weights_before_any_request(tmp_path, model_and_tok):
    model, tok = model_and_tok
    s = spec(tmp_path, "tensor")
    save_checkpoint(model, tok, tmp_path / "initial")
    with SGLangServers(s.rollout.sglang, tmp_path / "initial", tmp_path / "started") as running:
        external = s.model_copy(update={"rollout": s.rollout.model_copy(update={
            "sglang": s.rollout.sglang.model_copy(update={"urls": running.urls})})})
        state = {k: v.detach() for k, v in model.state_dict().items()}
        router = make_sglang_engine(external, None, tmp_path / "work", 5, state)
        try:
            assert router.servers.external and router.servers.services == []
            # published in the dtype the servers serve (bf16)
            expected = {k: pytest.approx(float(v.to(torch.bfloat16).double().sum()), rel=1e-6)
                        for k, v in state.items()}
            for u in running.urls:
                st = fake_state(u)
                assert st["version"] == "5" and st["weights"] == expected
            assert router.generate([[3, 4]], SamplingParams(max_new_tokens=2))[0][0].weight_version == 5
        finally:
            router.close()


@pytest.mark.slow
def test_the_step_0_gate_probes_sglang_servers_through_the_producer(tmp_path, model_and_tok):
    # The producer renders the probe's chat and the servers sample it, as for training prompts; the fake's
    # log-probs (-0.1 per position, not the model's) are far past the bound of an engine with other numerics (0.1).
    from factory.core.gate import GAP_CAUSE_SPREAD, check_engine
    from factory.core.trainer.torch_trainer import TorchTrainer

    model, tok = model_and_tok
    s = spec(tmp_path, "tensor")
    producer = make_producer(s, model, tok, PROBLEMS, start_version=0)
    try:
        res = check_engine(s.rollout, TorchTrainer(model, lr=0.0), producer, tok, [p.prompt for p in PROBLEMS],
                           s.resolved.logprob_gap_bound(run_device(s.resolved).type))
    finally:
        producer.close()
    assert res.engine == "SGLangProducer" and res.bound == 0.1
    assert [c for c, _ in res.problems] == [GAP_CAUSE_SPREAD] and res.figures["gap_abs_mean"] > 1.0
    assert res.figures["prompt_mismatches"] == res.figures["eos_problems"] == 0
