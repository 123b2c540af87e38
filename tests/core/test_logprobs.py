"""Chunked target log-probs (factory/core/trainer/logprobs.py): the same log-probs, entropy and parameter gradients
as the previous full-vocabulary computation (kept in benchmarks/logprob_memory.py as the reference) on small random
Llama, Qwen2, GPT-2, Gemma2 (final logit softcapping), Cohere (a logit scale: the whole-model path) and LoRA models;
no full-vocabulary tensor saved for backward; and optional activation checkpointing."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from factory.config import LoraSpec, parse_spec
from factory.core.batch import TrainBatch, pack
from factory.core.trainer.logprobs import PLAIN_HEADS, enable_activation_checkpointing, token_logprobs
from factory.core.trainer.torch_trainer import token_logprobs as trainer_token_logprobs
from tests.core.tiny_models import spread_weights

reference = importlib.import_module("benchmarks.logprob_memory").old_token_logprobs

VOCAB, B, T = 96, 3, 12


def tiny(arch: str, seed: int = 0, **extra) -> PreTrainedModel:
    """A 2-layer, 32-wide random model of `arch`; large weights so the log-probs spread."""
    if arch == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, **extra)
    else:
        cfg = AutoConfig.for_model(arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64,
                                   vocab_size=VOCAB, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return spread_weights(model, seed).train()


def batch(seed: int = 0) -> TrainBatch:
    """Right-padded rows of different lengths, as `batch.pack` lays them out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    lengths = torch.tensor([T, T - 4, T - 7])
    attention = (torch.arange(T)[None, :] < lengths[:, None]).long()
    ids = ids * attention
    return TrainBatch(ids, attention, attention[:, 1:].bool())


ARCHS = {  # arch -> config extras
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "gpt2": {},
    "gemma2": {"final_logit_softcapping": 2.0, "tie_word_embeddings": True},
    "cohere": {"logit_scale": 0.5},  # not a plain head: run whole, logits chunked
}


def grads_of(model: PreTrainedModel, impl, temperature: float, **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    b = batch()
    torch.manual_seed(7)  # GPT-2 trains with dropout: the same masks for every implementation
    logp, entropy = impl(model, b, temperature, with_entropy=True, **kw)
    weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)  # a loss that weighs every position differently
    (weights * logp * b.loss_mask).sum().backward()
    return logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                             if p.grad is not None}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("chunk_elements", [VOCAB * 5, 1 << 26])  # 5 token rows a chunk; the whole batch at once
