"""The small parts of `benchmarks/chaos.py` and `benchmarks/chaos_faults.py` that decide a fault's verdict: the
first failed check is the one named, and `--only` refuses an unknown part. (The /proc helpers that find a run's
processes: tests/benchmarks/test_chaos_runs.py; the fault runs themselves take minutes: the benchmark.)"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
cf = importlib.import_module("benchmarks.chaos_faults")


def test_the_verdict_names_the_first_failed_check():
    assert cf._verdict({"fault": "x"}, [(True, "a"), (False, "b"), (False, "c")]) == {"fault": "x", "ok": False,
                                                                                       "why": "b"}
    assert cf._verdict({}, [(True, "a")]) == {"ok": True, "why": None}


def test_only_refuses_an_unknown_part():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--only", "kills,disk_ful"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 2
    assert "--only: unknown part(s) ['disk_ful']" in res.stderr and "disk_full" in res.stderr
