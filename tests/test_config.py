"""Spec validation: every bad field is named with its value and what was expected."""

import json

import pytest

from factory.config import SpecError, apply_overrides, load_spec, parse_overrides, parse_spec
from factory.envs.spec_check import check_spec


def errors_of(data) -> list[str]:
    with pytest.raises(SpecError) as e:
        check_spec(parse_spec(data))
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
    new = apply_overrides(spec, parse_overrides(["algorithm.lr=1e-4", "task.digits=[3]"]))
    assert new.algorithm.lr == 1e-4 and new.task.digits == [3]
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


# ---------------------------------------------------------------- what `factory run` would die on, found at validation


def test_max_new_tokens_must_fit_the_models_positions_after_the_longest_prompt():
    # Default task: arithmetic up to 3 digits, "123+456=" after <bos>: 9 tokens; the tiny preset has 64 positions.
    assert parse_spec({"rollout": {"max_new_tokens": 55}}).rollout.max_new_tokens == 55
    (err,) = errors_of({"rollout": {"max_new_tokens": 100_000}})
    assert err == ("rollout.max_new_tokens: must be <= 55 so that the longest prompt (9 tokens, task arithmetic) "
                   "plus the completion fit the model's 64 positions (model.max_positions, unset: preset tiny's), "
                   "got 100000")
    # past its sane maximum (factory/config/bounds.py) the schema says so first, whatever the model
    assert errors_of({"rollout": {"max_new_tokens": 2_000_000_000}}) == [
        "rollout.max_new_tokens: must be <= 131072, got 2000000000"]
    assert errors_of({"rollout": {"max_new_tokens": 56}})[0].startswith("rollout.max_new_tokens: must be <= 55 ")
    assert parse_spec({"model": {"max_positions": 256}, "rollout": {"max_new_tokens": 247}})
    (err,) = errors_of({"model": {"max_positions": 256}, "rollout": {"max_new_tokens": 248}})
    assert "must be <= 247" in err and "model's 256 positions (model.max_positions)" in err
    # Word problems: the longest shipped prompt is 97 characters (98 tokens); they do not fit 64 positions at all.
    (err,) = errors_of({"task": {"name": "word_problems", "n_train": 100, "n_eval": 50}})
    assert err == ("model.max_positions: must be >= 106 to hold the longest prompt (98 tokens, task word_problems) "
                   "and rollout.max_new_tokens = 8, got 64 (model.max_positions, unset: preset tiny's)")
    assert parse_spec({"task": {"name": "word_problems", "n_train": 100, "n_eval": 50},
                       "model": {"max_positions": 256}, "rollout": {"max_new_tokens": 158}})


@pytest.mark.parametrize("section,field", [("algorithm", "lr"), ("sft", "lr"), ("task", "simulated_latency_s"),
                                           ("schedule", "wait_timeout_s"), ("algorithm", "is_cap")])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), "1e999", "-inf"])
def test_infinite_or_nan_floats_are_refused_everywhere(section, field, value):
    (err,) = errors_of({section: {field: value}})
    assert err.startswith(f"{section}.{field}: must be a finite number, got "), err


def test_n_train_beyond_what_the_task_can_generate_names_the_maximum():
    # add on 1-digit operands: 10 x 10 = 100 distinct problems, of which at most half are drawn.
    assert parse_spec({"task": {"digits": [1], "n_train": 42, "n_eval": 8}})
    (err,) = errors_of({"task": {"digits": [1], "n_train": 43, "n_eval": 8}})
    assert err == ("task.n_train: must be <= 42 (task arithmetic with operations ['add'] and digits [1] has 100 "
                   "distinct problems; n_train + n_eval may use at most half of them, and n_eval = 8), got 43")
    (err,) = errors_of({"task": {"name": "word_problems", "n_train": 20000, "n_eval": 8},
                        "model": {"max_positions": 256}})
    assert err == ("task.n_train: must be <= 392 (task word_problems has 400 distinct problems; n_train + n_eval may "
                   "use all of them, and n_eval = 8), got 20000")
    (err,) = errors_of({"task": {"name": "word_problems", "n_eval": 500}, "model": {"max_positions": 256}})
    assert err == ("task.n_eval: must be <= 384 (task word_problems has 400 distinct problems; n_train + n_eval may "
                   "use all of them, and n_train needs at least 16), got 500")
    (err,) = errors_of({"task": {"name": "code", "n_train": 20, "n_eval": 8}, "model": {"max_positions": 256}})
    assert err.startswith("task.n_train: must be <= 16 (task code has 24 distinct problems;")


