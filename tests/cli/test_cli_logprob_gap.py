"""`factory run` stopped by the step-0 log-prob gate (core/gate.py): exit code 8 with the gate's lines, the run recorded
as failed (cause logprob_gap) and no restart spent."""

import json

import pytest

from factory.cli import main
from factory.runs.exit_codes import EXIT_LOGPROB_GAP

TINY = ["--set", "name=gap", "--set", "model.preset=micro", "--set", "task.n_train=200", "--set", "task.n_eval=8",
        "--set", "sft.steps=2", "--set", "sft.stop_at_accuracy=null", "--set", "rollout.prompts_per_step=2",
        "--set", "algorithm.group_size=2", "--set", "schedule.steps=2"]


@pytest.mark.slow  # a whole `factory run` (dataset, SFT, the supervised attempt's start): ~45 s on 2 shared cores
def test_factory_run_stopped_by_the_gate_exits_8_with_its_figures_and_is_not_restarted(factory_home, capfd):
    # A bound below what fp32 on the CPU reaches (~1e-8): the good setup fails it, as a broken one fails the default
    rc = main(["run", "examples/quickstart.yaml", *TINY, "--set", "ops.max_logprob_gap=1e-12"])
    said = capfd.readouterr()
    err = said.err
    assert rc == EXIT_LOGPROB_GAP, err
    assert "the rollout engine and the trainer disagree at step 0 (SyncProducer: 3 prompts x 4 completions" in err
    assert "> ops.max_logprob_gap 1e-12" in err and "k3 KL" in err
    assert "no restart spent" in said.out and "attempt died" not in said.out + err
    assert main(["runs", "--format", "json"]) == 0
    (run,) = json.loads(capfd.readouterr().out)
    assert run["status"] == "failed" and run["attempts"] == 1
    assert main(["query", f"SELECT cause, detail FROM interruptions WHERE run_id = '{run['run_id']}'",
                 "--format", "json"]) == 0
    (cut,) = json.loads(capfd.readouterr().out)
    assert cut["cause"] == "logprob_gap" and cut["detail"].startswith("LogprobGapError: the rollout engine")
