"""`make demo`'s output is for people: no library warnings among its lines, its figures rounded, and a few lines
per training stage, not one per step.

Runs the demo's entry point (`python -m jobs.demo`) as `make demo` does, with tiny settings, in a temp
FACTORY_HOME, and reads everything it printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=60", "schedule.eval_pass_k=2"]


@pytest.mark.slow
def test_the_demo_prints_no_warnings_and_a_few_step_lines(tmp_path):
    home = tmp_path / "factory-home"
    env = dict(os.environ, FACTORY_HOME=str(home), DAGSTER_HOME=str(home / "dagster"), OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)  # the demo as a user runs it: Python's default warning filters
    demo = subprocess.run([sys.executable, "-m", "jobs.demo", *[a for o in TINY for a in ("--set", o)]], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    out = demo.stdout + demo.stderr
    assert demo.returncode == 0, out[-3000:]
    warned = [line for line in out.splitlines() if re.search(r"\w*Warning\b", line)]
    assert warned == [], "\n".join(warned[:20])
    assert re.search(r"quickstart finished in \d+s", demo.stdout)
    # 60 GRPO steps narrated in 11 lines: the first, every 6th and the last (the quickstart's 200 steps printed 200)
    grpo = re.findall(r"\bstep (\d+)/60 reward=", out)
    assert [int(s) for s in grpo] == [1, *range(6, 61, 6)], grpo
