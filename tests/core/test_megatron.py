"""The Megatron backend: HF ↔ Megatron conversion is bit-exact both ways (also through tensor- and pipeline-parallel
shards), loads strictly into a real GPTModel, and the GPTModel computes the HF model's logprobs and training step.

The conversion tests need no megatron-core. The GPTModel tests skip where megatron-core does not import. Megatron's
forward assumes CUDA in two places; `megatron_cpu_forward` gives those two a CPU equivalent (see its docstring):
the rest of the forward and backward is Megatron's own code."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from factory.config import parse_spec
from factory.core import algorithms
from factory.core.batch import pack
from factory.core.trainer.megatron_convert import (
    check_supported,
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    merge_pipeline,
    merge_tensor_parallel,
    pipeline_stage,
    split_tensor_parallel,
)
from factory.core.trainer.step import guarded_step
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.protocols import Trainer
from factory.protocols.trainer import trainer_problems

VOCAB = 96


def tiny(arch: str, tied: bool, seed: int = 0, **extra) -> PreTrainedModel:
    """A 2-layer model with grouped-query attention (4 heads, 2 key/value groups)."""
    config = AutoConfig.for_model(arch, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                  tie_word_embeddings=tied, rope_theta=10000.0, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at 1 and biases at 0: random values make a wrong mapping visible
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model.eval()


CASES = [("qwen2", True), ("qwen2", False), ("llama", True), ("llama", False)]
IDS = [f"{a}-{'tied' if t else 'untied'}" for a, t in CASES]


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# --- conversion on tensors (no megatron-core needed) ---------------------------------------------------------------


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_hf_megatron_hf_round_trip_is_bit_exact(arch, tied):
    model = tiny(arch, tied)
    hf = model.state_dict()
    m = hf_to_megatron(hf, model.config)
    assert ("output_layer.weight" in m) == (not tied)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in m) == (arch == "qwen2")
    assert m["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert_bit_exact(megatron_to_hf(m, model.config), hf)


def test_preset_models_round_trip():
    tok = build_tokenizer()
    for preset in ("tiny", "tiny-llama"):
        model = build_model(preset, tok, seed=1)
        assert_bit_exact(megatron_to_hf(hf_to_megatron(model.state_dict(), model.config), model.config),
                         model.state_dict())


def test_qkv_is_fused_per_query_group():
    """Megatron's rows: [q heads of group 0, k0, v0, q heads of group 1, k1, v1]."""
    model = tiny("qwen2", True)
    hf, cfg = model.state_dict(), model.config
    m = hf_to_megatron(hf, cfg)["decoder.layers.1.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    hd = 16
    group1 = m[4 * hd:]
    assert torch.equal(group1[:2 * hd], q[2 * hd:]) and torch.equal(group1[2 * hd:3 * hd], k[hd:])
    assert torch.equal(group1[3 * hd:], v[hd:])


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_tensor_parallel_split_merge_round_trip(arch, tied):
    model = tiny(arch, tied)
    cfg = model.config
    full = hf_to_megatron(model.state_dict(), cfg)
    shards = split_tensor_parallel(full, cfg, 2)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    # Rank 1 holds query group 1 whole (its 2 q heads, k and v), fc1 the second half of gate and of up.
    hf = model.state_dict()
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    half = cfg.__class__(**{**cfg.to_dict(), "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16})
    from factory.core.trainer.megatron_convert import geometry
    assert torch.equal(shards[1][qkv], fuse_qkv(q[32:], k[16:], v[16:], geometry(half)))
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[48:], up[48:]]))
    assert shards[0]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 32)
    assert shards[0]["embedding.word_embeddings.weight"].shape == (VOCAB // 2, 64)
    assert_bit_exact(merge_tensor_parallel(shards, cfg), full)
    assert_bit_exact(megatron_to_hf(merge_tensor_parallel(shards, cfg), cfg), hf)


def test_tensor_parallel_merge_refuses_disagreeing_replicas():
    model = tiny("llama", False)
    shards = split_tensor_parallel(hf_to_megatron(model.state_dict(), model.config), model.config, 2)
    shards[1]["decoder.final_layernorm.weight"] = shards[1]["decoder.final_layernorm.weight"] + 1
    with pytest.raises(ValueError, match="decoder.final_layernorm.weight: replicated"):
        merge_tensor_parallel(shards, model.config)


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_pipeline_stages_round_trip(arch, tied):
    model = tiny(arch, tied)
    cfg = model.config
    full = hf_to_megatron(model.state_dict(), cfg)
    stages = [pipeline_stage(full, cfg, r, 2) for r in range(2)]
    assert "embedding.word_embeddings.weight" in stages[0] and "embedding.word_embeddings.weight" not in stages[1]
    assert "decoder.layers.0.mlp.linear_fc2.weight" in stages[1] and "decoder.layers.1.input_layernorm.weight" \
        not in stages[1]
    assert "output_layer.weight" in stages[1]  # tied: the last stage's copy of the embedding
    assert_bit_exact(merge_pipeline(stages, cfg), full)


def test_sizes_that_do_not_split_are_named():
    model = tiny("qwen2", True)
    with pytest.raises(ValueError, match="num_key_value_heads: 2 is not divisible by trainer.tensor_parallel 4"):
        split_tensor_parallel(hf_to_megatron(model.state_dict(), model.config), model.config, 4)
    with pytest.raises(ValueError, match="trainer.pipeline_parallel: must divide num_hidden_layers 2"):
        pipeline_stage(hf_to_megatron(model.state_dict(), model.config), model.config, 0, 3)


def test_missing_and_unknown_keys_are_errors():
    model = tiny("qwen2", False)
    hf = model.state_dict()
    with pytest.raises(ValueError, match="missing 'lm_head.weight'"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "lm_head.weight"}, model.config)
    with pytest.raises(ValueError, match="keys the converter does not know.*extra"):
        hf_to_megatron({**hf, "model.extra": torch.zeros(1)}, model.config)


