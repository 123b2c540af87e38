"""A sweep member's `sweeps` row names its run from the moment it starts training (the live sweep page reads the
member's steps by it), not only once it ended: a tiny real member, watched from its first progress report."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyiceberg.expressions import EqualTo

from factory.cockpit.tracking import Tracker
from factory.config import apply_overrides, load_spec
from factory.envs.spec_check import check_spec
from factory.runs.experiment import run_sweep_member

BASE = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
TINY = {"name": "row-m000", "model.preset": "micro", "task.n_train": 200, "task.n_eval": 16, "sft.steps": 4,
        "sft.stop_at_accuracy": None, "rollout.prompts_per_step": 4, "algorithm.group_size": 2, "schedule.steps": 2,
        "trainer.threads": 1, "ops.preflight": "off"}


class Seen(Exception):
    """Raised by the progress probe once it has read the row: the member need not train further."""


def test_a_running_members_row_names_its_run(factory_home, lake):
    spec = check_spec(apply_overrides(load_spec(BASE), TINY))
    rows = []

    def probe(progress) -> None:  # the member's first progress report: it is training
        rows.extend(lake.read("sweeps", EqualTo("member", "row-m000")).to_pylist())
        raise Seen

    with pytest.raises(Seen):
        run_sweep_member(spec, factory_home, lake, Tracker(factory_home), "row", "row-m000", {"algorithm.lr": 1e-4},
                         sweep_name="row", run_id="row-m000-run", progress=probe)
    ((status, run_id),) = [(r["status"], r["run_id"]) for r in rows]
    assert (status, run_id) == ("running", "row-m000-run")
