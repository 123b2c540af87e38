"""tools/late_imports.py, `make lint`'s check of function-level imports, on small trees of its own (ruff runs on
them for real)."""

from __future__ import annotations

from pathlib import Path

from tools.late_imports import check, find, main

GOOD = '''"""A module."""


def f():
    import json  # noqa: PLC0415 heavy: torch, when the step runs

    return json
'''


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_an_import_with_its_reason_is_counted_and_passes(tmp_path):
    root = _tree(tmp_path, {"factory/a.py": GOOD, "assets/b.py": GOOD, "factory/top.py": "import json\n"})
    code, lines = check(root, limit=60, listing=True)
    assert code == 0, lines
    assert lines[:2] == ["assets/b.py:5: heavy: torch, when the step runs",
                         "factory/a.py:5: heavy: torch, when the step runs"]
    assert lines[-1].startswith("function-level imports: 1 in factory/ (limit 60), 1 in assets/, resources/, jobs/")


def test_an_import_without_a_noqa_or_without_a_reason_fails_naming_its_line(tmp_path):
    bare = "def f():\n    import json\n    return json\n"
    no_reason = "def g():\n    from os import path  # noqa: PLC0415\n    return path\n"
    punct = "class C:\n    import re  # noqa: PLC0415 -- ?\n"
    root = _tree(tmp_path, {"factory/a.py": bare, "jobs/b.py": no_reason, "resources/c.py": punct})
    code, lines = check(root)
    assert code == 1
    problems = [line.split(": ")[0] for line in lines[:-1]]
    assert problems == ["factory/a.py:2", "jobs/b.py:2", "resources/c.py:2"]
    assert "without `# noqa: PLC0415 <reason>`" in lines[0]
    assert "without a reason after the code" in lines[1] and "without a reason after the code" in lines[2]


def test_the_reason_is_read_after_other_codes_and_on_the_first_line_of_a_long_import(tmp_path):
    text = ("def f():\n    from collections import (  # noqa: E501, PLC0415 a cycle: collections imports f\n"
            "        OrderedDict,\n    )\n    return OrderedDict\n")
    root = _tree(tmp_path, {"factory/a.py": text})
    [late] = find(root)
    assert (late.path, late.line, late.reason) == ("factory/a.py", 2, "a cycle: collections imports f")


def test_more_than_the_limit_in_factory_fails_and_the_other_layers_do_not_count(tmp_path):
    root = _tree(tmp_path, {"factory/a.py": GOOD, "factory/b.py": GOOD, "assets/c.py": GOOD, "jobs/d.py": GOOD})
    assert check(root, limit=2)[0] == 0
    code, lines = check(root, limit=1)
    assert code == 1
    assert lines[0] == ("factory/: 2 function-level imports, more than the limit of 1: move some to the top of "
                        "their module")


def test_a_noqa_left_behind_by_an_import_moved_to_the_top_fails(tmp_path):
    moved = "import json  # noqa: PLC0415 heavy: torch\n\n\ndef f():\n    return json\n"
    root = _tree(tmp_path, {"factory/a.py": moved})
    code, lines = check(root)
    assert code == 1
    assert lines[0].startswith("factory/a.py:1: `# noqa: PLC0415` on a line with no function-level import")


def test_the_repository_itself_is_checked_by_main(capsys):
    """`make lint`'s call: the count line names the limit; this repository's code is what it reads."""
    code = main(["--limit", "100000"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert "function-level imports: " in text and "in factory/ (limit 100000)" in text
    assert (code == 0) == (" without " not in text)
