"""Each execution's own namespaces (`factory.envs.sandbox_confine`) as the pool reports them: what an execution
left is counted in its result and the pool's metrics and removed with it; what it left where a later execution could
reach it (a TCP socket in TIME_WAIT, memory still charged) gets its worker replaced; the kernel keyrings are
refused; and where executions cannot have namespaces of their own, each gets a worker of its own. Real bubblewrap
pools; skipped where bubblewrap cannot run.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import platform
import uuid

import pytest

from factory.envs import sandbox as sandbox_mod
from factory.envs import sandbox_handle
from factory.envs.redteam_carryover import ORACLES, run_oracle
from factory.envs.sandbox import SandboxLimits, SandboxPool
from factory.envs.sandbox_confine import Seccomp, seccomp_program

_LEAVE_IPC = r'''
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(0x51, 1 << 20, 0o1600) >= 0 and libc.msgget(0x52, 0o1600) >= 0
assert libc.semget(0x53, 4, 0o1600) >= 0 and libc.mq_open(b"/left", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0
if os.fork() == 0:
    os.setsid()
    time.sleep(3600)
print(sorted(os.listdir("/dev/mqueue")))
'''
_COUNT_IPC = "print([len(open(f'/proc/sysvipc/{k}').readlines()) - 1 for k in ('shm', 'msg', 'sem')], " \
             "sorted(os.listdir('/dev/mqueue')))"


def test_what_an_execution_left_is_reported_and_gone_before_the_next(require_sandbox):
    with SandboxPool(size=1) as pool, pool.sandbox() as sb:
        left = sb.exec(_LEAVE_IPC)
        after = sb.exec("import os\n" + _COUNT_IPC)
        m = pool.metrics()
    assert left.ok and left.stdout == "['left']\n", left
    assert left.leftovers == {"sysv_shm": 1, "sysv_shm_bytes": 1 << 20, "sysv_msg": 1, "sysv_sem": 1,
                              "posix_mqueue": 1, "processes": 1}
    assert after.ok and after.stdout == "[0, 0, 0] []\n" and after.leftovers == {}, after
    assert m["per_execution"] == "namespaces" and m["leftovers"] == 1 and m["recycled"] == 0  # one worker for both
    assert m["leftover_kinds"] == {"sysv_shm": 1, "sysv_msg": 1, "sysv_sem": 1, "posix_mqueue": 1, "processes": 1}


def test_a_tcp_socket_left_in_time_wait_gets_the_worker_replaced(require_sandbox):
    time_wait = next(o for o in ORACLES if o.name == "TCP TIME_WAIT port")
    with SandboxPool(size=1) as pool:
        with pool.sandbox() as sb:
            first = sb.pid
            r = sb.exec(time_wait.plant("0" * 32))
        with pool.sandbox(timeout=60) as sb:
            second = sb.pid
        m = pool.metrics()
    assert r.ok and r.leftovers.get("tcp_sockets", 0) >= 1, r
    assert first != second and m["recycled_for_leftovers"] == 1 and m["failures"] == 0, m


def test_memory_left_charged_gets_the_worker_replaced(require_sandbox, monkeypatch):
    # Negative dentries of the host's /usr stay charged to the worker's cgroup after the execution ends.
    monkeypatch.setattr(sandbox_handle, "_LEFTOVER_MEMORY_MB", 4)
    with SandboxPool(size=1) as pool:
        if pool.memory_limit == "rlimit_as":
            pytest.skip("no cgroup here: nothing to read the memory left charged from")
        # Names no run has looked up before: the host's dentry cache keeps those of earlier runs (charged to them).
        tag = uuid.uuid4().hex
        r = pool.run(f"import os\nfor i in range(100_000):\n    try:\n        os.stat(f'/usr/lib/.nx-{tag}-{{i}}')\n"
                     "    except OSError:\n        pass\n", limits=SandboxLimits(cpu_s=60, wall_s=120))
        m = pool.metrics()
    assert r.ok and r.leftovers.get("memory_mb", 0) > 4, r
    assert m["recycled_for_leftovers"] == 1 and m["leftover_kinds"] == {"memory_mb": 1}, m


_KEYCTL = r'''
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
r = libc.syscall(add_key, b"user", b"k", b"v", 1, ctypes.c_long(-4))
print(r, os.strerror(ctypes.get_errno()))
'''


@pytest.mark.parametrize("allow_userns", [False, True])
def test_the_kernel_keyrings_are_refused(require_sandbox, allow_userns):
    with SandboxPool(size=1, allow_userns=allow_userns) as pool:
        r = pool.run(_KEYCTL)
    assert r.ok and r.stdout == "-1 Operation not permitted\n", r


def _under_filter(deny_userns: bool) -> list[int]:
    """errno of add_key and of unshare(CLONE_NEWUSER) (0: it worked) in a child of ours under the filter."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: an unprivileged process may then install a filter
            Seccomp(seccomp_program(platform.machine(), deny_userns)).install()
            add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
            errs = [0 if libc.syscall(add_key, b"user", b"k", b"v", 1, ctypes.c_long(-4)) >= 0 else ctypes.get_errno(),
                    0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno()]
            os.write(w, json.dumps(errs).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return json.load(f)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="no seccomp program for this machine")
def test_the_seccomp_program_denies_the_keyrings_and_user_namespaces_unless_allowed():
    assert _under_filter(deny_userns=True) == [errno.EPERM, errno.EPERM]
    keys, userns = _under_filter(deny_userns=False)
    assert keys == errno.EPERM and userns != errno.EPERM
    assert seccomp_program("sparc") is None


def test_without_namespaces_per_execution_each_execution_gets_a_worker(require_sandbox):
    shm = next(o for o in ORACLES if o.name == "sysv_shm")
    pool = SandboxPool(size=1)
    pool._fresh = False  # as where the kernel refuses them (the test below makes it refuse)
    with pool:
        pids = []
        for _ in range(2):
            with pool.sandbox(timeout=60) as sb:
                pids.append(sb.pid)
                assert sb.exec("print(1)").ok
        outcome = run_oracle(pool, shm)
        m = pool.metrics()
    assert pids[0] != pids[1] and outcome.contained, outcome
    assert m["per_execution"] == "worker" and m["failures"] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the reference /proc is mounted only by a worker started as root")
def test_a_worker_that_cannot_confine_executions_says_why_and_serves_one(require_sandbox, monkeypatch, caplog):
    monkeypatch.setattr(sandbox_mod, "REF_PROC", "/.no-such-dir")
    with caplog.at_level(logging.WARNING, logger="factory.envs.sandbox"), SandboxPool(size=1) as pool:
        with pool.sandbox() as sb:
            why = sb.why_not_fresh
            assert sb.exec("print(1)").ok
        m = pool.metrics()
    assert why and "/.no-such-dir" in why and m["per_execution"] == "worker" and m["recycled"] == 1
    assert any("cannot have namespaces of their own" in r.getMessage() for r in caplog.records)
