"""The fused log-prob + entropy head (factory/core/trainer/fused_head.py, trainer.fused_head): the same log-probs,
entropy and gradients (hidden, weight, tied weight, bias) as the chunked head of logprobs.py in float32 to 1e-6,
in one chunk and many, at temperature 1 and not, logits kept or recomputed; no [N, V] float32 tensor saved for
backward; frozen heads and calls without a graph; no value read on the host (it runs on the meta device); and
through the trainers: "on" gives the loss and gradients of "off", "auto" on the CPU is the chunked path bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from factory.core.batch import TrainBatch, pack
from factory.core.trainer import fused_head, logprobs
from factory.core.trainer.distributed import DistributedTrainer
from factory.core.trainer.fused_head import fused_logprobs
from factory.core.trainer.logprobs import chunked_logprobs, token_logprobs
from factory.core.trainer.torch_trainer import TorchTrainer

N, H, V = 23, 16, 40
TOL = {"atol": 1e-6, "rtol": 1e-6}


def head_inputs(bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """Hidden states [N, H] (a leaf with grad), a Linear head, targets [N], and per-token loss weights [N]."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=bias)
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    return hidden, head, torch.randint(0, V, (N,), generator=g), torch.randn(N, generator=g)


def run(impl, hidden, head, targets, weights) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(logp, entropy, [grad hidden, grad weight, grad bias?]) of a per-token weighted loss through `impl`."""
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    logp, entropy = impl(hidden, head, targets)
    (weights * logp).sum().backward()
    return logp.detach(), entropy, [t.grad.clone() for t in (hidden, head.weight, head.bias)
                                   if t is not None and t.grad is not None]


def chunked(temperature: float, rows: int):
    """Today's head: `chunked_logprobs` over [1, N] with `rows` tokens a chunk (checkpointed when more than one)."""
    def impl(hidden, head, targets):
        logp, entropy = chunked_logprobs(hidden[None], targets[None], head, temperature, True, rows * V, V)
        return logp[0], entropy[0]
    return impl


def fused(temperature: float, rows: int, keep: bool):
    def impl(hidden, head, targets):
        return fused_logprobs(hidden, head.weight, head.bias, targets, temperature, rows, keep)
    return impl


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
@pytest.mark.parametrize("rows", [N, 5], ids=["one-chunk", "5-rows"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_values_and_gradients_match_the_chunked_head(keep: bool, rows: int, temperature: float, bias: bool) -> None:
    inputs = head_inputs(bias)
    ref_lp, ref_ent, ref_grads = run(chunked(temperature, rows), *inputs)
    lp, ent, grads = run(fused(temperature, rows, keep), *inputs)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (N,)
    assert not ent.requires_grad  # a metric
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    assert len(grads) == len(ref_grads) == 2 + bias
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=False):
        torch.testing.assert_close(got, want, **TOL, msg=name)
    assert ent.min() > 0 and grads[1].abs().max() > 1e-3  # values that could have failed


def test_a_frozen_head_and_calls_without_a_graph() -> None:
    hidden, head, targets, weights = head_inputs(bias=True)
    head.requires_grad_(False)
    ref_lp, _, ref_grads = run(chunked(1.0, 5), hidden, head, targets, weights)
    lp, _, grads = run(fused(1.0, 5, keep=True), hidden, head, targets, weights)
    assert head.weight.grad is None and len(grads) == 1
    torch.testing.assert_close(grads[0], ref_grads[0], **TOL)
    with torch.no_grad():  # the reference model's and `TorchTrainer.logprobs`' calls
        lp_ng, ent_ng = fused_logprobs(hidden, head.weight, head.bias, targets, 1.0, 5, keep_logits=True)
    assert not lp_ng.requires_grad and torch.equal(lp_ng, lp)
    lp_nothing, _ = fused_logprobs(hidden.detach(), head.weight, head.bias, targets, 1.0, 5)
    assert lp_nothing.grad_fn is None and torch.equal(lp_nothing, lp)


class SavedBytes:
    """The tensors autograd saves for backward inside the block: (shape, dtype) of each."""

    def __enter__(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        self.saved: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda x: x)
        self.hooks.__enter__()
        return self.saved

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append((tuple(t.shape), t.dtype))
        return t

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)


