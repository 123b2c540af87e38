"""An attempt's end is classified from what its loop returned (`LoopEnd`) and its own `StopRequest`, not from fields
set on the checkpoint policy: each cause gives the run status, interruption cause and error it gave before."""

import pytest

from factory.core.gate import LogprobGapError
from factory.core.loop import FINISHED, NON_FINITE, STOPPED, LoopEnd, NonFiniteLoss, RunInterrupted
from factory.lake.spool import LakeDown
from factory.runs.attempt import StopRequest
from factory.runs.rl_run import _classify, _ended


@pytest.mark.parametrize(("cause", "status", "recorded"), [
    ("signal", "interrupted", "signal"),
    (None, "interrupted", "signal"),  # a policy that names no cause: a signal, as before
    ("supervisor_lost", "interrupted", "supervisor_lost"),
    ("pruned", "pruned", "pruned"),
])
def test_a_stopped_loop_is_recorded_as_its_cause_with_the_message_it_always_had(cause, status, recorded):
    error, got_status, got_cause = _ended(LoopEnd(STOPPED, 3, [], cause), lake_down=None)
    assert (got_status, got_cause) == (status, recorded)
    assert isinstance(error, RunInterrupted) and error.cause == cause
    assert f"{type(error).__name__}: {error}" == "RunInterrupted: stopped on request after step 3; resume point written"


def test_the_lake_watch_outranks_a_later_signal():
    error, status, cause = _ended(LoopEnd(STOPPED, 3, [], "signal"), lake_down="the lake was down for 61 s")
    assert (type(error), str(error), status, cause) == (LakeDown, "the lake was down for 61 s", "interrupted",
                                                        "lake_down")


def test_non_finite_updates_and_the_gap_are_recorded_as_failures_unless_a_stop_was_asked():
    bad = NonFiniteLoss("2 steps in a row")
    assert _ended(LoopEnd(NON_FINITE, 2, [], None, bad), None) == (bad, "failed", "non_finite_loss")
    gap = LogprobGapError("drifted", {}, 0.1, "drift")
    assert _ended(LoopEnd("logprob_gap", 2, [], None, gap), None) == (gap, "failed", "logprob_gap")
    assert _ended(LoopEnd(NON_FINITE, 2, [], "signal", bad), None)[1:] == ("interrupted", "signal")


def test_an_exception_is_classified_by_its_type_and_the_stop_asked():
    assert _classify(KeyboardInterrupt(), StopRequest.SIGNAL) == ("interrupted", "signal")
    assert _classify(RuntimeError("boom"), None) == ("interrupted", "crash")
    assert _classify(RuntimeError("boom"), StopRequest.PRUNED) == ("pruned", "pruned")
    assert _classify(LakeDown("down"), StopRequest.PRUNED) == ("interrupted", "lake_down")


def test_a_stop_request_is_false_until_asked_and_a_later_ask_names_the_cause():
    stop = StopRequest()
    assert not stop and stop.cause is None
    stop.ask(StopRequest.PRUNED)
    stop.ask(StopRequest.SIGNAL)
    assert stop and stop.cause == "signal"
    assert LoopEnd(FINISHED, 4, []).finished
