"""The prompt feed (blender + curriculum): exactly-once across a resume in a fresh process, skips, weights moved
by a level curriculum, and the state a resume point holds."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import pytest

from factory.config import apply_overrides, parse_spec
from factory.data.feed import make_feed

SOURCES = [
    {"name": "easy", "kind": "arithmetic", "op": "add", "digits": 1, "n": 40, "block_rows": 16},
    {"name": "mid", "kind": "arithmetic", "op": "add", "digits": 2, "n": 60, "block_rows": 16},
    {"name": "hard", "kind": "arithmetic", "op": "add", "digits": 4, "n": 80, "block_rows": 16},
]
CURRICULA = {
    "none": {},
    "online": {"kind": "online", "attempts": 1, "retry_after": 400},
    "priority": {"kind": "priority", "floor": 0.1},
    "level": {"kind": "level", "levels": ["easy", "mid", "hard"], "threshold": 0.9, "window": 16, "review": 0.2},
}
PER_STEP, G = 4, 4


def spec(curriculum: dict):
    return apply_overrides(parse_spec({"seed": 3}), {"data": {"sources": SOURCES, "curriculum": curriculum,
                                                              "weights": {"easy": 1, "mid": 2, "hard": 1}}})


class FakeGroup:
    """What the feed reads of a trained group: its draw and its samples' rewards."""

    def __init__(self, draw: int, rewards: list[float]):
        self.meta = {"draw": draw}
        self.samples = [type("S", (), {"reward": r})() for r in rewards]


def rewards_for(problem) -> list[float]:
    """A fixed outcome per prompt: easy always solved, hard never, mid depending on the prompt."""
    if problem.digits == 1:
        return [1.0] * G
    if problem.digits == 4:
        return [0.0] * G
    k = zlib.crc32(problem.id.encode()) % (G + 1)
    return [1.0] * k + [0.0] * (G - k)


def play(feed, steps: range, in_flight: list, log: list) -> list:
    """One-step-off consumer: each step draws PER_STEP prompts and trains the previous step's. Returns what is in
    flight at the end (drawn, not trained)."""
    for step in steps:
        drawn = [feed.draw(step) for _ in range(PER_STEP)]
        feed.trained([FakeGroup(k, rewards_for(p)) for k, p in in_flight])
        log += [(k, p.id) for k, p in in_flight]
        in_flight = drawn
    return in_flight


RESUME = """
import json, sys
from tests.data.test_feed import spec, play, FakeGroup
from factory.data.feed import make_feed
args = json.loads(sys.argv[1])
feed = make_feed(spec(args["curriculum"]).resolved.blend)
feed.load_state_dict(json.loads(open(args["state"]).read()))
pending = [feed.draw(args["step"] - 1) for _ in args["pending"]]  # served again first, in order
assert [k for k, _ in pending] == args["pending"], ([k for k, _ in pending], args["pending"])
log = []
rest = play(feed, range(args["step"], args["steps"]), pending, log)
print(json.dumps({"log": log, "in_flight": [k for k, _ in rest], "metrics": feed.metrics()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CURRICULA))
def test_a_resume_in_a_fresh_process_trains_the_prompts_of_an_uninterrupted_run(tmp_path, name):
    steps, cut = 40, 17
    straight: list = []
    rest_straight = play(make_feed(spec(CURRICULA[name]).resolved.blend), range(steps), [], straight)

    before: list = []
    feed = make_feed(spec(CURRICULA[name]).resolved.blend)
    in_flight = play(feed, range(cut), [], before)
    state = feed.state_dict()
    assert state["pending"] == [k for k, _ in in_flight]  # groups in flight at the checkpoint
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))  # what a resume point holds (JSON)
    args = {"curriculum": CURRICULA[name], "state": str(path), "step": cut, "steps": steps,
            "pending": state["pending"]}
    out = subprocess.run([sys.executable, "-c", RESUME, json.dumps(args)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    after = json.loads(out.stdout)
    resumed = before + [tuple(x) for x in after["log"]]
    assert resumed == straight  # the same prompts, in the same order: none twice, none skipped
    assert after["in_flight"] == [k for k, _ in rest_straight]
    draws = [k for k, _ in resumed]
    assert len(draws) == len(set(draws))
    if name == "none":  # nothing skipped: the trained draws are exactly 0..n-1
        assert draws == list(range(len(draws)))
    if name != "none":
        assert after["metrics"] == make_metrics(name, steps)


def make_metrics(name: str, steps: int) -> dict:
    feed = make_feed(spec(CURRICULA[name]).resolved.blend)
    play(feed, range(steps), [], [])
    return feed.metrics()


def teaches(problem) -> bool:
    return len(set(rewards_for(problem))) > 1  # mixed outcomes: non-zero advantages


@pytest.mark.slow
def test_an_online_curriculum_spends_rollouts_on_prompts_that_still_teach():
    never_retry = {**CURRICULA["online"], "retry_after": 0}
    feeds = {"none": make_feed(spec({}).resolved.blend), "online": make_feed(spec(never_retry).resolved.blend),
             "priority": make_feed(spec(CURRICULA["priority"]).resolved.blend)}
    share = {}
    for n, feed in feeds.items():
        log: list = []
        problems = {}
        orig = feed.draw

        def draw(step, orig=orig, problems=problems):
            k, p = orig(step)
            problems[k] = p
            return k, p

        feed.draw = draw
        play(feed, range(400), [], log)
        share[n] = sum(teaches(problems[k]) for k, _ in log) / len(log)
    # by weight, mid is half of the blend and 3 of its 5 outcome kinds are mixed: 0.3 of groups teach
    assert share["none"] == pytest.approx(0.3, abs=0.05)
    # once the always- and never-solved prompts are dropped (after one epoch of each source), nearly all do
    assert share["online"] > 0.75
    assert share["priority"] > share["none"] + 0.1
    assert feeds["online"].metrics()["data/skipped"] > 0


def test_a_level_curriculum_moves_the_blend_weights():
    feed = make_feed(spec(CURRICULA["level"]).resolved.blend)
    assert feed.blender.weights() == {"easy": 1.0, "mid": 0.0, "hard": 0.0}
    log: list = []
    play(feed, range(30), [], log)
    w = feed.blender.weights()
    assert w["easy"] == pytest.approx(0.2) and w["mid"] == pytest.approx(0.8)  # easy passed; mid is not reached
    assert {pid[:4] for _, pid in log[-8:]} <= {"add1", "add2"}


def test_a_feed_state_from_another_curriculum_is_refused():
    feed = make_feed(spec(CURRICULA["online"]).resolved.blend)
    play(feed, range(3), [], [])
    state = feed.state_dict()
    with pytest.raises(ValueError, match="curriculum"):
        make_feed(spec(CURRICULA["none"]).resolved.blend).load_state_dict(state)
