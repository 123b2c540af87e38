"""The eval server (factory/runs/eval_server.py): the same results as the in-process eval, clear 4xx answers to bad
requests, 127.0.0.1 only, one server for concurrent starters, a crash mid-eval that ends the caller's wait at once
and makes the `checkpoint_eval` asset evaluate in-process, a run worker that imports no torch, mlflow or matplotlib
when the server answers, and no server left behind (each test stops its own; the module checks none remain).

A real micro model trained here (2-digit additions, 800 SFT steps: accuracy well above zero, so agreement means
something), a real lake, real server processes, real Dagster materializations."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from dagster import DagsterInstance, materialize
from pyiceberg.expressions import And, EqualTo

from factory.config import parse_spec
from factory.home import FactoryPaths, factory_home
from factory.lake import Lake
from factory.runs.checkpoint_eval import checkpoint_key, eval_key, evaluate_and_draw, evaluate_recorded_checkpoint
from factory.runs.eval_server import (
    EvalServerUnavailable,
    _alive,
    evaluate_remote,
    info_path,
    live_server,
    start_server,
    stop_server,
)
from tests.polling import exits_within, wait_for

ROOT = Path(__file__).resolve().parents[2]
SPEC = {"seed": 0, "name": "evsrv", "model": {"preset": "micro"},
        "task": {"digits": [2], "operations": ["add"], "n_train": 1000, "n_eval": 60, "reverse_answer": True,
                 "reverse_operands": True},
        "sft": {"steps": 800, "stop_at_accuracy": None, "lr": 3e-3},
        "algorithm": {"lr": 1e-7, "group_size": 2},
        "rollout": {"max_new_tokens": 3, "prompts_per_step": 2},
        "schedule": {"steps": 2, "checkpoint_every": 1, "eval_pass_k": 2}, "trainer": {"threads": 1}}


def _servers_of(home: FactoryPaths) -> list[int]:
    """Pids of eval server processes of `home` (by command line): what must be gone after the tests."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"factory.runs.eval_serve" in cmd and str(home.root).encode() in cmd and _alive(int(d.name)):
                pids.append(int(d.name))
    return pids


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with checkpoints at steps 1 and 2; its home and run_id. No server may outlive the module."""
    import torch

    from factory.cockpit.tracking import Tracker
    from factory.runs.rl_run import run_rl
    from factory.runs.stages import build_dataset, load_dataset, train_sft_checkpoint

    torch.set_num_threads(1)
    home = factory_home(tmp_path_factory.mktemp("evsrv"))
    spec = parse_spec(SPEC)
    splits = load_dataset(build_dataset(spec, home).path)
    sft = train_sft_checkpoint(spec, home, splits, log=lambda _: None)
    assert sft.accuracy >= 0.3, sft.accuracy  # something for the two ways to agree on
    with Lake.open(home) as lake:
        run = run_rl(spec, home, sft.checkpoint.path, splits, lake, Tracker(home), log=lambda _: None)
    yield home, run.run_id
    stop_server(home)
    assert _servers_of(home) == []


@pytest.fixture
def server(trained, monkeypatch):
    """A started server of the trained home, stopped (and checked gone) after the test."""
    home, run_id = trained
    monkeypatch.setenv("FACTORY_HOME", str(home.root))
    info = start_server(home)
    yield home, run_id, info
    stop_server(home)
    assert not _alive(info.pid) and not info_path(home).exists()


def _resources(home: FactoryPaths) -> dict:
    from resources import FactoryHomeResource, LakeResource, MlflowResource

    h = FactoryHomeResource(root=str(home.root))
    return {"home": h, "lake": LakeResource(home=h), "mlflow": MlflowResource(home=h)}



def _forget(lake: Lake, run_id: str, step: int) -> None:
    """Delete the checkpoint's eval rows, so the next eval evaluates instead of reusing them."""
    lake.delete("evals", And(EqualTo("run_id", run_id), EqualTo("step", step)))


