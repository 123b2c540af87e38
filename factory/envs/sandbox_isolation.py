"""Sandbox isolation: the bubblewrap command line, its probe, the interpreter layout and per-worker cgroups.

Isolation (`isolation="bwrap"`): new mount, pid, net, ipc and uts namespaces; a read-only root with
read-only /usr (+ the /bin, /lib* links), a few /etc files and the interpreter's installation; private
size-bounded tmpfs /tmp and /dev/shm (the only writable places); fresh /proc and minimal /dev; a
scrubbed environment (PATH, HOME=/tmp, LANG). The repo, FACTORY_HOME, /root and the host's loopback
are not reachable. Inside it the worker makes a user namespace of its own (sandbox_confine.py): so no
--disable-userns here; the code's process installs a seccomp filter that fails unshare/clone with CLONE_NEWUSER
(and the keyring calls), in every mode, unless the pool was made with allow_userns=True. The code sees the
standard library only (`python -I -S`, the interpreter behind `python`, e.g. a venv's base), and only its own
processes. How the code is kept from the worker depends on who runs the pool:

- as root, bwrap runs privileged (no user namespace) with only CAP_SETUID/CAP_SETGID kept (and CAP_SYS_ADMIN
  until the worker has mounted the reference /proc its namespaces need, REF_PROC: bwrap covers parts of the one
  it mounts as root, and a user namespace may mount a /proc only where one is fully visible); the worker then
  switches to a random unprivileged uid of its own, the code's, before it makes its namespaces (or, where it
  cannot make them, each child switches). RLIMIT_NPROC then binds (the kernel does not apply it to uid 0, even
  inside a user namespace).
- otherwise bwrap makes a user namespace; the code keeps the worker's uid.
Either way the fork server is pid 1 of the code's pid namespace: the code's signals do not reach it, its /proc
entry is covered, and it is non-dumpable, so its pipes stay out of reach.

Memory: RLIMIT_AS per process always; where this process may create cgroups (v2 with the memory
controller delegated, or v1 memory/pids hierarchies) each worker also gets its own cgroup with a
memory and pids limit, which bounds the sum over all processes of an execution.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from factory.envs.sandbox_types import SandboxLimits

log = logging.getLogger(__name__)

_CGROUP_OVERHEAD_MB = 64  # the worker and bwrap themselves, on top of the code's memory limit
# As root, bwrap covers parts of the /proc it mounts, and no user namespace may then mount a /proc of its own:
# the worker mounts an uncovered one here at start, for its executions' namespaces (sandbox_confine).
REF_PROC = "/.sandbox-proc"
_CGROUP_PREFIX = "factory-sandbox-"
_PROBES: dict[tuple, str | None] = {}  # (bwrap argv prefix) -> None if it works, else why not
_probe_lock = threading.Lock()


class IsolationUnavailable(RuntimeError):
    """bubblewrap (or the namespaces it needs) is not usable here; the message says why."""



def _world_readable(path: str) -> bool:
    """Whether any uid may read path and reach it (o+rx on it and o+x on every directory above)."""
    p = Path(path)
    try:
        return (p.stat().st_mode & 0o005) == 0o005 and all(q.stat().st_mode & 0o001 for q in p.parents)
    except OSError:
        return False


@dataclass(frozen=True)
class _PythonLayout:
    executable: str  # the real interpreter binary (a venv's python resolves to its base)
    base_prefix: str


def _python_layout(python: str) -> _PythonLayout:
    exe = os.path.realpath(python)
    if exe == os.path.realpath(sys.executable):
        return _PythonLayout(exe, sys.base_prefix)
    out = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                         text=True, timeout=60, check=True)
    return _PythonLayout(exe, out.stdout.strip())




def _bwrap_prefix(bwrap: str, layout: _PythonLayout, privileged: bool, tmp_mb: int) -> list[str]:
    """bubblewrap's arguments up to the command. privileged: we are root, so no user namespace (see the
    module docstring) and only the capabilities the worker needs to switch the code to its own uid (and, until it
    has mounted REF_PROC, CAP_SYS_ADMIN). No --disable-userns: each execution's namespaces start with a user
    namespace of their own; the code's seccomp filter denies it any further one."""
    a = [bwrap]
    if privileged:
        # CAP_SYS_ADMIN only for the worker to mount the reference /proc at start (REF_PROC); it drops it then.
        a += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SYS_ADMIN",
              "--dir", REF_PROC]
    else:
        a += ["--unshare-all", "--unshare-user"]
    a += ["--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            a += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            a += ["--ro-bind", top, top]
    # Minimal /etc: the dynamic loader's cache, the time zone, and the alternatives /usr/bin links into.
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives"):
        a += ["--ro-bind-try", f, f]
    binds = sorted(p for p in {layout.base_prefix, os.path.dirname(os.path.dirname(layout.executable))}
                   if not p.startswith("/usr/"))
    # bwrap gives the directories it creates above a bind their host modes; a 0700 /root above a pyenv
    # install would leave the code (its own uid) unable to import anything the worker had not preloaded.
    parents = sorted({str(q) for p in binds for q in Path(p).parents if str(q) != "/"}, key=len)
    for d in parents:
        a += ["--perms", "0755", "--dir", d]
    for p in binds:
        a += ["--ro-bind", p, p]
    size = str(tmp_mb << 20)
    a += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev",
          "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm", "--dir", "/dev/mqueue",
          # Only /tmp and /dev/shm stay writable (and are wiped after each run); in a user namespace the code
          # would otherwise own the sandbox's root and /dev, and could leave files there for the next run.
          "--remount-ro", "/dev", "--remount-ro", "/",
          "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
          "--setenv", "LANG", "C.UTF-8", "--chdir", "/tmp"]
    return a


