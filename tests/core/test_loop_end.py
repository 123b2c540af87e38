"""How the training loop ends is returned, not raised (`LoopEnd`): finished, stopped at a resume point (with who
asked), or stopped by non-finite updates; `train_rl` keeps raising what each stands for. A micro model, 2-3 steps."""

import pytest

from factory.config import parse_spec
from factory.core.loop import FINISHED, NON_FINITE, STOPPED, NonFiniteLoss, RunInterrupted, run_loop, train_rl
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(10)]


def spec(steps: int = 3, **task):
    return parse_spec({"seed": 0, "model": {"preset": "micro"}, "task": task,
                       "algorithm": {"group_size": 2, "lr": 0.01}, "ops": {"max_nonfinite_steps": 2},
                       "rollout": {"prompts_per_step": 2, "max_new_tokens": 3},
                       "trainer": {"threads": 1}, "schedule": {"steps": steps}})


class AskAfter:
    """A Checkpoints policy that asks the loop to stop after `after` steps, naming `cause`; keeps the points saved."""

    def __init__(self, after: int, cause: str | None):
        self.after, self.cause, self.saved, self.done = after, cause, [], 0

    def on_step(self, record) -> None:  # the loop's on_step: the run asks from there (its evals, its lake watch)
        self.done = record.step

    def due(self, done: int) -> bool:
        return False

    def stopping(self):
        return (self.cause or True) if self.done >= self.after else None

    def save(self, make_state, wait: bool = False) -> None:
        self.saved.append((make_state().step, wait))


def _model():
    tok = build_tokenizer()
    return build_model("micro", tok, seed=0), tok


def test_a_stop_asked_by_the_run_comes_back_as_its_end_with_who_asked():
    model, tok = _model()
    asked = AskAfter(1, "pruned")
    end = run_loop(spec(), model, tok, PROBLEMS, checkpoints=asked, on_step=asked.on_step)
    assert (end.kind, end.steps_done, end.cause, end.error) == (STOPPED, 1, "pruned", None)
    assert [r.step for r in end.records] == [1] and not end.finished
    assert asked.saved == [(1, True)]  # the resume point of the step it stopped after, waited for
    with pytest.raises(RunInterrupted, match="stopped on request after step 1; resume point written") as e:
        end.result()
    assert e.value.cause == "pruned"


def test_train_rl_still_raises_for_a_stop_and_returns_the_records_of_a_finished_loop():
    model, tok = _model()
    with pytest.raises(RunInterrupted) as e:
        asked = AskAfter(2, None)  # a policy that names no cause
        train_rl(spec(), model, tok, PROBLEMS, checkpoints=asked, on_step=asked.on_step)
    assert e.value.cause is None
    model, tok = _model()
    end = run_loop(spec(2), model, tok, PROBLEMS)
    assert (end.kind, end.steps_done, [r.step for r in end.records]) == (FINISHED, 2, [1, 2])
    assert end.result() is end.records


def test_non_finite_updates_end_the_loop_with_the_error_that_says_why():
    model, tok = _model()
    end = run_loop(spec(4, environment="tests.ops.faulty_envs:overflowing_reward"), model, tok, PROBLEMS)
    assert (end.kind, end.steps_done, end.cause) == (NON_FINITE, 2, None)
    assert isinstance(end.error, NonFiniteLoss) and "ops.max_nonfinite_steps = 2" in str(end.error)
    with pytest.raises(NonFiniteLoss):
        end.result()
