"""One execution never sees another's: memory, exit statuses as CPython reports them, no user namespaces.

The memory test is the attack of issue 23: on a pool of one worker, a third execution reads every readable
region of its own address space (/proc/self/maps, /proc/self/mem) and looks for the code, stdin, files and
stdout of the two before it. Skipped where bubblewrap cannot run (the isolation='none' cases still run).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from factory.envs.sandbox import SandboxLimits, SandboxPool

_MARK = "ISOLSECRET"  # every secret is _MARK + 32 hex digits; the scanner looks for the pattern, not the values

# The scanner: its own text holds only the pattern's parts, never a secret.
_SCAN = r'''
import re
pat = re.compile(("ISOL" + "SECRET").encode() + rb"[0-9a-f]{32}")
found = set()
with open("/proc/self/maps") as f:
    regions = [line.split() for line in f]
with open("/proc/self/mem", "rb", buffering=0) as mem:
    for parts in regions:
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if not parts[1].startswith("r") or (len(parts) > 5 and parts[5] in ("[vvar]", "[vsyscall]")):
            continue
        pos, tail = lo, b""
        while pos < hi:
            n = min(1 << 20, hi - pos)
            try:
                mem.seek(pos)
                chunk = mem.read(n)
            except OSError:
                break
            buf = tail + chunk
            found.update(m.group().decode() for m in pat.finditer(buf))
            tail, pos = buf[-64:], pos + n
print(sorted(found))
'''


def _secret(rng: random.Random) -> str:
    return f"{_MARK}{rng.getrandbits(128):032x}"


@pytest.fixture(params=["bwrap", "none"])
def isolation(request):
    if request.param == "bwrap":
        request.getfixturevalue("require_sandbox")
    return request.param


def test_an_execution_finds_nothing_of_earlier_ones_in_its_memory(isolation):
    rng = random.Random(23)
    code_s, stdin_s, file_s, out_s, file2_s = (_secret(rng) for _ in range(5))
    with SandboxPool(size=1, isolation=isolation, recycle_after=100) as pool, pool.sandbox() as sb:
        # 1: secrets in its code, its stdin and a test file; it reads them all (so they are in its heap too).
        first = sb.exec(f"import sys\nkeep = {code_s!r}\ndata = sys.stdin.read()\ntest = open('t.py').read()\n"
                        "print(len(data) + len(test))", stdin=stdin_s + "\n", files={"t.py": f"# {file_s}\n"})
        # 2: a secret on its stdout (built at run time: its code holds only the two halves).
        half = len(out_s) // 2
        second = sb.exec(f"a = {out_s[:half]!r}\nb = {out_s[half:]!r}\nprint(a + b)",
                         files={"other.txt": file2_s})
        assert first.ok and second.ok and second.stdout == out_s + "\n", (first, second)
        third = sb.exec(_SCAN, limits=SandboxLimits(wall_s=60, cpu_s=30))
    assert third.ok, third
    found = set(json.loads(third.stdout.replace("'", '"')))
    leaked = {name for name, s in [("code", code_s), ("stdin", stdin_s), ("file", file_s), ("stdout", out_s),
                                   ("second file", file2_s)] if s in found}
    assert not leaked, f"the third execution read the earlier ones' {sorted(leaked)} from its memory"


def _cpython_status(arg: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys\nsys.exit({arg})"], capture_output=True,
                       text=True, timeout=60)
    return p.returncode, p.stderr


_EXIT_ARGS = ["10**100", "-(10**100)", "2**63", "2**31", "2**32 + 3", "-1", "-129", "256", "255", "3", "0",
              "True", "False", "None", "'a message'", "1.5", "[1, 2]"]


@pytest.mark.parametrize("arg", _EXIT_ARGS)
def test_sys_exit_status_is_cpythons(isolation, arg):
    want_code, want_err = _cpython_status(arg)
    with SandboxPool(size=1, isolation=isolation) as pool:
        r = pool.run(f"import sys\nsys.exit({arg})")
    assert r.exit_code == want_code, f"sys.exit({arg}): python exits {want_code}, the sandbox reported {r.exit_code}"
    assert r.stderr == want_err and r.ok == (want_code == 0)


def test_sys_exit_in_an_atexit_function_is_ignored_as_cpython_does(isolation):
    code = "import atexit, sys\natexit.register(lambda: sys.exit(7))\nprint('body')\n"
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    with SandboxPool(size=1, isolation=isolation) as pool:
        r = pool.run(code)
    assert (r.exit_code, r.stdout) == (p.returncode, p.stdout) == (0, "body\n")
    assert "SystemExit: 7" in p.stderr and "SystemExit: 7" in r.stderr


_USERNS = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER = 0x10000000
results = {}
# os.unshare is Python 3.12+; libc's unshare(2) is the same call.
results["unshare(2)"] = "created" if libc.unshare(CLONE_NEWUSER) == 0 else os.strerror(ctypes.get_errno())
pid = os.fork()
if pid == 0:  # `unshare -U true`, from a child process
    os.execvp("unshare", ["unshare", "-U", "true"])
results["unshare -U"] = "created" if os.waitpid(pid, 0)[1] == 0 else "failed"
print(results)
sys.exit(0 if "created" in results.values() else 3)
'''


def test_user_namespaces_are_denied_unless_asked_for(isolation):
    with SandboxPool(size=1, isolation=isolation) as pool:
        denied = pool.run(_USERNS)
        # Threads and subprocesses still work (clone without CLONE_NEWUSER).
        ok = pool.run("import os, threading\nt = threading.Thread(target=print, args=('t',))\nt.start()\nt.join()\n"
                      "pid = os.fork()\nif pid == 0:\n    os.execvp('echo', ['echo', 's'])\n"
                      "assert os.waitpid(pid, 0)[1] == 0")
    assert denied.exit_code == 3 and "created" not in denied.stdout, denied
    assert ok.ok and sorted(ok.stdout.split()) == ["s", "t"], ok  # print is buffered, echo is not: any order
    with SandboxPool(size=1, isolation=isolation, allow_userns=True) as pool:
        allowed = pool.run(_USERNS)
    if "Operation not permitted" in allowed.stdout and isolation == "bwrap":
        pytest.skip(f"this kernel refuses user namespaces inside bwrap even when asked: {allowed.stdout}")
    assert allowed.exit_code == 0 and "created" in allowed.stdout, allowed


def test_large_stdout_and_stderr_come_back_whole_and_the_next_run_gets_none_of_them(require_sandbox):
    # Megabytes through the worker's buffers and its pipe to the host (many partial writes), then a run that
    # prints little: nothing of the first may trail into its reply.
    code = ("import sys\nsys.stdout.write(''.join(chr(97 + i % 26) for i in range(3_000_001)))\n"
            "sys.stderr.write('e' * 2_000_000)\n")
    with SandboxPool(size=1) as pool, pool.sandbox() as sb:
        big = sb.exec(code, limits=SandboxLimits(output_bytes=4 << 20))
        small = sb.exec("print('x')")
    want = "".join(chr(97 + i % 26) for i in range(3_000_001))
    assert big.ok and big.stdout == want and big.stderr == "e" * 2_000_000
    assert (small.stdout, small.stderr) == ("x\n", "")
