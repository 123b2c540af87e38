"""reasoning-gym tasks: rows from real entries, scored by each task's own score_answer on the <answer> tag, and
bad task names or configs named by field."""

from __future__ import annotations

import json

import pytest

from factory.envs.reasoning_gym_tasks import ANSWER_INSTRUCTION, rg_config_problem, rg_problem, rg_reward
from factory.envs.tasks import verify

TASKS = [("basic_arithmetic", {"min_terms": 2, "max_terms": 3}), ("leg_counting", {}),
         ("spell_backward", {}), ("chain_sum", {"min_terms": 2, "max_terms": 2})]


@pytest.mark.parametrize(("task", "config"), TASKS)
def test_a_real_entrys_answer_scores_1_and_a_wrong_one_0(task, config):
    for i in range(3):
        p = rg_problem(task, config, seed=7, size=10, index=i, source="rg")
        assert p.prompt.endswith("\n" + ANSWER_INSTRUCTION) and p.op == "reasoning_gym"
        assert json.loads(json.dumps(p.meta)) == p.meta  # JSON-safe
        assert rg_reward(f"Thinking... <answer>{p.answer}</answer>", p) == 1.0
        assert verify(f"<answer>{p.answer}</answer>", p) == 1.0
        wrong = rg_reward("<answer>certainly not this</answer>", p)
        assert wrong < 1.0 and (wrong == 0.0 or task == "spell_backward")  # it gives partial credit by letters
        numeric = p.answer.lstrip("-").isdigit()
        # without a tag, a numeric task takes the last number; any other answers nothing
        assert rg_reward(f"so it is {p.answer}", p) == (1.0 if numeric else 0.0)
        assert rg_reward(f"{p.answer}, or rather 123456789", p) == 0.0


def test_the_tag_wins_over_numbers_and_the_last_number_is_the_fallback():
    from factory.envs.reasoning_gym_tasks import rg_answer

    assert rg_answer("9 + 8 = 17", "17") == "17"
    assert rg_answer("I guess 12. <answer>17</answer> not 5", "17") == "17"
    assert rg_answer("28 - 92 = -64.", "-64") == "-64"
    assert rg_answer("no numbers", "3") is None
    assert rg_answer("olleh 3", "olleh") is None  # a word answer needs the tag


def test_rows_are_a_function_of_task_config_seed_and_index():
    a = rg_problem("basic_arithmetic", {}, seed=3, size=5, index=4, source="rg")
    b = rg_problem("basic_arithmetic", {}, seed=3, size=50, index=4, source="rg")
    c = rg_problem("basic_arithmetic", {}, seed=4, size=5, index=4, source="rg")
    assert (a.prompt, a.answer, a.id) == (b.prompt, b.answer, b.id)
    assert a.prompt != c.prompt


def test_bad_task_names_and_configs_name_the_field():
    assert rg_config_problem("basic_arithmetc", {}) == (
        "task: unknown reasoning-gym task 'basic_arithmetc' (did you mean 'basic_arithmetic', 'bitwise_arithmetic', "
        "'decimal_arithmetic')")
    bad_key = rg_config_problem("basic_arithmetic", {"min_term": 2})
    assert bad_key.startswith("config.min_term: not a config field of reasoning-gym task 'basic_arithmetic'; its "
                              "fields are min_terms, max_terms,")
    assert rg_config_problem("basic_arithmetic", {"seed": 1}) == (
        "config.seed: set the source's own `seed`, not the config's")
    refused = rg_config_problem("basic_arithmetic", {"min_terms": 5, "max_terms": 2})
    assert refused.startswith("config: reasoning-gym task 'basic_arithmetic' refuses it:")
    assert rg_config_problem("basic_arithmetic", {"min_terms": 2, "max_terms": 3}) is None
