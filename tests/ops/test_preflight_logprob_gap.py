"""The `logprob_gap` preflight check (ops/preflight/logprob_gap.py): the step-0 gate on the default tiny setup in quick
mode, and on an experiment's own setup with `factory preflight --spec FILE`, recorded in `node_health`."""

import uuid

from factory.cli import main
from factory.lake import Lake
from factory.ops.preflight import select_probes
from factory.ops.preflight.logprob_gap import logprob_gap_check


def test_the_default_tiny_setup_passes_in_quick_mode(factory_home):
    assert "logprob_gap" in [c for p in select_probes("quick") for c in p.checks]
    r = logprob_gap_check(factory_home)
    assert r.passed, r.message
    assert r.name == "logprob_gap" and r.threshold == 1e-4 and r.unit == "nats/token"
    assert 0 <= r.value < 1e-5  # fp32 on the CPU, the engine sharing the trainer's model: rounding only
    assert r.message.startswith("the default tiny setup, embedded engine, sync, fp32 on cpu: SyncProducer: 3 prompts")


def test_an_experiments_setup_past_its_bound_fails_and_is_recorded(factory_home, tmp_path, monkeypatch, capsys):
    node = f"test-node-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FACTORY_NODE", node)
    spec = tmp_path / "exp.yaml"
    # A bound below what fp32 on the CPU reaches (~1e-8): this setup fails it, as a broken engine fails the default.
    spec.write_text("model: {preset: micro}\ntask: {n_train: 32, n_eval: 8}\nops: {max_logprob_gap: 1.0e-12}\n")
    assert main(["preflight", "--check", "logprob_gap", "--spec", str(spec)]) == 1
    said = capsys.readouterr()
    assert "preflight check failed: logprob_gap: value" in said.err and "threshold 1e-12 nats/token" in said.err
    assert f"spec {spec}, embedded engine, sync, fp32 on cpu" in said.err
    assert "FAILED: dtype / weights: mean |engine - trainer log-prob|" in said.err \
        or "FAILED: attention kernel / positions: mean |engine - trainer log-prob|" in said.err
    with Lake.open(factory_home) as lake:
        (row,) = lake.read("node_health", f"node == '{node}'").to_pylist()
    assert row["check"] == "logprob_gap" and row["passed"] is False and row["threshold"] == 1e-12
    assert row["value"] > 1e-12 and "ops.max_logprob_gap 1e-12" in row["message"]


def test_a_spec_that_cannot_be_read_is_bad_input(factory_home, capsys):
    assert main(["preflight", "--check", "logprob_gap", "--spec", "nope.yaml"]) == 2
    assert "no such spec file: nope.yaml" in capsys.readouterr().err


