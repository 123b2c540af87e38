"""Confining one execution of the sandbox worker: namespaces of its own, no capabilities, a seccomp filter, and
the check of what it left behind.

A worker serves many executions, so whatever kernel state one execution can create in the worker's namespaces
(SysV shared memory, message queues and semaphores, POSIX message queues, files in /tmp and /dev/shm, the pid
and inode counters it advances, keys in the kernel keyrings) a later execution on it could read back: an RL
policy would use that to learn its tests' answers (issue 32). So every execution gets its own:

- user namespace (its uid and gid mapped to themselves), which owns
- an IPC namespace (SysV IPC and POSIX message queues start empty, their ids from 0),
- a mount namespace with a fresh /proc, /tmp, /dev/shm and /dev/mqueue (files and inode numbers start afresh;
  /proc shows only the execution's own processes, so the pids an earlier one used cannot be seen),
- a pid namespace whose init (`become_init`) is not the code: it reaps, and once the code's process exits it
  kills whatever the code left running, removes what it left in IPC, counts it (`leftovers`), reports to the
  worker and exits, and the namespaces go with it.

The code's own process (pid 2) then drops every capability (`drop_capabilities`) and installs a seccomp filter
(`seccomp_program`) that denies the kernel keyrings (add_key, request_key, keyctl: they are not namespaced; Docker's
default profile denies them too) and, unless the pool allows them, further user namespaces.

Mounting a fresh /proc needs a /proc in the worker's mount namespace that nothing covers. bubblewrap covers parts
of the /proc it mounts when it runs as root, so there the worker mounts one of its own at start
(`mount_reference_proc`, the one moment the worker holds CAP_SYS_ADMIN) and each execution hides it.

This module is the worker's (it imports only the standard library; the pool sends its text to the worker); the
host imports it for `seccomp_program` and the tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import struct

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x08000000, 0x10000000, 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_PR_CAPBSET_DROP, _PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 24, 1, 4
_CAP_SYS_ADMIN, _CAP_VERSION_3 = 21, 0x20080522
_IPC_RMID = 0

_libc = ctypes.CDLL(None, use_errno=True)


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _mount(source: str, target: str, fstype: str, flags: int, data: str | None = None) -> None:
    _ok(_libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode() if data else None),
        f"mount {fstype} on {target}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capset(keep: int) -> None:
    """Permitted and effective: exactly the capabilities in the bit mask `keep` (< 32); inheritable: none."""
    data = (_CapData * 2)(_CapData(keep, keep, 0), _CapData(0, 0, 0))
    _ok(_libc.capset(ctypes.byref(_CapHeader(_CAP_VERSION_3, 0)), data), "capset")


def _capabilities() -> int:
    """This process's effective capabilities (a bit mask)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))


