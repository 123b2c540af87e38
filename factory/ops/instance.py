"""The Dagster instance settings Factory runs with (`dagster.yaml`), and bringing an existing file up to them.

Every way of starting Factory gets these settings from here: `make demo` (jobs/demo.py) and `make ui`
write or update `$DAGSTER_HOME/dagster.yaml`, `dagster dev` started from the repository root without
DAGSTER_HOME reads the committed `dagster.yaml` there (kept equal to `instance_yaml()` by a test), and
the browser tests start from what `make demo` leaves behind.

The limits do not depend on these settings being present: the sweep launcher never has more than a
sweep's `max_concurrent` members in flight and the eval sensor never more than the eval limit, whatever
the instance's run queue says. The queue settings are a second line: a global cap on runs (a 2-core
machine is overloaded long before Dagster's default of 10), the eval limit where an operator sets it
(`EVAL_QUEUE` tag), which the eval sensor reads back (`eval_limit_from`), and the summary limit (`SUMMARY_QUEUE`
tag, 1: a sweep summary is light, so it has a queue of its own rather than waiting behind a model eval).

Recovery of a run worker that died (kill -9, the OOM killer) needs three settings, the same as
deploy/dagster.yaml's (a test keeps them equal): the run launcher that can check its workers
(resources/run_launcher.py, named here by module: this layer does not import it), run monitoring, which
marks such a run failed, and run retries, which re-execute it from the failed step for the jobs that ask
(assets/_retries.py `TRAINING_TAGS`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

QUEUE_TAG = "factory/queue"  # runs that share a limit: checkpoint evals carry value "eval", sweep summaries "summary"
EVAL_QUEUE = "eval"
SUMMARY_QUEUE = "summary"
DEFAULT_MAX_CONCURRENT_RUNS = 4
DEFAULT_MAX_CONCURRENT_EVALS = 1
MAX_CONCURRENT_SUMMARIES = 1  # never two summaries at once: each draws every member's pictures and MLflow artifacts
# Dagster's default launcher plus a health check of its run workers, by pid (resources/run_launcher.py).
RUN_LAUNCHER = {"module": "resources.run_launcher", "class": "WatchedRunLauncher"}
# The daemon checks started runs' workers every few seconds (the check is a /proc read) and marks a run whose worker
# is gone as failed; resuming a run in place is for launchers that support it (Kubernetes), a retry does it here.
RUN_MONITORING = {"enabled": True, "poll_interval_seconds": 5, "max_resume_run_attempts": 0}
# Only jobs that ask (dagster/max_retries) are retried; a step that failed on its own is left to its RetryPolicy.
RUN_RETRIES = {"enabled": True, "max_retries": 0, "retry_on_asset_or_op_failure": False}
RECOVERY_SETTINGS = {"run_launcher": RUN_LAUNCHER, "run_monitoring": RUN_MONITORING, "run_retries": RUN_RETRIES}


def instance_settings(max_concurrent_runs: int = DEFAULT_MAX_CONCURRENT_RUNS,
                      max_concurrent_evals: int = DEFAULT_MAX_CONCURRENT_EVALS) -> dict[str, Any]:
    """Factory's `dagster.yaml` as a mapping: no telemetry, a run queue with a global cap, an eval limit and a
    summary limit, and the recovery settings (`RECOVERY_SETTINGS`)."""
    if max_concurrent_runs < 1 or max_concurrent_evals < 1:
        raise ValueError(f"max_concurrent_runs and max_concurrent_evals must be >= 1, got "
                         f"{max_concurrent_runs} and {max_concurrent_evals}")
    return {
        "telemetry": {"enabled": False},
        "concurrency": {"runs": {
            "max_concurrent_runs": max_concurrent_runs,
            "tag_concurrency_limits": [_queue_limit(EVAL_QUEUE, max_concurrent_evals),
                                       _queue_limit(SUMMARY_QUEUE, MAX_CONCURRENT_SUMMARIES)],
        }},
        # A queued run starts within a second of a free slot (the default polls every 5 s).
        "run_queue": {"dequeue_interval_seconds": 1},
        **{key: dict(value) for key, value in RECOVERY_SETTINGS.items()},
    }


def _queue_limit(queue: str, n: int) -> dict[str, Any]:
    return {"key": QUEUE_TAG, "value": queue, "limit": n}


def instance_yaml(**kwargs: int) -> str:
    return yaml.safe_dump(instance_settings(**kwargs), sort_keys=False)


def ensure_instance_yaml(dagster_home: str | Path, **kwargs: int) -> list[str]:
    """Write Factory's settings to `dagster_home/dagster.yaml`, or add what an existing file lacks without
    changing what it sets; returns one line per change (empty when nothing changed). Atomic."""
    path = Path(dagster_home) / "dagster.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    want = instance_settings(**kwargs)
    if not path.exists():
        _write(path, yaml.safe_dump(want, sort_keys=False))
        return [f"{path}: written with Factory's settings"]
    try:
        have = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e}); fix or remove it") from None
    if not isinstance(have, dict):
        raise ValueError(f"{path}: expected a mapping of instance settings, got {type(have).__name__}")
    changes = []
    if "telemetry" not in have:
        have["telemetry"] = want["telemetry"]
        changes.append("telemetry: disabled")
    # Older files configure the queue under run_coordinator or run_queue; add the limits where they are set
    # (Dagster refuses the same field in two places).
    legacy = _legacy_queue(have)
    if legacy is not None:
        limits = legacy.setdefault("tag_concurrency_limits", []) or []
        legacy["tag_concurrency_limits"] = limits
    else:
        runs = have.setdefault("concurrency", {}).setdefault("runs", {})
        if "max_concurrent_runs" not in runs:
            runs["max_concurrent_runs"] = want["concurrency"]["runs"]["max_concurrent_runs"]
            changes.append(f"concurrency.runs.max_concurrent_runs: {runs['max_concurrent_runs']}")
        limits = runs.setdefault("tag_concurrency_limits", []) or []
        runs["tag_concurrency_limits"] = limits
    # A file written before summaries had their own queue has the eval limit only: it gains the summary limit.
    for limit in want["concurrency"]["runs"]["tag_concurrency_limits"]:
        if not _limits_queue(limits, limit["value"]):
            limits.append(limit)
            changes.append(f"run queue: at most {limit['limit']} {limit['value']} run(s) at once "
                           f"({QUEUE_TAG}={limit['value']})")
    if "run_coordinator" not in have and "dequeue_interval_seconds" not in (have.get("run_queue") or {}):
        have.setdefault("run_queue", {})["dequeue_interval_seconds"] = 1
        changes.append("run_queue.dequeue_interval_seconds: 1")
    # A file that sets one of these keeps it as it is (an operator's own launcher, retries turned off on purpose).
    for key, value in RECOVERY_SETTINGS.items():
        if key not in have:
            have[key] = dict(value)
            changes.append(f"{key}: {_inline(value)}")
    if changes:
        _write(path, yaml.safe_dump(have, sort_keys=False))
    return [f"{path}: added {c}" for c in changes]


def _legacy_queue(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The mapping that holds tag limits in an old-style file (`run_coordinator.config` or `run_queue` with
    limits), or None for the current `concurrency.runs` layout."""
    coordinator = cfg.get("run_coordinator")
    if isinstance(coordinator, dict):
        return coordinator.setdefault("config", {}) or {}
    queue = cfg.get("run_queue")
    if isinstance(queue, dict) and ("tag_concurrency_limits" in queue or "max_concurrent_runs" in queue):
        return queue
    return None


def _limits_queue(limits: list[Any], queue: str) -> bool:
    """Whether `limits` already limit runs tagged `factory/queue: <queue>`: by that value, or by the tag whatever
    its value (no value: every queue together; `applyLimitPerUniqueValue`: each queue)."""
    for x in limits:
        if isinstance(x, dict) and x.get("key") == QUEUE_TAG:
            value = x.get("value")
            if value is None or value == queue or isinstance(value, dict):
                return True
    return False


def queue_limit_from(tag_limits: list[dict[str, Any]] | None, queue: str, default: int) -> int:
    """The limit on runs tagged `factory/queue: <queue>` set in an instance's run-queue tag limits, else
    `default`."""
    for item in tag_limits or []:
        if item.get("key") == QUEUE_TAG and item.get("value") == queue:
            return max(1, int(item["limit"]))
    return default


def eval_limit_from(tag_limits: list[dict[str, Any]] | None, default: int = DEFAULT_MAX_CONCURRENT_EVALS) -> int:
    """The eval limit set in an instance's run-queue tag limits, else `default`."""
    return queue_limit_from(tag_limits, EVAL_QUEUE, default)


def _inline(value: dict[str, Any]) -> str:
    return ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in value.items())


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
