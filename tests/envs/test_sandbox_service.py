"""The sandbox pool as a service: `factory sandbox-serve` in its own process, driven by RemoteSandboxPool."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from factory.envs.sandbox import SandboxLimits
from factory.envs.sandbox_service import RemoteSandboxPool
from factory.ops.supervisor import ServiceProcess


@pytest.fixture(scope="module")
def remote(tmp_path_factory, require_sandbox):
    log = tmp_path_factory.mktemp("sandbox-service") / "service.log"
    argv = [sys.executable, "-m", "factory.cli", "sandbox-serve", "--port", "{port}", "--size", "2"]
    with ServiceProcess("sandbox-serve", argv, log_path=log) as svc, RemoteSandboxPool(svc.url) as client:
        yield client


def test_runs_code_in_the_service_process(remote):
    r = remote.run("import os\nprint(input()[::-1], os.getcwd().startswith('/tmp/'))", stdin="abc\n",
                   files={"data.txt": "x"})
    assert r.ok and r.stdout == "cba True\n" and r.reason == ""
    m = remote.metrics()
    assert m["pid"] != os.getpid() and m["isolation"] == "bwrap" and m["executions"] >= 1 and m["size"] == 2


def test_timeout_and_failures_come_back_as_results(remote):
    r = remote.run("import time\ntime.sleep(600)", limits=SandboxLimits(wall_s=0.5))
    assert (r.ok, r.timed_out, r.reason) == (False, True, "timeout after 0.5 s")
    r = remote.run("raise SystemExit(4)")
    assert (r.ok, r.exit_code, r.reason) == (False, 4, "exit code 4")
    assert remote.run("print('after')").stdout == "after\n"


def test_concurrent_requests_share_the_pool(remote):
    with ThreadPoolExecutor(max_workers=4) as ex:
        results = list(ex.map(lambda i: remote.run(f"print({i} * 2)"), range(12)))
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(12)]


def test_bad_requests_are_refused(remote):
    with pytest.raises(ValueError, match="bad file name"):
        remote.run("print(1)", files={"../x": "y"})
    r = httpx.post(remote.url + "/run", json={"code": "print(1)", "limits": {"wall_s": -1}})
    assert r.status_code == 422 and "wall_s" in r.text
    r = httpx.post(remote.url + "/run", json={"cod": "print(1)"})
    assert r.status_code == 422
    assert remote.health()


def test_code_rewards_use_the_pool_service_when_configured(remote, monkeypatch):
    from factory.config import TaskSpec
    from factory.envs import tasks

    client = remote
    monkeypatch.setenv("FACTORY_SANDBOX_URL", client.url)
    monkeypatch.setattr(tasks, "_POOL", None)
    splits = tasks.make_task_splits(TaskSpec(name="code", n_train=16, n_eval=8), 0)
    p = next(x for x in splits.train + splits.eval if x.id.endswith("-square"))
    before = client.metrics()["executions"]
    assert tasks.code_reward(p.answer, p) == 1.0 and tasks.code_reward("    return x\n", p) == pytest.approx(1 / 3)
    assert client.metrics()["executions"] == before + 2  # both ran in the service's pool
    assert isinstance(tasks.sandbox_pool(), type(client))
    monkeypatch.setattr(tasks, "_POOL", None)
