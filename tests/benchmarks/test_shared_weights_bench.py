"""`benchmarks/shared_weights.py --smoke`: the shared-buffer and codec paths run and hand over the same bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_shared_weights_benchmark_smoke_run_prints_its_figures():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shared_weights.py"), "--smoke"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["versions"] == 2 and figures["params"] > 0
    assert all(figures[k] > 0 for k in ("shared_publish_s", "shared_read_s", "codec_s"))