def test_logprobs_entropy_and_gradients_match_the_full_vocabulary_computation(arch: str, chunk_elements: int) -> None:
    model = tiny(arch, **ARCHS[arch])
    if arch == "gemma2":
        assert model.config.final_logit_softcapping == 2.0
    old_lp, old_ent, old_grads = grads_of(model, reference, 0.7)
    lp, ent, grads = grads_of(model, token_logprobs, 0.7, chunk_elements=chunk_elements)
    assert lp.shape == ent.shape == (B, T - 1)
    torch.testing.assert_close(lp, old_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, old_ent, atol=1e-5, rtol=0)
    assert grads.keys() == old_grads.keys() and len(grads) > 4
    for name, g in grads.items():
        torch.testing.assert_close(g, old_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_one_chunk_is_the_previous_computation_bit_for_bit() -> None:
    """A batch that fits one chunk (every preset's) gives the same bits as before on the CPU, log-probs and
    gradients: the quickstart's numbers do not move. (Taking the head over the target rows only, [B, T-1], was off
    by float reassociation here.)"""
    from factory.models.build import build_model
    from factory.models.tokenizer import tokenizer_for

    tok = tokenizer_for("arithmetic")
    model = build_model("tiny", tok, seed=0).train()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(6, 18, (64,), generator=g)
    rows = [torch.randint(3, len(tok), (int(n),), generator=g).tolist() for n in lengths]
    b = pack([r[:4] for r in rows], [r[4:] for r in rows], tok.pad_token_id)
    results = []
    for impl in (reference, token_logprobs):
        model.zero_grad(set_to_none=True)
        logp, entropy = impl(model, b, 1.0, with_entropy=True)
        (-(logp * b.loss_mask).sum() / b.loss_mask.sum()).backward()
        results.append((logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (old_lp, old_ent, old_grads), (lp, ent, grads) = results
    assert torch.equal(lp, old_lp) and torch.equal(ent, old_ent)
    assert all(torch.equal(a, c) for a, c in zip(grads, old_grads, strict=True))


def test_softcapping_and_logit_scale_are_applied() -> None:
    """Without Gemma's softcap (or Cohere's scale) the log-probs differ: the tests above would notice a head that
    skipped them."""
    capped = tiny("gemma2", **ARCHS["gemma2"])
    lp, _ = token_logprobs(capped, batch())
    capped.config.final_logit_softcapping = None
    assert (token_logprobs(capped, batch())[0] - lp).abs().max() > 1e-2


@pytest.mark.parametrize("arch,plain", [("qwen2", True), ("gpt2", True), ("gemma2", True), ("cohere", False)])
def test_known_heads_never_build_the_full_logits(arch: str, plain: bool) -> None:
    """A plain head goes through the decoder and the head per chunk: the causal-LM forward (which returns [B, T, V]
    logits) is not called; an unknown head is run whole."""
    model = tiny(arch, **ARCHS[arch])
    assert (type(model).__name__ in PLAIN_HEADS) == plain
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    token_logprobs(model, batch())
    assert len(calls) == (0 if plain else 1)


def test_a_wrapper_is_run_through_its_own_forward() -> None:
    """DDP and FSDP wrap the model and must see the forward; anything not in PLAIN_HEADS is called whole."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.module = inner

        def forward(self, **kw):
            return self.module(**kw)

    model = tiny("qwen2", **ARCHS["qwen2"])
    calls: list[int] = []
    wrapped = Wrapper(model)
    wrapped.register_forward_hook(lambda *_: calls.append(1))
    lp, _ = token_logprobs(wrapped, batch())
    assert calls == [1]
    torch.testing.assert_close(lp, reference(model, batch())[0], atol=1e-5, rtol=0)


def test_no_full_vocabulary_tensor_is_saved_for_backward() -> None:
    """What backward keeps: nothing as large as the [B, T-1, V] log-softmax the old computation saved (it failed
    here); at most a chunk's worth of vocabulary rows."""
    model = tiny("qwen2", **ARCHS["qwen2"])
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = token_logprobs(model, batch(), with_entropy=True, chunk_elements=VOCAB * 4)
    assert len(shapes) > 10  # the decoder's saved activations were seen
    over_vocab = [s for s in shapes if s and s[-1] == VOCAB]
    assert all(torch.Size(s).numel() <= 4 * VOCAB for s in over_vocab), over_vocab
    assert logp.requires_grad and not entropy.requires_grad  # the entropy is a metric: no graph kept for it


def test_no_grad_gives_the_same_numbers_without_a_graph() -> None:
    model = tiny("gpt2").eval()
    lp, ent = token_logprobs(model, batch(), 1.3, with_entropy=True, chunk_elements=VOCAB * 3)
    with torch.no_grad():
        lp2, ent2 = token_logprobs(model, batch(), 1.3, with_entropy=True, chunk_elements=VOCAB * 3)
    assert not lp2.requires_grad
    torch.testing.assert_close(lp2, lp.detach(), atol=0, rtol=0)
    torch.testing.assert_close(ent2, ent, atol=0, rtol=0)
    assert token_logprobs(model, batch())[1] is None


def test_the_trainer_keeps_its_token_logprobs() -> None:
    model = tiny("llama", **ARCHS["llama"])
    lp, ent = trainer_token_logprobs(model, batch(), 0.9, with_entropy=True)
    old_lp, old_ent = reference(model, batch(), 0.9, with_entropy=True)
    torch.testing.assert_close(lp, old_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, old_ent.detach(), atol=1e-5, rtol=0)


def test_lora_adapters_get_the_same_gradients() -> None:
    from factory.models.lora import attach

    model = tiny("qwen2", **ARCHS["qwen2"])
    attach(model, LoraSpec(r=4, alpha=8.0))
    with torch.no_grad():  # B starts at zero; make the adapters matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    old_lp, _, old_grads = grads_of(model, reference, 1.0)
    lp, _, grads = grads_of(model, token_logprobs, 1.0, chunk_elements=VOCAB * 5)
    torch.testing.assert_close(lp, old_lp, atol=1e-5, rtol=0)
    assert grads.keys() == old_grads.keys() and all("lora_" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, old_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_bad_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_elements"):
        token_logprobs(tiny("gpt2"), batch(), chunk_elements=0)


# ------------------------------------------------------------------ activation checkpointing


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    plain = tiny("qwen2", **ARCHS["qwen2"])
    lp, _, grads = grads_of(plain, token_logprobs, 1.0)
    enable_activation_checkpointing(plain)
    assert any(getattr(m, "gradient_checkpointing", False) for m in plain.modules())
    lp2, _, grads2 = grads_of(plain, token_logprobs, 1.0)
    torch.testing.assert_close(lp2, lp, atol=0, rtol=0)
    for name, g in grads.items():
        torch.testing.assert_close(grads2[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_activation_checkpointing_with_lora_adapters() -> None:
    from factory.models.lora import attach

    model = tiny("llama", **ARCHS["llama"])
    attach(model, LoraSpec(r=4, alpha=8.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    _, _, grads = grads_of(model, token_logprobs, 1.0)
    enable_activation_checkpointing(model)
    _, _, grads2 = grads_of(model, token_logprobs, 1.0)
    assert grads.keys() == grads2.keys() and all("lora_" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(grads2[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_activation_checkpointing_refuses_a_model_that_cannot() -> None:
    with pytest.raises(ValueError, match="trainer.activation_checkpointing: Linear"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def _spec(**trainer):
    return parse_spec({"trainer": trainer})


def test_the_setting_is_late_and_refused_with_megatron() -> None:
    assert _spec().trainer.activation_checkpointing is False
    assert "activation_checkpointing" not in _spec().to_json()  # a late field: unset, fingerprints stay
    assert '"activation_checkpointing": true' in _spec(activation_checkpointing=True).to_json()
    with pytest.raises(ValueError, match="trainer.activation_checkpointing"):
        _spec(activation_checkpointing=True, backend="megatron")


def test_make_trainer_turns_it_on() -> None:
    from factory.core.trainer.ranks import make_trainer

    model = tiny("qwen2", **ARCHS["qwen2"])
    make_trainer(_spec(activation_checkpointing=True), model)
    assert model.model.gradient_checkpointing and model.model.layers[0].gradient_checkpointing
    other = tiny("qwen2", **ARCHS["qwen2"])
    make_trainer(_spec(), other)
    assert not other.model.layers[0].gradient_checkpointing


# ------------------------------------------------------------------ GPU only (skipped on the CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_under_bf16_autocast_the_numbers_match_and_the_peak_drops() -> None:
    """On a GPU, as `DistributedTrainer` runs it with precision bf16: the log-probs follow the model's device, match
    the old computation within bf16 noise, and one micro-batch's peak allocation is lower (vocabulary 32,000)."""
    device = torch.device("cuda")
    cfg = AutoConfig.for_model("qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, vocab_size=32000, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device).train()
    ids = torch.randint(0, 32000, (2, 512), generator=torch.Generator().manual_seed(0)).to(device)
    b = TrainBatch(ids, torch.ones_like(ids), torch.ones(2, 511, dtype=torch.bool, device=device))
    out = {}
    chunked = lambda m, b, t, with_entropy: token_logprobs(m, b, t, with_entropy, chunk_elements=32000 * 128)  # noqa: E731
    for name, impl in (("old", reference), ("new", chunked)):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, entropy = impl(model, b, 1.0, with_entropy=True)
        (-(logp * b.loss_mask).sum() / b.loss_mask.sum()).backward()
        torch.cuda.synchronize()
        out[name] = (logp.detach(), entropy.detach(), torch.cuda.max_memory_allocated() - base)
    assert out["new"][0].device.type == "cuda"
    torch.testing.assert_close(out["new"][0], out["old"][0], atol=1e-2, rtol=0)
    torch.testing.assert_close(out["new"][1], out["old"][1], atol=1e-2, rtol=0)
    assert out["new"][2] < out["old"][2] / 2
