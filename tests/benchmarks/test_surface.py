"""benchmarks/surface.py, the check that a restructuring left the user-facing surface as it was: the quickstart's
fingerprint is the published one, the CLI, asset keys and lake tables are all there, and a change is reported."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
surface = importlib.import_module("benchmarks.surface")


def test_the_surface_holds_every_part_and_a_saved_one_compares_equal(tmp_path, factory_home):
    s = surface.surface()
    assert s["fingerprints"]["quickstart.yaml"] == "96eec83d19b10919"  # README's and every lake's quickstart run
    assert {"factory", "factory run", "factory query", "factory deploy render"} <= set(s["cli"])
    assert "grpo_run" in s["dagster"]["asset_keys"] and "steps" in s["lake"]
    saved = tmp_path / "surface.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "surface.py"), "--save", str(saved)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.splitlines()[-1])["differences"] == 0
    changed = json.loads(saved.read_text())
    changed["lake"]["steps"] += "\nextra: int64"
    changed["fingerprints"]["quickstart.yaml"] = "0" * 16
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "surface.py"), "--against",
                          str(tmp_path / "changed.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout[-3000:]
    assert "/lake/steps: differs" in res.stdout and "/fingerprints/quickstart.yaml: '0000000000000000' ->" in res.stdout
    assert json.loads(res.stdout.splitlines()[-1])["differences"] == 2
