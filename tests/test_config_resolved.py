"""`spec.resolved`: the cross-section defaults (device, precision, engine numerics, gap bound) worked out once at
validation, as the components used to work them out where they were used, and absent from the spec's dumps."""

from __future__ import annotations

import copy
import inspect
import itertools
import pickle
from pathlib import Path

import pytest

from factory.config import SpecError, load_spec, parse_spec
from factory.config.ops import GAP_BOUND_OTHER_NUMERICS, GAP_BOUND_SAME_NUMERICS
from factory.core import loop
from factory.core.buffer import RolloutBuffer
from factory.core.trainer import ranks

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def _old_engine_differs(spec: dict, device_type: str) -> bool:
    # core/correction.engine_differs as it was before the view (efceeb9), over the raw sections
    r, t, mode = spec.get("rollout", {}), spec.get("trainer", {}), spec.get("schedule", {}).get("mode", "sync")
    if device_type != "cpu" or r.get("round_weights") is not None or t.get("precision", "fp32") != "fp32":
        return True
    return mode != "sync" and r.get("engine", "embedded") in ("server", "sglang")


@pytest.mark.parametrize(("mode", "engine", "precision", "round_weights"), [
    c for c in itertools.product(("sync", "one_step_off", "async"), ("embedded", "server", "sglang"),
                                 ("fp32", "bf16"), (None, "bf16"))
    if not (c[3] is not None and c[1] != "embedded" and c[0] != "sync")])  # round_weights: in-process engines only
def test_engine_numerics_resolve_as_the_components_worked_them_out(mode, engine, precision, round_weights) -> None:
    raw = {"schedule": {"mode": mode}, "rollout": {"engine": engine, "round_weights": round_weights},
           "trainer": {"precision": precision}}
    r = parse_spec(raw).resolved
    for device_type in ("cpu", "cuda"):
        differs = _old_engine_differs(raw, device_type)
        assert r.engine_differs(device_type) == differs
        assert r.logprob_gap_bound(device_type) == (GAP_BOUND_OTHER_NUMERICS if differs else GAP_BOUND_SAME_NUMERICS)
    assert r.precision == precision
    bounded = parse_spec({**raw, "ops": {"max_logprob_gap": 0.25}}).resolved
    assert bounded.logprob_gap_bound("cpu") == bounded.logprob_gap_bound("cuda") == 0.25


def test_the_device_is_the_placed_trainer_gpu_and_a_contradiction_is_refused_at_validation() -> None:
    assert (parse_spec({}).resolved.device, parse_spec({}).resolved.device_field) == ("auto", "device")
    assert parse_spec({"device": "cpu"}).resolved.device == "cpu"
    placed = parse_spec({"trainer": {"devices": [2]}}).resolved
    assert (placed.device, placed.device_field) == ("cuda:2", "trainer.devices")
    assert parse_spec({"device": "cuda:2", "trainer": {"devices": [2]}}).resolved.device == "cuda:2"
    # ranks of a multi-process trainer are placed by trainer.devices themselves: the run's device stays `device`
    ranks = parse_spec({"device": "cpu", "trainer": {"world_size": 2, "devices": [0, 1]}}).resolved
    assert ranks.device == "cpu"
    with pytest.raises(SpecError, match=r"trainer.devices: \[1\] places the one trainer process on cuda:1, but "
                                        r"device is 'cuda:0'"):
        parse_spec({"device": "cuda:0", "trainer": {"devices": [1]}})


def test_an_assigned_section_re_resolves() -> None:
    s = parse_spec({})
    assert not s.resolved.numerics_differ
    s.trainer = s.trainer.model_copy(update={"precision": "bf16"})  # validate_assignment reruns the validator
    assert s.resolved.numerics_differ and s.resolved.precision == "bf16"
    # a spec handed to another process or copied keeps its view (a private attribute travels with the model)
    assert pickle.loads(pickle.dumps(s)).resolved == copy.deepcopy(s).resolved == s.resolved


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_view_is_not_in_the_dump(path: Path) -> None:
    s = load_spec(path)
    assert s.resolved is not None
    dumped = s.to_json()
    assert "resolved" not in dumped and "numerics_differ" not in dumped
    assert parse_spec(s.model_dump(mode="json")).fingerprint() == s.fingerprint()


def test_the_quickstart_fingerprint_is_what_it_was() -> None:
    assert load_spec(Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml").fingerprint() \
        == "96eec83d19b10919"


def test_the_cuda_settings_and_the_blend_seed_resolve_across_sections() -> None:
    assert parse_spec({}).resolved.cuda_asked == ()
    asked = parse_spec({"device": "cuda:1", "trainer": {"world_size": 2, "devices": [0, 1]},
                        "schedule": {"mode": "async"},
                        "rollout": {"engine": "sglang", "devices": [2], "sglang": {}}}).resolved.cuda_asked
    assert asked == (("device", "cuda:1"), ("trainer.devices", "[0, 1]"), ("rollout.devices", "[2]"))
    assert parse_spec({"trainer": {"backend": "megatron"}}).resolved.cuda_asked == (("trainer.backend", "megatron"),)
    assert parse_spec({"seed": 7}).resolved.blend.seed == 7  # no data section: the spec's seed
    blend = {"sources": [{"name": "a", "kind": "arithmetic", "op": "add", "digits": 1, "n": 64}]}
    assert parse_spec({"seed": 7, "data": blend}).resolved.blend.seed == 7
    assert parse_spec({"seed": 7, "data": {**blend, "seed": 3}}).resolved.blend.seed == 3


@pytest.mark.parametrize("raw", [
    {"schedule": {"mode": "one_step_off"}, "rollout": {"prompts_per_step": 3}},
    {"schedule": {"mode": "async"}, "buffer": {"policy": "reject", "max_staleness": 0}},
    {"schedule": {"mode": "async"}, "buffer": {"max_staleness": 2}, "rollout": {"prompts_per_step": 2}},
    {"schedule": {"mode": "async"}, "buffer": {"depth": 3}, "rollout": {"concurrency": 5}},
], ids=["one_step_off", "async-reject-0", "async-bound-2", "async-set"])
def test_the_buffer_and_the_groups_in_flight_resolve_as_the_producer_builds_them(raw: dict) -> None:
    s = parse_spec(raw)
    r = s.resolved
    built = RolloutBuffer.from_spec(r.buffer, groups_per_step=s.rollout.prompts_per_step)  # OverlappedProducer's
    assert r.buffer_depth == built.capacity
    assert r.concurrency == (s.rollout.concurrency or built.capacity)
    if s.schedule.mode == "one_step_off":  # whatever the buffer section says, one step off is one version deep
        assert (r.buffer.policy, r.buffer.max_staleness) == ("bound", 1)


def test_off_policy_is_staleness_or_a_gap_and_one_answer_for_every_rank() -> None:
    """The dual clip's default follows `off_policy`: the leader's loss (core/loop.py) and a follower rank's
    (trainer/ranks.py `follow`) both ask `spec.resolved`, so they cannot disagree as they did when `follow` built its
    loss without it."""
    assert parse_spec({}).resolved.off_policy("cpu") is False
    assert parse_spec({}).resolved.off_policy("cuda") is True  # the engine computes otherwise on a GPU
    assert parse_spec({"schedule": {"mode": "one_step_off"}}).resolved.off_policy("cpu") is True
    assert parse_spec({"trainer": {"precision": "bf16"}}).resolved.off_policy("cpu") is True
    for module in (loop, ranks):
        assert "off_policy=spec.resolved.off_policy(" in inspect.getsource(module)
