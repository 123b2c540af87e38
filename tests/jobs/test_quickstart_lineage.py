"""Two quickstarts running at once on one Dagster instance never take each other's files.

Run A trains its SFT checkpoint; run B, started then, trains its own; only then does A's GRPO start, from A's
checkpoint and on A's dataset, then B's, and A's control and report name A's GRPO run, though B's finished since.
The interleaving is forced by a success hook on the two runs' steps (a turnstile), not left to timing: reading an
upstream's latest materialization (what assets/_metadata.py did before resources/lineage.py) fails here."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from dagster import DagsterInstance, HookContext, instance_for_test, success_hook

from factory.home import factory_home
from factory.lake import Lake
from jobs import defs, make_resources

SPEC = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=16", "sft.steps=4", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=2", "algorithm.group_size=2", "schedule.steps=2", "schedule.eval_pass_k=2"]
RUNS = {"a": [*TINY, "name=race-a", "seed=1"], "b": [*TINY, "name=race-b", "seed=2"]}
# The order the two runs reach these points in: each waits at its point until the next one is reached.
TURNS = [("a", "sft_checkpoint"), ("b", "sft_checkpoint"), ("a", "grpo_run"), ("b", "grpo_run"), ("a", "end")]
WAIT_S = 600
# Capturing a step's output redirects the process's stdout and stderr; two runs in threads would restore each
# other's redirections and leave pytest writing into a step's log file.
NO_CAPTURE = {"compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                               "class": "NoOpComputeLogManager"}}


def race(instance: DagsterInstance, home: Path) -> dict:
    reached = {turn: threading.Event() for turn in TURNS}

    @success_hook(required_resource_keys={"spec"})
    def turnstile(context: HookContext) -> None:
        turn = (context.resources.spec.spec().name.removeprefix("race-"), context.step_key)
        if turn in TURNS:
            reached[turn].set()
            following = TURNS[TURNS.index(turn) + 1]
            assert reached[following].wait(WAIT_S), f"{turn} waited for {following} in vain"

    job = defs.resolve_job_def("quickstart").with_hooks({turnstile})
    results: dict = {}

    def run(name: str) -> None:
        try:
            with DagsterInstance.from_ref(instance.get_ref()) as own:  # as a second process would open it
                results[name] = job.execute_in_process(instance=own, raise_on_error=False,
                                                       resources=make_resources(SPEC, RUNS[name], str(home)))
        finally:  # A's end is the last turn; a run that stopped early keeps the other from waiting on it
            for event in reached.values():
                event.set()

    a = threading.Thread(target=run, args=("a",))
    a.start()
    reached[("a", "sft_checkpoint")].wait(WAIT_S)
    b = threading.Thread(target=run, args=("b",))
    b.start()
    a.join()
    b.join()
    return results


def metadata(result, asset: str) -> dict:
    (mat,) = result.asset_materializations_for_node(asset)
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.mark.slow
def test_two_quickstarts_at_once_read_their_own_upstream_outputs(tmp_path):
    home = tmp_path / "home"
    with instance_for_test(overrides=NO_CAPTURE) as instance:  # SQLite storage in a temp DAGSTER_HOME
        results = race(instance, home)
        assert all(r.success for r in results.values())
        # the race happened: B's SFT landed between A's SFT and A's GRPO, B's GRPO before A's control
        steps = ("sft_checkpoint", "grpo_run", "sft_control")
        order = sorted(((e.timestamp, name, e.dagster_event.asset_key.to_user_string())
                        for name, result in results.items() for e in instance.all_logs(result.run_id)
                        if e.dagster_event and e.dagster_event.event_type_value == "ASSET_MATERIALIZATION"
                        and e.dagster_event.asset_key.to_user_string() in steps))
        assert [(n, a) for _, n, a in order] == [*TURNS[:4], ("a", "sft_control"), ("b", "sft_control")]

        lake = Lake.open(factory_home(home))
        runs = {r["run_id"]: r for r in lake.read("runs").to_pylist()}
        seen = {}
        for name, result in results.items():
            dataset, sft, grpo = (metadata(result, a) for a in ("task_dataset", "sft_checkpoint", "grpo_run"))
            seen[name] = (dataset["path"], sft["path"], grpo["run_id"])
            train = {json.loads(line)["prompt"] for line in (Path(dataset["path"]) / "train.jsonl").open()}
            prompts = {r["prompt"] for r in lake.read("rollouts").to_pylist() if r["run_id"] == grpo["run_id"]}
            # GRPO started from this run's SFT checkpoint and drew this run's training prompts
            assert runs[grpo["run_id"]]["init_checkpoint"] == sft["path"], name
            assert prompts and prompts <= train, name
            # the control and the report are about this run's GRPO run
            assert metadata(result, "sft_control")["run_id"] == grpo["run_id"], name
            assert metadata(result, "eval_report")["run_id"] == grpo["run_id"], name
            # the run's log names the materializations its steps (and the check) read: all its own
            loaded = [e for e in instance.all_logs(result.run_id) if e.dagster_event
                      and e.dagster_event.event_type_value == "LOADED_INPUT"]
            assert {e.step_key for e in loaded} >= {"sft_checkpoint", "grpo_run", "grpo_run_grpo_beats_sft",
                                                    "sft_control", "eval_report"}
            assert {e.dagster_event.event_specific_data.metadata["upstream_dagster_run"].value
                    for e in loaded} == {result.run_id}, name
        # the two runs made different files
        assert len({v for files in seen.values() for v in files}) == 6