def test_capacity_counts_distinct_problems_exactly():
    from factory.envs.arithmetic import _problem, arithmetic_capacity

    for ops, digits in [(["add"], [1]), (["sub"], [1, 2]), (["mul", "add", "sub"], [1, 2])]:
        ids = set()
        for d in digits:
            lo, hi = (0, 9) if d == 1 else (10 ** (d - 1), 10**d - 1)
            for op in ops:
                ids |= {_problem(a, op, b, d, True).id for a in range(lo, hi + 1) for b in range(lo, hi + 1)}
        assert arithmetic_capacity(ops, digits) == len(ids), (ops, digits)
    assert arithmetic_capacity(["add"], [6]) == (9 * 10**5) ** 2


def test_the_largest_valid_n_train_generates():
    from factory.envs.tasks import make_task_splits

    spec = parse_spec({"task": {"operations": ["sub"], "digits": [1], "n_train": 19, "n_eval": 8}})
    splits = make_task_splits(spec.task, 0)
    assert len(splits.train) == 19 and not {p.id for p in splits.train} & {p.id for p in splits.eval}
    assert errors_of({"task": {"operations": ["sub"], "digits": [1], "n_train": 20, "n_eval": 8}})


# ---------------------------------------------------------------- error messages as written, inputs clipped, duplicates


def test_pydantic_messages_are_kept_as_written():
    (err,) = errors_of({"name": "not a name!"})
    assert err == "name: String should match pattern '^[A-Za-z0-9_.-]+$', got 'not a name!'"


def test_huge_inputs_are_clipped_in_errors():
    huge = "x" * 10_000_000
    for data in ({"name": huge}, {"task": {"operations": [huge]}}, {"sft": {"steps": huge}},
                 {"model": {"preset": huge}}, {"task": {"name": huge}}):
        (err,) = errors_of(data)
        assert len(err) < 400 and "… (10000000 chars)" in err, err[:400]
    (err,) = errors_of({"model": {"max_positions": 10**100}})  # a 101-digit int
    assert len(err) < 400 and "(101 chars)" in err, err


def test_duplicate_keys_are_refused_with_key_and_line(tmp_path):
    spec = tmp_path / "dup.yaml"
    spec.write_text("seed: 1\nalgorithm:\n  lr: 1.0e-3\n  group_size: 4\n  lr: 1.0e-4\n")
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    assert e.value.errors == ["<file>: duplicate key 'lr' at line 5 (first at line 3)"]
    assert str(spec) in str(e.value)
    spec.write_text("seed: 1\nseed: 2\n")
    with pytest.raises(SpecError, match=r"duplicate key 'seed' at line 2 \(first at line 1\)"):
        load_spec(spec)


def test_yaml_merge_keys_may_still_override():
    from factory.config import load_yaml

    assert load_yaml("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n") == {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 2}}


def test_sft_examples_must_fit_the_training_split():
    assert parse_spec({"task": {"n_train": 100}, "sft": {"examples": 100}}).sft.examples == 100
    with pytest.raises(SpecError, match=r"sft.examples: must be <= task.n_train = 100 .* got 101"):
        parse_spec({"task": {"n_train": 100}, "sft": {"examples": 101}})


def test_sft_sees_only_its_labeled_examples(factory_home):
    from factory.models.checkpoint import read_meta
    from factory.runs.stages import build_dataset, load_dataset, train_sft_checkpoint

    spec = parse_spec({"model": {"preset": "micro"}, "task": {"n_train": 200, "n_eval": 16},
                       "sft": {"steps": 2, "examples": 7}, "schedule": {"eval_pass_k": 1}})
    splits = load_dataset(build_dataset(spec, factory_home).path)
    res = train_sft_checkpoint(spec, factory_home, splits, log=lambda _: None)
    assert read_meta(res.checkpoint.path)["labeled_examples"] == 7


DATA = {"sources": [{"name": "add2", "kind": "arithmetic", "op": "add", "digits": 2, "n": 500},
                    {"name": "add3", "kind": "arithmetic", "op": "add", "digits": 3, "n": 5000}]}


