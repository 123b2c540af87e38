"""`resources/launch.py`'s exit-code mapping: which exits of `factory train-grpo` Dagster may retry."""

import pytest
from dagster import Failure

from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_LOGPROB_GAP, EXIT_NEEDS_FIX
from resources.launch import check_exit


def test_only_a_crash_is_retried_not_what_needs_a_fix():
    check_exit(0, "train-grpo")  # done: nothing raised
    for code in (EXIT_BAD_INPUT, EXIT_NEEDS_FIX, EXIT_LOGPROB_GAP):
        with pytest.raises(Failure) as caught:
            check_exit(code, "train-grpo")
        assert caught.value.allow_retries is False and f"exited with {code} (needs a fix" in caught.value.description
    with pytest.raises(Failure) as caught:
        check_exit(EXIT_FAILED, "train-grpo")
    assert caught.value.allow_retries is not False
