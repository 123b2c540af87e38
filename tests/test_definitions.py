"""The Dagster code location loads: `dagster definitions validate -w workspace.yaml` (what `dagster dev` loads)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_workspace_loads_without_errors(tmp_path):
    env = dict(os.environ, DAGSTER_HOME=str(tmp_path), FACTORY_HOME=str(tmp_path / "home"))
    dagster = Path(sys.executable).parent / "dagster"
    proc = subprocess.run([str(dagster), "definitions", "validate", "-w", "workspace.yaml"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Validation successful" in proc.stdout + proc.stderr
