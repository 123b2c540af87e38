"""The sandbox pool as a service: `factory sandbox-serve` in its own process, driven by RemoteSandboxPool."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from factory.envs.sandbox import SandboxLimits
from factory.envs.sandbox_service import RemoteSandboxPool
from factory.infra.supervisor import ServiceProcess


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


def _raw(text: str) -> bytes:
    return text.encode()


# (id, method, path, json body or raw bytes, status, field, words the message must hold)
BAD = [
    ("file-name-trailing-slash", {"code": "print(1)", "files": {"ok/": "x"}}, 422, "files", ["bad file name 'ok/'"]),
    ("file-name-dotdot", {"code": "print(1)", "files": {"../x": "y"}}, 422, "files", ["bad file name"]),
    ("file-name-empty-part", {"code": "print(1)", "files": {"a//b": "y"}}, 422, "files", ["bad file name"]),
    ("file-names-collide", {"code": "print(1)", "files": {"a": "x", "a/b": "y"}}, 422, "files", ["directory"]),
    ("file-name-huge", {"code": "print(1)", "files": {"n" * 100_000: "y"}}, 422, "files", ["over 1024 bytes"]),
    ("file-text-type", {"code": "print(1)", "files": {"a": 5}}, 422, "files.a", ["valid string"]),
    ("files-type", {"code": "print(1)", "files": ["a"]}, 422, "files", ["valid dictionary"]),
    ("code-missing", {"cod": "print(1)"}, 422, "code", ["required"]),
    ("code-type", {"code": 5}, 422, "code", ["valid string"]),
    ("code-lone-surrogate", _raw('{"code": "print(1)\\ud800"}'), 422, "code", ["not valid Unicode"]),
    ("stdin-type", {"code": "print(1)", "stdin": 5}, 422, "stdin", ["valid string"]),
    ("stdin-lone-surrogate", _raw('{"code": "print(1)", "stdin": "\\ud800"}'), 422, "stdin",
     ["not valid Unicode"]),
    ("limit-unknown", {"code": "print(1)", "limits": {"wall": 1}}, 422, "limits.wall", ["not permitted"]),
    ("limit-negative", {"code": "print(1)", "limits": {"wall_s": -1}}, 422, "limits.wall_s", ["greater than 0"]),
    ("limit-nan", _raw('{"code": "print(1)", "limits": {"wall_s": NaN}}'), 422, "limits.wall_s", ["finite"]),
    ("limit-inf", _raw('{"code": "print(1)", "limits": {"cpu_s": Infinity}}'), 422, "limits.cpu_s", ["finite"]),
    ("limit-huge-wall", {"code": "print(1)", "limits": {"wall_s": 1e300}}, 422, "limits.wall_s",
     ["less than or equal to 3600"]),
    ("limit-huge-memory", {"code": "print(1)", "limits": {"memory_mb": 10 ** 15}}, 422, "limits.memory_mb",
     ["less than or equal to"]),
    ("limit-huge-open-files", {"code": "print(1)", "limits": {"open_files": 10 ** 9}}, 422, "limits.open_files",
     ["less than or equal to"]),
    ("limit-huge-output", {"code": "print(1)", "limits": {"output_bytes": 10 ** 12}}, 422, "limits.output_bytes",
     ["less than or equal to"]),
    ("malformed-json", _raw('{"code": '), 422, "body", ["malformed JSON"]),
    ("not-an-object", _raw('"print(1)"'), 422, "body", ["valid dictionary"]),
    ("oversized", {"code": "#" * (8 << 20)}, 413, "body", ["byte limit"]),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_request_is_refused_naming_the_field(remote, case):
    _, body, status, field, words = case
    with httpx.Client(base_url=remote.url, timeout=60) as http:  # keep-alive across the refusal
        if isinstance(body, bytes):
            r = http.post("/run", content=body, headers={"content-type": "application/json"})
        else:
            r = http.post("/run", json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["field"] == field and err["type"] != "internal_error", err
        assert all(w in err["message"] for w in words) and len(err["message"]) <= 500, err["message"]
        assert field.split(".")[0] in err["message"]
        # nothing ran, no worker was hurt, and a good request still succeeds
        good = http.post("/run", json={"code": "print(input() * 2)", "stdin": "ab\n"})
        assert good.status_code == 200 and good.json()["stdout"] == "abab\n"
    assert remote.metrics()["failures"] == 0


def test_unknown_routes_are_404_naming_them(remote):
    r = httpx.get(remote.url + "/runs")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found: GET /runs"
    assert httpx.get(remote.url + "/run").status_code == 405


def test_the_client_raises_value_error_with_the_message(remote):
    with pytest.raises(ValueError, match=r"refused the request \(422\): files: bad file name 'ok/'"):
        remote.run("print(1)", files={"ok/": "x"})


def test_code_rewards_use_the_pool_service_when_configured(remote, monkeypatch):
    from factory.config import TaskSpec
    from factory.envs import pool, tasks

    client = remote
    monkeypatch.setenv("FACTORY_SANDBOX_URL", client.url)
    monkeypatch.setattr(pool, "_POOL", None)
    splits = tasks.make_task_splits(TaskSpec(name="code", n_train=16, n_eval=8), 0)
    p = next(x for x in splits.train + splits.eval if x.id.endswith("-square"))
    before = client.metrics()["executions"]
    assert tasks.code_reward(p.answer, p) == 1.0 and tasks.code_reward("    return x\n", p) == pytest.approx(1 / 3)
    assert client.metrics()["executions"] == before + 2  # both ran in the service's pool
    assert isinstance(tasks.sandbox_pool(), type(client))
    monkeypatch.setattr(pool, "_POOL", None)


@pytest.mark.slow
def test_sandbox_serve_takes_the_body_limit_from_its_flag(tmp_path, require_sandbox):
    argv = [sys.executable, "-m", "factory.cli", "sandbox-serve", "--port", "{port}", "--size", "1",
            "--max-body-mb", "0.01"]
    with ServiceProcess("sandbox-serve", argv, log_path=tmp_path / "service.log") as svc:
        r = httpx.post(svc.url + "/run", json={"code": "#" * 20_000})
        assert r.status_code == 413 and "10485 byte limit" in r.json()["error"]["message"]
        assert httpx.post(svc.url + "/run", json={"code": "print(3)"}).json()["stdout"] == "3\n"
