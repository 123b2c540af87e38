"""Packed rows (factory/core/trainer/packing.py): on small random Qwen2 and Llama models in float32 on the CPU, with
ragged rows as the loop packs them, the packed forward gives the padded forward's per-token log-probs, entropy,
GRPO loss and the gradient of every parameter (1e-6 absolute + 1e-6 relative), with and without bucket padding, one
row or rows capped at the padded width; the packed <-> padded round trip; the trainer's steps (GRPO and SFT) with
packing on against off; through DDP, FSDP2 and `DistributedTrainer`; the padded fallback with one log line; and
packing at "auto" on the CPU never touched (bit for bit)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from factory.config import AlgorithmSpec
from factory.core.algorithms import grpo_loss, make_loss, sft_loss
from factory.core.batch import TrainBatch, pack
from factory.core.trainer import packing
from factory.core.trainer.distributed import DistributedTrainer
from factory.core.trainer.logprobs import token_logprobs
from factory.core.trainer.packing import (
    PACKABLE,
    Packer,
    choose_row_cap,
    packed_token_logprobs,
    packing_problem,
    pair_cost,
    plan_for,
    plan_packing,
    round_up,
    sample_lengths,
    takes_prebuilt_mask,
)
from factory.core.trainer.torch_trainer import TorchTrainer
from tests.core.host_sync import NoHostCopy, NoHostSync
from tests.core.tiny_models import spread_weights

VOCAB, PAD = 96, 0


def tiny(arch: str, impl: str = "sdpa", seed: int = 0) -> PreTrainedModel:
    """A 2-layer, 32-wide random `arch` model; weights large enough that the log-probs spread."""
    cfg = AutoConfig.for_model(arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, intermediate_size=64, max_position_embeddings=128, vocab_size=VOCAB,
                               tie_word_embeddings=arch == "qwen2")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=impl)
    return spread_weights(model, seed).train()


def rl_batch(seed: int = 0, rows: int = 6) -> TrainBatch:
    """Ragged rows as the loop packs them (`batch.pack`): prompts of 3-8 tokens, completions of 1-14 with the
    sampler's log-probs, a multi-turn row with environment tokens masked out, per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts, completions = [ids(3, 9) for _ in range(rows)], [ids(1, 15) for _ in range(rows)]
    completions[1] = completions[1][:1]  # one target only
    masks = [[1] * len(c) for c in completions]
    masks[2] = [int(i % 3 != 1) for i in range(len(completions[2]))]  # tokens the environment inserted
    old = [(-torch.rand(len(c), generator=g) * 3).tolist() for c in completions]
    adv = torch.randn(rows, generator=g).tolist()
    return pack(prompts, completions, PAD, {"old_logprobs": old}, {"advantages": adv}, completion_masks=masks)


