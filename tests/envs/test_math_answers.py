"""The math_verify verifier: the final answer (last \\boxed{}, else last <answer>) against the gold answer by
math-verify, bounded in time on and off the main thread, never raising."""

from __future__ import annotations

import threading

import pytest

from factory.envs.math_answers import final_answer, last_boxed, math_verify_reward
from factory.envs.tasks import verify
from factory.problem import Problem


def row(answer: str) -> Problem:
    return Problem("m-1", "What is half of one?", answer, "math_verify", 0, {"source": "m", "verifier": "math_verify"})


def test_the_final_answer_is_the_last_balanced_box_else_the_last_answer_tag():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{3} and an unclosed \boxed{4") == "3"
    assert last_boxed("no box") is None
    assert final_answer("<answer>7</answer> later <answer> 8 </answer>") == "8"
    assert final_answer(r"<answer>7</answer> \boxed{9}") == "9"
    assert final_answer("the answer is 12") is None


@pytest.mark.parametrize(("gold", "completion", "reward"), [
    (r"\frac{1}{2}", r"So it is \boxed{0.5}.", 1.0),
    (r"\frac{1}{2}", r"\boxed{\frac{2}{4}}", 1.0),
    ("1/2", "<answer>\\frac12</answer>", 1.0),
    ("x^2+1", r"\boxed{1 + x^2}", 1.0),
    (r"\frac{1}{2}", r"\boxed{0.4}", 0.0),
    (r"\frac{1}{2}", r"0.5 is it (no final answer form)", 0.0),
    # the whole text is not the answer: an earlier box is not what counts
    (r"\frac{1}{2}", r"not \boxed{0.5} but \boxed{2}", 0.0),
    ("42", r"\boxed{\frac{}{}}{{{", 0.0),
])
def test_correct_answers_score_1_and_wrong_ones_0(gold, completion, reward):
    assert math_verify_reward(completion, row(gold)) == reward
    assert verify(completion, row(gold)) == reward  # the task dispatch routes math_verify rows here


def test_it_scores_off_the_main_thread_where_math_verifys_alarm_cannot_run():
    got: list[float] = []
    threads = [threading.Thread(target=lambda c=c: got.append(math_verify_reward(c, row(r"\frac{1}{2}"))))
               for c in (r"\boxed{0.5}", r"\boxed{3}")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [0.0, 1.0]


def test_garbage_never_raises():
    for completion in ["", r"\boxed{}", "\\boxed{" + "(" * 500 + "}", r"\boxed{\int_0^\infty}", "<answer></answer>"]:
        assert math_verify_reward(completion, row("3")) == 0.0
    assert math_verify_reward(r"\boxed{3}", row("")) == 0.0  # a row without a gold answer scores 0


def test_a_pathological_answer_scores_0_off_the_main_thread_and_the_verifier_goes_on():
    """A power tower keeps sympy in C (holding the GIL) past math-verify's alarm; in the checker process it is
    cut off, scores 0, and the next check is answered."""
    got: list[float] = []
    tower = r"\boxed{9^{9^{9^{9^{9}}}}}"
    t = threading.Thread(target=lambda: got.extend([math_verify_reward(tower, row("1")),
                                                    math_verify_reward(r"\boxed{1}", row("1"))]))
    t.start()
    t.join()
    assert got == [0.0, 1.0]


def test_a_dead_checker_process_is_replaced():
    from factory.envs.math_answers import _CHECKER_PROCESS

    assert math_verify_reward(r"\boxed{2}", row("2")) == 1.0
    _CHECKER_PROCESS._proc.kill()
    _CHECKER_PROCESS._proc.wait()
    assert math_verify_reward(r"\boxed{2}", row("2")) == 1.0