def _post(port: int, path: str, body: bytes, method: str = "POST") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_the_server_gives_the_in_process_result(server):
    home, run_id, _ = server
    with Lake.open(home) as lake:
        for step in (1, 2):
            _forget(lake, run_id, step)
        # two evals in a row: whatever the first leaves in the server's process must not change the second
        drawn = [evaluate_remote(home, run_id, step, "heldout", tolerance=0.05, start=False) for step in (1, 2)]
        remote = [d.result for d in drawn]
        rows_remote = sorted((r["step"], r["benchmark"], r["metric"], r["value"], r["n"])
                             for r in lake.read("evals", EqualTo("run_id", run_id)).to_pylist())
        for step in (1, 2):
            _forget(lake, run_id, step)
        local_drawn = [evaluate_and_draw(home, lake, None, run_id, step, "heldout", 0.05) for step in (1, 2)]
        local = [d.result for d in local_drawn]
        rows_local = sorted((r["step"], r["benchmark"], r["metric"], r["value"], r["n"])
                            for r in lake.read("evals", EqualTo("run_id", run_id)).to_pylist())
    assert not any(r.reused for r in remote + local)
    assert remote == local  # accuracy, pass@k, n, digest: every field
    assert [d.regression for d in drawn] == [d.regression for d in local_drawn]
    assert drawn[1].regression.previous_step == 1  # the check compared step 2 with step 1
    assert rows_remote == rows_local and len(rows_remote) >= 4  # accuracy and pass@2 of each step, at least
    assert all(r.accuracy >= 0.3 and r.pass_at_k is not None for r in remote), remote
    # a third ask of the same checkpoint reuses the rows, as in-process does
    assert evaluate_remote(home, run_id, 1, "heldout", start=False).result.reused
    # and the picture the asset shows comes back with it: a PNG, and the MLflow URL of the all-benchmarks one
    assert all(d.picture.startswith(b"\x89PNG") and "get-artifact" in d.evals_url for d in drawn)


def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(server):
    home, run_id, info = server
    cases = [
        (b"not json", 400, "body: not JSON"),
        (b"[1, 2]", 400, "expected a JSON object"),
        (json.dumps({"run_id": run_id, "benchmark": "heldout"}).encode(), 400, "step: expected int, got None"),
        (json.dumps({"run_id": run_id, "step": "1", "benchmark": "heldout"}).encode(), 400, "step: expected int"),
        (json.dumps({"run_id": run_id, "step": -1, "benchmark": "heldout"}).encode(), 400, "step: expected >= 0"),
        (json.dumps({"run_id": run_id, "step": 1, "benchmark": "heldout", "tolerance": "x"}).encode(), 400,
         "tolerance: expected a number in [0, 1] or null, got 'x'"),
        (json.dumps({"run_id": run_id, "step": 1, "benchmark": "mmlu"}).encode(), 422, "unknown benchmark 'mmlu'"),
        (json.dumps({"run_id": run_id, "step": 99, "benchmark": "heldout"}).encode(), 404, "no checkpoint"),
    ]
    for body, code, says in cases:
        status, answer = _post(info.port, "/eval", body)
        assert (status, says in answer["error"]) == (code, True), (body, status, answer)
    assert _post(info.port, "/nowhere", b"{}")[0] == 404
    # the client raises the in-process errors, with the in-process words
    with pytest.raises(LookupError, match="no checkpoint"):
        evaluate_remote(home, run_id, 99, "heldout", start=False)
    with pytest.raises(ValueError, match="unknown benchmark"):
        evaluate_remote(home, run_id, 1, "mmlu", start=False)
    assert live_server(home) == info
    assert evaluate_remote(home, run_id, 2, "heldout", start=False).result.n == 60


def test_it_listens_on_loopback_only_and_concurrent_starts_share_it(server):
    home, _, info = server
    port = f"{info.port:04X}"
    listening = [line.split()[1] for line in Path(f"/proc/{info.pid}/net/tcp").read_text().splitlines()[1:]
                 if line.split()[1].endswith(f":{port}") and line.split()[3] == "0A"]  # 0A: LISTEN
    assert listening == [f"0100007F:{port}"]  # 127.0.0.1, nothing else
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(start_server(home))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [info] * 3 and _servers_of(home) == [info.pid]


