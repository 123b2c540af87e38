"""Starting a job as N trainer ranks under torchrun, from Python: a bounded wait, and a failing rank's own error.

`run_ranks` runs `python -m torch.distributed.run --standalone` on one node (its rendezvous store binds port 0 and
the ranks share it: no port is picked free and bound later, when other work may have taken it), each rank's
stdout/stderr in its own log file. It returns every rank's output when all exit 0; otherwise it raises `RanksFailed`
naming the rank torchrun saw fail first, with that rank's stderr tail (the traceback), not torchrun's own stack. Past
`timeout` the whole process group is killed and `RanksTimedOut` is raised with what the ranks had written.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TAIL_CHARS = 4000  # of a failing rank's stderr in the error message: enough for a traceback
_ROOT_RANK = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)", re.S)


class RanksFailed(RuntimeError):
    """A rank exited non-zero (torchrun then stopped the others)."""


class RanksTimedOut(RanksFailed):
    """The ranks did not all exit within the timeout; they were killed."""


@dataclass(frozen=True)
class RankOutput:
    rank: int
    stdout: str
    stderr: str


def torchrun_command(nproc: int, target: str, args: Sequence[str], log_dir: Path | None) -> list[str]:
    """The torchrun command line: `target` is a script path (ends in .py) or a module name (run with -m). Each
    rank's output goes to `log_dir`, or with None rank 0's to this terminal and the others' nowhere."""
    if nproc < 1:
        raise ValueError(f"nproc: need at least 1 rank, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "0"]
    cmd += ["--log-dir", str(log_dir), "--redirects", "3"] if log_dir is not None else ["--local-ranks-filter", "0"]
    if not target.endswith(".py"):
        cmd.append("-m")
    return [*cmd, target, *map(str, args)]


def run_ranks(nproc: int, target: str | Path, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
              timeout: float = 600.0, threads: int = 1, cwd: str | Path | None = None) -> list[RankOutput]:
    """Run `target` (a .py script or a module name) as `nproc` ranks; return each rank's output, rank order.

    `env` is added to this process's environment; `threads` sets OMP_NUM_THREADS (torch's intra-op threads) per
    rank. Raises `RanksFailed` (with the first failing rank's stderr) or `RanksTimedOut` after `timeout` seconds."""
    target = str(target)
    if target.endswith(".py") and not Path(target).is_file():
        raise FileNotFoundError(f"rank script not found: {target}")
    with tempfile.TemporaryDirectory(prefix="factory-ranks-") as tmp:
        log_dir = Path(tmp)
        cmd = torchrun_command(nproc, target, args, log_dir)
        full_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": str(threads)}
        # Its own session: on timeout the agent and every rank go down together, nothing is orphaned.
        proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            agent_out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            agent_out, _ = proc.communicate()
            outputs = _rank_outputs(log_dir, nproc)
            raise RanksTimedOut(f"{nproc} ranks of {target} did not finish within {timeout:g} s (killed)\n"
                                + "".join(_describe(o) for o in outputs)) from None
        outputs = _rank_outputs(log_dir, nproc)
        if proc.returncode != 0:
            m = _ROOT_RANK.search(agent_out)
            first = int(m.group(1)) if m else None
            shown = [o for o in outputs if o.rank == first] or [o for o in outputs if o.stderr.strip()]
            where = f"rank {first} failed first" if first is not None else "a rank failed"
            raise RanksFailed(f"{nproc} ranks of {target}: {where} (torchrun exit {proc.returncode})\n"
                              + "".join(_describe(o) for o in shown)
                              + ("" if shown else f"torchrun said:\n{agent_out[-TAIL_CHARS:]}"))
        return outputs


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _rank_outputs(log_dir: Path, nproc: int) -> list[RankOutput]:
    """Each rank's logs: torchrun writes <log_dir>/<run id>/attempt_0/<local rank>/{stdout,stderr}.log."""
    out = []
    for rank in range(nproc):
        texts = {}
        for stream in ("stdout", "stderr"):
            files = sorted(log_dir.glob(f"*/attempt_*/{rank}/{stream}.log"))
            texts[stream] = files[-1].read_text(errors="replace") if files else ""
        out.append(RankOutput(rank, texts["stdout"], texts["stderr"]))
    return out


def _describe(o: RankOutput) -> str:
    return f"--- rank {o.rank} stderr (tail) ---\n{o.stderr[-TAIL_CHARS:]}\n"
