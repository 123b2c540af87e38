"""benchmarks/spec_reach.py: the static walk of the spec follows calls, stored attributes and class constructors,
counts a climb where the walk comes back up a layer, and on this tree reaches the run's modules but not the
components that take sections."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

sr = importlib.import_module("benchmarks.spec_reach")

PYPROJECT = """
[[tool.importlinter.contracts]]
name = "factory's layers point one way"
type = "layers"
layers = ["factory.runs", "factory.core", "factory.data"]
"""

TREE = {
    "factory/__init__.py": "",
    "factory/runs/__init__.py": "",
    "factory/runs/experiment.py": """
        from factory.core.loop import Loop, train
        from factory.data import feed as feeds

        def run_experiment(spec, paths):
            s = spec
            train(s)
            Loop(spec).go()
            feeds.make(spec.data)  # a section: the spec stops here
            other(spec)

        def other(config):
            return config.seed
    """,
    "factory/core/__init__.py": "",
    "factory/core/loop.py": """
        from factory.data.feed import make_feed

        def train(spec):
            make_feed(spec, n=1)

        class Base:
            def go(self):
                return self.helper()

        class Loop(Base):
            def __init__(self, spec):
                self.spec = spec

            def helper(self):
                return self.spec.rollout
    """,
    "factory/data/__init__.py": "",
    "factory/data/feed.py": """
        def make_feed(spec, n):
            return spec.data

        def make(data):
            return data.sources
    """,
}


def _tree(root: Path) -> Path:
    (root / "pyproject.toml").write_text(PYPROJECT.replace("[[", "[tool.importlinter]\nroot_packages = []\n\n[[", 1))
    for rel, text in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_walk_follows_aliases_objects_and_climbs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sr, "START", ("factory.runs.experiment", "run_experiment", "spec"))
    r = sr.measure(_tree(tmp_path))
    assert r["module_list"] == ["factory.core.loop", "factory.data.feed", "factory.runs.experiment"]
    # runs -> core (train) -> data (make_feed) -> runs? no: back to core (Loop) is a climb from data, then the
    # walk returns to runs for other(): another climb
    assert r["climb_list"] == ["factory.data.feed -> factory.core.loop", "factory.core.loop -> factory.runs.experiment"]
    assert r["reading"] == 3 and r["signatures"] == 0
    assert r["functions"] == 7  # run_experiment, train, make_feed, Loop.__init__, go, helper, other; not make


def test_on_this_tree_the_run_reaches_the_loop_but_not_the_section_takers() -> None:
    r = sr.measure(Path(__file__).resolve().parents[2])
    mods = set(r["module_list"])
    assert {"factory.runs.experiment", "factory.runs.rl_run", "factory.core.loop"} <= mods
    # through the registries' lookups (PRODUCERS.get(...)(spec, ...), TRAINERS.get(...)(spec, model)) to the built-ins
    assert {"factory.core.producers.builders", "factory.core.sglang.producer", "factory.core.trainer.megatron"} <= mods
    # handed sections (the rollout, the model, the data) or the resolved view, not the spec
    assert not mods & {"factory.core.gate", "factory.core.correction", "factory.infra.device"}
    assert r["signatures"] > 0 and r["climbs"] <= len(r["module_list"])
