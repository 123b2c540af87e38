"""A real run (tiny model, this CPU) through a real lake outage: the SQLite catalog's write lock held by another
connection from step 2, so every commit fails with `database is locked`. Within ops.lake_outage_s the run trains
on, spools its rows and flushes them once the catalog is back; past it, it stops at a resume point with one line,
and resuming it finishes the run with every step recorded once."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch

from factory.cockpit.tracking import Tracker
from factory.config import parse_spec
from factory.home import FactoryPaths
from factory.lake.spool import SPOOL, LakeDown, is_catalog_error
from factory.lake.writer import Lake
from factory.models.build import build_model
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem, Splits
from factory.progress import Progress
from factory.runs.degraded import when_lake_up
from factory.runs.rl_run import run_rl

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(12)]
SPLITS = Splits(train=PROBLEMS[:8], eval=PROBLEMS[8:])
STEPS = 6


def spec(**ops):
    return parse_spec({"name": "outage", "seed": 3, "model": {"preset": "micro"},
                       "algorithm": {"group_size": 2, "lr": 1e-3},
                       "rollout": {"prompts_per_step": 2, "max_new_tokens": 2}, "trainer": {"threads": 1},
                       "sft": {"steps": 2, "stop_at_accuracy": None},
                       "schedule": {"steps": STEPS, "eval_pass_k": 1, "log_rollouts": 1, "wait_timeout_s": 60},
                       "ops": {"preflight": "off", "resume_every": 2, **ops}})


class CatalogOutage:
    """The catalog unavailable to every other connection while `down` (its write lock held)."""

    def __init__(self, db: Path):
        self.conn = sqlite3.connect(db, isolation_level=None)
        self.down = False

    def start(self) -> None:
        if not self.down:
            self.conn.execute("BEGIN EXCLUSIVE")
            self.down = True

    def end(self) -> None:
        if self.down:
            self.conn.execute("ROLLBACK")
            self.down = False


@pytest.fixture
def init(factory_home: FactoryPaths) -> Path:
    torch.manual_seed(0)
    tok = build_tokenizer()
    return save_checkpoint(build_model("micro", tok, seed=0), tok, factory_home.checkpoints / "init").path


def steps_of(lake: Lake, run_id: str) -> list[int]:
    return sorted(r["step"] for r in lake.read("steps").to_pylist() if r["run_id"] == run_id)


def test_an_outage_within_the_budget_keeps_the_run_training_and_loses_nothing(factory_home, lake, init):
    outage = CatalogOutage(factory_home.catalog_db)
    seen: dict[int, int] = {}
    run_dir: list[Path] = []

    def progress(p: Progress) -> None:  # the trainer's thread, after each step, before its rows are written
        if p.step == 2:
            outage.start()
        if p.step == 5:
            seen[5] = len(list((run_dir[0] / SPOOL).glob("*.json"))) if run_dir else -1
            outage.end()

    said: list[str] = []

    def log(line: str) -> None:
        said.append(line)
        if not run_dir and line.startswith("run ") and ": device" in line:
            run_dir.append(factory_home.checkpoints / line.split()[1].rstrip(":"))

    try:
        res = run_rl(spec(), factory_home, init, SPLITS, lake, Tracker(factory_home), log=log, flush_every=1,
                     progress=progress)
    finally:
        outage.end()
    assert seen[5] > 0  # steps 2-4 (and the resume point of step 4's rows) waited in the spool
    assert steps_of(lake, res.run_id) == list(range(1, STEPS + 1))  # every step once
    (row,) = lake.read("runs").to_pylist()
    assert (row["status"], row["attempts"]) == ("succeeded", 1)
    saves = [json.loads(line)["step"] for line in (run_dir[0] / "saves.jsonl").read_text().splitlines()]
    assert 4 in saves  # a resume point was written while the catalog was down
    assert not list((run_dir[0] / SPOOL).glob("*.json"))
    assert len({r["step"] for r in lake.read("rollouts").to_pylist()}) == STEPS


def test_an_outage_past_the_budget_stops_at_a_resume_point_and_resume_finishes(factory_home, lake, init):
    outage = CatalogOutage(factory_home.catalog_db)

    def progress(p: Progress) -> None:
        if p.step == 3:
            outage.start()

    s = spec(lake_outage_s=0)  # no patience: the first failed write is past the budget
    said: list[str] = []
    try:
        with pytest.raises(LakeDown) as e:
            run_rl(s, factory_home, init, SPLITS, lake, Tracker(factory_home), log=said.append, flush_every=1,
                   progress=progress, run_id="outage-1")
    finally:
        outage.end()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("lake unavailable for ") and "ops.lake_outage_s = 0" in msg
    run_dir = factory_home.checkpoints / "outage-1"
    assert (run_dir / "resume" / "step-000003" / "MANIFEST.json").is_file()  # stopped at a resume point
    assert list((run_dir / SPOOL).glob("*.json"))  # its rows kept locally, not lost
    assert steps_of(lake, "outage-1") == [1, 2]  # the lake saw only what it took before the outage

    res = run_rl(s, factory_home, init, SPLITS, lake, Tracker(factory_home), log=said.append, run_id="outage-1")
    assert any("attempt 2 resumes from resume point step-000003" in line for line in said)
    assert steps_of(lake, "outage-1") == list(range(1, STEPS + 1))
    (row,) = lake.read("runs").to_pylist()
    assert (row["status"], row["attempts"], res.attempt) == ("succeeded", 2, 2)
    (cut,) = lake.read("interruptions").to_pylist()
    assert cut["cause"] == "lake_down" and cut["attempt"] == 1 and "lake unavailable" in cut["detail"]
    assert not list((run_dir / SPOOL).glob("*.json"))


def test_lake_outage_s_is_a_late_field_kept_out_of_dumps_and_fingerprints_at_its_default():
    default = spec()
    assert "lake_outage_s" not in json.loads(default.to_json())["ops"] and default.ops.lake_outage_s == 300
    assert spec(lake_outage_s=300).fingerprint() == default.fingerprint()
    assert spec(lake_outage_s=60).fingerprint() != default.fingerprint()


def test_an_attempt_starting_in_an_outage_waits_for_the_lake(factory_home, lake):
    """A run killed during an outage: its next attempt's first reads meet the catalog unreachable (a catalog server
    refusing connections, as a stopped PostgreSQL does) and wait for it, beating the heartbeat, instead of stopping;
    the catalog comes back once the wait was announced."""
    down = {"uri": "postgresql+psycopg2://factory:factory@127.0.0.1:9/factory"}  # nothing listens on port 9
    beats, said = [], []

    def first_reads() -> int:
        with Lake.open(factory_home, **down) as lk:
            return len(lk.read("runs"))

    def log(line: str) -> None:
        said.append(line)
        down.clear()  # the catalog is back

    assert when_lake_up(first_reads, 60.0, beat=lambda: beats.append(1), log=log, every_s=0.05) == 0
    assert len(said) == 1 and said[0].startswith("lake unavailable (OperationalError)")
    assert "ops.lake_outage_s = 60" in said[0] and beats


def test_an_attempt_starting_in_an_outage_stops_past_the_budget(factory_home):
    now = [0.0]
    uri = "postgresql+psycopg2://factory:factory@127.0.0.1:9/factory"
    with pytest.raises(Exception) as e:
        when_lake_up(lambda: Lake.open(factory_home, uri=uri), 12.0, beat=lambda: None, log=lambda _: None,
                     every_s=5.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert is_catalog_error(e.value) and now[0] == 12.0  # tried at 0, 5, 10 and 12 s, then gave up