def test_a_crash_mid_eval_ends_the_wait_and_the_asset_evaluates_in_process(trained, monkeypatch, tmp_path):
    from assets.evals import checkpoint_eval

    home, run_id = trained
    monkeypatch.setenv("FACTORY_HOME", str(home.root))
    monkeypatch.setenv("FACTORY_FAULT_KILL", "eval_server_eval:1")  # the server SIGKILLs itself inside its eval
    info = start_server(home)
    with pytest.raises(EvalServerUnavailable, match=f"pid {info.pid}.* gave no answer"):
        evaluate_remote(home, run_id, 1, "carry_chains", start=False)
    # its sockets close before it is a zombie: on a loaded machine the client can hear the close first
    assert exits_within(info.pid, 60.0) and not _alive(info.pid)
    # The asset: the server it starts dies the same way; the eval is done in the run's own process instead.
    with Lake.open(home) as lake:
        _forget(lake, run_id, 1)
    with DagsterInstance.ephemeral() as instance:
        key = eval_key(checkpoint_key(run_id, 1), "heldout")
        instance.add_dynamic_partitions("checkpoint_evals", [key])
        result = materialize([checkpoint_eval], partition_key=str(key), resources=_resources(home),
                             instance=instance)
        assert result.success
        said = [e.user_message for e in instance.all_logs(result.run_id)]
        warned = [m for m in said if "evaluating in this process instead of the eval server" in m]
    assert warned and "gave no answer" in warned[0], said
    (mat,) = result.asset_materializations_for_node("checkpoint_eval")
    assert mat.metadata["reused"].value is False and mat.metadata["n"].value == "60"
    stop_server(home)
    assert _servers_of(home) == []


ASSET_IN_A_FRESH_PROCESS = """
import json, sys
from dagster import DagsterInstance, materialize
from assets.evals import checkpoint_eval
from factory.runs.checkpoint_eval import eval_key
from factory.home import factory_home
from resources import FactoryHomeResource, LakeResource, MlflowResource
h = FactoryHomeResource(root=sys.argv[1])
resources = lambda _: {"home": h, "lake": LakeResource(home=h), "mlflow": MlflowResource(home=h)}
home = factory_home(sys.argv[1])
key = eval_key(sys.argv[2], "heldout")
with DagsterInstance.ephemeral() as instance:
    instance.add_dynamic_partitions("checkpoint_evals", [key])
    result = materialize([checkpoint_eval], partition_key=str(key), resources=resources(home), instance=instance)
(mat,) = result.asset_materializations_for_node("checkpoint_eval")
print(json.dumps({"success": result.success, "heavy": [m for m in ("torch", "transformers", "mlflow", "matplotlib")
                                                     if m in sys.modules],
                  "accuracy": mat.metadata["accuracy"].value, "reused": mat.metadata["reused"].value,
                  "pictures": "pictures" in mat.metadata and "evals" in mat.metadata}))
"""


def test_the_asset_imports_no_torch_mlflow_or_matplotlib_when_the_server_answers(server):
    home, run_id, info = server
    with Lake.open(home) as lake:
        _forget(lake, run_id, 1)
        expected = evaluate_recorded_checkpoint(home, lake, run_id, 1, "heldout")
        _forget(lake, run_id, 1)
    out = subprocess.run([sys.executable, "-c", ASSET_IN_A_FRESH_PROCESS, str(home.root), checkpoint_key(run_id, 1)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "FACTORY_HOME": str(home.root)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got == {"success": True, "heavy": [], "accuracy": expected.accuracy, "reused": False, "pictures": True}
    assert live_server(home) == info  # the asset used the running server instead of starting one
    assert _post(info.port, "/health", b"", method="GET")[1]["served"] >= 1


def test_an_idle_server_exits_and_removes_its_file(trained, monkeypatch):
    home, _ = trained
    monkeypatch.setenv("FACTORY_HOME", str(home.root))
    info = start_server(home, idle_s=1.0)
    wait_for("the idle server to exit", lambda: not _alive(info.pid), limit_s=120)
    assert not info_path(home).exists() and live_server(home) is None


def test_eval_serve_refuses_bad_arguments(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FACTORY_HOME": str(tmp_path)}
    for args, says in ((["--idle-s", "-1"], "--idle-s: must be >= 0"), (["--port", "70000"], "--port: must be")):
        out = subprocess.run([sys.executable, "-m", "factory.cli", "eval-serve", *args], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode != 0 and says in out.stderr, out.stderr


def test_the_eval_job_runs_its_step_in_the_run_worker_unless_told(monkeypatch):
    from dagster import in_process_executor

    from assets.evals import _eval_executor

    monkeypatch.delenv("FACTORY_EVAL_EXECUTOR", raising=False)
    assert _eval_executor() is in_process_executor
    monkeypatch.setenv("FACTORY_EVAL_EXECUTOR", "multiprocess")
    assert _eval_executor() is None  # Dagster's default: a process per step
    monkeypatch.setenv("FACTORY_EVAL_EXECUTOR", "threads")
    with pytest.raises(ValueError, match="FACTORY_EVAL_EXECUTOR: expected in_process or multiprocess, got 'threads'"):
        _eval_executor()