def forward(model: PreTrainedModel, batch: TrainBatch, packed: bool, **kw) -> tuple[torch.Tensor, ...]:
    """(log-probs, entropy, GRPO loss) and the gradient of every parameter, through the padded or packed path."""
    model.zero_grad(set_to_none=True)
    impl = packed_token_logprobs if packed else token_logprobs
    logp, entropy = impl(model, batch, 0.7, with_entropy=True, **kw)
    loss, _ = grpo_loss(logp, batch.per_token["old_logprobs"], batch.per_seq["advantages"], batch.loss_mask,
                        ref_logprobs=batch.per_token["old_logprobs"] - 0.1, kl_coef=0.05)
    loss.backward()
    return logp.detach(), entropy.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a: tuple, b: tuple, valid: torch.Tensor) -> None:
    (lp_a, ent_a, loss_a, grads_a), (lp_b, ent_b, loss_b, grads_b) = a, b
    torch.testing.assert_close(lp_a[valid], lp_b[valid], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent_a[valid], ent_b[valid], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 8
    for name, g in grads_a.items():
        torch.testing.assert_close(g, grads_b[name], atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("bucket", [1, 16])
def test_packed_rows_give_the_padded_logprobs_loss_and_gradients(arch: str, impl: str, bucket: int) -> None:
    model, batch = tiny(arch, impl), rl_batch()
    padded = forward(model, batch, packed=False)
    valid = batch.attention_mask[:, 1:].bool()
    assert_same(forward(model, batch, packed=True, bucket=bucket), padded, valid)  # the layout plan_for picks
    lengths, width = sample_lengths(batch.attention_mask), batch.input_ids.shape[1]
    capped = plan_packing(lengths, width, bucket, width)  # rows no longer than the padded ones
    one_row = plan_packing(lengths, width, bucket)
    assert 1 < capped.rows < len(batch) and one_row.rows == 1 and capped.length % bucket == 0
    assert_same(forward(model, batch, packed=True, plan=capped), padded, valid)
    assert_same(forward(model, batch, packed=True, plan=one_row), padded, valid)
    lp, ent, _, _ = forward(model, batch, packed=True, plan=one_row)
    assert not lp[~valid].any() and not ent[~valid].any()  # zeros where the padded batch has no real target


EVERY_ARCH = {  # model_type -> (config extras, attention implementations): each class of PACKABLE
    "qwen2": ({"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}, ("sdpa", "eager")),
    "qwen3": ({}, ("sdpa", "eager")), "mistral": ({"sliding_window": 5}, ("sdpa", "eager")),
    "gemma": ({}, ("sdpa", "eager")), "gemma2": ({"sliding_window": 5, "final_logit_softcapping": 2.0}, ("eager",)),
    "gemma3_text": ({"sliding_window": 5}, ("sdpa", "eager")), "phi3": ({"sliding_window": 5}, ("sdpa", "eager")),
    "smollm3": ({}, ("sdpa", "eager")), "olmo2": ({}, ("sdpa", "eager")),
    "starcoder2": ({"sliding_window": 5}, ("sdpa", "eager")), "gpt2": ({}, ("sdpa", "eager")),
}


@pytest.mark.parametrize("arch,impl", [(a, i) for a, (_, impls) in EVERY_ARCH.items() for i in impls])
def test_every_packable_architecture_with_sliding_windows(arch: str, impl: str) -> None:
    """Each architecture of PACKABLE (a sliding window of 5 tokens where it has one, shorter than most samples, so
    the window is applied on the per-sample positions) in eval mode: packed equals padded, capped rows, one row and
    the layout `plan_for` picks for it."""
    model = every_arch_model(arch, impl)
    batch = rl_batch()
    padded, valid = forward(model, batch, packed=False), batch.attention_mask[:, 1:].bool()
    lengths, width = sample_lengths(batch.attention_mask), batch.input_ids.shape[1]
    # position ids alone (transformers builds the mask) and, where the model takes one, the plan's prebuilt mask
    for with_mask in {False, takes_prebuilt_mask(model)}:
        for cap, bucket in ((width, 1), (None, 8)):
            plan = plan_packing(lengths, width, bucket, cap, with_mask)
            assert_same(forward(model, batch, packed=True, plan=plan), padded, valid)
    assert_same(forward(model, batch, packed=True, bucket=8), padded, valid)  # the layout plan_for picks


def every_arch_model(arch: str, impl: str) -> PreTrainedModel:
    """A 2-layer, 32-wide random model of `arch` (EVERY_ARCH's config extras) in eval mode."""
    if arch == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB)
    else:
        cfg = AutoConfig.for_model(arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                   max_position_embeddings=128, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2, **EVERY_ARCH[arch][0])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=impl).eval()
    assert type(model).__name__ in PACKABLE and packing_problem(model) is None
    return spread_weights(model)


# EVERY_ARCH's models with a sliding window: they keep the position-ids path (a mask per layer type)
SLIDING = {"qwen2", "mistral", "gemma2", "gemma3_text", "phi3", "starcoder2"}


@pytest.mark.parametrize("arch,impl", [(a, i) for a, (_, impls) in EVERY_ARCH.items() for i in impls])
def test_the_prebuilt_document_mask_is_the_one_transformers_builds(arch: str, impl: str) -> None:
    """Where the model takes it (full attention, sdpa or eager), the plan's mask (bool for sdpa, additive float for
    eager) is torch.equal to `create_causal_mask`'s from the packed position ids, on rows of several samples and an
    end pad; and the packed forward with it reads nothing on the host. A sliding window keeps the position ids."""
    model = every_arch_model(arch, impl)
    assert takes_prebuilt_mask(model) is (arch not in SLIDING)
    batch = rl_batch()
    plan = plan_for(model, batch, bucket=8)
    if arch in SLIDING:
        assert plan.documents is None and plan.document_mask is None
        return
    assert plan.rows < batch.input_ids.shape[0] and plan.document_mask.shape == (plan.rows, 1, plan.length, plan.length)
    dtype = torch.bool if impl == "sdpa" else torch.float32
    embeds = torch.zeros(plan.rows, plan.length, 32)
    built = create_causal_mask(model.config, embeds, None, None, position_ids=plan.position_ids)
    assert isinstance(built, torch.Tensor) and built.dtype == dtype
    assert torch.equal(plan.forward_mask(dtype), built)
    with NoHostSync(), NoHostCopy():
        logp, _ = packed_token_logprobs(model, batch, plan=plan)
    assert logp.shape == (batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)


def test_without_the_document_mask_the_logprobs_differ() -> None:
    """The check above has teeth: the same packed row with positions counting on across samples (no document
    boundary for transformers to find) attends across samples and gives other log-probs."""
    model, batch = tiny("qwen2"), rl_batch()
    plan = plan_packing(sample_lengths(batch.attention_mask), batch.input_ids.shape[1])
    padded, _ = token_logprobs(model, batch)
    crossing, _ = token_logprobs(model, plan.batch(batch.input_ids), position_ids=torch.arange(plan.length)[None])
    valid = batch.attention_mask[:, 1:].bool()
    assert (plan.unpack(crossing) - padded)[valid].abs().max() > 1e-2


@pytest.mark.parametrize("bucket,cap", [(1, None), (8, None), (1, 12), (8, 12)])
def test_the_round_trip_packed_to_padded(bucket: int, cap: int | None) -> None:
    """Each real token lands once, positions restart at 0 per sample and per end pad, rows respect the cap and the
    bucket, and unpacking the packed targets gives the padded targets (0 where there is none)."""
    lengths, width = [9, 0, 1, 12, 5, 7, 2], 12
    plan = plan_packing(lengths, width, bucket, cap)
    g = torch.Generator().manual_seed(0)
    real = torch.arange(width) < torch.tensor(lengths)[:, None]
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g) * real
    packed = plan.pack(ids)
    assert packed.shape == (plan.rows, plan.length) and plan.length % bucket == 0
    assert plan.real_tokens == sum(lengths) == int((packed != 0).sum())
    assert plan.rows == (1 if cap is None else 3)  # first-fit-decreasing, cap 12: 12+0 | 9+2+1 | 7+5
    assert plan.packed_tokens - sum(lengths) < plan.rows * bucket + (0 if cap is None else 12)
    real = torch.zeros(plan.packed_tokens, dtype=torch.bool)
    real[plan.token_dst] = True
    end_pads = int((~real.view(plan.rows, plan.length)[:, -1]).sum())
    assert int((plan.position_ids == 0).sum()) == sum(n > 0 for n in lengths) + end_pads  # each a document
    targets = plan.unpack(packed[:, 1:])
    want = torch.where(plan.out_valid, ids[:, 1:], torch.zeros_like(ids[:, 1:]))
    assert torch.equal(targets, want)
    assert torch.equal(plan.out_valid, (torch.arange(width - 1) < torch.tensor(lengths)[:, None] - 1))
    assert int(plan.target_valid.sum()) == int(plan.out_valid.sum())
    for i, n in enumerate(lengths):  # a sample's positions are 0..n-1, in order
        positions = plan.position_ids.reshape(-1)[plan.token_dst[sum(lengths[:i]):sum(lengths[:i + 1])]]
        assert torch.equal(positions, torch.arange(n))


def test_the_row_layout_weighs_matmul_tokens_against_attention_pairs() -> None:
    """Attention free: everything in one row (fewest slots). Attention dear: rows no longer than the padded width.
    Flash-attention (varlen) models get one row whatever the cost."""
    lengths, width = [1800, 1500, 1200, 900, 600, 300, 250, 200], 1800
    assert plan_packing(lengths, width, 128, choose_row_cap(lengths, width, 128, 0.0)).rows == 1
    assert choose_row_cap(lengths, width, 128, 1.0) == round_up(width, 128)
    model = tiny("qwen2")
    assert 0 < pair_cost(model) < 1
    model.config._attn_implementation = "flash_attention_2"
    batch = rl_batch()
    assert plan_for(model, batch, 8).rows == 1


def test_bad_plans_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="bucket"):
        plan_packing([3], 4, bucket=0)
    with pytest.raises(ValueError, match="lengths"):
        plan_packing([5], 4)
    with pytest.raises(ValueError, match="attention_mask: packing needs right-padded rows"):
        sample_lengths(torch.tensor([[0, 1, 1]]))
    plan = plan_packing([3, 2], 4)
    with pytest.raises(ValueError, match="input_ids: expected width 4"):
        plan.pack(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="values: expected the packed targets' shape"):
        plan.unpack(torch.zeros(1, 2))


