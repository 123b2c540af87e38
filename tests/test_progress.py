"""Progress of a stage: the ETA from the mean step time, the line and tags it shows, and the throttle."""

from factory.progress import Progress, Throttle, format_duration


def test_eta_is_the_mean_step_time_times_the_steps_left():
    p = Progress("grpo", step=10, steps=50, elapsed_s=20.0, reward=0.4123)
    assert p.eta_s == 80.0
    assert p.line() == "grpo step 10/50 reward 0.412 eta 1m20s"
    assert p.tags() == {"progress": "grpo 10/50", "eta": "1m20s", "reward": "0.412"}
    assert Progress("sft", 0, 50, 0.0).eta_s is None and Progress("sft", 0, 50, 0.0).tags()["eta"] == "?"
    # a step's completions that tripped a reward-hack detector show beside the reward in the Dagster UI
    assert Progress("grpo", 10, 50, 16.0, 0.412, hacks=3.0).tags()["hacks"] == "3"
    assert Progress("sft", 50, 50, 99.0).eta_s == 0.0


def test_a_stage_that_may_stop_early_shows_its_eta_as_a_bound_and_says_why():
    """SFT runs up to sft.steps but stops at stop_at_accuracy: the time to sft.steps is only an upper bound."""
    p = Progress("sft", step=100, steps=2500, elapsed_s=30.0, stops_at_accuracy=0.25)
    assert p.eta_s == 720.0
    assert p.tags()["eta"] == "≤ 12m00s (stops early at accuracy 0.25)"
    assert p.line() == "sft step 100/2500 eta ≤ 12m00s (stops early at accuracy 0.25)"
    # before the first step nothing is known, and at the end nothing is left: no bound to qualify
    assert Progress("sft", 0, 2500, 0.0, stops_at_accuracy=0.25).tags()["eta"] == "?"
    assert Progress("sft", 2500, 2500, 99.0, stops_at_accuracy=0.25).tags()["eta"] == "0s"


def test_durations_read_like_a_clock():
    assert [format_duration(s) for s in (None, 0, 42.4, 185, 3725)] == ["?", "0s", "42s", "3m05s", "1h02m"]


def test_throttle_reports_at_most_every_interval_and_always_the_last_step():
    now = [0.0]
    seen = []
    t = Throttle(lambda p: seen.append(p.step), every_s=5.0, clock=lambda: now[0])
    for step in range(1, 11):
        now[0] = step * 1.0  # one step a second
        t(Progress("grpo", step, 10, now[0]))
    assert seen == [1, 6, 10]
