"""The README and docs/ stay true to the repository: the README is short, its `make` commands are Makefile
targets, every relative link and heading anchor resolves, and every repository path a page names in
backticks exists (so moving a module without updating the docs fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# `factory/core/loop.py`, `tests/deploy/`: files (a dot in the name) and folders (a trailing slash) under the
# repository's own top-level folders; `factory/progress` without either is a run tag, not a path
TOP = "factory|assets|jobs|resources|tests|benchmarks|examples|deploy|docs"
REPO_PATH = re.compile(rf"`((?:{TOP})/[^`\s]*(?:/|\.\w+))`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_the_readme_reads_in_five_minutes() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_readmes_make_commands_are_makefile_targets() -> None:
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README.read_text()))
    assert {"demo", "test"} <= named
    assert named - makefile_targets() == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_repository_paths_exist(page: Path) -> None:
    missing = [p for p in REPO_PATH.findall(page.read_text())
               if not any(c in p for c in "<*{") and not (ROOT / p).exists()]
    assert missing == []


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


INTERPRETER_PATH = re.compile(r"(?:\.venv/lib/|site-packages/|lib/python3\.\d+/)")


def test_no_example_or_page_names_a_file_inside_one_interpreters_install() -> None:
    # `.venv/lib/python3.11/site-packages/...` works for one Python in one venv run from one directory: examples and
    # pages name shipped files by their package (`pkg:<package>/<path>`, factory/model_source.py) instead.
    pages = [*PAGES, *sorted((ROOT / "examples").glob("*.yaml"))]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in pages
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if INTERPRETER_PATH.search(line)]
    assert found == []
