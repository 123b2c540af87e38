"""Marking a Kubernetes node with its preflight outcome (`factory preflight --mark-node`), so that training pods
avoid a node that failed.

A failed node gets the label `factory.dev/preflight=failed`, the taint `factory.dev/preflight-failed` (effect
NoSchedule) and the annotation `factory.dev/preflight` (JSON: preflight id, failed check names, when). A passing
node gets the label `passed`, the same annotation with no failed checks, and loses that taint; every other taint
(the GPU pool's, a cordon's) is kept. Training pods avoid a failed node because they do not tolerate the taint:
the scheduler places no new pod there (NoSchedule: pods already running stay; the preflight Job only starts once
the node's GPUs are free, so normally none is). The preflight Job itself tolerates it, so a failed node can be
re-tested and cleared.

`node_patch` builds the JSON merge patch from the node as read (pure: tested on its own); `mark_node` reads the node
and sends the patch. A merge patch replaces a list whole, so the patch carries the node's complete new taint list,
and the node's `resourceVersion`, so that a taint another writer added between the read and the patch is not lost:
the API server answers 409 Conflict and the read-and-patch is retried.

A partial run (`--check NAME`) changes only what it checked: the failed checks it did not run stay failed (read from
the node's annotation), so a partial re-run after a fix clears the node only when nothing else failed.

The calls are tested against the fake API server in tests/deploy/fake_kube.py (a local HTTP server speaking a
subset of the Kubernetes API), not against a real API server, node or scheduler (docs/kubernetes.md).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Iterable
from typing import Any

from urllib3.exceptions import HTTPError

from factory.infra.supervisor import retry
from factory.ops.preflight.result import PreflightReport

LABEL = "factory.dev/preflight"  # "passed" | "failed"
ANNOTATION = "factory.dev/preflight"  # JSON: {"preflight_id", "failed", "checked_at", "partial"}
TAINT_KEY = "factory.dev/preflight-failed"
TAINT_EFFECT = "NoSchedule"
MERGE_PATCH = "application/merge-patch+json"
CONFLICT_RETRIES = 5


class MarkError(RuntimeError):
    """The node could not be read or patched; the message names the node and what the API server said."""


def previous_failures(node: dict[str, Any]) -> list[str]:
    """The failed check names in the node's preflight annotation ([] when there is none or it is not ours)."""
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
    try:
        failed = json.loads(raw)["failed"] if raw else []
    except (ValueError, TypeError, KeyError):
        return []
    return [str(c) for c in failed] if isinstance(failed, list) else []


def node_patch(node: dict[str, Any], report: PreflightReport, partial: bool = False,
               now: dt.datetime | None = None) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that marks `node` (a Node as the API returns it, camelCase) with `report`'s
    outcome. With `partial`, failed checks the report did not run stay failed. See the module docstring."""
    failed = [r.name for r in report.failed]
    if partial:
        ran = {r.name for r in report.results}
        failed += [c for c in previous_failures(node) if c not in ran and c not in failed]
    others = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") != TAINT_KEY]
    taints = [*others, {"key": TAINT_KEY, "value": report.preflight_id, "effect": TAINT_EFFECT}] if failed else others
    note = {"preflight_id": report.preflight_id, "failed": sorted(failed), "partial": partial,
            "checked_at": (now or report.started_at).astimezone(dt.UTC).isoformat(timespec="seconds")}
    meta: dict[str, Any] = {"labels": {LABEL: "failed" if failed else "passed"},
                            "annotations": {ANNOTATION: json.dumps(note, sort_keys=True)}}
    rv = (node.get("metadata") or {}).get("resourceVersion")
    if rv:
        meta["resourceVersion"] = rv  # optimistic concurrency: 409 if the node changed since it was read
    return {"metadata": meta, "spec": {"taints": taints}}


def tolerates(tolerations: Iterable[dict[str, Any]], key: str = TAINT_KEY, effect: str = TAINT_EFFECT,
              value: str = "") -> bool:
    """Whether a pod with `tolerations` (manifest dicts) tolerates the taint, by Kubernetes' matching rules: an
    empty key with Exists matches every taint, an empty effect matches every effect, Equal compares the value."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != effect:
            continue
        op = t.get("operator", "Equal")
        if not t.get("key"):
            if op == "Exists":
                return True
            continue
        if t["key"] == key and (op == "Exists" or t.get("value", "") == value):
            return True
    return False


def api_client(kubeconfig: str | None = None) -> Any:
    """A kubernetes ApiClient: from `kubeconfig` (a file; tests point it at a local server), else $KUBECONFIG, else
    the pod's in-cluster service account (the preflight Job's)."""
    from kubernetes import client, config  # noqa: PLC0415 heavy: kubernetes; marking a node needs it, the checks not

    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        flag = "--kubeconfig" if kubeconfig else "$KUBECONFIG"
        if not os.path.isfile(path):
            raise MarkError(f"{flag}: no such file: {path}")
        try:
            return config.new_client_from_config(config_file=path)
        except Exception as e:  # noqa: BLE001 - the client raises TypeError/KeyError on a malformed file, not only
            raise MarkError(f"{flag}: {path} is not a usable kubeconfig ({type(e).__name__}: {e})") from None
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException as e:
        raise MarkError(f"no Kubernetes credentials: give --kubeconfig or $KUBECONFIG, or run in a pod with a "
                        f"service account ({e})") from None
    return client.ApiClient(cfg)


def mark_node(name: str, report: PreflightReport, partial: bool = False, kubeconfig: str | None = None
              ) -> dict[str, Any]:
    """Read node `name`, send `node_patch`, retry on 409 Conflict; return the patched Node (camelCase dict).
    MarkError naming the node and the API server's answer otherwise."""
    from kubernetes import client  # noqa: PLC0415 heavy: kubernetes; marking a node needs it, the checks do not

    with api_client(kubeconfig) as api:
        core = client.CoreV1Api(api)

        def patch() -> dict[str, Any]:
            # Raw JSON, not the client's typed model: the taints go back exactly as read (a field this client
            # version does not know would otherwise be dropped, and timeAdded rewritten).
            node = json.loads(core.read_node(name, _preload_content=False).data)
            # The client sends a dict as a strategic merge patch unless told: name the RFC 7386 merge patch
            # node_patch is written for (lists replaced whole, null deletes).
            patched = core.patch_node(name, node_patch(node, report, partial), _content_type=MERGE_PATCH,
                                      _preload_content=False)
            return json.loads(patched.data)

        try:
            return retry(patch, attempts=CONFLICT_RETRIES,
                         on=lambda e: isinstance(e, client.ApiException) and e.status == 409)
        except client.ApiException as e:
            raise MarkError(f"cannot mark node {name}: API server answered {e.status} {e.reason}: "
                            f"{_status_message(e.body)}") from None
        except (HTTPError, OSError) as e:  # unreachable server, refused connection, TLS
            raise MarkError(f"cannot mark node {name}: {type(e).__name__}: {e}") from None


def _status_message(body: str | bytes | None) -> str:
    """The `message` of a Kubernetes Status body (what went wrong, in the server's words), else the body's start."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else (body or "")
    try:
        return str(json.loads(text)["message"])
    except (ValueError, TypeError, KeyError):
        return text.strip()[:300] or "no body"
