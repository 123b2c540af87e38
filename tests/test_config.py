"""Spec validation: every bad field is named with its value and what was expected."""

import pytest

from factory.config import SpecError, apply_overrides, load_spec, parse_overrides, parse_spec


def errors_of(data) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    return e.value.errors


def test_quickstart_example_is_valid():
    spec = load_spec("examples/quickstart.yaml")
    assert spec.algorithm.name == "grpo" and spec.algorithm.group_size >= 2


def test_bound_error_names_path_value_and_expectation():
    assert errors_of({"algorithm": {"group_size": 1}}) == ["algorithm.group_size: must be >= 2, got 1"]


def test_unknown_keys_are_named():
    errs = errors_of({"algorithm": {"group_sise": 4}, "extra_section": {}})
    assert "algorithm.group_sise: unknown key (not a field of this section)" in errs
    assert "extra_section: unknown key (not a field of this section)" in errs


def test_unknown_model_preset_lists_valid_ones():
    (err,) = errors_of({"model": {"preset": "huge"}})
    assert err.startswith("model.preset: unknown model preset 'huge'; valid presets:")
    assert "tiny" in err and "micro" in err


def test_wrong_type_and_literal():
    errs = errors_of({"sft": {"steps": "many"}, "task": {"operations": ["div"]}})
    assert any(e.startswith("sft.steps:") and "'many'" in e for e in errs)
    assert any(e.startswith("task.operations.0: expected 'add', 'sub' or 'mul'") for e in errs)


def test_cross_field_rule():
    errs = errors_of({"rollout": {"prompts_per_step": 3}, "algorithm": {"group_size": 3},
                      "trainer": {"minibatches": 2}})
    assert errs == ["trainer.minibatches: must divide rollout.prompts_per_step * algorithm.group_size "
                    "= 9, got 2"]


def test_load_spec_names_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML") as e:
        load_spec(bad)
    assert str(bad) in str(e.value)


def test_overrides_apply_and_revalidate():
    spec = parse_spec({})
    new = apply_overrides(spec, parse_overrides(["algorithm.lr=1e-4", "task.digits=[2]"]))
    assert new.algorithm.lr == 1e-4 and new.task.digits == [2]
    assert spec.algorithm.lr != 1e-4  # the original is untouched
    with pytest.raises(SpecError, match="algorithm.group_size: must be >= 2, got 0"):
        apply_overrides(spec, {"algorithm.group_size": 0})
    with pytest.raises(SpecError, match="expected path=value"):
        parse_overrides(["algorithm.lr"])


def test_fingerprint_is_stable_and_content_based():
    a = parse_spec({"seed": 1, "algorithm": {"lr": 0.001}})
    b = parse_spec({"algorithm": {"lr": 0.001}, "seed": 1})
    assert a.fingerprint() == b.fingerprint() != parse_spec({"seed": 2}).fingerprint()


def test_buffer_depth_bound_is_checked_against_the_batch():
    assert errors_of({"buffer": {"policy": "bound", "max_staleness": 2, "depth": 65},
                      "rollout": {"prompts_per_step": 32}}) == [
        "buffer.depth: with policy 'bound' must be <= buffer.max_staleness * rollout.prompts_per_step = 64 "
        "(deeper lets groups grow staler than allowed), got 65"]
    assert parse_spec({"buffer": {"policy": "reject", "max_staleness": 0, "depth": 500}}).buffer.depth == 500
