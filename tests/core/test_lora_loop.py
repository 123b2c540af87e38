"""LoRA in the trainer and the loop, on tiny random-initialised models: the optimizer holds and steps only the
adapters (the base stays bit-identical), and in an overlapped run the engine, which receives only adapters and
merges them into its base copy, holds exactly the trainer's merged weights after each update."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from factory.config import LoraSpec, parse_spec
from factory.core.batch import pack
from factory.core.loop import make_producer, train_rl
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.models import lora
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem

# A completion is right exactly when its first token is <eos> (as in test_loop.py): mixed rewards from the start.
PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(10)]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def test_attach_freezes_the_base_and_the_trainer_steps_only_the_adapters():
    model = tiny_llama()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora.attach(model, LoraSpec(r=4, alpha=8))
    adapted = lora.lora_layers(model)
    # all-linear: the 7 projections of attention and MLP in each of 2 layers, not the (tied) output head
    assert len(adapted) == 14 and not any(n.endswith("lm_head") for n in adapted)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert lora.base_state(model).keys() == base.keys()
    trainer = TorchTrainer(model, lr=1e-2)
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if n in trainable}
    batch = pack([[2, 3, 4]] * 2, [[5, 6, 7], [8, 9, 10]], 0, {}, {"advantages": [1.0, -1.0]})

    def loss_fn(logp, mb):
        return -(logp * mb.per_seq["advantages"][:, None] * mb.loss_mask).sum() / mb.loss_mask.sum(), {}

    before = lora.adapter_state(model)
    trainer.step(batch, loss_fn)
    after = lora.adapter_state(model)
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.lora_B"],
                           after["model.layers.0.self_attn.q_proj.lora_B"])  # B moved off zero
    for k, v in lora.base_state(model).items():
        assert torch.equal(v, base[k]), k  # the frozen base, bit for bit
    assert len(trainer.optimizer.state) == len(trainable)  # AdamW moments for the adapters only


def test_an_overlapped_lora_run_publishes_adapters_and_the_engine_holds_the_merged_policy():
    tok = build_tokenizer()
    spec = parse_spec({"seed": 0, "model": {"preset": "micro"}, "algorithm": {"group_size": 4, "lr": 0.01},
                       "rollout": {"prompts_per_step": 4, "max_new_tokens": 3},
                       "trainer": {"threads": 1, "lora": {"r": 4, "alpha": 8}},
                       "schedule": {"steps": 3, "mode": "one_step_off", "wait_timeout_s": 120}})
    model = build_model("micro", tok, seed=0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    lora.attach(model, spec.trainer.lora)  # attached here to build the producer ourselves and keep its engine
    producer = make_producer(spec, model, tok, PROBLEMS, start_version=0)
    published: list[dict] = []
    merge = producer._merger.merge
    producer._merger.merge = lambda adapters, full=False: (published.append(adapters), merge(adapters, full))[1]
    records = train_rl(spec, model, tok, PROBLEMS, producer=producer)
    assert [r.step for r in records] == [1, 2, 3]
    # what crossed to the rollout side each version: the adapters alone, not one base weight
    assert len(published) == 3 and all(lora.is_adapter_state(p) for p in published)
    # sampler and trainer logprobs on the same tokens right after each publish (trainer: unmerged LoRA forward)
    assert max(r.logprob_mismatch for r in records) < 1e-4
    # train_rl leaves `model` plain and merged; the engine merged the last adapters into its own base copy
    engine = producer.engine.model.state_dict()
    assert list(model.state_dict()) == list(start)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # only adapted projections moved
    for k, v in model.state_dict().items():
        assert torch.equal(engine[k], v), k
    ids = torch.tensor([tok("3+3=").input_ids])
    with torch.no_grad():
        assert torch.equal(producer.engine.model(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


@pytest.mark.slow
def test_a_lora_run_with_the_rollout_server_sends_adapters_and_samples_the_current_policy():
    tok = build_tokenizer()
    spec = parse_spec({"seed": 0, "model": {"preset": "micro"}, "algorithm": {"group_size": 4, "lr": 0.01},
                       "rollout": {"prompts_per_step": 4, "max_new_tokens": 3, "engine": "server"},
                       "trainer": {"threads": 1, "lora": {"r": 4, "alpha": 8}},
                       "schedule": {"steps": 3, "mode": "one_step_off", "wait_timeout_s": 300}})
    model = build_model("micro", tok, seed=0)
    lora.attach(model, spec.trainer.lora)
    producer = make_producer(spec, model, tok, PROBLEMS, start_version=0)
    records = train_rl(spec, model, tok, PROBLEMS, producer=producer)
    assert [r.step for r in records] == [1, 2, 3]
    assert lora.is_adapter_state(producer._state)  # what the server was last sent: adapters, not weights
    # the server's samples are scored by the trainer's (unmerged LoRA) forward right after each publish
    assert max(r.logprob_mismatch for r in records) < 1e-4
