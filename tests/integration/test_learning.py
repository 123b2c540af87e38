"""Learning is real: GRPO raises held-out accuracy above the SFT start (fixed seed, measured margin).

Uses the quickstart task with a shorter GRPO phase. The model never sees the held-out split; the
SFT stop rule looks only at training problems.
"""

import pytest

from factory.cockpit.tracking import Tracker
from factory.config import apply_overrides, load_spec, parse_overrides
from factory.lake import Lake
from factory.runs.rl_run import run_rl
from factory.runs.stages import build_dataset, load_dataset, train_sft_checkpoint

# Measured on this spec (30 GRPO steps, 300 held-out problems, 1 thread), SFT -> GRPO accuracy:
# seed 0: 0.21 -> 0.74 (+53 points), seed 1: 0.24 -> 0.49 (+25), seed 2: 0.29 -> 0.72 (+43).
# The test runs seed 0 and asks for less than half of the worst seed's gain.
MIN_GAIN = 0.10


@pytest.mark.slow
def test_grpo_raises_heldout_accuracy(factory_home):
    spec = apply_overrides(load_spec("examples/quickstart.yaml"), parse_overrides([
        "name=learning", "seed=0", "trainer.threads=1", "schedule.steps=30", "task.n_eval=300",
    ]))
    splits = load_dataset(build_dataset(spec, factory_home).path)
    sft = train_sft_checkpoint(spec, factory_home, splits, log=lambda _: None)
    run = run_rl(spec, factory_home, sft.checkpoint.path, splits, Lake.open(factory_home),
                   Tracker(factory_home), log=lambda _: None)
    assert run.start_accuracy == pytest.approx(sft.accuracy)
    assert run.start_pass_at_k > run.start_accuracy  # room for RL to turn pass@k into pass@1
    assert run.final_accuracy - run.start_accuracy >= MIN_GAIN, (run.start_accuracy, run.final_accuracy)