@pytest.mark.parametrize(("arch", "extra", "field"), [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
     "rope_parameters.rope_type"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen2_moe", {}, "model_type"),
])
def test_unsupported_configs_name_the_field(arch, extra, field):
    config = AutoConfig.for_model(arch, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, **extra)
    with pytest.raises(ValueError, match=f"^{field}"):
        check_supported(config)


# --- a real GPTModel (megatron-core) -------------------------------------------------------------------------------


def _require_megatron() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core does not import here (pip install -e '.[megatron]')",
                        exc_type=ImportError)


@pytest.fixture(scope="module")
def mg():
    """megatron.core with a 1-rank gloo group and tensor/pipeline parallel 1, torn down after the module."""
    _require_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from factory.core.trainer import megatron

    megatron.init_model_parallel(1, 1)
    yield megatron
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _cpu_stand_ins() -> list[tuple[object, str, object]]:
    """Megatron 0.16's forward on CPU torch. Two CUDA assumptions get a CPU stand-in, nothing else:
    - RotaryEmbedding.get_emb moves its frequency table to `torch.cuda.current_device()` on first use: that
      device is reported as "cpu", so the table stays where the model is;
    - DotProductAttention forks the CUDA RNG tracker around attention dropout (p = 0 here, no random numbers are
      drawn): the fork is a no-op context.
    The attention mask is always passed explicitly (`megatron_attention_mask`), so Megatron's CUDA default causal
    mask is never built."""
    import megatron.core.tensor_parallel.random as mrandom

    class NoForkTracker:
        def fork(self, name: str = "model-parallel-rng"):
            return contextlib.nullcontext()

    return [(torch.cuda, "current_device", lambda: "cpu"), (mrandom, "_CUDA_RNG_STATE_TRACKER", NoForkTracker()),
            (mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)]


