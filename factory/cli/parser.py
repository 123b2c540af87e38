"""The `factory` command line: every command's arguments, one function per command group. Each command names its
implementation as "module:function" in `factory/cli/`, imported only when that command runs (`app.py`), so
`factory --help` and a usage error never import torch, pyiceberg, uvicorn or the deploy code."""

from __future__ import annotations

import argparse

from factory.presets import PRESETS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="factory", description="RL post-training experiment factory")
    parser.add_argument("--home", help="state directory (default: $FACTORY_HOME, else ./.factory)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_spec_commands, _run_commands, _lake_commands, _serve_commands, _model_commands, _preflight_commands,
                _deploy_commands):
        add(sub)
    return parser



def _spec_commands(sub: argparse._SubParsersAction) -> None:
    """validate: check a spec."""
    p = sub.add_parser("validate", help="check a spec, and that this machine has the cores and GPUs it asks for; "
                                          "exit 2 naming each bad field")
    add_spec(p)
    p.add_argument("--show", action="store_true", help="print the resolved spec with defaults")
    p.set_defaults(func="spec:cmd_validate")


def _run_commands(sub: argparse._SubParsersAction) -> None:
    """run, train-grpo, resume, attempt: training a spec."""
    p = sub.add_parser("run", help="train a spec end to end (the same code the Dagster assets call)")
    add_spec(p, optional=True)
    p.add_argument("--control", action="store_true",
                   help="also spend the GRPO run's wall time on more SFT, for comparison")
    p.add_argument("--resume", metavar="RUN_ID", help="continue this run from its newest resume point instead")
    p.add_argument("--in-process", action="store_true",
                   help="train in this process, without automatic restarts (default: attempts run in child "
                        "processes, restarted and resumed when one dies or hangs, up to ops.max_restarts)")
    p.set_defaults(func="run:cmd_run")

    p = sub.add_parser("train-grpo", help="(the grpo_run asset's trainer pods) the RL run, inputs and "
                       "result through Dagster Pipes")
    add_spec(p)
    p.add_argument("--init", help="SFT checkpoint to start from (outside Pipes; under Pipes the extras give it)")
    p.add_argument("--dataset", help="dataset directory (outside Pipes)")
    p.add_argument("--run-id", help="continue this factory run (outside Pipes)")
    p.set_defaults(func="run:cmd_train_rl")

    p = sub.add_parser("resume", help="continue a run that did not finish, from its newest resume point",
                       description="Continue a run that did not finish (killed, crashed, stopped, out of restarts) "
                       "from its newest complete resume point, supervised like `factory run`. If the supervising "
                       "`factory run` was killed, its attempt stopped by itself at its next resume point (exit 7, "
                       "cause supervisor_lost) and this continues it; while that attempt still holds the run's "
                       "lock, resume refuses (wait for it to stop).")
    p.add_argument("run_id", metavar="RUN_ID", help="run id (see `factory runs`)")
    p.set_defaults(func="run:cmd_resume")

    p = sub.add_parser("attempt", help="(internal) one attempt of a run in this process; run/resume start these")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--standby", action="store_true", help="warm up, then fork an attempt per 'go ATTEMPT' on stdin")
    p.set_defaults(func="run:cmd_attempt")


def _lake_commands(sub: argparse._SubParsersAction) -> None:
    """query, runs, best, compare: reading the lake."""
    p = sub.add_parser("query", help="run SQL (DuckDB) over the lake tables",
                       description="Tables: runs, steps, checkpoints, evals, rollouts, node_health, sweeps.")
    p.add_argument("sql", help="e.g. \"SELECT step, loss FROM steps WHERE run_id = '...' ORDER BY step\"")
    add_format(p)
    p.set_defaults(func="lake:cmd_query")

    p = sub.add_parser("runs", help="list runs with status and final accuracy")
    add_format(p)
    p.set_defaults(func="lake:cmd_runs")

    p = sub.add_parser("best", help="rank runs by an eval metric: final results, or every run at one step",
                       description="Ranks runs by METRIC (table `evals`) on the benchmark, best first: final results "
                                   "only (runs that succeeded, each at its greatest step that recorded it), or with "
                                   "--step N every run's value at step N. A pruned, failed or running run's latest "
                                   "value is from an earlier step, so it is not ranked with final results; the "
                                   "table says what was ranked and which runs were left out.")
    p.add_argument("--metric", required=True, help="eval metric, e.g. accuracy or pass@8")
    p.add_argument("--benchmark", help="benchmark (default: the one whole benchmark, i.e. without '/', "
                                       "that has the metric; required when there are several)")
    p.add_argument("--sweep", metavar="SWEEP_ID", help="only runs of this sweep")
    p.add_argument("--top", type=int, default=10, metavar="N", help="how many runs (default: 10)")
    p.add_argument("--lowest", action="store_true", help="lowest value first (for losses, error rates)")
    p.add_argument("--step", type=int, metavar="N", help="rank every run that recorded the metric at step N "
                                                          "(default: final results of succeeded runs)")
    add_format(p)
    p.set_defaults(func="lake:cmd_best")

    p = sub.add_parser("compare", help="compare two runs: spec differences, final evals, step aggregates")
    p.add_argument("run_a", metavar="RUN_A", help="run id (see `factory runs`)")
    p.add_argument("run_b", metavar="RUN_B", help="run id")
    # No csv: its three sections have different columns; json is one object for scripts.
    p.add_argument("--format", "-f", choices=("table", "json"), default="table",
                   help="output format (default: table)")
    p.set_defaults(func="lake:cmd_compare")