def _probe_bwrap(prefix: list[str], exe: str) -> None:
    key = tuple(prefix) + (exe,)
    with _probe_lock:
        if key not in _PROBES:
            try:
                p = subprocess.run([*prefix, exe, "-I", "-S", "-c", "pass"], capture_output=True, text=True,
                                   timeout=60)
                why = None if p.returncode == 0 else (p.stderr.strip() or f"exit code {p.returncode}")
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"{type(e).__name__}: {e}"
            _PROBES[key] = why
        why = _PROBES[key]
    if why is not None:
        raise IsolationUnavailable(
            f"bubblewrap cannot start a sandbox here: {why}. It needs the bubblewrap package and, unless run as "
            f"root, unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            f"user.max_user_namespaces > 0; inside a container, one that allows them). isolation='none' runs "
            f"without isolation.")


class _Cgroup:
    """One worker's cgroups: a memory (and, where possible, pids) limit over all its processes."""

    def __init__(self, kind: str, dirs: dict[str, str]):
        self.kind, self.dirs = kind, dirs  # controller ("memory", "pids") -> directory

    @property
    def procs_files(self) -> list[str]:
        return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

    def set_limits(self, limits: SandboxLimits) -> None:
        memory = (limits.memory_mb + _CGROUP_OVERHEAD_MB) << 20
        pids = limits.processes + 8  # + the worker, bwrap's init and a sweep helper
        if self.kind == "cgroup-v2":
            _write(os.path.join(self.dirs["memory"], "memory.max"), memory)
            with contextlib.suppress(OSError):
                _write(os.path.join(self.dirs["memory"], "memory.swap.max"), 0)
        else:
            _write(os.path.join(self.dirs["memory"], "memory.limit_in_bytes"), memory)
        if "pids" in self.dirs:
            _write(os.path.join(self.dirs["pids"], "pids.max"), pids)

    def memory_bytes(self) -> int | None:
        """Memory charged to the cgroup now (None where it cannot be read)."""
        name = "memory.current" if self.kind == "cgroup-v2" else "memory.usage_in_bytes"
        try:
            with open(os.path.join(self.dirs["memory"], name)) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        name = "memory.events" if self.kind == "cgroup-v2" else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs["memory"], name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, timeout: float = 2.0) -> None:
        end = time.monotonic() + timeout
        for d in set(self.dirs.values()):
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # still has dying processes
                    if time.monotonic() >= end:
                        log.debug("could not remove cgroup %s", d)
                        break
                    time.sleep(0.01)  # processes leave a cgroup asynchronously after SIGKILL; bounded


def _write(path: str, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


class _Cgroups:
    """Where this process may create per-worker cgroups with a memory limit; `detect()` is None elsewhere."""

    def __init__(self, kind: str, parents: dict[str, str]):
        self.kind, self.parents = kind, parents

    @classmethod
    def detect(cls, root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> _Cgroups | None:
        try:
            with open(self_cgroup) as f:
                lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        except OSError:
            return None
        if os.path.exists(os.path.join(root, "cgroup.controllers")):  # v2 (unified)
            path = next((p for i, c, p in lines if i == "0"), None)
            if path is None:
                return None
            parent = os.path.join(root, path.lstrip("/"))
            probe = cls._probe(parent, ["memory.max"])
            if probe is None:
                return None
            parents = {"memory": parent}
            if "pids.max" in probe:
                parents["pids"] = parent
            return cls("cgroup-v2", parents)
        parents = {}
        for _, controllers, path in lines:
            for c in controllers.split(","):
                if c in ("memory", "pids"):
                    d = os.path.join(root, c, path.lstrip("/"))
                    if cls._probe(d, ["memory.limit_in_bytes" if c == "memory" else "pids.max"]) is not None:
                        parents[c] = d
        return cls("cgroup-v1", parents) if "memory" in parents else None

    @staticmethod
    def _probe(parent: str, need: list[str]) -> set[str] | None:
        """Files a new child cgroup of parent has, if we may make one that has all of `need`."""
        d = os.path.join(parent, f"{_CGROUP_PREFIX}probe-{os.getpid()}")
        try:
            os.mkdir(d)
        except OSError:
            return None
        try:
            names = set(os.listdir(d))
            return names if all(n in names for n in need) else None
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(d)

    def create(self, name: str) -> _Cgroup:
        dirs = {}
        for c, parent in self.parents.items():
            d = os.path.join(parent, _CGROUP_PREFIX + name)
            os.makedirs(d, exist_ok=True)
            dirs[c] = d
        return _Cgroup(self.kind, dirs)

    def remove_stale(self) -> None:
        """Empty cgroups left by pools of processes that have died."""
        for parent in set(self.parents.values()):
            with contextlib.suppress(OSError):
                for name in os.listdir(parent):
                    pid = name[len(_CGROUP_PREFIX):].split("-", 1)[0]
                    if name.startswith(_CGROUP_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(parent, name))
