"""The small parts of `benchmarks/chaos.py` and `benchmarks/chaos_faults.py` that decide a fault's verdict, on real
processes: a zombie is not counted as left running, a process's whole family is found, the first failed check is
the one named, and `--only` refuses an unknown part. (The fault runs themselves take minutes: the benchmark.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cf = _load("chaos_faults")


def test_a_dead_unreaped_child_is_not_alive_and_a_live_one_is():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert cf.alive(child.pid)
    finally:
        child.stdin.close()  # EOF: it exits
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left a zombie (not reaped)
    assert not cf.alive(child.pid)
    child.wait()
    assert not cf.alive(child.pid)


def test_descendants_are_children_and_grandchildren():
    code = ("import subprocess, sys; g = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], "
            "stdin=subprocess.PIPE); print(g.pid, flush=True); sys.stdin.read(); g.stdin.close(); g.wait()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert {child.pid, grandchild} <= cf.descendants(os.getpid())
        assert cf.descendants(child.pid) == {grandchild}
    finally:
        child.stdin.close()
        child.wait()


def test_the_verdict_names_the_first_failed_check():
    assert cf._verdict({"fault": "x"}, [(True, "a"), (False, "b"), (False, "c")]) == {"fault": "x", "ok": False,
                                                                                       "why": "b"}
    assert cf._verdict({}, [(True, "a")]) == {"ok": True, "why": None}


def test_only_refuses_an_unknown_part():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--only", "kills,disk_ful"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 2
    assert "--only: unknown part(s) ['disk_ful']" in res.stderr and "disk_full" in res.stderr