@pytest.mark.parametrize(("data", "words"), [
    ({**DATA, "weights": {"add2": 1, "add9": 1}},
     "data: weights: unknown source(s) ['add9'] (sources: ['add2', 'add3'])"),
    ({**DATA, "weights": {"add2": -1, "add3": 1}}, "data: weights: weights must be >= 0, got {'add2': -1.0}"),
    ({**DATA, "weights": {"add2": 0, "add3": 0}}, "data: weights: all weights are 0"),
    ({**DATA, "schedule": {10: {"add2": 1}}}, "data: schedule: the first entry must be step 0"),
    ({**DATA, "schedule": {0: {"add2": 1}, 50: {"add4": 1}}}, "data: schedule.50: unknown source(s) ['add4']"),
    ({**DATA, "schedule": {0: {"add2": 1}}, "weights": {"add2": 1}}, "data: weights and schedule: give one"),
    ({"sources": [DATA["sources"][0], DATA["sources"][0]]}, "data.sources: entry 1: source name 'add2' is used twice"),
    ({"sources": [{"name": "gsm", "kind": "parquet", "path": "x.parquet"}]},
     "data.sources: entry 0: source 'gsm': parquet.verifier: Field required"),
    ({"sources": [{"name": "a", "kind": "arithmetic", "op": "add", "digits": 2}]}, "source 'a': arithmetic.n"),
    ({**DATA, "curriculum": {"kind": "level", "levels": ["add2", "add7"]}},
     "data: curriculum.levels: unknown source(s) ['add7']"),
    ({**DATA, "curriculum": {"kind": "online", "levels": ["add2"]}}, "only used by kind 'level'"),
    ({**DATA, "filter": {"min_pass_rate": 0.9, "max_pass_rate": 0.1}}, "data.filter: min_pass_rate 0.9 must be <="),
    ({**DATA, "sources": []}, "data.sources: List should have at least 1 item"),
    ({"sources": [{"name": "wp", "kind": "suite", "suite": "word_problems"}]},
     "data.sources: ['wp'] hold text prompts, but the model's tokenizer is task arithmetic's"),
])
def test_a_bad_data_section_names_the_source_weight_or_schedule_entry(data, words):
    with pytest.raises(SpecError) as e:
        parse_spec({"data": data})
    assert words in str(e.value)


def test_a_data_section_round_trips_and_defaults_to_equal_weights():
    spec = parse_spec({"data": DATA})
    assert spec.data.blend_weights() == {0: {"add2": 1.0, "add3": 1.0}}
    back = parse_spec(json.loads(spec.to_json()))  # schedule steps come back as ints from JSON's string keys
    assert back == spec
    sched = apply_overrides(spec, {"data.schedule": {0: {"add2": 1}, 300: {"add3": 1}}})
    assert parse_spec(json.loads(sched.to_json())).data.blend_weights() == {0: {"add2": 1.0}, 300: {"add3": 1.0}}
    assert spec.fingerprint() != sched.fingerprint()
    assert spec.warm_start_fingerprint() == sched.warm_start_fingerprint()  # the blend is GRPO's, not SFT's
    assert load_spec("examples/blend.yaml").data.names() == ["add2", "add3", "add4"]


def test_a_generated_source_whose_prompts_do_not_fit_the_model_is_refused():
    with pytest.raises(SpecError, match="model.max_positions"):
        check_spec(parse_spec({"model": {"max_positions": 16}, "task": {"digits": [1], "n_train": 20, "n_eval": 8},
                               "rollout": {"max_new_tokens": 2},
                               "data": {"sources": [{"name": "big", "kind": "arithmetic", "op": "add", "digits": 9,
                                                     "n": 10}]}}))


def test_overrides_reach_list_entries_by_index():
    spec = load_spec("examples/blend.yaml")
    assert apply_overrides(spec, {"data.sources.1.n": 300}).data.sources[1]["n"] == 300
    with pytest.raises(SpecError, match=r"data.sources.7.n: '7' is not an index of the 3 entries of data.sources"):
        apply_overrides(spec, {"data.sources.7.n": 1})


def test_lora_section_defaults_and_the_combinations_it_refuses():
    spec = parse_spec({"trainer": {"lora": {}}})
    lo = spec.trainer.lora
    assert (lo.r, lo.alpha, lo.dropout, lo.target_modules) == (16, 32.0, 0.0, "all-linear")
    assert parse_spec({}).trainer.lora is None  # full fine-tuning
    assert parse_spec({}).fingerprint() == parse_spec({"trainer": {"lora": None}}).fingerprint()  # unchanged
    assert errors_of({"trainer": {"lora": {"r": 0}}}) == ["trainer.lora.r: must be >= 1, got 0"]
    assert errors_of({"trainer": {"lora": {"dropout": 1.0}}}) == ["trainer.lora.dropout: must be < 1.0, got 1.0"]
    (err,) = errors_of({"trainer": {"lora": {"target_modules": []}}})
    assert err.startswith("trainer.lora.target_modules")
    (err,) = errors_of({"trainer": {"lora": {}, "backend": "megatron"}})
    assert "trainer.lora: LoRA runs on the one-process torch trainer" in err and "'megatron'" in err
    (err,) = errors_of({"trainer": {"lora": {}, "world_size": 2}})
    assert "trainer.lora" in err and "world_size 2" in err
    (err,) = errors_of({"trainer": {"lora": {}}, "rollout": {"engine": "sglang"}})
    assert "trainer.lora: not wired to rollout.engine sglang" in err
