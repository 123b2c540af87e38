"""What a restructuring must leave as it was, printed as digests to compare two trees: the spec fingerprint of every
example, the CLI (every command's `--help`), the Dagster asset keys, job and check names, the lake's table schemas and
the spec's JSON schema.

    python benchmarks/surface.py                    # this tree
    python benchmarks/surface.py --save a.json      # keep the full surface (texts, not digests) to diff later
    python benchmarks/surface.py --against a.json   # the parts that differ from a saved surface, and exit 1 if any

Run it in each tree with that tree on PYTHONPATH (a worktree of the old commit, then this one). The last line is JSON:
each part's digest.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fingerprints() -> dict[str, str]:
    from factory.config import load_spec

    return {p.name: load_spec(p).fingerprint() for p in sorted((ROOT / "examples").glob("*.yaml"))}


def _cli() -> dict[str, str]:
    os.environ["COLUMNS"] = "120"  # argparse wraps help to the terminal width
    from factory.cli.parser import build_parser

    out: dict[str, str] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        out[name] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}")

    walk(build_parser(), "factory")
    return out


def _dagster() -> dict[str, list[str]]:
    from jobs import defs

    repo = defs.get_repository_def()
    graph = repo.asset_graph
    return {
        "asset_keys": sorted(k.to_user_string() for k in graph.get_all_asset_keys()),
        "jobs": sorted(j.name for j in repo.get_all_jobs()),
        "asset_checks": sorted(f"{k.asset_key.to_user_string()}:{k.name}" for k in graph.asset_check_keys),
        "schedules": sorted(s.name for s in repo.schedule_defs),
        "sensors": sorted(s.name for s in repo.sensor_defs),
    }


def _lake() -> dict[str, str]:
    from factory.lake.schemas import TABLES, to_arrow_schema

    return {name: to_arrow_schema(name).to_string(show_schema_metadata=False) for name in sorted(TABLES)}


def _json_schema() -> str:
    from factory.config import ExperimentSpec

    return json.dumps(ExperimentSpec.model_json_schema(), sort_keys=True, indent=1)


def surface() -> dict[str, object]:
    return {"fingerprints": _fingerprints(), "cli": _cli(), "dagster": _dagster(), "lake": _lake(),
            "spec_json_schema": _json_schema()}


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _diff(old: object, new: object, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{path}/{k}: only in the saved surface" for k in old.keys() - new.keys()]
        out += [f"{path}/{k}: only in this tree" for k in new.keys() - old.keys()]
        for k in sorted(old.keys() & new.keys()):
            out += _diff(old[k], new[k], f"{path}/{k}")
        return out
    if old == new:
        return []
    if isinstance(old, str) and isinstance(new, str) and "\n" in old + new:
        lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0))[2:12]
        return ["\n".join([f"{path}: differs", *("    " + line for line in lines)])]
    return [f"{path}: {old!r} -> {new!r}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", type=Path, help="write the full surface here")
    ap.add_argument("--against", type=Path, help="compare with a saved surface")
    args = ap.parse_args()
    s = surface()
    if args.save:
        tmp = args.save.with_suffix(".tmp")
        tmp.write_text(json.dumps(s, sort_keys=True, indent=1))
        tmp.replace(args.save)
    digests = {part: _digest(value) for part, value in s.items()}
    print(f"{'part':<18}{'digest':<18}items")
    for part, value in s.items():
        print(f"{part:<18}{digests[part]:<18}{len(value) if isinstance(value, dict | list) else 1}")
    diffs = _diff(json.loads(args.against.read_text()), json.loads(json.dumps(s))) if args.against else []
    for line in diffs:
        print(line)
    print(json.dumps({"digests": digests, "fingerprints": s["fingerprints"], "differences": len(diffs)}))
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
