"""Placement (factory/infra/placement.py): each component's cores and torch threads, from the spec, in the thread or
process that runs it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from factory.config import apply_overrides, load_spec
from factory.infra.placement import Place, check_placement, enter, entered, placements

QUICKSTART = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="placement on separate cores needs at least 2 cores")


@pytest.fixture
def restore_main_thread():
    """`enter` narrows the calling thread: give the test process its cores and threads back."""
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)


def spec_with(**overrides):
    return apply_overrides(load_spec(QUICKSTART), overrides)


def test_cores_the_process_does_not_have_are_refused_naming_the_field():
    spec = spec_with(**{"rollout.cpus": [0, 99]})
    with pytest.raises(ValueError, match=r"rollout.cpus: cores \[99\] are not available to this process \(it may "
                                         r"use \[0, 1\]\), got \[0, 99\]"):
        check_placement(spec, available=[0, 1])


def test_shared_cores_are_allowed_with_a_note():
    spec = spec_with(**{"trainer.cpus": [0], "rollout.cpus": [0, 1], "rollout.env_cpus": [1]})
    notes = check_placement(spec, available=[0, 1])
    assert notes == ["placement: trainer.cpus and rollout.cpus share cores [0]: they will compete for them",
                     "placement: rollout.cpus and rollout.env_cpus share cores [1]: they will compete for them"]
    assert check_placement(spec_with(), available=[0]) == []  # nothing pinned: nothing to say


def test_unset_placement_dumps_as_before():
    spec = spec_with()
    dumped = spec.model_dump()
    assert "cpus" not in dumped["trainer"] and "cpus" not in dumped["rollout"] and "sandbox_cpus" not in dumped["task"]
    assert spec_with(**{"trainer.cpus": [0]}).fingerprint() != spec.fingerprint()


@two_cores
def test_enter_places_the_calling_thread(restore_main_thread):
    enter(Place("trainer", (CORES[0],), threads=1))
    assert os.sched_getaffinity(0) == {CORES[0]} and torch.get_num_threads() == 1
    enter(Place("environment"))  # no cores of its own: the process's cores at start, not the trainer's
    assert os.sched_getaffinity(0) == set(CORES)


@two_cores
def test_an_async_run_puts_trainer_engine_and_scoring_on_their_cores(restore_main_thread):
    from factory.core.loop import train_rl
    from factory.envs.tasks import make_task_splits
    from factory.models.build import policy_for
    from factory.runs.stages import set_threads

    a, b = CORES[0], CORES[1]
    spec = spec_with(**{"model.preset": "micro", "schedule.mode": "async", "schedule.steps": 2,
                        "rollout.prompts_per_step": 4, "algorithm.group_size": 2, "trainer.minibatches": 1,
                        "trainer.cpus": [a], "trainer.threads": 1, "rollout.cpus": [b], "rollout.threads": 1,
                        "rollout.env_cpus": [b], "sft.steps": 1})
    entered(clear=True)  # runs earlier in this process placed threads of the same names
    set_threads(spec, log=lambda _: None)
    model, tok = policy_for(spec)
    records = train_rl(spec, model, tok, make_task_splits(spec.task, spec.seed).train[:64])
    assert len(records) == 2
    placed = entered()
    assert placed["MainThread"] == ("trainer", frozenset({a}), 1)
    assert placed["rollout-engine"] == ("rollout", frozenset({b}), 1)
    producers = [v for k, v in placed.items() if k.startswith("producer-")]
    assert producers and all(v[:2] == ("environment", frozenset({b})) for v in producers)


@pytest.mark.slow
@two_cores
def test_child_processes_start_on_their_components_cores(require_sandbox):
    from factory.envs.sandbox import SandboxPool
    from factory.envs.workers import make_environment

    env = make_environment(0.0, "service", processes=1, timeout=60.0, env_cpus=[CORES[1]])
    try:
        (svc,) = env.services
        status = Path(f"/proc/{svc._proc.pid}/status").read_text()
        allowed = next(line.split(":")[1].strip() for line in status.splitlines()
                       if line.startswith("Cpus_allowed_list"))
        assert allowed == str(CORES[1])
    finally:
        env.close()
    with SandboxPool(size=1, cpus=[CORES[0]]) as pool:
        r = pool.run("import os; print(sorted(os.sched_getaffinity(0)))")
    assert r.ok and r.stdout.strip() == f"[{CORES[0]}]"


def test_placements_read_each_components_fields():
    spec = spec_with(**{"trainer.cpus": [1, 0, 1], "trainer.threads": 2, "rollout.threads": 3,
                        "task.sandbox_cpus": [0]})
    p = placements(spec)
    assert p["trainer"] == Place("trainer", (0, 1), 2)
    assert p["rollout"] == Place("rollout", None, 3)
    assert p["environment"] == Place("environment")
    assert p["sandbox"] == Place("sandbox", (0,))


def test_rollout_devices_are_sglang_gpus_one_group_per_server():
    spec = spec_with(**{"rollout.engine": "sglang", "rollout.sglang.servers": 2, "rollout.sglang.tp_size": 2,
                        "rollout.devices": [4, 5, 6, 7]})
    assert spec.rollout.devices == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"rollout.devices: rollout.sglang.servers x tp_size = 4 GPUs, got 2"):
        spec_with(**{"rollout.engine": "sglang", "rollout.sglang.servers": 2, "rollout.sglang.tp_size": 2,
                     "rollout.devices": [0, 1]})
    with pytest.raises(ValueError, match=r"rollout.devices: GPUs for SGLang servers .* the embedded engine runs on "
                                         r"the CPU"):
        spec_with(**{"rollout.devices": [0]})
