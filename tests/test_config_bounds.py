"""Small spec inputs with large costs: YAML alias bombs are refused while loading, seeds must be in the range
torch, the lake (int64) and `random` all accept, sizes past their sane maxima (factory/config/bounds.py) are refused
naming the field, and a boolean is never taken for a number."""

from __future__ import annotations

import subprocess
import sys

import pytest

from factory.config import MAX_YAML_NODES, SpecError, YAMLBombError, apply_overrides, load_spec, load_yaml, parse_spec


def _bomb(levels: int) -> str:
    """An alias bomb: each level is a list of 9 aliases to the level before (9**levels leaves, a few hundred bytes)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_before_it_expands(tmp_path):
    text = _bomb(8)  # 9**8 = 43 million leaves: validating it ran for minutes
    assert len(text) < 1024
    with pytest.raises(YAMLBombError, match=r"more than .* nodes"):
        load_yaml(text)
    spec = tmp_path / "bomb.yaml"
    spec.write_text("seed: 1\nname: x\nextra:\n" + "".join("  " + line + "\n" for line in text.splitlines()))
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    (line,) = e.value.errors
    assert line.startswith("<file>: ") and "alias" in line and "\n" not in line


def test_recursive_alias_is_refused():
    with pytest.raises(YAMLBombError, match="recursive"):
        load_yaml("a: &a [1, *a]\n")


def test_aliases_within_budget_still_load():
    # merge keys and a few aliases are ordinary YAML: they still load
    assert load_yaml("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\nc: *a\n") == {
        "a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 2}, "c": {"x": 1, "y": 2}}
    assert load_yaml("") is None
    # a document just under the node budget loads, one over it does not
    flat = "[" + ", ".join(["1"] * (MAX_YAML_NODES - 1)) + "]"
    assert len(load_yaml(flat)) == MAX_YAML_NODES - 1
    big = "a: &a [" + ", ".join(["1"] * (MAX_YAML_NODES // 2)) + "]\nb: *a\n"
    with pytest.raises(YAMLBombError):
        load_yaml(big)


def test_validate_refuses_the_bomb_with_one_line_and_exit_2(tmp_path):
    spec = tmp_path / "bomb.yaml"
    spec.write_text("name: x\nrollout: {}\nextra:\n" + "".join("  " + line + "\n" for line in _bomb(8).splitlines()))
    r = subprocess.run([sys.executable, "-m", "factory.cli", "validate", str(spec)], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert any("alias" in x for x in lines), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("where", ["seed", "data.seed", "data.sources.0.seed", "data.sources.1.seed"])
@pytest.mark.parametrize("value", [10**29, 2**63, -1])
def test_seeds_out_of_range_are_refused(where, value):
    data = {"data": {"sources": [{"name": "a", "kind": "arithmetic", "op": "add", "digits": 2, "n": 100},
                                 {"name": "r", "kind": "reasoning_gym", "task": "basic_arithmetic", "size": 10}]}}
    node: dict = data
    parts = where.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[parts[-1]] = value
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    (line,) = e.value.errors
    bounds = ("9223372036854775807", ">= 0", "greater than or equal to 0")
    assert "seed" in line and any(w in line for w in bounds), line


def test_seeds_in_range_pass():
    top = 2**63 - 1
    spec = parse_spec({"seed": top, "data": {"seed": 0, "sources": [
        {"name": "a", "kind": "arithmetic", "op": "add", "digits": 2, "n": 100, "seed": top}]}})
    assert spec.seed == top and spec.data.sources[0]["seed"] == top


# ---------------------------------------------------------------- sizes past their sane maxima, booleans for numbers


@pytest.mark.parametrize("field,value,bound", [
    ("algorithm.group_size", 10**9, 1024), ("rollout.prompts_per_step", 10**9, 65536),
    ("sft.batch_size", 10**9, 65536), ("schedule.eval_pass_k", 10**9, 1024), ("rollout.env_processes", 10**5, 256),
    ("rollout.concurrency", 10**9, 65536), ("task.n_train", 10**9, 1_000_000), ("rollout.max_new_tokens", 10**9,
                                                                                  131072)])
def test_sizes_past_their_sane_maximum_are_refused_naming_the_field(field, value, bound):
    with pytest.raises(SpecError) as e:
        apply_overrides(parse_spec({}), {field: value})
    (line,) = e.value.errors
    assert line == f"{field}: must be <= {bound}, got {value}"


def test_a_steps_samples_are_bounded_as_a_product():
    ok = apply_overrides(parse_spec({}), {"rollout.prompts_per_step": 1024, "algorithm.group_size": 1024})
    assert ok.rollout.prompts_per_step * ok.algorithm.group_size == 2**20
    with pytest.raises(SpecError) as e:
        apply_overrides(parse_spec({}), {"rollout.prompts_per_step": 2048, "algorithm.group_size": 1024})
    (line,) = e.value.errors
    assert line.startswith("rollout.prompts_per_step * algorithm.group_size: a step's samples must be <= 1048576")
    assert line.endswith("got 2048 * 1024 = 2097152")


@pytest.mark.parametrize("where,value", [
    ("seed", True), ("schedule.steps", True), ("algorithm.lr", False), ("task.digits", [True, 3]),
    ("data.seed", True), ("data.weights", {"a": True})])
def test_a_boolean_is_not_taken_for_a_number(where, value):
    data: dict = {"data": {"sources": [{"name": "a", "kind": "arithmetic", "op": "add", "digits": 2, "n": 100}]}}
    node = data
    *parents, last = where.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    assert e.value.errors == [f"{where}: expected a number, got a boolean (true/false)"]


def test_a_boolean_in_a_source_spec_is_refused_and_yaml_switches_still_work():
    with pytest.raises(SpecError) as e:
        parse_spec({"data": {"sources": [{"name": "a", "kind": "arithmetic", "op": "add", "digits": 2, "n": 100,
                                          "seed": True}]}})
    (line,) = e.value.errors
    assert line.startswith("data.sources: entry 0: source 'a': ") and line.endswith(
        "seed: expected a number, got a boolean (true/false)")
    spec = parse_spec({"ops": {"preflight": False}, "algorithm": {"scale_rewards": True}, "seed": 1})
    assert (spec.ops.preflight, spec.algorithm.scale_rewards, spec.seed) == ("off", True, 1)


def test_validate_and_run_refuse_a_billion_samples_with_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    from factory.cli import main

    home = tmp_path / "home"
    monkeypatch.setenv("FACTORY_HOME", str(home))
    for cmd in ("validate", "run"):
        for field in ("algorithm.group_size", "rollout.prompts_per_step"):
            assert main([cmd, "examples/quickstart.yaml", "--set", f"{field}=1000000000"]) == 2
            err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("invalid spec")]
            assert err == [f"  {field}: must be <= {1024 if 'group' in field else 65536}, got 1000000000"]
    assert not [p for p in home.rglob("*") if p.is_file()]  # nothing written