def logits_like(saved: list[tuple[tuple[int, ...], torch.dtype]], dtype: torch.dtype) -> list:
    """Saved tensors of `dtype` with a vocabulary-wide last dimension and more than one row: logits, not the weight
    (which is [V, H]) nor a bias."""
    return [(s, d) for s, d in saved if d == dtype and len(s) >= 2 and s[-1] == V]


def test_nothing_vocabulary_wide_in_float32_is_saved_for_backward() -> None:
    hidden, head, targets, _ = head_inputs(bias=False)
    with SavedBytes() as saved:  # recompute: hidden, weight, targets and the logsumexp only
        fused_logprobs(hidden, head.weight, None, targets, 0.7, 5, keep_logits=False)
    assert sorted(saved, key=str) == sorted([((N, H), torch.float32), ((V, H), torch.float32), ((N,), torch.int64),
                                             ((N,), torch.float32)], key=str)
    bf16 = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16)
    with SavedBytes() as saved:  # kept: the chunks' logits in the model's dtype, never a float32 copy
        fused_logprobs(hidden.to(torch.bfloat16), bf16.weight, None, targets, 0.7, 5, keep_logits=True)
    assert logits_like(saved, torch.float32) == []
    assert sorted(s for s, _ in logits_like(saved, torch.bfloat16)) == [(3, V)] + [(5, V)] * 4
    with SavedBytes() as saved:  # the check bites: one chunk of today's head keeps float32 [N, V] tensors
        chunked_logprobs(hidden[None], targets[None], head, 0.7, True, 1 << 20, V)
    assert logits_like(saved, torch.float32)


