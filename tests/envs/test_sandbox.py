"""The sandbox pool: lending, recycling, limits, isolation errors, and the adversarial suite under bwrap.

Skipped where bubblewrap cannot run, unless FACTORY_REQUIRE_SANDBOX=1 (CI sets it: there, a missing
sandbox is a failure).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal

import pytest

from factory.envs import sandbox as sandbox_mod
from factory.envs.sandbox import LIMIT_MAX, IsolationUnavailable, SandboxLimits, SandboxPool, SandboxRequestError


@pytest.fixture
def pool(require_sandbox):
    with SandboxPool(size=2) as p:
        yield p


def test_runs_code_with_stdin_and_files(pool):
    r = pool.run("print(1)")
    assert (r.ok, r.exit_code, r.stdout, r.reason, r.timed_out, r.truncated) == (True, 0, "1\n", "", False, False)

    r = pool.run("import sys\nprint(sys.stdin.read().upper())", stdin="hello\n")
    assert r.ok and r.stdout == "HELLO\n\n"

    r = pool.run("import solution, json\nprint(solution.f(2), json.load(open('data/x.json'))['k'])",
                 files={"solution.py": "def f(x):\n    return x * 21\n", "data/x.json": '{"k": "v"}'})
    assert r.ok and r.stdout == "42 v\n", r.stderr


def test_code_imports_modules_the_worker_did_not_preload(pool):
    # The code runs as its own uid: the interpreter's files must be readable to it, not just to the worker.
    r = pool.run("import socket, subprocess, unittest, sqlite3, decimal\nprint('ok')")
    assert r.ok and r.stdout == "ok\n", r.stderr


def test_failures_score_zero_with_a_reason(pool):
    r = pool.run("import sys\nsys.exit(3)")
    assert (r.ok, r.exit_code, r.reason) == (False, 3, "exit code 3")

    r = pool.run("x = 1\nraise ValueError('boom')")
    assert (r.ok, r.exit_code, r.reason) == (False, 1, "exit code 1")
    # A traceback like python's own: the code's frames, not the worker's.
    assert 'File "main.py", line 2' in r.stderr and "ValueError: boom" in r.stderr and "_run_as_main" not in r.stderr

    r = pool.run("def f(:\n")
    assert not r.ok and "SyntaxError" in r.stderr


def test_wall_timeout_kills_the_code(pool):
    r = pool.run("import time\nprint('started', flush=True)\ntime.sleep(600)", limits=SandboxLimits(wall_s=0.5))
    assert r.timed_out and not r.ok and r.killed_by == "SIGKILL"
    assert r.reason == "timeout after 0.5 s"
    assert r.stdout == "started\n"  # output before the kill is kept
    assert pool.run("print(2)").stdout == "2\n"


@pytest.mark.slow
def test_cpu_limit(pool):
    r = pool.run("while True:\n    pass", limits=SandboxLimits(cpu_s=1, wall_s=30))
    assert (r.ok, r.timed_out, r.killed_by, r.reason) == (False, False, "SIGXCPU", "CPU time limit (1 s)")


def test_memory_limit(pool):
    r = pool.run("x = bytearray(b'x') * (1 << 30)", limits=SandboxLimits(memory_mb=256))
    assert not r.ok and r.reason == "memory limit (256 MB)" and "MemoryError" in r.stderr


def test_output_is_truncated_and_the_code_stopped(pool):
    r = pool.run("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", limits=SandboxLimits(output_bytes=10_000))
    assert r.truncated and not r.ok and r.reason == "output over 10000 bytes"
    assert r.stdout == "x" * 10_000


def test_each_run_gets_a_fresh_directory(pool):
    with pool.sandbox() as sb:
        first = sb.exec("import os\nopen('left.txt', 'w').write('x')\nopen('/tmp/also.txt', 'w').write('x')\n"
                        "print(os.getcwd())")
        second = sb.exec("import os, json\n"
                         "print(json.dumps([os.getcwd(), sorted(os.listdir('.')), os.path.exists('/tmp/also.txt')]))")
    assert first.ok and second.ok
    cwd, listing, tmp_left = json.loads(second.stdout)
    # The same name (in a /tmp of each execution's own: not even the count of executions before it shows), empty.
    assert cwd == first.stdout.strip() and listing == ["main.py"] and tmp_left is False


def test_acquire_and_release(pool):
    a, b = pool.acquire(), pool.acquire()
    assert a is not b
    assert pool.metrics()["busy"] == 2 and pool.metrics()["warm"] == 0
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.05)
    pool.release(a)
    pool.release(b)
    m = pool.metrics()
    assert m["busy"] == 0 and m["warm"] == 2 and m["cold_starts"] == 2 and m["failures"] == 0
    with pool.sandbox() as sb:
        assert sb.exec("print(3)").stdout == "3\n"
    assert pool.metrics()["executions"] == 1


def test_recycled_after_n_uses(require_sandbox):
    with SandboxPool(size=1, recycle_after=3) as pool:
        pids = []
        for _ in range(4):
            with pool.sandbox() as sb:
                pids.append(sb.pid)
                assert sb.exec("print(1)").ok
        assert pids[0] == pids[1] == pids[2] != pids[3]
        m = pool.metrics()
        assert (m["recycled"], m["cold_starts"], m["failures"], m["executions"]) == (1, 2, 0, 4)


def test_killed_worker_is_replaced(require_sandbox):
    with SandboxPool(size=1) as pool:
        with pool.sandbox() as sb:
            dead = sb.pid
        os.kill(dead, signal.SIGKILL)
        sb._proc.wait(timeout=30)
        r = pool.run("print('still serving')")
        assert r.ok and r.stdout == "still serving\n"
        with pool.sandbox() as sb:
            assert sb.pid != dead
        m = pool.metrics()
        assert m["failures"] == 1 and m["cold_starts"] == 2 and m["recycled"] == 1


def test_health_check_replaces_dead_idle_workers(require_sandbox):
    with SandboxPool(size=2) as pool:
        with pool.sandbox() as sb:
            pass
        os.kill(sb.pid, signal.SIGKILL)
        sb._proc.wait(timeout=30)
        assert pool.health_check() == 1
        assert [pool.run("print(1)").ok for _ in range(4)] == [True] * 4


BAD_FILES = [
    {"../escape.py": "x"}, {"/etc/passwd": "x"}, {"a/../../b": "x"}, {"a/../b": "x"},
    {"ok/": "x"},  # was a set-up traceback in the code's stderr
    {"a//b": "x"}, {"a/./b": "x"}, {"./": "x"}, {"": "x"}, {"a\0b": "x"}, {"\ud800": "x"},
    {"x" * 256: "y"}, {"d/" * 600 + "f": "y"},
    {"a": "x", "a/b": "y"}, {"a/b": "x", "a": "y"},  # one name is another's directory
    {"main.py/x": "y"},  # main.py is the code's file
]


@pytest.mark.parametrize("files", BAD_FILES, ids=[repr(list(f))[:40] for f in BAD_FILES])
def test_bad_file_names_are_the_callers_error(pool, files):
    with pytest.raises(SandboxRequestError, match="bad file name") as e:
        pool.run("print(1)", files=files)
    assert e.value.field == "files" and len(str(e.value)) < 400  # a huge name is not echoed whole
    assert pool.run("print(1)").stdout == "1\n"


@pytest.mark.parametrize("kwargs, field", [
    ({"code": "print(1)\ud800"}, "code"),
    ({"code": "print(1)", "stdin": "\ud800"}, "stdin"),
    ({"code": "print(1)", "files": {"a.txt": "\udbff"}}, "files['a.txt']"),
    ({"code": "print(1)", "files": {"a.txt": 5}}, "files['a.txt']"),
])
def test_text_that_is_not_unicode_is_the_callers_error(pool, kwargs, field):
    with pytest.raises(SandboxRequestError) as e:
        pool.run(**kwargs)
    assert e.value.field == field and str(e.value).startswith(field)


def test_raw_bytes_in_text_reach_the_code(pool):
    # surrogateescape: a str made from undecodable bytes goes to the code as those bytes
    r = pool.run("import sys\nprint(sys.stdin.buffer.read().hex(), open('b.bin', 'rb').read().hex())",
                 stdin="\udc80", files={"b.bin": "\udcff"})
    assert r.ok and r.stdout == "80 ff\n", r.stderr


def test_missing_bwrap_raises_isolation_unavailable():
    with pytest.raises(IsolationUnavailable, match="bubblewrap not found"):
        SandboxPool(size=1, bwrap="/nonexistent/bwrap")


def test_bwrap_that_cannot_make_namespaces_raises_isolation_unavailable(tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(IsolationUnavailable, match="No permissions to create new namespace"):
        SandboxPool(size=1, bwrap=str(fake))


def test_isolation_none_warns_once_and_still_limits(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_mod, "_WARNED_UNISOLATED", False)
    with caplog.at_level(logging.WARNING, logger="factory.envs.sandbox"):
        with SandboxPool(size=1, isolation="none") as pool:
            assert pool.run("print(1)").stdout == "1\n"
            r = pool.run("import time\ntime.sleep(600)", limits=SandboxLimits(wall_s=0.3))
            assert r.timed_out and r.reason == "timeout after 0.3 s"
        SandboxPool(size=1, isolation="none")
    warnings = [r for r in caplog.records if "NOT isolated" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


@pytest.mark.parametrize("kwargs", [{"wall_s": 0}, {"wall_s": float("nan")}, {"wall_s": float("inf")},
                                    {"cpu_s": -1}, {"cpu_s": 1e300}, {"memory_mb": 10 ** 15}, {"open_files": 10 ** 9},
                                    {"processes": 10 ** 20}, {"output_bytes": 1 << 40}, {"file_size_mb": True}])
def test_limits_validate(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=f"SandboxLimits.{name} must be a number in"):
        SandboxLimits(**kwargs)
    assert SandboxLimits(**{name: LIMIT_MAX[name]}) is not None  # the bound itself is allowed
    assert dataclasses.asdict(SandboxLimits())["output_bytes"] == 1 << 20


@pytest.mark.slow
def test_redteam_suite_is_contained_under_bwrap(require_sandbox):
    from factory.envs.redteam import run_suite

    outcomes, metrics = run_suite("bwrap", size=2)
    escaped = [(o.case, o.reason) for o in outcomes if o.contained is False]
    assert not escaped
    assert sum(1 for o in outcomes if o.contained) >= 13
    assert metrics["warm"] + metrics["busy"] >= 1
