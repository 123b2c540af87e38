"""Runs that survive: a real `factory run` whose attempt is SIGKILLed, hangs, or gets SIGTERM, and what the lake
says afterwards (one `steps` row per step, the interruption with its cause, attempts and goodput), with the
final weights of a killed-and-resumed sync run bit-identical to an uninterrupted one."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factory.lake import Lake

TINY = ["--set", "name=crash", "--set", "model.preset=micro", "--set", "task.n_train=200", "--set", "task.n_eval=16",
        "--set", "sft.steps=10", "--set", "sft.stop_at_accuracy=null", "--set", "rollout.prompts_per_step=4",
        "--set", "algorithm.group_size=2", "--set", "schedule.steps=8", "--set", "schedule.eval_pass_k=2",
        "--set", "ops.resume_every=2", "--set", "trainer.threads=1", "--set", "ops.preflight=off"]


def factory(home: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "factory.cli", "--home", str(home), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def only_run(home: Path) -> dict:
    (row,) = rows(home, "runs")
    return row


def _lake(home: Path) -> Lake:
    from factory.home import FactoryPaths

    return Lake.open(FactoryPaths(home))


def rows(home: Path, table: str) -> list[dict]:
    with _lake(home) as lake:
        return lake.read(table).to_pylist()


def weights_sha(home: Path, run_id: str) -> str:
    return hashlib.sha256((home / "checkpoints" / run_id / "final" / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--set", "trainer.lora={r: 4, alpha: 8}"]], ids=["full", "lora"])
def test_a_killed_attempt_is_restarted_and_the_result_is_bit_identical(tmp_path, extra):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    ok = factory(straight, "run", "examples/quickstart.yaml", *TINY, *extra, "--in-process", timeout=900)
    assert ok.returncode == 0, ok.stderr
    # The first attempt SIGKILLs itself as it is about to publish step 5's weights (a resume point of
    # step 4, or of step 2 if step 4's was still being written, is on disk). With LoRA the resume point holds the
    # adapters and their AdamW state, and the final checkpoint is the merged model.
    res = factory(crashed, "run", "examples/quickstart.yaml", *TINY, *extra,
                  env={"FACTORY_FAULT_KILL": "publish:5", "FACTORY_FAULT_ATTEMPT": "1"}, timeout=900)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "attempt died (signal SIGKILL); restart 1 of 3" in res.stdout
    run = only_run(crashed)
    assert (run["status"], run["attempts"], run["restarts"], run["interruptions"]) == ("succeeded", 2, 1, 1)
    assert 0 < run["goodput"] < 1
    steps = sorted((r["step"], r["attempt"]) for r in rows(crashed, "steps"))
    assert [s for s, _ in steps] == list(range(1, 9))  # one row per step: no hole, no duplicate
    (cut,) = rows(crashed, "interruptions")
    assert cut["cause"] == "killed" and cut["attempt"] == 1 and cut["last_step"] == 4
    assert cut["resumed_from_step"] in (2, 4) and cut["steps_lost"] == 4 - cut["resumed_from_step"]
    assert {a for s, a in steps if s > cut["resumed_from_step"]} == {2}
    assert cut["recover_s"] > 0 and cut["detect_s"] >= 0
    (straight_run,) = rows(straight, "runs")
    assert weights_sha(crashed, run["run_id"]) == weights_sha(straight, straight_run["run_id"])
    with _lake(crashed) as lake:
        assert len({r["step"] for r in lake.read("rollouts").to_pylist()}) == 8


@pytest.mark.slow
def test_a_hung_attempt_is_killed_and_resumed(tmp_path):
    res = factory(tmp_path, "run", "examples/quickstart.yaml", *TINY, "--set", "ops.hang_timeout_s=3",
                  env={"FACTORY_FAULT_HANG": "publish:4", "FACTORY_FAULT_ATTEMPT": "1"})
    assert res.returncode == 0, res.stderr + res.stdout
    assert "hung for" in res.stdout
    # before the kill the hung attempt printed where it was: every thread's stack, the main one in the fault point
    assert "most recent call first" in res.stderr and "in fault_point" in res.stderr, res.stderr
    (cut,) = rows(tmp_path, "interruptions")
    assert cut["cause"] == "hang" and "ops.hang_timeout_s = 3" in cut["detail"]
    assert 3 <= cut["detect_s"] < 60  # noticed after the timeout, long before PyTorch's 10-minute watchdog
    assert only_run(tmp_path)["status"] == "succeeded"


@pytest.mark.slow
def test_sigterm_saves_and_stops_then_resume_finishes_into_the_same_mlflow_run(tmp_path):
    # Each weight publish holds 0.3 s (a fault point's window), so the test can signal mid-run.
    env = {**os.environ, "FACTORY_FAULT_DIR": str(tmp_path / "faults"), "FACTORY_FAULT_HOLD_S": "0.3"}
    proc = subprocess.Popen([sys.executable, "-m", "factory.cli", "--home", str(tmp_path / "home"), "run",
                             "examples/quickstart.yaml", *TINY, "--in-process"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    beat = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and beat is None:
        for b in (tmp_path / "home" / "checkpoints").glob("crash-*/heartbeat"):
            text = b.read_text().strip()
            if text.isdigit() and int(text) >= 3:
                beat = b
        time.sleep(0.05)
    assert beat is not None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, out + err  # EXIT_STOPPED
    home = tmp_path / "home"
    run = only_run(home)
    assert run["status"] == "interrupted"
    (cut,) = rows(home, "interruptions")
    assert cut["cause"] == "signal"
    stopped_at = max(r["step"] for r in rows(home, "steps"))
    assert 3 <= stopped_at < 8
    # The resume point of the step it stopped after is complete on disk.
    assert sorted(p.name for p in (beat.parent / "resume").iterdir())[-1] == f"step-{stopped_at:06d}"
    res = factory(home, "resume", run["run_id"])
    assert res.returncode == 0, res.stderr + res.stdout
    after = only_run(home)
    assert (after["status"], after["attempts"]) == ("succeeded", 2)
    assert after["mlflow_run_id"] == run["mlflow_run_id"]
    steps = rows(home, "steps")
    assert sorted(r["step"] for r in steps) == list(range(1, 9))
    assert {r["attempt"] for r in steps if r["step"] > stopped_at} == {2}
    (cut,) = rows(home, "interruptions")
    assert cut["resumed_from_step"] == stopped_at and cut["steps_lost"] == 0


@pytest.mark.slow
def test_factory_runs_shows_a_killed_run_as_interrupted_and_resume_completes_it(tmp_path):
    res = factory(tmp_path, "run", "examples/quickstart.yaml", *TINY, "--in-process",
                  env={"FACTORY_FAULT_KILL": "publish:6"})
    assert res.returncode == -signal.SIGKILL
    assert only_run(tmp_path)["status"] == "running"  # what the dead process left behind
    listed = factory(tmp_path, "runs", "--format", "json")
    (run,) = json.loads(listed.stdout)
    assert run["status"] == "interrupted"
    (cut,) = rows(tmp_path, "interruptions")
    assert cut["cause"] == "killed" and cut["last_step"] == 5
    done = factory(tmp_path, "resume", run["run_id"])
    assert done.returncode == 0, done.stderr + done.stdout
    run = only_run(tmp_path)
    assert run["status"] == "succeeded" and run["attempts"] == 2
    assert sorted(r["step"] for r in rows(tmp_path, "steps")) == list(range(1, 9))
    # MLflow too: step 5, trained by the dead attempt past its resume point (step 4) and again by the second, has
    # one point, as has every other step (raw history: MLflow keeps every point logged).
    from factory.cockpit.tracking import Tracker
    from factory.home import FactoryPaths

    client = Tracker(FactoryPaths(tmp_path)).client
    for key in ("batch/reward_mean", "batch/loss"):
        assert sorted(m.step for m in client.get_metric_history(run["mlflow_run_id"], key)) == list(range(1, 9)), key


@pytest.mark.slow
@pytest.mark.parametrize("args", [["resume", "nope"], ["run", "--resume", "nope"]])
def test_resuming_an_unknown_run_is_a_clear_error(tmp_path, args):
    res = factory(tmp_path, *args)
    assert res.returncode == 2 and "no run 'nope' in the lake" in res.stderr


@pytest.mark.slow
def test_a_node_that_failed_preflight_gets_no_run_and_no_resume(tmp_path):
    assert TINY[-2:] == ["--set", "ops.preflight=off"]
    gated = [*TINY[:-2], "--set", "ops.preflight=gate"]
    gate_on = {"FACTORY_PREFLIGHT": "gate"}
    # The first run passes the gate (a quick preflight runs first), then dies.
    killed = factory(tmp_path, "run", "examples/quickstart.yaml", *gated, "--in-process",
                     env={**gate_on, "FACTORY_FAULT_KILL": "publish:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "running a quick one" in killed.stdout
    # A real fault: bubblewrap is not on PATH, so the sandbox check fails and is recorded for this node.
    (tmp_path / "empty-bin").mkdir()
    no_bwrap = {**gate_on, "PATH": str(tmp_path / "empty-bin")}
    pre = factory(tmp_path, "preflight", "--check", "sandbox", env=no_bwrap)
    assert pre.returncode == 1 and "sandbox" in pre.stderr
    refused = factory(tmp_path, "run", "examples/quickstart.yaml", *gated, env=no_bwrap)
    assert refused.returncode == 1 and "failed preflight check(s) sandbox; training refused" in refused.stderr
    (run,) = rows(tmp_path, "runs")  # no second run was started
    again = factory(tmp_path, "resume", run["run_id"], env=no_bwrap)
    assert again.returncode == 1 and "training refused" in again.stderr
    causes = sorted(c["cause"] for c in rows(tmp_path, "interruptions"))
    assert causes == ["failed_preflight", "killed"]


def test_a_lora_runs_resume_point_loads_into_its_start_model_merged():
    import torch

    from factory.config import parse_spec
    from factory.models import lora
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer
    from factory.runs.rl_run import load_trained

    tok = build_tokenizer()
    spec = parse_spec({"model": {"preset": "micro"}, "trainer": {"lora": {"r": 2, "alpha": 4}}})
    trained = build_model("micro", tok, seed=0)
    lora.attach(trained, spec.trainer.lora)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if ".lora_B." in name:
                p.fill_(0.01)
    weights = {k: v.clone() for k, v in trained.state_dict().items()}  # what a resume point holds: base + adapters
    start = build_model("micro", tok, seed=0)
    load_trained(spec, start, weights)
    assert not lora.attached(start)
    expected = lora.merged_copy(trained).state_dict()
    assert list(start.state_dict()) == list(expected)
    assert all(torch.equal(v, expected[k]) for k, v in start.state_dict().items())