def test_packing_and_unpacking_read_nothing_on_the_host() -> None:
    """With the plan built beforehand (from the CPU batch), what runs on the device per step (pack the ids, unpack
    the values and their gradient) has no host sync and no data-dependent shape."""
    batch = rl_batch()
    plan = plan_packing(sample_lengths(batch.attention_mask), batch.input_ids.shape[1], 8)
    values = torch.randn(plan.rows, plan.length - 1, requires_grad=True)
    with NoHostSync(), NoHostCopy():
        packed = plan.to(torch.device("cpu")).pack(batch.input_ids)
        out = plan.unpack(values)
        (out * 2).sum().backward()
    assert packed.shape == (plan.rows, plan.length)
    assert torch.equal(values.grad, plan.target_valid.float() * 2)  # each real target once, boundaries none


def packed_forwards(model: torch.nn.Module) -> list[int]:
    """Rows of every decoder forward of `model` that got position ids and no 2-D attention mask (a packed one: no
    mask, or the plan's prebuilt 4-D document mask)."""
    rows: list[int] = []

    def spy(_module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if kwargs.get("position_ids") is not None and (mask is None or mask.dim() == 4):
            rows.append(kwargs["input_ids"].shape[0])

    model.model.register_forward_pre_hook(spy, with_kwargs=True)
    return rows


def sgd(trainer):
    """`trainer` stepping plain SGD at lr 1, so a parameter moves by exactly its (clipped) gradient. AdamW's first
    step moves each parameter by about lr * sign(gradient), which turns float noise in a gradient that is 0 in exact
    arithmetic (a key bias: softmax ignores it) into a full step either way."""
    trainer.optimizer = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=1.0)
    return trainer