def test_bf16_autocast_computes_the_head_as_autocast_would() -> None:
    """Under CPU bf16 autocast over float32 weights (the trainer's precision bf16), the logits are bf16 as with
    `nn.Linear` under autocast: the fused head agrees with the chunked one to bf16 rounding, far closer than to the
    float32 head, and returns float32 gradients for the float32 weight."""
    hidden, head, targets, weights = head_inputs(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_lp, _, ref_grads = run(chunked(1.0, 5), hidden, head, targets, weights)
        lp, _, grads = run(fused(1.0, 5, keep=True), hidden, head, targets, weights)
    fp32_lp, _, _ = run(fused(1.0, 5, keep=True), hidden, head, targets, weights)
    assert grads[1].dtype == torch.float32 and grads[0].dtype == torch.float32
    assert (lp - ref_lp).abs().max() < 1e-6 < (lp - fp32_lp).abs().max()
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_no_value_is_read_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward run on the meta device (tensors without data: any `.item()`, `bool(tensor)` or
    data-dependent shape would raise), in bf16 with CUDA's float32 `out_dtype` accumulation of the weight gradient
    (addmm's dtype_out has a meta kernel): the step holds no host sync."""
    monkeypatch.setattr(fused_head, "_OUT_DTYPE_DEVICES", frozenset({"cuda", "meta"}))
    n, h, v = 16384, 896, 151936  # the Qwen2-0.5B head at 16k tokens: free on meta
    hidden = torch.empty(n, h, device="meta", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.empty(v, h, device="meta", requires_grad=True)  # float32 master weight
    targets = torch.empty(n, device="meta", dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        logp, entropy = fused_logprobs(hidden, weight.to(torch.bfloat16).detach().requires_grad_(), None, targets,
                                       0.7, 441, keep_logits=True)
    logp.sum().backward()
    assert hidden.grad.shape == (n, h) and hidden.grad.dtype == torch.bfloat16
    logp, _ = fused_logprobs(hidden.float(), weight, None, targets, 1.0, 441)
    logp.sum().backward()
    assert weight.grad.shape == (v, h) and weight.grad.dtype == torch.float32


def test_compiles_whole_without_a_graph_break() -> None:
    """`torch.compile(fullgraph=True)` traces the op (forward and backward, the chunk loop unrolled) with no graph
    break, to the eager values; aot_eager: no C++ compiler needed (a few seconds, most of it dynamo's start)."""
    hidden, head, targets, weights = head_inputs(bias=True)

    def loss(h: torch.Tensor) -> torch.Tensor:
        return (weights * fused_logprobs(h, head.weight, head.bias, targets, 0.7, 5, keep_logits=True)[0]).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = compiled(hidden)
    got.backward()
    got_grads = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    want = loss(hidden)
    want.backward()
    torch.testing.assert_close(got.detach(), want.detach(), **TOL)
    for g, w in zip(got_grads, (hidden.grad, head.weight.grad), strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_bad_input_is_refused_naming_what_was_expected() -> None:
    hidden, head, targets, _ = head_inputs(bias=False)
    with pytest.raises(ValueError, match=r"expected targets \[23\]"):
        fused_logprobs(hidden, head.weight, None, targets[:-1])
    with pytest.raises(ValueError, match="chunk_rows: expected >= 1"):
        fused_logprobs(hidden, head.weight, None, targets, chunk_rows=0)
    with pytest.raises(ValueError, match=r"hidden \[N, H\] and weight \[V, H\]"):
        fused_logprobs(hidden[:, :-1], head.weight, None, targets)


# ------------------------------------------------------------------ through the model and the trainers


def tiny(tied: bool, seed: int = 0) -> PreTrainedModel:
    """A 2-layer, 32-wide random Qwen2 with 96 tokens, its head tied to the embedding or not."""
    cfg = AutoConfig.for_model("qwen2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                               vocab_size=96, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()


def rl_batch(seed: int = 0, rows: int = 6) -> TrainBatch:
    """Right-padded prompt + completion rows of different lengths, as the loop packs them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 14, (rows,), generator=g)
    ids = [torch.randint(1, 96, (int(n),), generator=g).tolist() for n in lengths]
    return pack([r[:3] for r in ids], [r[3:] for r in ids], 0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk_elements", [96 * 7, 1 << 26], ids=["7-rows", "one-chunk"])
def test_token_logprobs_fused_matches_the_chunked_head_on_a_model(tied: bool, chunk_elements: int) -> None:
    model = tiny(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    b = rl_batch()
    out = []
    for use in (False, True):
        model.zero_grad(set_to_none=True)
        logp, entropy = token_logprobs(model, b, 0.8, with_entropy=True, chunk_elements=chunk_elements, fused=use)
        (-(logp * b.loss_mask).sum() / b.loss_mask.sum()).backward()
        out.append((logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref_lp, ref_ent, ref_grads), (lp, ent, grads) = out
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **TOL, msg=name)


def test_token_logprobs_keeps_the_logits_where_they_fit_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within `keep_budget` (one chunk's 256 MB on the CPU) the chunks' logits are kept for backward; past it they
    are recomputed: nothing vocabulary-wide is saved."""
    model, b = tiny(tied=True), rl_batch()
    rows = b.loss_mask.numel()

    def saved_logits() -> list:
        with SavedBytes() as saved:
            token_logprobs(model, b, 1.0, with_entropy=True, chunk_elements=96 * 7, fused=True)
        return [s for s, d in saved if len(s) == 2 and s[-1] == 96 and s[0] <= 7]

    kept = saved_logits()
    assert sum(s[0] for s in kept) == rows
    monkeypatch.setattr(logprobs, "keep_budget", lambda device: rows * 96 * 4 - 1)  # one byte short
    assert saved_logits() == []


def pg_loss(logp: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """A policy-gradient loss with a different advantage per row (so every row's gradient counts)."""
    adv = torch.linspace(-1.0, 1.0, len(batch))[:, None]
    mask = batch.loss_mask.float()
    return -(adv * logp * mask).sum() / mask.sum(), {}


def trainer_step(make, fused: str, packing: str = "off") -> tuple[dict[str, float], torch.Tensor,
                                                                   dict[str, torch.Tensor]]:
    trainer = make(copy.deepcopy(tiny(tied=True)), fused, packing)
    b = rl_batch(1)
    before = trainer.logprobs(b)
    metrics = trainer.step(b, pg_loss)
    return metrics, before, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


TRAINERS = {
    "torch": lambda model, fused, packing: TorchTrainer(model, lr=1e-3, fused_head=fused, packing=packing),
    "distributed": lambda model, fused, packing: DistributedTrainer(model, lr=1e-3, fused_head=fused,
                                                                    packing=packing, grad_accum=2),
}


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Grows by one each time the fused op runs with a graph."""
    calls: list[int] = []
    real = fused_head._FusedHead.apply
    monkeypatch.setattr(fused_head._FusedHead, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("packing", ["off", "on"], ids=["padded", "packed"])
@pytest.mark.parametrize("kind", sorted(TRAINERS))
def test_trainer_fused_head_on_gives_the_loss_and_gradients_of_off(kind: str, packing: str,
                                                                   fused_calls: list[int]) -> None:
    off, off_lp, off_grads = trainer_step(TRAINERS[kind], "off", packing)
    assert fused_calls == []
    on, on_lp, on_grads = trainer_step(TRAINERS[kind], "on", packing)
    assert len(fused_calls) == (2 if kind == "distributed" else 1)  # a step's forward per micro-batch
    assert off["nonfinite"] == on["nonfinite"] == 0.0
    torch.testing.assert_close(on_lp, off_lp, **TOL)
    for key in ("loss", "entropy", "grad_norm"):
        assert on[key] == pytest.approx(off[key], rel=1e-6, abs=1e-6), key
    for name, g in on_grads.items():
        torch.testing.assert_close(g, off_grads[name], **TOL, msg=name)


@pytest.mark.parametrize("kind", sorted(TRAINERS))
def test_auto_on_the_cpu_is_the_chunked_path_bit_for_bit(kind: str, fused_calls: list[int]) -> None:
    """At "auto" the CPU trainers never enter the fused op, so their numbers are today's bit for bit (the
    quickstart's fingerprint and `make demo` figures stay)."""
    auto, auto_lp, auto_grads = trainer_step(TRAINERS[kind], "auto")
    assert fused_calls == []
    off, off_lp, off_grads = trainer_step(TRAINERS[kind], "off")
    assert torch.equal(auto_lp, off_lp) and auto == {**off, "train_s": auto["train_s"]}
    assert all(torch.equal(g, off_grads[n]) for n, g in auto_grads.items())


# ------------------------------------------------------------------ GPU only (skipped on the CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_auto_turns_it_on_without_a_host_sync_and_bf16_agrees(fused_calls: list[int]) -> None:
    """On a GPU under bf16 autocast: "auto" resolves to the fused op; the head's forward and backward run under
    `set_sync_debug_mode("error")` (a host sync raises); the log-probs, entropy and the weight gradient (float32,
    summed by addmm's `out_dtype`) agree with the chunked head within bf16 noise (vocabulary 32,000, 2 x 512
    tokens, 128 tokens a chunk)."""
    device = torch.device("cuda")
    cfg = AutoConfig.for_model("qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, vocab_size=32000, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device).train()
    assert TorchTrainer(model, lr=0.0).uses("fused_head")
    ids = torch.randint(0, 32000, (2, 512), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state.detach().requires_grad_()
    targets, chunk = ids[:, 1:], 32000 * 128
    out = {}
    for use in (False, True):
        model.zero_grad(set_to_none=True)
        hidden.grad = None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if use else "default")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if use:
                    logp, entropy = logprobs.fused_head_logprobs(hidden, model.lm_head, targets, 0.7, True, chunk)
                else:
                    logp, entropy = chunked_logprobs(hidden, targets, model.lm_head, 0.7, True, chunk, 32000,
                                                     drop_last=True)
            logp.mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out[use] = (logp.detach(), entropy, model.lm_head.weight.grad.clone(), hidden.grad.clone())
    assert len(fused_calls) == 1 and out[True][0].device.type == "cuda"
    assert out[True][2].dtype == torch.float32
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-2, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-2, rtol=0)
    for got, want in zip(out[True][2:], out[False][2:], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=5e-2)
