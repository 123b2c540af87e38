"""`rollout.engine: sglang` in the overlapped modes: the producer threads sample from SGLang servers.

`SGLangProducer` is `OverlappedProducer` (buffer, staleness policy, version tags, feed) with the
engine swapped: `make_sglang_engine` starts the servers of `rollout.sglang` on a checkpoint of the
trainer's current model (or uses `rollout.sglang.urls`, pushing the current weights to them first),
and returns an `SGLangRouter` whose weight updates go the spec's way (disk | tensor | distributed).
Each prompt group is one /generate call of n copies on one server; completions carry the version
the request left with and the server's label, the older counting (`SGLangEngine`), so staleness
works as with the embedded engine. `publish` sends the trainer's state dict to every server and
checks every server reports the new version before the producers date new work with it.

Servers serve in bfloat16 unless `extra_args` sets a `--dtype` (`sglang_servers.served_dtype`), and
every update is published in that dtype. A distributed (NCCL) update stages on the trainer's GPU;
when a server started here uses that GPU too (rollout.devices, or SGLang's own GPUs 0.. when unset),
NCCL would refuse two ranks on one GPU, so the update goes as tensors (CUDA IPC) instead, saying so in
the log. At start, every server's sglang version must be at least `MIN_SGLANG_VERSION`.

Not the same as the embedded engine: per-sample seeds are not sent (`sampling_seed` needs a
deterministic-inference server), so SGLang runs are not bit-reproducible; `token_versions` are
empty (which token came from which version is unknown; `weight_version` is the oldest possible).

Not run against a real SGLang server (docs/hardware.md). The producer test
runs it end to end against fake SGLang server processes (tests/core/fake_sglang_server.py) that
answer with deterministic tokens.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.config import ExperimentSpec
from factory.core.producers.overlapped import OverlappedProducer
from factory.core.producers.sync import SyncProducer
from factory.core.rollout.base import Completion, SamplingParams
from factory.core.sglang.router import SGLangRouter
from factory.core.sglang.servers import LAUNCH_MODULE, SGLangServers, served_dtype
from factory.core.sglang.weights import DiskUpdate, DistributedUpdate, TensorUpdate, WeightUpdate
from factory.data.feed import PromptFeed
from factory.models.checkpoint import remove_checkpoint, save_checkpoint

log = logging.getLogger(__name__)


def server_gpus(spec: ExperimentSpec) -> set[int] | None:
    """The GPU ids (this process's numbering) the started servers use; None for `rollout.sglang.urls`
    (servers Factory did not start: their GPUs are unknown here)."""
    sg = spec.rollout.sglang
    if sg.urls:
        return None
    n = sg.servers * sg.tp_size
    return set(spec.rollout.devices[:n]) if spec.rollout.devices is not None else set(range(n))


def make_updater(spec: ExperimentSpec, workdir: Path, model_dir: Path | None,
                 staging: torch.device | str | None = None) -> WeightUpdate:
    """The spec's weight update, publishing in the servers' dtype. `staging`: where a distributed update
    stages tensors (the trainer's device; default: the first GPU when there is one)."""
    sg = spec.rollout.sglang
    dtype = served_dtype(sg)
    how = sg.weight_update
    cuda = torch.cuda.is_available()
    device = torch.device(staging) if staging is not None else torch.device("cuda" if cuda else "cpu")
    if how == "distributed" and device.type == "cuda":
        index = device.index if device.index is not None else 0
        taken = server_gpus(spec)
        if taken is not None and index in taken:
            log.warning("rollout.sglang.weight_update: distributed would stage on cuda:%d, which SGLang server(s) "
                        "also use (GPUs %s): NCCL refuses two ranks on one GPU; sending tensors (CUDA IPC) "
                        "instead", index, sorted(taken))
            how = "tensor"
    if how == "disk":
        return DiskUpdate(workdir / "weights", config_dir=model_dir, dtype=dtype)
    if how == "tensor":
        return TensorUpdate(tp_size=sg.tp_size, dtype=dtype)
    n = len(sg.urls) or sg.servers
    return DistributedUpdate("127.0.0.1", 0, [sg.tp_size] * n, backend="nccl" if device.type == "cuda" else "gloo",
                             device=device, timeout_s=spec.schedule.wait_timeout_s, dtype=dtype)


def make_sglang_engine(spec: ExperimentSpec, model_dir: Path | None, workdir: Path, version: int,
                       state: dict[str, torch.Tensor] | None = None, *, gpus: Sequence[int] | None = None,
                       module: str = LAUNCH_MODULE, stop_token_ids: list[int] | None = None,
                       staging: torch.device | str | None = None) -> SGLangRouter:
    """Start (or find) the spec's SGLang servers and a router over them at `version`.

    Started servers load `model_dir` (the weights of `version`) and get the label `version`
    (POST /update_weight_version); external ones (`rollout.sglang.urls`) are sent `state` as `version`.
    Servers older than `MIN_SGLANG_VERSION` are refused. `staging`: the trainer's device (`make_updater`)."""
    sg = spec.rollout.sglang
    if sg is None:
        raise ValueError("rollout.engine: sglang needs rollout.sglang")
    servers = SGLangServers(sg, None if sg.urls else model_dir, workdir / "logs", gpus=gpus, module=module).start()
    try:
        router = SGLangRouter(servers.urls, make_updater(spec, workdir, model_dir, staging), weight_version=version,
                              servers=servers, update_mode=spec.rollout.update_mode,
                              timeout=spec.schedule.wait_timeout_s, stop_token_ids=stop_token_ids)
        try:
            router.check_server_versions()
        except BaseException:
            router.close()
            raise
        if servers.external:
            if state is None:
                raise ValueError("rollout.sglang.urls: the servers there need the trainer's weights (state)")
            router.load_weights(state, version)
        else:
            for c in router.clients:
                c.post_checked("/update_weight_version", {"new_version": str(version)}, f"version label {version}")
            router.check_versions(version)
    except BaseException:
        servers.stop()
        raise
    return router


class SGLangProducer(OverlappedProducer):
    """As `OverlappedProducer`, with SGLang servers as the engine (rollout.engine: sglang)."""

    def _start_engine(self, model: PreTrainedModel, version: int) -> None:
        self._workdir = Path(tempfile.mkdtemp(prefix="factory-sglang-"))
        # the servers start from it (unless rollout.sglang.urls); disk updates copy its config files
        model_dir = self._workdir / "initial"
        save_checkpoint(model, self.tok, model_dir)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        eos = self.tok.eos_token_id
        self.engine = make_sglang_engine(self.spec, model_dir, self._workdir, version, state,
                                         gpus=self.spec.rollout.devices,
                                         stop_token_ids=[eos] if eos is not None else None,
                                         staging=next(model.parameters()).device)

    def _sample(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        return self.engine.generate([prompt_ids], params)[0]

    def publish(self, model: PreTrainedModel, version: int) -> None:
        self.engine.load_weights({k: v.detach() for k, v in model.state_dict().items()}, version)
        self._published = version

    def metrics(self) -> dict[str, float]:
        m = super().metrics()
        for i, n in enumerate(self.engine.routed):
            m[f"sglang_routed_{i}"] = float(n)
        if self.engine.servers is not None and not self.engine.servers.external:
            m["sglang_restarts"] = float(sum(self.engine.servers.restarts()))
        return m

    def _stop_engine(self) -> None:
        self.engine.close()
        if self.engine.servers is not None:
            self.engine.servers.stop()
        # the logs stay for post-mortems; the checkpoint and published weights go
        remove_checkpoint(self._workdir / "initial")
        shutil.rmtree(self._workdir / "weights", ignore_errors=True)


def build(spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, feed: PromptFeed,
          start_version: int, state: dict | None) -> SyncProducer | SGLangProducer:
    """`rollout.engine: sglang`, the built-in `factory.protocols.PRODUCERS` entry (sync samples in-process)."""
    cls = SyncProducer if spec.schedule.mode == "sync" else SGLangProducer
    return cls(spec, model, tokenizer, feed, start_version, state=state)
