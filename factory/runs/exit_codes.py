"""Exit codes of the `factory` command and of a run's processes (an attempt, the Pipes entrypoint), which the
restarts supervisor and the Dagster launcher read back: 0 ok, 1 failure while doing the work (retryable),
2 bad input, 3 stopped on request (SIGTERM/SIGINT; resumable), 4 stopped until something is fixed (non-finite
losses, a tripped circuit breaker: not retried), 5 stopped because a dependency stayed down (the lake/catalog past
`ops.lake_outage_s`: not retried, resumable once it is back), 6 stopped because a disk is full (not retried,
resumable once space is freed), 7 an attempt that lost its supervisor and stopped at a resume point
(resumable with `factory resume`; nobody is left to read it but the record), 8 stopped because the rollout engine's
log-probs and the trainer's disagree past `ops.max_logprob_gap` (at step 0, or for `ops.max_gap_steps` steps: a
setup to fix, not retried)."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3
EXIT_NEEDS_FIX = 4
EXIT_DEPENDENCY_DOWN = 5
EXIT_DISK_FULL = 6
EXIT_SUPERVISOR_LOST = 7
EXIT_LOGPROB_GAP = 8
