"""A spec's blend played forward: realized vs target shares, the quota error bound, the picture."""

from pathlib import Path

import pytest

from factory.cockpit.blend_report import blend_report
from factory.cockpit.plots import PNG_SIGNATURE
from factory.config import load_spec, parse_spec
from factory.data.from_spec import open_sources

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
SOURCES = [{"name": "add2", "kind": "arithmetic", "op": "add", "digits": 2, "n": 300},
           {"name": "add3", "kind": "arithmetic", "op": "add", "digits": 3, "n": 300, "seed": 1}]


def spec(**data):
    d = load_spec(QUICKSTART).model_dump(mode="json")
    d["data"] = {"sources": SOURCES, **data}
    d["schedule"]["steps"], d["rollout"]["prompts_per_step"] = 10, 8
    return parse_spec(d, "test")


@pytest.mark.slow
def test_fixed_weights_are_met_within_one_prompt_at_every_prefix():
    s = spec(weights={"add2": 1.0, "add3": 3.0})
    r = blend_report(s, open_sources(s.resolved.blend))
    assert r.draws == 80 and r.at_steps == list(range(10))
    by = {x.name: x for x in r.sources}
    assert by["add2"].target == 0.25 and by["add3"].target == 0.75
    assert (by["add2"].draws, by["add3"].draws) == (20, 60)  # 80 draws split exactly
    assert by["add2"].realized == 0.25
    assert 0 < r.max_quota_error < 1
    for name in ("add2", "add3"):  # every cumulative share within one prompt of its target
        for k, (real, tgt) in enumerate(zip(r.realized[name], r.target[name], strict=True)):
            assert abs(real - tgt) * 8 * (k + 1) < 1


def test_a_schedule_shows_as_a_turn_in_the_target_and_the_stream_follows_it():
    s = spec(schedule={0: {"add2": 1.0, "add3": 0.0}, 5: {"add2": 0.0, "add3": 1.0}})
    r = blend_report(s, open_sources(s.resolved.blend))
    assert r.realized["add2"][:5] == [1.0] * 5 and r.target["add2"][:5] == [1.0] * 5
    assert r.realized["add2"][-1] == 0.5 == r.target["add2"][-1]  # 5 steps each
    assert r.realized["add3"][7] == r.target["add3"][7] == 3 / 8
    assert r.max_quota_error == 0.0  # one source at a time: never off


@pytest.mark.slow
def test_the_picture_is_a_deterministic_png_and_long_runs_are_sampled():
    s = spec(weights={"add2": 0.3, "add3": 0.7})
    sources = open_sources(s.resolved.blend)
    a, b = blend_report(s, sources, steps=1000, prompts_per_step=2), blend_report(s, sources)
    assert len(a.at_steps) <= 401 and a.at_steps[-1] == 999 and a.draws == 2000
    png = a.png()
    assert png.startswith(PNG_SIGNATURE) and png == blend_report(s, open_sources(s.resolved.blend), steps=1000,
                                                                 prompts_per_step=2).png()
    assert png != b.png()


def test_without_a_data_section_the_task_split_is_the_one_source():
    from factory.data.from_spec import task_source
    from factory.problem import Problem

    s = load_spec(QUICKSTART)
    train = [Problem(str(i), f"{i}+1=", str(i + 1), "add", 1, {}) for i in range(50)]
    r = blend_report(s, [task_source(s.task, train)], steps=3)
    assert [(x.name, x.realized, x.target) for x in r.sources] == [("arithmetic", 1.0, 1.0)]
