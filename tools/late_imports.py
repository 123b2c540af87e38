"""The function-level imports (ruff's PLC0415) left in the code, each with its reason; `make lint` runs it:

    .venv/bin/python tools/late_imports.py [--list]

Every import inside a function or class body in factory/, assets/, resources/ and jobs/ carries
`# noqa: PLC0415 <why it is late>` on its line (heavy and used on one path, an optional extra, a cycle it breaks, a
subprocess entry, ...). Prints how many there are in factory/ and fails (exit 1) when that passes the limit, when one
has no reason after the code, or when a `# noqa: PLC0415` sits on a line that no longer has a late import. Ruff has no
rule that asks a noqa for its reason (astral-sh/ruff#5182), so this asks: ruff finds the imports (`--ignore-noqa`, so
that the annotated ones are listed too), this reads their comments.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = ("factory", "assets", "resources", "jobs")
COUNTED = "factory"  # the engine; the Dagster layers' late imports keep the code location light and are not counted
LIMIT = 60
CODE_RULE = "PLC0415"
# A noqa comment as "noqa: E501, PLC0415 the reason" (after a hash): ruff reads the codes, the rest is the reason.
NOQA = re.compile(r"#\s*noqa:\s*(?P<codes>[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)(?P<reason>.*)$")
WORD = re.compile(r"[A-Za-z]{3,}")


@dataclass(frozen=True)
class LateImport:
    path: str  # relative to the root
    line: int  # the line ruff reads the noqa from
    reason: str | None  # None: no noqa for PLC0415 on the line; "": one without a reason


def _noqa(text: str) -> tuple[list[str], str] | None:
    """The codes and the reason of the line's noqa comment, or None."""
    m = NOQA.search(text)
    if m is None:
        return None
    return [c.strip() for c in m["codes"].split(",")], m["reason"].strip()


def find(root: Path = ROOT, paths: tuple[str, ...] = CODE) -> list[LateImport]:
    """Every import ruff's PLC0415 finds under `paths`, annotated or not, in file and line order."""
    present = [p for p in paths if (root / p).exists()]
    if not present:
        return []
    cmd = [sys.executable, "-m", "ruff", "check", "--select", CODE_RULE, "--ignore-noqa", "--output-format", "json",
           "--exit-zero", *present]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"late_imports: `{' '.join(cmd[2:])}` failed: {out.stderr.strip()[-500:]}")
    found = []
    for d in json.loads(out.stdout):
        path = Path(d["filename"]).resolve().relative_to(root.resolve()).as_posix()
        row = d.get("noqa_row") or d["location"]["row"]
        text = (root / path).read_text().splitlines()[row - 1]
        noqa = _noqa(text)
        reason = noqa[1] if noqa and CODE_RULE in noqa[0] else None
        found.append(LateImport(path, row, reason))
    return sorted(found, key=lambda i: (i.path, i.line))


def stale(root: Path, late: list[LateImport], paths: tuple[str, ...] = CODE) -> list[str]:
    """`path:line` of each `# noqa: PLC0415` on a line with no late import (the import moved, the comment stayed)."""
    at = {(i.path, i.line) for i in late}
    out = []
    for p in paths:
        for f in sorted((root / p).rglob("*.py")) if (root / p).is_dir() else []:
            rel = f.relative_to(root).as_posix()
            for n, text in enumerate(f.read_text().splitlines(), 1):
                noqa = _noqa(text)
                if noqa and CODE_RULE in noqa[0] and (rel, n) not in at:
                    out.append(f"{rel}:{n}")
    return out


def check(root: Path = ROOT, limit: int = LIMIT, listing: bool = False) -> tuple[int, list[str]]:
    """(exit code, lines to print): the count in factory/ against the limit, and each problem on a line."""
    late = find(root)
    counted = [i for i in late if i.path.startswith(COUNTED + "/")]
    problems = []
    for i in late:
        if i.reason is None:
            problems.append(f"{i.path}:{i.line}: function-level import without `# noqa: {CODE_RULE} <reason>`: "
                            "move it to the top of the module, or say why it is late")
        elif not WORD.search(i.reason):
            problems.append(f"{i.path}:{i.line}: `# noqa: {CODE_RULE}` without a reason after the code "
                            "(say why the import is late: heavy and on one path, an optional extra, a cycle, ...)")
    problems += [f"{s}: `# noqa: {CODE_RULE}` on a line with no function-level import: remove it"
                 for s in stale(root, late)]
    if len(counted) > limit:
        problems.append(f"{COUNTED}/: {len(counted)} function-level imports, more than the limit of {limit}: move "
                        "some to the top of their module")
    lines = [f"{i.path}:{i.line}: {i.reason or '(no reason)'}" for i in late] if listing else []
    others = len(late) - len(counted)
    lines.append(f"function-level imports: {len(counted)} in {COUNTED}/ (limit {limit}), {others} in "
                 f"{', '.join(p + '/' for p in CODE if p != COUNTED)}; each with its reason "
                 f"(`python tools/late_imports.py --list`)" if not problems else
                 f"function-level imports: {len(counted)} in {COUNTED}/ (limit {limit}), {others} elsewhere")
    return (1 if problems else 0), problems + lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print each late import with its reason")
    parser.add_argument("--limit", type=int, default=LIMIT, help=f"most allowed in {COUNTED}/ (default {LIMIT})")
    args = parser.parse_args(argv)
    code, lines = check(ROOT, args.limit, args.list)
    print("\n".join(lines), file=sys.stderr if code else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
