"""Every snippet of the "Run history" section of docs/lake.md runs, as written, against a lake with rows:
the `factory` commands through main(argv), the Python blocks with exec() from the directory that
holds `.factory`. Placeholders RUN_A, RUN_B and SWEEP_ID are replaced by recorded ids."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from factory.cli import main
from factory.home import factory_home
from factory.lake import Lake

PAGE = Path(__file__).resolve().parents[2] / "docs" / "lake.md"
SECTION = "## Run history"
T0 = dt.datetime(2025, 7, 1, tzinfo=dt.UTC)
IDS = {"RUN_A": "quickstart-a", "RUN_B": "quickstart-b", "SWEEP_ID": "lr-sweep"}


def section_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the page's Run history section, placeholders filled."""
    text = PAGE.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    body = text[start:end if end != -1 else None]
    blocks = re.findall(r"```(\w+)\n(.*?)```", body, flags=re.DOTALL)
    out = []
    for lang, code in blocks:
        for placeholder, value in IDS.items():
            code = code.replace(placeholder, value)
        out.append((lang, code))
    return out


def commands(code: str) -> list[list[str]]:
    """The argv of each command in a bash block; a quoted argument may span lines."""
    argvs, pending = [], ""
    for line in code.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        pending = ""
        if argv:
            argvs.append(argv)
    assert not pending, f"unclosed quote in a command: {pending!r}"
    return argvs


@pytest.fixture
def doc_home(tmp_path, monkeypatch) -> Path:
    """./.factory (the default home the page's Python uses) with two runs of a sweep."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / ".factory"))
    with Lake.open(factory_home()) as lake:
        base = dict(sweep_id=IDS["SWEEP_ID"], spec_fingerprint="f", code_version="c", status="succeeded",
                    started_at=T0)
        lake.upsert("runs", [
            dict(base, run_id=IDS["RUN_A"], name="lr-1e-4", seed=0, spec={"algorithm": {"lr": 1e-4}}),
            dict(base, run_id=IDS["RUN_B"], name="lr-3e-4", seed=0, spec={"algorithm": {"lr": 3e-4}}),
        ])
        for run, acc in ((IDS["RUN_A"], 0.8), (IDS["RUN_B"], 0.9)):
            lake.upsert("steps", [dict(run_id=run, step=s, weight_version=s, reward_mean=0.5, kl=0.01,
                                       tokens_per_s=100.0, recorded_at=T0) for s in range(0, 120, 10)])
            lake.upsert("evals", [dict(run_id=run, step=step, benchmark="arithmetic_heldout", metric="accuracy",
                                       value=acc - 0.1 * (step < 110), n=500, recorded_at=T0) for step in (20, 110)])
    return tmp_path


def test_the_section_has_the_snippets():
    langs = [lang for lang, _ in section_blocks()]
    assert langs.count("bash") >= 2 and "python" in langs
    argvs = [a for lang, code in section_blocks() if lang == "bash" for a in commands(code)]
    assert {a[1] for a in argvs} >= {"runs", "best", "compare", "query"}


@pytest.mark.slow
def test_the_commands_run(doc_home, capsys):
    for lang, code in section_blocks():
        if lang != "bash":
            continue
        for argv in commands(code):
            assert argv[0] == ".venv/bin/factory", argv
            assert main(argv[1:]) == 0, (argv, capsys.readouterr().err)
            out = capsys.readouterr().out
            assert IDS["RUN_B"] in out or "lr-3e-4" in out, (argv, out)
            if "json" in argv:
                json.loads(out)


def test_the_python_runs(doc_home):
    for lang, code in section_blocks():
        if lang != "python":
            continue
        printed = io.StringIO()
        scope: dict = {}
        with contextlib.redirect_stdout(printed):
            exec(compile(code, str(PAGE), "exec"), scope)  # noqa: S102 - the page's own snippet
        assert sorted(scope["late"].column("step").to_pylist()) == [100, 110]
        assert printed.getvalue().strip() == "[(12, 0.5)]"