@pytest.fixture
def megatron_cpu_forward(mg, monkeypatch):
    for obj, name, value in _cpu_stand_ins():
        monkeypatch.setattr(obj, name, value)


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_gpt_model_loads_strictly_and_reads_back_bit_exact(mg, arch, tied):
    model = tiny(arch, tied)
    rng = torch.get_rng_state()
    gpt = mg.build_gpt_model(model.config)
    assert torch.equal(torch.get_rng_state(), rng)  # building draws its random init from a fork
    # Marked as sharded (Megatron marks only while initialising): the gradient norm counts it on every rank.
    assert gpt.decoder.layers[0].self_attention.linear_qkv.weight.tensor_model_parallel
    names = set(gpt.state_dict())
    assert ("output_layer.weight" in names) == (not tied)
    mg.load_hf_state(gpt, model.state_dict(), model.config)  # load_state_dict(strict=True) inside
    assert_bit_exact(mg.megatron_state_to_hf(gpt, model.config), model.state_dict())


def test_gpt_model_from_preset_and_bpe_model_dir(mg, tmp_path):
    from factory.models.bpe import build_bpe_model_dir

    hf = AutoModelForCausalLM.from_pretrained(build_bpe_model_dir(tmp_path / "bpe", preset="micro"))
    gpt = mg.build_gpt_model(hf.config)
    mg.load_hf_state(gpt, hf.state_dict(), hf.config)
    assert_bit_exact(mg.megatron_state_to_hf(gpt, hf.config), hf.state_dict())


def test_unsupported_config_is_refused_before_building(mg):
    config = AutoConfig.for_model("qwen2", num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                                  use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="use_sliding_window"):
        mg.build_gpt_model(config)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    completions = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (6, 2, 7, 4)]
    old = [(-torch.rand(len(c), generator=g) - 3.0).tolist() for c in completions]
    return pack(prompts, completions, pad_id=0, completion_values={"old_logprobs": old},
                per_seq={"advantages": [1.0, -0.5, 0.7, -1.2]})


def _spec(arch: str):
    return parse_spec({"seed": 0, "model": {"preset": "tiny-llama" if arch == "llama" else "tiny"},
                       "algorithm": {"group_size": 4, "lr": 1e-3},
                       "rollout": {"prompts_per_step": 1, "max_new_tokens": 8, "temperature": 0.9},
                       "trainer": {"backend": "megatron", "grad_clip": 0.5}})


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_megatron_trainer_matches_torch_trainer(mg, megatron_cpu_forward, arch, tied):
    """Same weights, same right-padded batch, same loss function: the same logprobs, loss, gradient norm and
    entropy, and after the AdamW steps the same logprobs again (float tolerance: the kernels differ)."""
    spec = _spec(arch)
    model = tiny(arch, tied, seed=3)
    reference = TorchTrainer(tiny(arch, tied, seed=3), lr=spec.algorithm.lr, grad_clip=spec.trainer.grad_clip,
                             temperature=spec.rollout.temperature)
    trainer = mg.make_megatron_trainer(spec, model, device="cpu")
    batch = _batch()
    mask = batch.loss_mask
    torch.testing.assert_close(trainer.logprobs(batch)[mask], reference.logprobs(batch)[mask], atol=2e-5, rtol=1e-5)
    loss_fn = algorithms.make_loss(spec.algorithm)
    # Two minibatches of the same seeded shuffle: two AdamW steps each.
    got = trainer.step(batch, loss_fn, minibatches=2, generator=torch.Generator().manual_seed(5))
    want = reference.step(batch, loss_fn, minibatches=2, generator=torch.Generator().manual_seed(5))
    assert trainer.version == reference.version == 2 and got["nonfinite"] == 0.0
    for key in ("loss", "grad_norm", "entropy"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(trainer.logprobs(batch)[mask], reference.logprobs(batch)[mask], atol=2e-4, rtol=1e-4)
    # The HF model the loop publishes is kept in step with the trained weights.
    assert_bit_exact(model.state_dict(), trainer.hf_state_dict())
    assert not torch.equal(model.state_dict()["model.norm.weight"], tiny(arch, tied, seed=3).state_dict()[
        "model.norm.weight"])


def test_nonfinite_minibatch_is_skipped(mg, megatron_cpu_forward, monkeypatch):
    """Through the one non-finite rule (`trainer/step.py`'s `guarded_step`, spied on: the real one runs), decided
    on the host; and `MegatronTrainer` is a `factory.protocols.Trainer`."""
    model = tiny("qwen2", True)
    trainer = mg.make_megatron_trainer(_spec("qwen2"), model, device="cpu")
    assert isinstance(trainer, Trainer) and trainer_problems(trainer) == []
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if v is not None}
    calls = []

    def spy(optimizer, loss, grad_norm, *, on_device):
        calls.append(on_device)
        return guarded_step(optimizer, loss, grad_norm, on_device=on_device)

    monkeypatch.setattr(mg, "guarded_step", spy)

    def nan_loss(logp, batch):
        return (logp * batch.loss_mask).sum() * float("nan"), {}

    metrics = trainer.step(_batch(), nan_loss)
    assert metrics["nonfinite"] == 1.0 and trainer.version == 0 and calls == [False]
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_make_megatron_trainer_reads_the_spec(mg):
    model = tiny("qwen2", True)
    with pytest.raises(ValueError, match="trainer.backend: make_megatron_trainer needs 'megatron'"):
        mg.make_megatron_trainer(parse_spec({"model": {"preset": "tiny"}}), model, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="trainer.backend: megatron runs on CUDA GPUs"):
            mg.make_megatron_trainer(_spec("qwen2"), model)
    tp2 = parse_spec({**_spec("qwen2").model_dump(mode="json"),
                      "trainer": {"backend": "megatron", "tensor_parallel": 2, "world_size": 2}})
    with pytest.raises(ValueError, match=r"Megatron is already initialised with \(1, 1\)"):
        mg.make_megatron_trainer(tp2, model, device="cpu")


