"""Producers and the prompt feed: a file source's prompt too long for the model is named, and mixed-verifier
blends score each prompt with its own source's verifier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from factory.config import parse_spec
from factory.core.producers.common import encode_prompt, scorer
from factory.infra.device import run_device
from factory.models.tokenizer import tokenizer_for
from factory.problem import Problem


def test_a_prompt_too_long_for_the_model_names_the_prompt_and_its_source():
    spec = parse_spec({"model": {"max_positions": 32}, "task": {"digits": [2], "n_train": 100, "n_eval": 8}})
    tok = tokenizer_for("arithmetic")
    ok = Problem("p1", "12+34=", "64", "add", 2, {"source": "mine"})
    assert len(encode_prompt(tok, ok, spec, 32)) == 7  # <bos> and one token per character
    long = Problem("p2", "1" * 40 + "+1=", "2", "add", 40, {"source": "mined"})
    with pytest.raises(ValueError, match=r"prompt 'p2' of source 'mined' has 44 tokens.*32 positions"):
        encode_prompt(tok, long, spec, 32)


def test_each_prompt_is_scored_by_its_sources_verifier_unless_the_spec_names_an_environment():
    spec = parse_spec({})
    word = Problem("w", "q", "3", "word", 0, {"source": "wp", "verifier": "word_problems"})
    assert scorer(spec, word) == "word_problems"
    assert scorer(spec, Problem("a", "1+1=", "2", "add", 1)) == "arithmetic"  # no verifier named: the task's
    custom = parse_spec({"task": {"environment": "calculator_tool"}, "rollout": {"engine": "server"},
                         "schedule": {"mode": "async"}})
    assert scorer(custom, word) == "calculator_tool"


def test_a_prompt_outside_a_character_tokenizers_alphabet_is_named():
    spec = parse_spec({"task": {"digits": [2], "n_train": 100, "n_eval": 8}})
    bad = Problem("w1", "Ann has 3 apples", "3", "word", 0, {"source": "mined"})
    with pytest.raises(ValueError, match=r"prompt 'w1' of source 'mined' cannot be tokenized.*task arithmetic"):
        encode_prompt(tokenizer_for("arithmetic"), bad, spec, 64)


def test_the_context_is_the_specs_else_a_path_models_own_else_the_presets():  # models/build.py
    from types import SimpleNamespace

    from factory.models.build import policy_positions

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=128))
    assert policy_positions(parse_spec({}).model, model) == 64  # the tiny preset's, whatever the model object says
    assert policy_positions(parse_spec({"model": {"max_positions": 48}}).model, model) == 48
    assert policy_positions(parse_spec({"model": {"path": "/some/dir"}}).model, model) == 128


def test_the_rollout_server_process_runs_on_the_runs_device_in_its_precision():
    from factory.cli.parser import build_parser
    from factory.core.producers.server import server_argv

    spec = parse_spec({"device": "cpu", "rollout": {"engine": "server"}})
    argv = server_argv(spec, Path("/ckpt"), rows=64, version=3)
    args = build_parser().parse_args([a.replace("{port}", "0") for a in argv[3:]])  # what `factory serve` reads
    assert (args.device, args.precision, args.checkpoint, args.max_batch, args.weight_version) == \
        ("cpu", "fp32", "/ckpt", 64, 3)
    auto = server_argv(parse_spec({"trainer": {"precision": "bf16"}}), Path("/ckpt"), rows=8, version=0)
    assert auto[auto.index("--device") + 1] == str(run_device(parse_spec({}).resolved))  # auto: the run resolves it
    assert auto[auto.index("--precision") + 1] == "bf16"


def test_the_specs_kv_budget_reaches_the_rollout_server_and_the_in_process_engine():
    from factory.cli.parser import build_parser
    from factory.core.producers.server import server_argv

    spec = parse_spec({"rollout": {"engine": "server", "kv_budget_mb": 96}})
    args = build_parser().parse_args([a.replace("{port}", "0") for a in server_argv(spec, Path("/c"), 8, 0)[3:]])
    assert args.kv_budget_mb == 96
    assert build_parser().parse_args([a.replace("{port}", "0") for a in server_argv(
        parse_spec({}), Path("/c"), 8, 0)[3:]]).kv_budget_mb is None  # unset: the server sizes it from the machine
    assert "kv_budget_mb" not in parse_spec({}).model_dump()["rollout"]  # a late field: old fingerprints stay


def test_the_overlapped_producer_rolls_out_on_the_paged_engine_and_takes_published_weights():
    import torch

    from factory.core.producers.overlapped import OverlappedProducer
    from factory.core.rollout.engines.paged.engine import PagedEngine
    from factory.data.feed import feed_of
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    problems = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(4)]
    spec = parse_spec({"seed": 0, "model": {"preset": "micro"}, "algorithm": {"group_size": 4},
                       "rollout": {"prompts_per_step": 2, "max_new_tokens": 3}, "trainer": {"threads": 1},
                       "schedule": {"mode": "one_step_off", "steps": 2, "wait_timeout_s": 60}})
    producer = OverlappedProducer(spec, model, tok, feed_of(problems, 0), 0)
    try:
        assert isinstance(producer.engine, PagedEngine)  # micro is a Qwen2: the paged engine runs it
        batch = producer.next_batch(1)
        assert len(batch) == 2 and all(len(g.samples) == 4 for g in batch)
        assert all(1 <= len(s.token_ids) <= 3 and s.versions == [0] for g in batch for s in g.samples)
        params = {n: p.data_ptr() for n, p in producer.engine.model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        producer.publish(model, 1)  # copied into the engine's own parameter tensors
        assert producer.engine.weight_version == 1
        assert {n: p.data_ptr() for n, p in producer.engine.model.named_parameters()} == params
        probe = producer.probe(tok("1+1=").input_ids, 2)
        assert [c.token_versions[0] for c in probe] == [1, 1]
    finally:
        producer.close()


def test_weight_transport_auto_is_shared_on_cuda_and_codec_on_the_cpu_or_with_lora():
    from factory.config import SpecError
    from factory.core.producers.server import weight_transport

    assert weight_transport(parse_spec({"device": "cpu", "rollout": {"engine": "server"}})) == "codec"
    assert weight_transport(parse_spec({"device": "cpu", "rollout": {"engine": "server",
                                                                      "weight_transport": "shared"}})) == "shared"
    assert "weight_transport" not in parse_spec({}).model_dump()["rollout"]  # a late field: old fingerprints stay
    with pytest.raises(SpecError, match="rollout.weight_transport: 'shared' carries whole weights"):
        parse_spec({"rollout": {"engine": "server", "weight_transport": "shared"}, "trainer": {"lora": {"r": 4}}})
    with pytest.raises(SpecError, match="rollout.weight_transport: 'shared' is Factory's rollout server's"):
        parse_spec({"rollout": {"engine": "sglang", "weight_transport": "shared"}})
    import torch

    if torch.cuda.is_available():
        assert weight_transport(parse_spec({"device": "cuda", "rollout": {"engine": "server"}})) == "shared"


@pytest.mark.slow  # ~20 s: two `factory serve` processes start (the second after the kill)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU: the server maps the buffer by CUDA IPC"))])
def test_the_server_producer_hands_versions_through_the_shared_buffer_and_a_restarted_server_reattaches(device):
    """A run's ServerProducer with rollout.weight_transport shared on the CPU, its `factory serve` process real: each
    version is what the trainer holds, bit for bit in the buffer, and served; after the server is killed, the
    restarted one attaches again and serves the newest version (no full push: no host copy is even kept)."""
    import httpx
    import torch

    from factory.core.producers.server import ServerProducer
    from factory.core.weights.shared import SharedWeightsReader
    from factory.data.feed import feed_of
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0).to(device)
    problems = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(4)]
    transport = "shared" if device == "cpu" else "auto"  # auto is shared on CUDA
    spec = parse_spec({"seed": 0, "device": device, "model": {"preset": "micro"}, "algorithm": {"group_size": 2},
                       "rollout": {"engine": "server", "weight_transport": transport, "prompts_per_step": 1,
                                   "max_new_tokens": 2, "concurrency": 1, "threads": 1},
                       "trainer": {"threads": 1}, "schedule": {"mode": "async", "steps": 2, "wait_timeout_s": 60}})
    producer = ServerProducer(spec, model, tok, feed_of(problems, 0), 0)
    try:
        assert producer._state is None and producer._shared is not None  # no host copy for a full push
        reader = SharedWeightsReader.attach(producer._shared.handle())
        mirror = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
            if version == 2:
                producer.service.kill()  # the next publish finds it dead: restart, re-attach, read the newest
            producer.publish(model, version)
            assert httpx.get(producer.service.url + "/health", timeout=30).json()["weight_version"] == version
            assert reader.read_into(mirror) == version
            assert all(torch.equal(mirror[k].view(torch.int32), v.view(torch.int32))
                       for k, v in model.state_dict().items())
        assert producer.service.restarts == 1
        assert [c.weight_version for c in producer.probe(tok("1+1=").input_ids, 2)] == [2, 2]
        reader.close()
        control = Path(producer._shared.handle()["control"])
    finally:
        producer.close()
    assert not control.exists() and not control.parent.exists()  # the writer removed its files