def mount_reference_proc(path: str) -> str | None:
    """Mount a /proc nothing covers at `path` (an empty directory bubblewrap made), then give up CAP_SYS_ADMIN for
    good, whatever happened: bubblewrap set no_new_privs, so no exec can bring it back. The capabilities the worker
    came with but this one stay (CAP_SETUID and CAP_SETGID, to run the code as its own uid). Returns why the mount
    failed (None: it did not)."""
    try:
        _mount("proc", path, "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        why = None
    except OSError as e:
        why = str(e)
    finally:
        _capset(_capabilities() & ~(1 << _CAP_SYS_ADMIN) & 0xFFFFFFFF)
    if _capabilities() & (1 << _CAP_SYS_ADMIN):
        raise OSError("CAP_SYS_ADMIN is still effective after dropping it")
    return why


def enter_namespaces() -> None:
    """Make this process the owner of new user, IPC and mount namespaces, with the next process it forks the init
    of a new pid namespace; its uid and gid map to themselves (so files it makes belong to it as before)."""
    uid, gid = os.getuid(), os.getgid()
    _ok(_libc.unshare(CLONE_NEWUSER | CLONE_NEWIPC | CLONE_NEWNS | CLONE_NEWPID), "unshare")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def mount_execution_fs(tmp_bytes: int, hide: list[str]) -> None:
    """In the new pid namespace's init: a /proc of this pid namespace, empty size-bounded /tmp and /dev/shm, the
    IPC namespace's message queues on /dev/mqueue (where that directory exists) and an empty read-only tmpfs
    over each path in `hide` (the worker's reference /proc)."""
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for d in ("/tmp", "/dev/shm"):
        _mount("tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={tmp_bytes},mode=1777")
    if os.path.isdir("/dev/mqueue"):
        _mount("mqueue", "/dev/mqueue", "mqueue", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for d in hide:
        _mount("tmpfs", d, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k,mode=0")


def drop_capabilities() -> None:
    """No capability left, in any set (the code's process, in the user namespace it owns)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    _capset(0)
    if _capabilities():
        raise OSError("capabilities left after dropping them all")


def become_init(code_pid: int, report_fd: int) -> None:
    """Pid 1 of the execution's pid namespace, until the code's process exits: reap everything; then kill what is
    left, remove what it left in IPC, write {"status": the code's wait status, "leftovers": {...}} to report_fd
    (`leftovers`, and "processes": how many were still running) and exit (the namespaces end with us)."""
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # the code (same uid) can neither ptrace us nor open our fds
    for fd in (0, 1, 2):
        os.close(fd)  # the worker's pipes end when the code's processes are done with them
    status = None
    while status is None:
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == code_pid:
            status = st
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)  # as init, every other process of the namespace
    killed = 0
    with contextlib.suppress(ChildProcessError):
        while True:
            os.waitpid(-1, 0)
            killed += 1
    left = leftovers(remove=True)
    if killed:
        left["processes"] = killed
    report = json.dumps({"status": status, "leftovers": left}).encode()
    os.write(report_fd, report[:4096])
    os._exit(0)


def _sysvipc(kind: str) -> list[list[str]]:
    with open(f"/proc/sysvipc/{kind}") as f:
        return [line.split() for line in f.readlines()[1:]]


def leftovers(remove: bool = False) -> dict[str, int]:
    """What is in this IPC namespace and in the keyrings of our uid (ours: only what the execution left), by kind,
    kinds with none left out: sysv_shm (segments) and sysv_shm_bytes, sysv_msg, sysv_sem, posix_mqueue, keys.
    remove: also remove the IPC objects now, so their memory is free when the execution ends (the kernel frees a
    dead IPC namespace later, from a work queue)."""
    found: dict[str, int] = {}
    shm = _sysvipc("shm")
    if shm:
        found["sysv_shm"], found["sysv_shm_bytes"] = len(shm), sum(int(row[3]) for row in shm)
    for kind, rows in (("sysv_msg", _sysvipc("msg")), ("sysv_sem", _sysvipc("sem"))):
        if rows:
            found[kind] = len(rows)
    queues = os.listdir("/dev/mqueue") if os.path.ismount("/dev/mqueue") else []
    if queues:
        found["posix_mqueue"] = len(queues)
    with contextlib.suppress(OSError), open("/proc/keys") as f:
        uid = os.getuid()
        if keys := sum(1 for line in f if line.split()[5:6] == [str(uid)]):
            found["keys"] = keys
    if remove:
        for row in shm:
            _libc.shmctl(int(row[1]), _IPC_RMID, None)
        for row in _sysvipc("msg"):
            _libc.msgctl(int(row[1]), _IPC_RMID, None)
        for row in _sysvipc("sem"):
            _libc.semctl(int(row[1]), 0, _IPC_RMID)
        for name in queues:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/mqueue", name))
    return found


def tcp_sockets() -> int:
    """TCP sockets in this network namespace (TIME_WAIT and the like outlive their processes)."""
    n = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name) as f:
            n += len(f.readlines()) - 1
    return n


# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h): a classic BPF program.
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
# machine -> AUDIT_ARCH_*, and the numbers of the calls the filter looks at
_SYSCALLS = {"x86_64": (0xC000003E, {"unshare": 272, "clone": 56, "clone3": 435, "add_key": 248, "request_key": 249,
                                     "keyctl": 250}),
             "aarch64": (0xC00000B7, {"unshare": 97, "clone": 220, "clone3": 435, "add_key": 217, "request_key": 218,
                                      "keyctl": 219})}
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE, JSET, BPF_RET|K
_ALLOW, _EPERM, _ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38


def seccomp_program(machine: str, deny_userns: bool = True) -> bytes | None:
    """The filter (struct sock_filter[]) for this machine; None where the numbers are not known. It fails with
    EPERM: add_key, request_key and keyctl; other architectures' and x32 calls; and, when deny_userns, unshare(2)
    and clone(2) with CLONE_NEWUSER; clone3(2) then gets ENOSYS (its flags are in memory a filter cannot read;
    glibc falls back to clone)."""
    if machine not in _SYSCALLS:
        return None
    arch, nr = _SYSCALLS[machine]
    # (code, jump if true, jump if false, k); jumps are labels, resolved below
    prog: list[tuple[int, object, object, int]] = [
        (_LD, 0, 0, 4), (_JEQ, 0, "eperm", arch), (_LD, 0, 0, 0), (_JGE, "eperm", 0, 0x40000000),
        *((_JEQ, "eperm", 0, nr[name]) for name in ("add_key", "request_key", "keyctl"))]
    if deny_userns:
        prog += [(_JEQ, "enosys", 0, nr["clone3"]), (_JEQ, "flags", 0, nr["unshare"]), (_JEQ, "flags", 0, nr["clone"])]
    prog += [(_RET, 0, 0, _ALLOW)]
    labels = {}
    if deny_userns:
        labels["flags"] = len(prog)  # args[0], its low 32 bits (little-endian)
        prog += [(_LD, 0, 0, 16), (_JSET, "eperm", 0, CLONE_NEWUSER), (_RET, 0, 0, _ALLOW)]
    labels["eperm"], labels["enosys"] = len(prog), len(prog) + 1
    prog += [(_RET, 0, 0, _EPERM), (_RET, 0, 0, _ENOSYS)]

    def off(i: int, target: object) -> int:
        return target if isinstance(target, int) else labels[target] - i - 1

    return b"".join(struct.pack("=HBBI", code, off(i, jt), off(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog))


class _SockFprog(ctypes.Structure):
    """struct sock_fprog: the program prctl(PR_SET_SECCOMP) takes."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Seccomp:
    """A seccomp program made once (in the worker) and installed in each execution's process."""

    def __init__(self, program: bytes):
        self._filter = ctypes.create_string_buffer(program, len(program))
        self._prog = ctypes.pointer(_SockFprog(len(program) // 8, ctypes.addressof(self._filter)))

    def install(self) -> None:
        if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, self._prog, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "could not install the seccomp filter")