class _FakeCudaRng:
    """The one CUDA generator Megatron's RNG tracker reads and writes, kept on the CPU: seeding it, reading and
    setting its state. What the tracker does with it (add, fork, restore) is Megatron's own code."""

    def __init__(self):
        self.state = torch.Generator().manual_seed(0).get_state()
        self.seeds: list[int] = []

    def manual_seed(self, seed: int) -> None:
        self.seeds.append(seed)
        self.state = torch.Generator().manual_seed(seed).get_state()

    def get(self, *args, **kwargs) -> torch.Tensor:
        return self.state.clone()

    def set(self, state: torch.Tensor, *args, **kwargs) -> None:
        self.state = state.clone()


@pytest.fixture
def cuda_path(mg, monkeypatch):
    """What make_megatron_trainer meets on a one-GPU machine, on this CPU: torch reports one CUDA device, a fresh
    (never seeded) Megatron RNG tracker over a fake CUDA generator, and moving a module to CUDA leaves it on the
    CPU. Megatron's real CudaRNGStatesTracker is used: only the generator under it is fake."""
    import megatron.core.tensor_parallel.random as mrandom

    rng = _FakeCudaRng()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # RoPE's table stays with the model
    monkeypatch.setattr(torch.cuda, "manual_seed", rng.manual_seed)
    monkeypatch.setattr(torch.cuda, "get_rng_state", rng.get)
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", rng.get)
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", rng.set)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    to = torch.nn.Module.to

    def to_cpu_for_cuda(self, *args, **kwargs):
        if args and torch.device(args[0]).type == "cuda":
            return self
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to_cpu_for_cuda)
    return mrandom, rng


