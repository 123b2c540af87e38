"""`factory validate` and `factory run` refuse data sources the run could not open, with one line naming the source
and exit 2, before any work starts; a relative `path:` is relative to the spec file's folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


GOOD = {"id": ["q0", "q1"], "prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}


def write_spec(folder: Path, source: dict) -> Path:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["data"] = {"sources": [{"name": "add2", "kind": "arithmetic", "op": "add", "digits": 2, "n": 400},
                                {"name": "f", "verifier": "arithmetic", **source}]}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def factory(*argv: str, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "FACTORY_HOME": str(home), "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run([sys.executable, "-m", "factory.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600, check=False)


def _refused(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    problems = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("invalid spec")]
    assert len(problems) == 1, r.stderr
    (line,) = problems
    assert "data.sources.1.path" in line and "'f'" in line, line
    for w in words:
        assert w in line, line
    return line


def _bad_sources(tmp_path: Path) -> list[tuple[str, dict, tuple[str, ...]]]:
    text = tmp_path / "notes.parquet"
    text.write_text("not parquet at all\n")
    wrong = write_parquet(tmp_path / "wrong.parquet", {"question": ["1+1="], "final": ["2"]})
    return [
        ("missing", {"kind": "parquet", "path": str(tmp_path / "nope.parquet")}, ("does not exist",)),
        ("wrong-columns", {"kind": "parquet", "path": str(wrong)}, ("no column", "'prompt'", "'question'")),
        ("not-parquet", {"kind": "parquet", "path": str(text)}, ("not a Parquet file",)),
        ("passwd-as-jsonl", {"kind": "jsonl", "path": "../../../../../../../../../../etc/passwd"}, ("not JSON",)),
        ("passwd-as-parquet", {"kind": "parquet", "path": "../../../../../../../../../../etc/passwd"},
         ("not a Parquet file",)),
        ("hf-not-a-dataset", {"kind": "hf_disk", "path": str(tmp_path)}, ("state.json",)),
    ]


def test_validate_refuses_bad_sources_with_one_line(tmp_path):
    for case, source, words in _bad_sources(tmp_path):
        spec = write_spec(tmp_path / case, source)
        r = factory("validate", str(spec), cwd=tmp_path, home=tmp_path / "home")
        _refused(r, *words)


def test_relative_paths_are_relative_to_the_spec_folder(tmp_path):
    from factory.config import load_spec

    folder = tmp_path / "specs" / "blend"
    write_parquet(folder / "data" / "rows.parquet", GOOD)
    spec = write_spec(folder, {"kind": "parquet", "path": "data/rows.parquet"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = factory("validate", str(spec), cwd=elsewhere, home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    assert load_spec(spec).data.sources[1]["path"] == str(folder / "data" / "rows.parquet")
    # the same file named relative to where the command runs is not found: the spec's folder decides
    spec2 = write_spec(tmp_path / "other", {"kind": "parquet", "path": "data/rows.parquet"})
    r = factory("validate", str(spec2), cwd=folder, home=tmp_path / "home")
    _refused(r, "does not exist", str(tmp_path / "other" / "data" / "rows.parquet"))


@pytest.mark.parametrize("flag", [[], ["--in-process"]])
def test_run_refuses_a_bad_source_before_any_attempt(tmp_path, flag):
    spec = write_spec(tmp_path / "s", {"kind": "parquet", "path": str(tmp_path / "nope.parquet")})
    home = tmp_path / "home"
    r = factory("run", str(spec), *flag, cwd=tmp_path, home=home)
    _refused(r, "does not exist")
    runs = home / "runs"
    assert not runs.exists() or not any(runs.iterdir())  # no attempt was started


RUN_IN_PROCESS = """
import argparse, sys
from factory.cli.run import _run_spec
from factory.config import parse_spec
spec = parse_spec({"model": {"preset": "micro"}, "ops": {"preflight": "off"},
                   "task": {"name": "arithmetic", "operations": ["add"], "digits": [2], "n_train": 200, "n_eval": 20},
                   "sft": {"steps": 2, "batch_size": 8, "check_every": 1}, "algorithm": {"group_size": 2},
                   "rollout": {"prompts_per_step": 2, "max_new_tokens": 4}, "schedule": {"steps": 1, "eval_pass_k": 1},
                   "data": {"sources": [{"name": "a", "kind": "arithmetic", "op": "add", "digits": 2, "n": 100},
                                        {"name": "f", "kind": sys.argv[2], "path": sys.argv[1],
                                         "verifier": "arithmetic"}]}})
sys.exit(_run_spec(spec, argparse.Namespace(home=None, control=False, in_process=True)))
"""


def test_in_process_run_gives_one_line_for_a_source_gone_after_the_check(tmp_path):
    """A file that vanished after the spec was checked (what `load` would have refused): one line, exit 2."""
    env = {**os.environ, "FACTORY_HOME": str(tmp_path / "home"), "PYTHONPATH": str(Path(__file__).parents[2])}
    r = subprocess.run([sys.executable, "-c", RUN_IN_PROCESS, str(tmp_path / "gone.parquet"), "parquet"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("factory: error:")]
    assert "source 'f'" in line and "does not exist" in line, line


def test_supervised_attempt_stops_on_a_bad_row_it_meets_naming_source_file_and_line(tmp_path):
    """Supervised: a row the run meets that the spec's check did not see (a spec built in Python is not checked; a
    file may change after the check) stops the run with one line naming the source, the file and the line, exit 2
    (bad input), and no restart (restarting cannot mend the file)."""
    script = RUN_IN_PROCESS.replace('"ops": {"preflight": "off"}', '"ops": {"preflight": "off", "max_restarts": 2}') \
        .replace("in_process=True", "in_process=False")
    rows = [json.dumps({"id": f"q{i}", "prompt": f"{i % 10}+{i % 7}=", "answer": str(i % 10 + i % 7)})
            for i in range(100)]
    rows[50] = '{"id": "q50", "prompt": broken'
    data = tmp_path / "bad51.jsonl"
    data.write_text("\n".join(rows) + "\n")
    env = {**os.environ, "FACTORY_HOME": str(tmp_path / "home"), "PYTHONPATH": str(Path(__file__).parents[2])}
    r = subprocess.run([sys.executable, "-c", script, str(data), "jsonl"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=900, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "restart 1 of" not in r.stdout + r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    lines = [x for x in r.stderr.splitlines() if "source 'f'" in x]
    assert lines and all(f"line 51 of '{data}' is not JSON" in x for x in lines), r.stderr[-3000:]


def test_validate_and_run_refuse_a_row_broken_far_into_the_file(tmp_path):
    """Every line is checked before anything runs (the run used to train SFT and start RL before meeting it)."""
    rows = [json.dumps({"id": f"q{i}", "prompt": f"{i % 10}+{i % 7}=", "answer": str(i % 10 + i % 7)})
            for i in range(100)]
    rows[50] = '{"id": "q50", "prompt": broken'
    data = tmp_path / "bad51.jsonl"
    data.write_text("\n".join(rows) + "\n")
    spec = write_spec(tmp_path / "s", {"kind": "jsonl", "path": str(data)})
    home = tmp_path / "home"
    for cmd in ("validate", "run"):
        r = factory(cmd, str(spec), cwd=tmp_path, home=home)
        _refused(r, f"line 51 of '{data}' is not JSON")
    assert not home.exists() or not [p for p in home.rglob("*") if p.is_file()]  # nothing written
