"""The spec checks that need the task families run wherever a spec is loaded and read as the schema's own."""

import pytest
import yaml

from factory.config import SpecError, parse_spec
from factory.envs.spec_check import check_spec, load_checked_spec


def test_a_spec_file_whose_task_is_too_small_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("task: {operations: [add], digits: [1], n_train: 43, n_eval: 8}\n")
    with pytest.raises(SpecError) as e:
        load_checked_spec(path)
    assert e.value.source == str(path)
    assert e.value.errors == ["task.n_train: must be <= 42 (task arithmetic with operations ['add'] and digits [1] "
                              "has 100 distinct problems; n_train + n_eval may use at most half of them, and n_eval "
                              "= 8), got 43"]
    assert str(e.value).startswith(f"invalid spec {path}:\n  task.n_train: must be <= 42 ")


def test_overrides_are_checked_too_and_name_no_file(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("task: {operations: [add], digits: [1], n_train: 40, n_eval: 8}\n")
    assert load_checked_spec(path, {}).task.n_train == 40
    with pytest.raises(SpecError) as e:
        load_checked_spec(path, {"rollout.max_new_tokens": 2_000})
    assert e.value.source is None and e.value.errors[0].startswith("rollout.max_new_tokens: must be <= 59 ")


def test_a_spec_that_fits_comes_back_unchanged():
    spec = parse_spec({"task": {"operations": ["add"], "digits": [1], "n_train": 42, "n_eval": 8}})
    assert check_spec(spec) is spec


@pytest.mark.parametrize(("rg", "error"), [
    ({"task": "basic_arithmetc"}, "data.sources[1].task: unknown reasoning-gym task 'basic_arithmetc' (did you mean "
                                  "'basic_arithmetic', 'bitwise_arithmetic', 'decimal_arithmetic')"),
    ({"task": "basic_arithmetic", "config": {"max_term": 3}},
     "data.sources[1].config.max_term: not a config field of reasoning-gym task 'basic_arithmetic'; its fields are "
     "min_terms, max_terms, min_digits, max_digits, operators, allow_parentheses, allow_negation, format_style, "
     "whitespace"),
])
def test_a_bad_reasoning_gym_task_or_config_is_refused_at_validate_time_naming_the_field(tmp_path, rg, error):
    path = tmp_path / "rg.yaml"
    spec = {"task": {"name": "word_problems", "n_train": 40, "n_eval": 8},
            "data": {"sources": [{"name": "wp", "kind": "suite", "suite": "word_problems"},
                                 {"name": "rg", "kind": "reasoning_gym", "size": 100, **rg}]}}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError) as e:
        load_checked_spec(path)
    assert e.value.source == str(path) and e.value.errors == [error]