def test_megatron_on_cuda_seeds_the_model_parallel_rng_from_the_run_seed(mg, cuda_path):
    """On CUDA, attention forks Megatron's 'model-parallel-rng' state on every forward; unseeded it raises "cuda rng
    state model-parallel-rng is not added" (the CPU stand-ins above replace the tracker and hid this). The trainer
    built for a CUDA device registers it, seeded from the run's seed, and the forward through the real tracker
    runs."""
    mrandom, rng = cuda_path
    spec = parse_spec({**_spec("qwen2").model_dump(mode="json"), "seed": 7})
    trainer = mg.make_megatron_trainer(spec, tiny("qwen2", True), device="cuda:0")
    tracker = mrandom.get_cuda_rng_tracker()
    assert "model-parallel-rng" in tracker.get_states()
    assert rng.seeds[0] == 7 and 7 + 2718 in tracker.seeds_  # data-parallel seed, then tensor-parallel rank 0's
    lp = trainer.logprobs(_batch())  # DotProductAttention forks the tracker: raises if the state is not added
    assert torch.isfinite(lp).all()


# --- tensor parallel 2 across two real ranks (torchrun, gloo, CPU) -------------------------------------------------


def _tensor_parallel_worker(out: str) -> None:
    """One rank of a tensor_parallel 2 run (torchrun runs this file): build, load the shards strictly, logprobs,
    one step, gather the weights back; rank 0 saves what it saw to `out`."""
    import datetime

    import torch.distributed as dist

    from factory.core.trainer import megatron

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # a lost collective fails, not hangs
    for obj, name, value in _cpu_stand_ins():
        setattr(obj, name, value)
    spec = parse_spec({**_spec("llama").model_dump(mode="json"),
                       "trainer": {"backend": "megatron", "grad_clip": 0.5, "tensor_parallel": 2, "world_size": 2}})
    model = tiny("llama", False, seed=3)
    trainer = megatron.make_megatron_trainer(spec, model, device="cpu")
    shapes = {k: tuple(v.shape) for k, v in trainer.model.state_dict().items() if v is not None}
    loaded = trainer.hf_state_dict()
    batch = _batch()
    before = trainer.logprobs(batch)
    metrics = trainer.step(batch, algorithms.make_loss(spec.algorithm))
    after = trainer.logprobs(batch)
    trained = trainer.hf_state_dict()
    if dist.get_rank() == 0:
        torch.save({"shapes": shapes, "loaded": loaded, "before": before, "metrics": metrics, "after": after,
                    "trained": trained, "hf_model": model.state_dict()}, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_2_on_two_ranks_matches_torch_trainer(tmp_path):
    """Megatron's own TP layers (column/row parallel, vocab-parallel embedding, gathered logits) on two CPU ranks:
    the shards load strictly, gather back bit-exact, and logprobs / loss / gradient norm / the step match the
    single-process torch trainer."""
    _require_megatron()
    import os
    import signal
    import subprocess

    out = tmp_path / "rank0.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    # --standalone: a rendezvous on a free localhost port; a new session so a hang is killed with both ranks.
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             __file__, str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the two ranks did not finish: {stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    got = torch.load(out)
    assert got["shapes"]["decoder.layers.0.self_attention.linear_qkv.weight"] == ((2 + 2) * 16, 64)  # one group
    assert got["shapes"]["decoder.layers.0.mlp.linear_fc2.weight"] == (64, 48)
    assert got["shapes"]["output_layer.weight"] == (VOCAB // 2, 64)
    start = tiny("llama", False, seed=3)
    assert_bit_exact(got["loaded"], start.state_dict())
    spec = _spec("llama")
    reference = TorchTrainer(start, lr=spec.algorithm.lr, grad_clip=spec.trainer.grad_clip,
                             temperature=spec.rollout.temperature)
    batch = _batch()
    mask = batch.loss_mask
    torch.testing.assert_close(got["before"][mask], reference.logprobs(batch)[mask], atol=2e-5, rtol=1e-5)
    want = reference.step(batch, algorithms.make_loss(spec.algorithm))
    for key in ("loss", "grad_norm", "entropy"):
        assert got["metrics"][key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(got["after"][mask], reference.logprobs(batch)[mask], atol=2e-4, rtol=1e-4)
    assert_bit_exact(got["trained"], got["hf_model"])


if __name__ == "__main__":
    _tensor_parallel_worker(sys.argv[1])
