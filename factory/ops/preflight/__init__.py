"""Preflight node tests: is this node fit to train? Checks with values, thresholds and messages; records in the lake
table `node_health`; the gate that keeps training off a node whose latest preflight failed.

    result.py       CheckResult, PreflightReport, the table printed by `factory preflight`
    nodes.py        node name and kind, the floors per kind
    runner.py       the checks of each mode, run in order, recorded
    gate.py         gate(ops, paths, lake, log): refuse, or run a quick preflight first when none is fresh
    gpu.py, perf.py, determinism.py, disk.py, allreduce.py, services.py, logprob_gap.py: the checks themselves
"""

from factory.ops.preflight.gate import PreflightFailed, gate, latest_results, preflight_disabled
from factory.ops.preflight.nodes import NODE_KINDS, NodeKind, node_kind, node_name
from factory.ops.preflight.result import CheckResult, PreflightReport, format_checks
from factory.ops.preflight.runner import CHECK_NAMES, MODES, PROBES, run_preflight, select_probes

__all__ = ["CHECK_NAMES", "MODES", "NODE_KINDS", "PROBES", "CheckResult", "NodeKind", "PreflightFailed",
           "PreflightReport", "format_checks", "gate", "latest_results", "node_kind", "node_name",
           "preflight_disabled", "run_preflight", "select_probes"]
