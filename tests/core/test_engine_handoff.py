"""The in-process handoff (issue 34, point 2): an engine takes each version by one in-place cast-copy of the
publisher's tensors into its own parameters (tied weights once, its own tensors not at all), a withdrawn update is
never applied, and `OverlappedProducer.publish` hands over the trainer's live tensors without a clone."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from factory.core.rollout.engines.sequences import load_state_dict_into
from tests.core.paged_models import paged_engine, perturbed, tiny, word_tokenizer


class Ops(TorchDispatchMode):
    """Counts the aten ops run under it (copy_, clone, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def storages(model: torch.nn.Module) -> int:
    return len({t.untyped_storage().data_ptr() for t in model.state_dict().values()})


def test_a_tied_model_takes_one_copy_per_storage_cast_into_its_own_tensors():
    engine_model = tiny("qwen2", tie_word_embeddings=True).to(torch.bfloat16)
    source = perturbed("qwen2")  # fp32, other values
    source.lm_head.weight = source.model.embed_tokens.weight  # tied like the engine's
    state = source.state_dict()
    assert "lm_head.weight" in state and storages(engine_model) == len(state) - 1
    ptrs = {k: v.data_ptr() for k, v in engine_model.state_dict().items()}
    with Ops() as ops:
        load_state_dict_into(engine_model, state)
    assert ops.counts.get("copy_", 0) == len(state) - 1  # the tied head is not copied a second time
    assert {k: v.data_ptr() for k, v in engine_model.state_dict().items()} == ptrs  # in place
    for k, v in engine_model.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, state[k].to(torch.bfloat16)), k


def test_entries_that_are_the_engines_own_tensors_are_not_copied_and_misfits_copy_nothing():
    model = tiny("llama")
    own = model.state_dict()
    new_q = torch.full_like(own["model.layers.0.self_attn.q_proj.weight"], 0.5)
    with Ops() as ops:  # the LoRA merge's shape: the engine's own tensors plus the merged ones
        load_state_dict_into(model, {**own, "model.layers.0.self_attn.q_proj.weight": new_q})
    assert ops.counts.get("copy_", 0) == 1
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, new_q)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrong = {**{k: torch.zeros_like(v) for k, v in own.items()}, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"size mismatch for model\.norm\.weight: \(3,\) into \(64,\)"):
        load_state_dict_into(model, wrong)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        load_state_dict_into(model, {k: v for k, v in own.items() if k != "model.norm.weight"})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing half-copied


def test_a_withdrawn_update_is_never_applied():
    tok = word_tokenizer()
    eng = paged_engine(tiny("llama"), tok)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    fut = eng.update_weights(perturbed("llama").state_dict(), 1, "in_flight")
    assert fut.cancel()  # not begun: the publisher may withdraw it
    eng.step()
    assert eng.weight_version == 0
    assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())
    applied = eng.update_weights(perturbed("llama").state_dict(), 2, "in_flight")
    eng.step()
    assert applied.result(timeout=0) == 2 and not applied.cancel()  # once applied it cannot be withdrawn


def test_handed_over_withdraws_an_update_the_engine_has_not_begun():
    from factory.core.producers.overlapped import _handed_over

    pending = Future()
    with pytest.raises(TimeoutError, match="did not apply the weight update within 0s.*withdrawn"):
        _handed_over(pending, timeout=0.01)
    assert pending.cancelled()
    begun = Future()
    assert begun.set_running_or_notify_cancel()  # the engine is copying: publish waits for it to finish
    begun.set_result(3)
    _handed_over(begun, timeout=0.01)


@pytest.mark.parametrize("mode", ["in_flight", "finish_old"])
def test_publish_hands_the_live_tensors_over_without_a_clone(mode):
    from factory.config import parse_spec
    from factory.core.producers.overlapped import OverlappedProducer
    from factory.data.feed import feed_of
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer
    from factory.problem import Problem

    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    problems = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(4)]
    spec = parse_spec({"seed": 0, "model": {"preset": "micro"}, "algorithm": {"group_size": 2},
                       "rollout": {"prompts_per_step": 1, "max_new_tokens": 2, "concurrency": 1,
                                   "update_mode": mode},
                       "trainer": {"threads": 1}, "schedule": {"mode": "async", "steps": 2, "wait_timeout_s": 60}})
    producer = OverlappedProducer(spec, model, tok, feed_of(problems, 0), 0)
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        with Ops() as ops:
            producer.publish(model, 1)
        assert ops.counts.get("clone", 0) == 0  # the caller's side (the copies run on the engine's thread)
        assert producer.engine.weight_version == 1
        mine = producer.engine.model.state_dict()
        assert all(torch.equal(mine[k], v.to(mine[k].dtype)) for k, v in model.state_dict().items())
        held = {k: v.clone() for k, v in mine.items()}
        with torch.no_grad():  # the trainer's next step: the engine's copy does not follow it
            for p in model.parameters():
                p.add_(1.0)
        assert all(torch.equal(v, held[k]) for k, v in producer.engine.model.state_dict().items())
    finally:
        producer.close()
