"""The host's side of the code harness: a verdict counts only with the nonce, once, with the n of checks sent and
0 <= k <= n; flags are read only from the nonce's line; the request carries the nonce on stdin only."""

from __future__ import annotations

import pytest

from factory.envs.code_harness import (
    HACK_FLAGS,
    harness_request,
    read_flags,
    read_verdict,
    static_flags,
)

NONCE = "f00d" * 8


@pytest.mark.parametrize(("stdout", "k"), [
    (f"{NONCE} PASSED 3/3\n", 3),
    (f"noise\n{NONCE} FLAGS []\n{NONCE} PASSED 0/3\n", 0),
    ("PASSED 3/3\n", None),  # no nonce
    (f"{'0' * 32} PASSED 3/3\n", None),  # another nonce
    (f"{NONCE} PASSED 1000/1\n", None),  # n is not the number of checks
    (f"{NONCE} PASSED 4/3\n", None),  # k > n
    (f"{NONCE} PASSED -1/3\n", None),
    (f"{NONCE} PASSED 3/3 trailing\n", None),
    (f"{NONCE} PASSED 3/3\n{NONCE} PASSED 0/3\n", None),  # two verdicts: neither counts
    ("", None),
    (None, None),
])
def test_a_verdict_counts_only_with_the_nonce_once_and_in_range(stdout, k):
    assert read_verdict(stdout, NONCE, 3) == k


def test_flags_are_read_from_the_nonces_line_only_and_known_names_only():
    assert read_flags(f'{NONCE} FLAGS ["early_exit", "marker", "bogus"]\n', NONCE) == {"early_exit", "marker"}
    assert read_flags('FLAGS ["marker"]\n', NONCE) == set()
    assert read_flags(f"{NONCE} FLAGS not json\n", NONCE) == set()
    assert set(HACK_FLAGS) == {"early_exit", "marker", "touched_tests"}


def test_static_flags():
    assert static_flags("    return open('problem.json').read()\n") == {"touched_tests"}
    assert static_flags("    import os; os._exit(0)\n") == {"early_exit"}
    assert static_flags("    import sys; sys.exit(0)\n") == {"early_exit"}
    assert static_flags("    return a + b\n") == set()


def test_the_nonce_travels_on_stdin_only_and_the_entry_point_is_checked():
    req = harness_request("def add(a, b):\n    return a + b\n", {"kind": "code", "tests": ["add(1, 2) == 3"]},
                          "add", NONCE)
    assert req["stdin"] == NONCE + "\n"
    assert NONCE not in req["code"] and all(NONCE not in v for v in req["files"].values())
    assert set(req["files"]) == {"problem.json", "candidate.py", "child.py"}
    with pytest.raises(ValueError, match="entry_point"):
        harness_request("x = 1\n", {"kind": "code", "tests": ["x"]}, "not a name; import os", NONCE)