def _serve_commands(sub: argparse._SubParsersAction) -> None:
    """serve, env-serve, sandbox-serve, eval-serve: the HTTP services."""
    p = sub.add_parser("serve", help="serve a policy over the OpenAI API (rollout server mode)",
                       description="OpenAI-compatible rollout server with SGLang-style control endpoints.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="HF-format checkpoint directory to serve (or, as model.path takes, a .gguf "
                     "file or a Hugging Face Hub id in the local cache)")
    src.add_argument("--preset", help="serve a freshly initialised model of this preset (for trying the API)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--max-batch", type=int, default=64, help="sequences decoded together (default: 64)")
    p.add_argument("--max-seq-len", type=int, help="prompt + completion limit (default: the model's context)")
    p.add_argument("--weight-version", type=int, default=0, help="version tag of the served weights (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="init seed for --preset")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; on cores shared with "
                                               "other jobs 1 can be much faster)")
    p.add_argument("--device", default="auto", help="where the model computes: auto (a GPU when torch sees one, else "
                                                    "the CPU; default), cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: decode under bf16 autocast on a GPU (fp32 weights kept); the CPU always decodes fp32")
    p.add_argument("--kv-budget-mb", type=int, metavar="MIB",
                   help="MiB the KV cache may hold; requests wait for room in it, one that can never fit gets a 400 "
                        "(default: half the memory free at start: the GPU's, or the host's within its cgroup and "
                        "rlimits)")
    p.add_argument("--engine", choices=("auto", "paged", "continuous"), default="auto",
                   help="the rollout engine: auto (the paged engine for Llama / Qwen2 / Qwen3 / Mistral models, else "
                        "the continuous engine, with a log line saying why; default), paged or continuous")
    p.add_argument("--served-model-name", action="append", metavar="NAME",
                   help="a name requests may give as `model` (repeatable; default: the checkpoint directory's name "
                        "or the preset); `policy`, the name Factory's environments use, is always accepted")
    add_max_body(p)
    add_max_body(p, "--max-update-mb", 16384, "a weight update (POST /update_weights_from_delta)")
    p.set_defaults(func="serve:cmd_serve")

    p = sub.add_parser("env-serve", help="serve environment workers (episode scoring) over HTTP",
                       description="Environment workers: POST /score runs episodes side by side and returns rewards.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port (default: 8100)")
    p.add_argument("--latency-unit", type=float, default=0.0,
                   help="simulated heavy-tailed episode latency unit in seconds (envs/latency.py); 0: none")
    add_max_body(p)
    p.set_defaults(func="env_serve:cmd_env_serve")

    p = sub.add_parser("sandbox-serve", help="serve a sandbox pool (runs generated code) over HTTP",
                       description="Sandbox pool: POST /run executes code in a warm, isolated worker and "
                                   "returns its result (factory/envs/sandbox_service.py).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8200, help="port (default: 8200)")
    p.add_argument("--size", type=int, default=4, help="warm workers (default: 4)")
    p.add_argument("--isolation", choices=("bwrap", "none"), default="bwrap",
                   help="bwrap: namespaces via bubblewrap (default); none: NOT isolated, for trusted code only")
    add_max_body(p)
    p.set_defaults(func="env_serve:cmd_sandbox_serve")

    p = sub.add_parser("eval-serve", help="serve checkpoint evals over HTTP (the periodic evals' shared process)",
                       description="Eval server: POST /eval {run_id, step, benchmark} evaluates a recorded checkpoint "
                                   "as the checkpoint_eval asset does, without a process start per eval "
                                   "(factory/runs/eval_server.py). The asset starts one on demand.")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: 0, any free one; the port is "
                                                       "written to FACTORY_HOME/run/eval-server.json)")
    p.add_argument("--idle-s", type=float, default=600.0,
                   help="exit after this many seconds without a request; 0: never (default: 600)")
    p.set_defaults(func="env_serve:cmd_eval_serve")


def _model_commands(sub: argparse._SubParsersAction) -> None:
    """bpe-model, models import."""
    p = sub.add_parser("models", help="models for model.path: a .gguf file, a cached Hugging Face Hub id or a "
                       "directory")
    models = p.add_subparsers(dest="models_command", required=True)
    p = models.add_parser("import", help="resolve a model.path value ahead of a run (a .gguf file is converted "
                          "once into FACTORY_HOME/models/gguf) and print the directory it names",
                          description="model.path takes a local Hugging Face directory, a .gguf file (converted "
                          "once under FACTORY_HOME and reused) or a Hugging Face Hub id org/name[@revision] from the "
                          "local cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; nothing is "
                          "downloaded). An existing directory wins over a hub id.")
    p.add_argument("src", metavar="SRC", help="a .gguf file, a hub id (org/name or org/name@revision) or a directory")
    p.set_defaults(func="models:cmd_models_import")

    p = sub.add_parser("bpe-model", help="write a small HF model directory (Qwen2, byte-level BPE tokenizer, ChatML "
                       "template) built offline, to try model.path without a download")
    p.add_argument("dir", help="the directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="the model's size")
    p.add_argument("--max-positions", type=int, default=128)
    p.add_argument("--force", action="store_true", help="write over a directory that is not empty")
    p.set_defaults(func="models:cmd_bpe_model")


def _preflight_commands(sub: argparse._SubParsersAction) -> None:
    """preflight: this node's checks."""
    p = sub.add_parser("preflight", help="test this node (hardware, software, disks, lake, sandbox); exit 1 naming "
                       "failed checks", description="Preflight node tests (factory/ops/preflight/): each check's "
                       "value against its floor, recorded in the lake table node_health; training refuses a node "
                       "whose latest preflight failed.")
    p.add_argument("--deep", action="store_true", help="measure longer; add all-reduce, the rollout server and the "
                   "whole sandbox red-team suite (about 1-3 min instead of about 15 s)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object instead of the table")
    p.add_argument("--check", dest="checks", action="append", default=[], metavar="NAME",
                   help="run only this check (repeatable), e.g. after fixing what it found")
    p.add_argument("--kind", help="node kind whose floors apply (default: $FACTORY_NODE_KIND, else detected)")
    p.add_argument("--no-record", action="store_true", help="do not write the results to the lake")
    p.add_argument("--spec", metavar="FILE", help="gate this experiment's own rollout engine and trainer in the "
                   "logprob_gap check (its model, engine, mode, precision, device) instead of the default tiny setup")
    p.add_argument("--verbose", "-v", action="store_true", help="log each check on stderr as it finishes")
    p.add_argument("--mark-node", action="store_true", help="then mark the Kubernetes node $NODE_NAME: label "
                   "factory.dev/preflight=passed|failed, taint factory.dev/preflight-failed on failure (removed on "
                   "a pass); what the `factory deploy preflight` Jobs run")
    p.add_argument("--kubeconfig", help="with --mark-node: kubeconfig file (default: $KUBECONFIG, else the pod's "
                   "service account)")
    p.set_defaults(func="preflight:cmd_preflight")


def _deploy_commands(sub: argparse._SubParsersAction) -> None:
    """deploy render, deploy preflight: Kubernetes manifests."""
    p = sub.add_parser("deploy", help="Kubernetes: render the manifests a spec needs (factory/deploy/)")
    deploy = p.add_subparsers(dest="deploy_command", required=True)
    p = deploy.add_parser("render", help="write every manifest Factory would create for a spec to --out, for "
                          "review and GitOps (nothing is applied to a cluster)")
    add_spec(p)
    p.add_argument("--out", required=True, help="directory to write (refused when not empty, unless --force)")
    p.add_argument("--profile", help="deploy profile YAML (image, namespace, node pools; default: built-in)")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    p.set_defaults(func="deploy:cmd_deploy_render")
    p = deploy.add_parser("preflight", help="write RBAC and one Job per node that preflights it and marks it "
                          "(a failed node is tainted so training avoids it); nothing is applied")
    p.add_argument("--nodes", required=True, help="comma-separated node names, e.g. gpu-node-1,gpu-node-2")
    p.add_argument("--out", required=True, help="directory to write (refused when not empty, unless --force)")
    p.add_argument("--profile", help="deploy profile YAML (image, namespace, train pool; default: built-in)")
    p.add_argument("--spec", help="experiment spec: its ConfigMap is mounted and its GPUs per training pod requested "
                   "(default: the profile's gpus_per_train_pod)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a --spec field (repeatable)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs each Job requests (default: a training pod's); a node's "
                   "whole count tests every GPU")
    p.add_argument("--deep", action="store_true", help="the Jobs run the deep preflight")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    p.set_defaults(func="deploy:cmd_deploy_preflight")


def add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", "-f", choices=("table", "csv", "json"), default="table",
                   help="output format (default: table)")


def add_spec(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("spec", nargs="?" if optional else None, help="path to an experiment spec (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a spec field, e.g. --set algorithm.lr=1e-4 (repeatable; values are YAML)")


def add_max_body(p: argparse.ArgumentParser, flag: str = "--max-body-mb", default: float = 8.0,
                  what: str = "a JSON request body") -> None:
    def megabytes(text: str) -> int:
        try:
            mb = float(text)
        except ValueError:
            mb = float("nan")
        if not 0 < mb < float("inf"):
            raise argparse.ArgumentTypeError(f"want a number of MiB > 0, got {text!r}")
        return max(1, int(mb * (1 << 20)))

    p.add_argument(flag, type=megabytes, default=int(default * (1 << 20)), metavar="MIB",
                   help=f"{what} over this many MiB gets a 413 (default: {default:g})")
