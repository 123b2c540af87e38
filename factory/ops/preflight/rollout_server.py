"""The rollout server check: `factory serve` started, supervised, on a freshly built `micro` checkpoint answers
POST /v1/completions. It builds a model (torch, transformers): the runner imports this module when the probe runs."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from factory.home import FactoryPaths
from factory.infra.supervisor import ServiceProcess, ServiceUnavailable
from factory.models.build import build_model
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer
from factory.ops.preflight.result import CheckResult

ROLLOUT_STARTUP_S = 90.0


def rollout_server_check(paths: FactoryPaths) -> CheckResult:
    """`factory serve` on a freshly built `micro` checkpoint, supervised, answers POST /v1/completions."""
    expected = f"serves a completion within {ROLLOUT_STARTUP_S:.0f} s"
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".preflight-serve-", dir=paths.checkpoints))
    try:
        tok = build_tokenizer()
        save_checkpoint(build_model("micro", tok, seed=0), tok, tmp / "micro")
        argv = [sys.executable, "-m", "factory.cli", "serve", "--checkpoint", str(tmp / "micro"), "--port", "{port}",
                "--threads", "1", "--max-batch", "4"]
        try:
            with ServiceProcess("preflight rollout server", argv, log_path=tmp / "serve.log",
                                startup_timeout=ROLLOUT_STARTUP_S, max_restarts=0) as svc:
                r = httpx.post(f"{svc.url}/v1/completions", timeout=30.0,
                               json={"model": "micro", "prompt": "12+34=", "max_tokens": 4, "temperature": 0})
        except ServiceUnavailable as e:
            log = (tmp / "serve.log").read_text(errors="replace").strip().splitlines()[-3:]
            return CheckResult("rollout_server", False, None, ROLLOUT_STARTUP_S, "s", expected,
                               f"{e}; last log lines: {' | '.join(log)}")
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            return CheckResult("rollout_server", False, seconds, ROLLOUT_STARTUP_S, "s", expected,
                               f"POST /v1/completions answered {r.status_code}: {r.text[:200]}")
        choice = r.json()["choices"][0]
        if not choice.get("token_ids"):
            return CheckResult("rollout_server", False, seconds, ROLLOUT_STARTUP_S, "s", expected,
                               f"POST /v1/completions returned no tokens: {choice}")
        return CheckResult("rollout_server", True, round(seconds, 2), ROLLOUT_STARTUP_S, "s", expected,
                           f"started `factory serve` on a fresh micro checkpoint and got a completion of "
                           f"{len(choice['token_ids'])} tokens in {seconds:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
