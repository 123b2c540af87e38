"""`assets/_retries.py`: what a training asset must not retry (it needs a person first) leaves as such a Failure."""

import pytest
from dagster import Failure

from assets._retries import no_retry_for_what_needs_a_fix
from factory.core.gate import LogprobGapError


def test_a_logprob_gap_is_not_retried_and_keeps_its_lines():
    err = LogprobGapError("the rollout engine and the trainer disagree at step 0\n  eos mismatch: ...",
                          {"gap_abs_mean": 1e-8}, 1e-3, "eos mismatch")
    with pytest.raises(Failure) as caught, no_retry_for_what_needs_a_fix():
        raise err
    assert caught.value.allow_retries is False
    assert caught.value.description.startswith("LogprobGapError: the rollout engine and the trainer disagree")
    assert "eos mismatch" in caught.value.description
    with pytest.raises(RuntimeError, match="a crash"), no_retry_for_what_needs_a_fix():  # others: Dagster's policy
        raise RuntimeError("a crash")