def trainers(model: PreTrainedModel) -> tuple[TorchTrainer, TorchTrainer]:
    return (sgd(TorchTrainer(copy.deepcopy(model), lr=1.0, packing="off")),
            sgd(TorchTrainer(copy.deepcopy(model), lr=1.0, packing="on")))


def params_close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6, msg=name)


def test_the_trainer_plans_from_the_cpu_batch(monkeypatch) -> None:
    """`TorchTrainer` and `DistributedTrainer` build each packing plan before the batch leaves the CPU and hand it to
    the packed forward, so on a GPU the step reads no attention mask back from the device: the packed forward never
    plans itself."""
    _, on = trainers(tiny("qwen2"))
    given: list[bool] = []
    real = packing.packed_token_logprobs

    def spy(*args, **kwargs):
        given.append((args[5] if len(args) > 5 else kwargs.get("plan")) is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(packing, "packed_token_logprobs", spy)
    on.logprobs(rl_batch())
    on.step(rl_batch(), make_loss(AlgorithmSpec(name="grpo")), 2, torch.Generator().manual_seed(0))
    assert given == [True] * 3  # logprobs, then each of the 2 minibatches
    given.clear()
    distributed = DistributedTrainer(tiny("qwen2"), lr=1e-2, grad_accum=2, packing="on")
    distributed.logprobs(rl_batch())
    distributed.step(rl_batch(), make_loss(AlgorithmSpec(name="grpo")))
    assert given == [True] * 3  # logprobs, then each of the 2 micro-batches


def test_trainer_steps_with_packing_on_match_off_for_grpo_and_sft() -> None:
    """The trainer's own paths: `logprobs` (old / reference log-probs) and `step` (two minibatches, so a shuffled
    split is packed each time) for the GRPO loss and for an SFT batch as sft.py builds it."""
    model, batch = tiny("qwen2"), rl_batch(rows=8)
    off, on = trainers(model)
    packed, padded = packed_forwards(on.model), packed_forwards(off.model)
    valid = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(on.logprobs(batch)[valid], off.logprobs(batch)[valid], atol=1e-6, rtol=1e-6)
    assert not on.logprobs(batch)[~valid].any()
    loss_fn = make_loss(AlgorithmSpec(name="grpo"))
    m_off = off.step(batch, loss_fn, 2, torch.Generator().manual_seed(3))
    m_on = on.step(batch, loss_fn, 2, torch.Generator().manual_seed(3))
    for key in ("loss", "grad_norm", "entropy", "clip_frac"):
        assert m_on[key] == pytest.approx(m_off[key], abs=1e-6), key
    params_close(on.model, off.model)
    # the 2 logprobs calls (8 rows), the 2 minibatches (4 rows): fewer packed rows each (capped at the padded width)
    assert len(packed) == 4 and max(packed[:2]) < 8 and max(packed[2:]) < 4 and padded == []

    sft = pack([r[:4] for r in batch.input_ids.tolist()], [[5, 6, 7], [8], [9, 10], [11] * 6] * 2, PAD)
    off, on = trainers(tiny("llama"))
    packed = packed_forwards(on.model)
    m_off = off.step(sft, lambda lp, b: sft_loss(lp, b.loss_mask))
    m_on = on.step(sft, lambda lp, b: sft_loss(lp, b.loss_mask))
    assert m_on["loss"] == pytest.approx(m_off["loss"], abs=1e-6)
    params_close(on.model, off.model)
    assert len(packed) == 1 and packed[0] < len(sft)


def test_auto_on_the_cpu_leaves_the_trainer_bit_for_bit() -> None:
    """packing="auto" on the CPU is the padded path itself: log-probs equal to `token_logprobs` before this
    change (torch.equal), the same bits after steps as packing "off", and the packer never consulted."""
    model, batch = tiny("qwen2"), rl_batch(rows=8)
    off = TorchTrainer(copy.deepcopy(model), lr=1e-2, packing="off")
    auto = TorchTrainer(copy.deepcopy(model), lr=1e-2)
    assert not auto.uses("packing")
    with torch.no_grad():
        assert torch.equal(auto.logprobs(batch), token_logprobs(model.eval(), batch)[0])
    loss_fn = make_loss(AlgorithmSpec(name="grpo"))
    for _ in range(2):
        m_auto, m_off = auto.step(batch, loss_fn), off.step(batch, loss_fn)
        m_auto.pop("train_s"), m_off.pop("train_s")
        assert m_auto == m_off
    for p, q in zip(auto.model.parameters(), off.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert auto.packer._verdicts == {}


def test_a_model_that_cannot_pack_falls_back_with_one_log_line(caplog) -> None:
    """An architecture outside PACKABLE (Cohere here) or an attention implementation without a document mask keeps
    the padded path, bit for bit, and says so once per model."""
    cfg = AutoConfig.for_model("cohere", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB)
    torch.manual_seed(0)
    cohere, batch = AutoModelForCausalLM.from_config(cfg), rl_batch()
    packer = Packer()
    with caplog.at_level(logging.WARNING, logger="factory.core.trainer.packing"):
        for _ in range(2):
            assert torch.equal(packer.token_logprobs(cohere, batch)[0], token_logprobs(cohere, batch)[0])
    lines = [r.getMessage() for r in caplog.records if r.name == "factory.core.trainer.packing"]
    assert len(lines) == 1 and "CohereForCausalLM" in lines[0] and "padded path" in lines[0]
    qwen = tiny("qwen2")
    assert packing_problem(qwen) is None
    qwen.config._attn_implementation = "my_kernel"
    assert "attention implementation 'my_kernel'" in packing_problem(qwen)


def test_through_ddp_and_fsdp2_and_the_distributed_trainer(tmp_path) -> None:
    """DDP's wrapper and FSDP2's module (one gloo rank) pass the position ids through: packed equals padded. And
    `DistributedTrainer` (alone, grad_accum 2) steps with packing on as with it off."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, batch = tiny("llama"), rl_batch()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(copy.deepcopy(model))
        packed = packed_forwards(ddp.module)
        assert packing_problem(ddp) is None
        valid = batch.attention_mask[:, 1:].bool()
        want = forward(model, batch, packed=False)
        got = forward(ddp, batch, packed=True)
        got = got[:3] + ({n.removeprefix("module."): g for n, g in got[3].items()},)
        assert_same(got, want, valid)
        assert packed and max(packed) < len(batch)
        from torch.distributed.fsdp import fully_shard  # heavy (~2 s): here only

        fsdp = copy.deepcopy(model)
        for layer in fsdp.model.layers:
            fully_shard(layer)
        fully_shard(fsdp)
        assert type(fsdp).__name__ == "FSDPLlamaForCausalLM" and packing_problem(fsdp) is None
        packed = packed_forwards(fsdp)
        lp, ent, loss, grads = forward(fsdp, batch, packed=True)
        assert_same((lp, ent, loss, {n: g.full_tensor() for n, g in grads.items()}), want, valid)
        assert packed and max(packed) < len(batch)
    finally:
        dist.destroy_process_group()
    loss_fn = make_loss(AlgorithmSpec(name="grpo"))
    results = []
    for toggle in ("off", "on"):
        t = sgd(DistributedTrainer(copy.deepcopy(model), lr=1.0, grad_accum=2, packing=toggle))
        packed = packed_forwards(t.model)
        results.append((t.logprobs(batch), t.step(batch, loss_fn), t.model, packed))
    (lp_off, m_off, off, packed_off), (lp_on, m_on, on, packed_on) = results
    assert packed_off == [] and len(packed_on) == 3  # logprobs, then 2 micro-batches
    torch.testing.assert_close(lp_on[valid], lp_off[valid], atol=1e-6, rtol=1e-6)
    assert m_on["loss"] == pytest.approx(m_off["loss"], abs=1e-6)
    params_close(on, off)
