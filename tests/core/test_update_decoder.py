"""The rollout server's update decoder: full weights as before; LoRA adapters kept on their own version chain and
merged into the base weights the server started from, each version from the base; a delta against adapters the server
does not hold is a version mismatch (the server's 409)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from factory.config import LoraSpec
from factory.core.rollout.server.update_decoder import UpdateDecoder
from factory.core.weights import WeightVersionMismatch, encode_delta, encode_full
from factory.models import lora


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def step_adapters(model: torch.nn.Module, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return lora.adapter_state(model)


def test_adapter_updates_merge_from_the_base_and_deltas_need_their_base_version():
    trainer = tiny_llama()
    served = {k: v.clone() for k, v in trainer.state_dict().items()}  # the server starts from the base
    lora.attach(trainer, LoraSpec(r=4, alpha=8))
    decode = UpdateDecoder()
    v1 = step_adapters(trainer, 1)
    state, version = decode(bytes(encode_full(v1, 1).to_bytes()), served, 0)
    assert version == 1
    for k, v in lora.merged_copy(trainer).state_dict().items():
        assert torch.equal(state[k], v), k
    v2 = step_adapters(trainer, 2)
    delta = encode_delta(v1, v2, 2, base_version=1)
    assert delta.nbytes < sum(t.numel() * 4 for t in trainer.parameters())  # adapters only: far below the weights
    state, version = decode(bytes(delta.to_bytes()), state, 1)  # `current` is now v1's merged weights
    assert version == 2
    for k, v in lora.merged_copy(trainer).state_dict().items():
        assert torch.equal(state[k], v), k  # merged from the base copy, not on top of v1's merge
    stale = encode_delta(v1, step_adapters(trainer, 3), 3, base_version=1)  # against v1; the decoder holds v2
    with pytest.raises(WeightVersionMismatch, match="base v1"):
        decode(bytes(stale.to_bytes()), state, 2)


def test_full_weight_updates_decode_as_before():
    model = tiny_llama()
    current = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: v + 1 for k, v in current.items()}
    state, version = UpdateDecoder()(bytes(encode_delta(current, new, 5, base_version=4).to_bytes()), current, 4)
    assert version == 5 and all(torch.equal(state[k], new[k]) for k in new)
    with pytest.raises(WeightVersionMismatch):
        UpdateDecoder()(bytes(encode_delta(current, new, 5, base_version=4).to_bytes()), current, 3)


def test_the_rollout_server_takes_adapters_over_http_and_samples_the_merged_policy():
    import httpx

    from factory.core.rollout.engines.continuous import ContinuousEngine
    from factory.core.rollout.server.app import launch_server
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    engine = ContinuousEngine(build_model("micro", tok, seed=0), tok, max_batch=4, name="micro")  # the base
    trainer = build_model("micro", tok, seed=0)
    lora.attach(trainer, LoraSpec(r=4, alpha=8))
    with launch_server(engine) as handle:
        v1 = step_adapters(trainer, 1)
        r = httpx.post(handle.url + "/update_weights_from_delta", content=bytes(encode_full(v1, 1).to_bytes()),
                       timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == 1
        v2 = step_adapters(trainer, 2)
        body = bytes(encode_delta(v1, v2, 2, base_version=1).to_bytes())
        r = httpx.post(handle.url + "/update_weights_from_delta", content=body, timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == 2
        merged = lora.merged_copy(trainer).eval()
        for k, v in merged.state_dict().items():
            assert torch.equal(engine.model.state_dict()[k], v), k
        ids = torch.tensor([tok("12+34=").input_ids])
        with torch.no_grad():
            assert torch.equal(engine.model(input_ids=ids).logits, merged(input_ids=ids).logits)
        again = httpx.post(handle.url + "/update_weights_from_delta", content=body, timeout=30)
        assert again.status_code == 409  # the server's adapters are at v2 now: the trainer resends them in full
