"""Small spec inputs with large costs: YAML alias bombs are refused while loading, and seeds must be in the range
torch, the lake (int64) and `random` all accept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from factory.config import MAX_YAML_NODES, SpecError, YAMLBombError, load_spec, load_yaml, parse_spec


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
