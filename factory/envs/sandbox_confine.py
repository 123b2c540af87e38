"""Confining the executions of a sandbox worker: namespaces, no capabilities, a seccomp filter, and the check of
what each execution left behind.

A worker serves many executions, so whatever kernel state one execution can create in the worker's namespaces
(SysV shared memory, message queues and semaphores, POSIX message queues, files in /tmp and /dev/shm, the pid
and inode counters it advances, keys in the kernel keyrings) a later execution on it could read back: an RL
policy would use that to learn its tests' answers (issue 32). So:

- the fork server is pid 1 of a pid namespace of its own, in a user namespace of its own (made once, at start:
  `enter_user_and_pid_namespaces`, `start_fork_server`). Each execution is its child there; after each, it kills
  and reaps everything left and sets the namespace's last pid back (`end_execution`), so every execution's
  processes are numbered from 2 again. As init it ignores the code's signals; the code cannot read it either
  (its /proc/1 is covered, `begin_execution`), so nothing an earlier execution made it do shows.
- each execution gets new IPC and mount namespaces (`begin_execution`): SysV IPC and POSIX message queues start
  empty with ids from 0, /tmp, /dev/shm and /dev/mqueue are fresh mounts (files and inode numbers start afresh).
  After it, the fork server is still in them: it counts what was left (`leftovers`), removes it at once (the
  kernel frees a dead IPC namespace later, from a work queue) and returns to its own mount namespace, which
  frees the execution's.
- the code's process drops every capability (`drop_capabilities`) and installs a seccomp filter
  (`seccomp_program`) that denies the kernel keyrings (add_key, request_key, keyctl: they are not namespaced;
  Docker's default profile denies them too) and, unless the pool allows them, further user namespaces.

Mounting a /proc in a user namespace needs a /proc in the mount namespace that nothing covers. bubblewrap covers
parts of the /proc it mounts when it runs as root, so there the worker mounts one of its own first
(`mount_reference_proc`, the one moment the worker holds CAP_SYS_ADMIN outside namespaces of its own) and the
fork server hides it.

This module is the worker's (it imports only the standard library; the pool sends its text to the worker); the
host imports it for `seccomp_program` and the tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x08000000, 0x10000000, 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_PR_CAPBSET_DROP = 24
_CAP_SYS_ADMIN, _CAP_VERSION_3 = 21, 0x20080522
_IPC_RMID = 0

_libc = ctypes.CDLL(None, use_errno=True)


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _read(path: str) -> bytes:
    """A small file's bytes (os.read: a text file object costs a fresh fork ~100 page faults)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


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
    status = _read("/proc/self/status")
    return int(status[status.index(b"CapEff:") + 7:].split(None, 1)[0], 16)


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


def enter_user_and_pid_namespaces() -> None:
    """Own a new user namespace (our uid and gid mapped to themselves, so files we make belong to us as before)
    and make the next process we fork the init of a new pid namespace in it: the fork server."""
    uid, gid = os.getuid(), os.getgid()
    _ok(_libc.unshare(CLONE_NEWUSER | CLONE_NEWPID), "unshare")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def start_fork_server(hide: list[str]) -> int:
    """In the fork server (pid 1 of its pid namespace): a mount namespace of its own with a /proc of that pid
    namespace and an empty read-only tmpfs over each path in `hide` (the reference /proc). Returns a descriptor of
    that mount namespace, which every execution's starts as a copy of."""
    _ok(_libc.unshare(CLONE_NEWNS), "unshare")
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for d in hide:
        _mount("tmpfs", d, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k,mode=0")
    return os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)


def begin_execution(base_mnt: int, tmp_bytes: int) -> None:
    """Before forking an execution: new IPC and mount namespaces (a copy of the fork server's) with empty
    size-bounded /tmp and /dev/shm, the new IPC namespace's message queues on /dev/mqueue (where that directory
    exists) and an empty tmpfs over /proc/1, the fork server's entry."""
    _ok(_libc.setns(base_mnt, CLONE_NEWNS), "setns")
    _ok(_libc.unshare(CLONE_NEWIPC | CLONE_NEWNS), "unshare")
    for d in ("/tmp", "/dev/shm"):
        _mount("tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={tmp_bytes},mode=1777")
    if os.path.isdir("/dev/mqueue"):
        _mount("mqueue", "/dev/mqueue", "mqueue", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    _mount("tmpfs", "/proc/1", "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k,mode=0")


def end_execution(base_mnt: int) -> dict[str, int]:
    """Once the execution's processes are all gone: what it left in IPC (`leftovers`, removed now), then back to the
    fork server's mount namespace (the execution's, and its /tmp, go) and the pid namespace's next pid set back
    to 2. Returns the leftovers."""
    left = leftovers(remove=True)
    _ok(_libc.setns(base_mnt, CLONE_NEWNS), "setns")
    _write("/proc/sys/kernel/ns_last_pid", "1")
    return left


def drop_capabilities() -> None:
    """No capability left, in any set (the code's process, in the user namespace it owns)."""
    for cap in range(int(_read("/proc/sys/kernel/cap_last_cap")) + 1):
        _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    _capset(0)
    if _capabilities():
        raise OSError("capabilities left after dropping them all")


def _sysvipc(kind: str) -> list[list[bytes]]:
    return [line.split() for line in _read(f"/proc/sysvipc/{kind}").splitlines()[1:]]


def leftovers(remove: bool = False) -> dict[str, int]:
    """What is in this IPC namespace (an execution's: only what it left), by kind, kinds with none left out:
    sysv_shm (segments) and sysv_shm_bytes, sysv_msg, sysv_sem, posix_mqueue. remove: also remove it all now.
    (Keys need no check: the seccomp filter denies every call that makes one.)"""
    found: dict[str, int] = {}
    shm, msg, sem = _sysvipc("shm"), _sysvipc("msg"), _sysvipc("sem")
    if shm:
        found["sysv_shm"], found["sysv_shm_bytes"] = len(shm), sum(int(row[3]) for row in shm)
    if msg:
        found["sysv_msg"] = len(msg)
    if sem:
        found["sysv_sem"] = len(sem)
    queues = os.listdir("/dev/mqueue") if os.path.ismount("/dev/mqueue") else []
    if queues:
        found["posix_mqueue"] = len(queues)
    if remove:
        for row in shm:
            _libc.shmctl(int(row[1]), _IPC_RMID, None)
        for row in msg:
            _libc.msgctl(int(row[1]), _IPC_RMID, None)
        for row in sem:
            _libc.semctl(int(row[1]), 0, _IPC_RMID)
        for name in queues:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/mqueue", name))
    return found


def tcp_sockets() -> int:
    """TCP sockets in this network namespace, in use or in TIME_WAIT (which outlives its process): the per-namespace
    counters of /proc/net/sockstat{,6} (/proc/net/tcp would walk the host's whole connection table)."""
    n = 0
    for name in ("/proc/net/sockstat", "/proc/net/sockstat6"):
        with contextlib.suppress(OSError):
            for line in _read(name).splitlines():
                if line.startswith((b"TCP:", b"TCP6:")):
                    fields = line.split()[1:]
                    counts = dict(zip(fields[::2], fields[1::2], strict=False))
                    n += int(counts.get(b"inuse", 0)) + int(counts.get(b"tw", 0))
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
