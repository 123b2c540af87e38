"""How new weights reach SGLang servers: from disk, from tensors, or through a distributed group.

One small interface, `WeightUpdate`: `prepare(state, version)` once on the trainer side, then
`apply(client, version)` per server (the router runs these side by side and checks each server's
version afterwards), and `resync(client)` for a server restarted at its initial weights.

Shapes followed (SGLang's native HTTP API: docs "native_api" / "rl" pages and
`python/sglang/srt/managers/io_struct.py` + `entrypoints/http_server.py`; docs/hardware.md says which release):
- disk: POST /update_weights_from_disk {"model_path", "weight_version", "load_format"?}
  (UpdateWeightFromDiskReqInput) → {"success", "message", "num_paused_requests"}; the directory
  holds `model.safetensors` with the Hugging Face parameter names and the model's config files.
- tensor: POST /update_weights_from_tensor {"serialized_named_tensors": [one str per TP rank],
  "load_format": null, "flush_cache", "weight_version"} (UpdateWeightsFromTensorReqInput) →
  {"success", "message"}. Each entry is base64 of a pickle of `[(name, tensor), ...]`, what
  `MultiprocessingSerializer.serialize(named_tensors, output_str=True)` makes (ForkingPickler:
  CUDA tensors travel as CUDA IPC handles, so the trainer and the server must share the node).
  CPU tensors are pickled by value here (plain pickle: `torch._utils` / `torch.storage`, which
  SGLang's allowlisted unpickler accepts), since ForkingPickler's shared-memory path for CPU
  storage needs the two processes to share an authkey. "flattened_bucket" (needs sglang's
  FlattenedTensorMetadata class) is not implemented. Sent in buckets of `bucket_bytes`; only the
  last bucket carries `weight_version` and `flush_cache: true`.
- distributed: POST /init_weights_update_group {"master_address", "master_port", "rank_offset",
  "world_size", "group_name", "backend"} (InitWeightsUpdateGroupReqInput) on every server at once
  while the trainer joins as rank 0 (`init_custom_process_group`, the same rendezvous SGLang
  uses: tcp:// store on the trainer, a PrefixStore per group name); then per bucket POST
  /update_weights_from_distributed {"names", "dtypes" ("bfloat16", ...), "shapes", "group_name",
  "flush_cache", "weight_version"} (UpdateWeightsFromDistributedReqInput) to every server while
  the trainer broadcasts each tensor from rank 0 in that order.

Weights are published in the dtype the servers serve (`dtype`, from `sglang_servers.served_dtype`:
bfloat16 by default): floating tensors are cast on the trainer's device before they leave it, which
halves what travels and what is written, and the server gets what it runs with.

CUDA tensors sent by /update_weights_from_tensor name their device by UUID, not by the trainer's
index (`cuda_ipc_reduction`): a server sees only its own GPUs, renumbered from 0, so the trainer's
index names another GPU there or none. SGLang's receiving side (its `monkey_patch_torch_reductions`,
applied in every server) maps a UUID in that slot back to its own index.

Not run against a real SGLang server (docs/hardware.md). The tests run all three against
`tests/core/fake_sglang_server.py`: disk (the fake loads the safetensors), tensor (the fake
unpickles the payload with an allowlist like SGLang's and checks one entry per TP rank), and
distributed over gloo on CPU (the fake joins the group with this module's
`init_custom_process_group` and receives the broadcasts). Not run: CUDA IPC tensors (the UUID
rewrite is tested with a mocked reduction and mocked device properties), NCCL, TP > 1 behind one
server, SGLang's own loaders.
"""

from __future__ import annotations

import base64
import datetime
import io
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - registers torch's ForkingPickler reductions (CUDA tensors as IPC handles)
import torch.multiprocessing.reductions as reductions
from safetensors.torch import save_file
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

from factory.core.sglang.client import SGLangEngine, SGLangError
from factory.infra.device import host_copy

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class WeightUpdate(Protocol):
    """One way of moving a version's weights into SGLang servers."""

    def prepare(self, state: dict[str, torch.Tensor], version: int) -> None: ...

    def apply(self, client: SGLangEngine, version: int) -> None: ...

    def resync(self, client: SGLangEngine) -> None: ...


def _checked(client: SGLangEngine, endpoint: str, payload: dict[str, Any], what: str) -> dict:
    return client.post_checked(endpoint, payload, what)


def cast_state(state: dict[str, torch.Tensor], dtype: str | torch.dtype | None) -> dict[str, torch.Tensor]:
    """`state` with its floating tensors in `dtype` (cast where they are, before they travel); others, and
    everything when `dtype` is None, unchanged."""
    if dtype is None:
        return dict(state)
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight dtype {dtype!r} is not a torch dtype name")
    return {k: v.detach().to(dt) if v.is_floating_point() else v for k, v in state.items()}


def buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The named tensors in order, cut into runs of at most `bucket_bytes` (a larger tensor alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out if out[0] else []


# ------------------------------------------------------------------ disk


class DiskUpdate:
    """Write `weights_dir/v{version:08d}/` (model.safetensors + the model's config files), then every
    server loads it. `weights_dir` must be readable by the servers at the same path."""

    def __init__(self, weights_dir: str | Path, config_dir: str | Path | None = None, keep: int = 2,
                 dtype: str | torch.dtype | None = None):
        self.weights_dir, self.keep, self.dtype = Path(weights_dir), keep, dtype
        self.config_dir = Path(config_dir) if config_dir is not None else None
        self.path: Path | None = None

    def prepare(self, state: dict[str, torch.Tensor], version: int) -> None:
        state = cast_state(state, self.dtype)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        target = self.weights_dir / f"v{version:08d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version:08d}-", dir=self.weights_dir))
        try:
            save_file({k: host_copy(v).contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
            if self.config_dir is not None:
                for f in self.config_dir.iterdir():
                    if f.is_file() and not f.name.endswith(WEIGHT_FILES):
                        shutil.copy2(f, tmp / f.name)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        self.path = target
        old = sorted(p for p in self.weights_dir.glob("v*") if p.is_dir() and p != target)
        for p in old[: max(0, len(old) - (self.keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)

    def apply(self, client: SGLangEngine, version: int) -> None:
        if self.path is None:
            raise SGLangError("/update_weights_from_disk", "apply before prepare: no weights written yet")
        client.update_weights_from_disk(self.path, version, verify=False)  # the router checks versions

    def resync(self, client: SGLangEngine) -> None:
        if self.path is not None:
            self.apply(client, int(self.path.name[1:]))


# ------------------------------------------------------------------ tensor


_DEVICE_ARG = 6  # where torch's reduce_tensor puts the storage's device index among rebuild_cuda_tensor's args


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index`, written as SGLang's reductions patch compares it."""
    return str(torch.cuda.get_device_properties(index).uuid)


def cuda_ipc_reduction(t: torch.Tensor, reduce: Callable | None = None,
                       uuid_of: Callable[[int], str] | None = None) -> tuple[Callable, tuple]:
    """torch's CUDA IPC reduction of `t` with the device index replaced by the device's UUID: the server
    (its own CUDA_VISIBLE_DEVICES) finds its local index for that UUID when it rebuilds the tensor."""
    fn, args = (reduce or reductions.reduce_tensor)(t)
    uuid_of = uuid_of or device_uuid
    args = list(args)
    if isinstance(args[_DEVICE_ARG], int):
        args[_DEVICE_ARG] = uuid_of(args[_DEVICE_ARG])
    return fn, tuple(args)


class _UUIDPickler(ForkingPickler):
    """ForkingPickler whose CUDA tensors travel as IPC handles addressed by device UUID."""

    @staticmethod
    def is_ipc(t: torch.Tensor) -> bool:
        return t.is_cuda

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and self.is_ipc(obj):
            return cuda_ipc_reduction(obj)
        return NotImplemented


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """base64 of a pickle of [(name, tensor)] as SGLang's MultiprocessingSerializer(output_str=True)
    reads it: CUDA tensors as IPC handles naming their device by UUID, CPU tensors by value."""
    buf = io.BytesIO()
    if any(t.is_cuda for _, t in named):
        _UUIDPickler(buf).dump([(n, t.detach()) for n, t in named])
    else:
        pickle.dump([(n, t.detach().contiguous()) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class TensorUpdate:
    """POST the tensors themselves to /update_weights_from_tensor, `bucket_bytes` at a time."""

    endpoint = "/update_weights_from_tensor"

    def __init__(self, tp_size: int = 1, bucket_bytes: int = 512 << 20, dtype: str | torch.dtype | None = None):
        self.tp_size, self.bucket_bytes, self.dtype = tp_size, bucket_bytes, dtype
        self.payloads: list[str] = []
        self.version: int | None = None
        self._held: dict[str, torch.Tensor] = {}  # CUDA IPC: the sent tensors must outlive the server's loads

    def prepare(self, state: dict[str, torch.Tensor], version: int) -> None:
        state = cast_state(state, self.dtype)
        self._held = state
        self.payloads = [serialize_named_tensors(b) for b in buckets(state, self.bucket_bytes)]
        self.version = version

    def apply(self, client: SGLangEngine, version: int) -> None:
        for i, payload in enumerate(self.payloads):
            last = i == len(self.payloads) - 1
            body: dict[str, Any] = {"serialized_named_tensors": [payload] * self.tp_size, "load_format": None,
                                    "flush_cache": last}
            if last:
                body["weight_version"] = str(version)
            _checked(client, self.endpoint, body, f"bucket {i + 1}/{len(self.payloads)} of version {version}")

    def resync(self, client: SGLangEngine) -> None:
        if self.version is not None:
            self.apply(client, self.version)


# ------------------------------------------------------------------ distributed


def init_custom_process_group(backend: str, init_method: str | dist.Store, world_size: int, rank: int,
                              group_name: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group outside the default one (the trainer may have its own), joined the way SGLang's
    `init_custom_process_group` joins it: rendezvous on `init_method` (rank 0 hosts the tcp store; or
    `init_method` is that store, already listening), a PrefixStore named after the group, ranks 0..world_size-1."""
    if isinstance(init_method, str):
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    else:
        store = init_method
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: what the server resolves with getattr(torch, name)."""
    return str(dtype).removeprefix("torch.")


class DistributedUpdate:
    """Broadcast from the trainer (rank 0) over a group that every server's TP ranks join.

    `tp_sizes[i]`: server i's TP ranks take ranks 1 + sum(tp_sizes[:i]) ... (its `rank_offset`).
    `master_port` 0: the kernel picks the port when the trainer's store binds, and the servers are told that one.
    `device`: where the trainer stages each tensor for the broadcast (a CUDA device for NCCL: one no server
    uses, since NCCL refuses two ranks on one GPU). `dtype`: what the servers serve (tensors are cast to it)."""

    def __init__(self, master_address: str, master_port: int, tp_sizes: list[int], *, backend: str = "nccl",
                 group_name: str = "factory_weights", bucket_bytes: int = 512 << 20,
                 device: str | torch.device = "cpu", timeout_s: float = 600.0, dtype: str | torch.dtype | None = None):
        self.master_address, self.master_port, self.tp_sizes = master_address, master_port, list(tp_sizes)
        self.backend, self.group_name, self.bucket_bytes = backend, group_name, bucket_bytes
        self.device, self.timeout = torch.device(device), datetime.timedelta(seconds=timeout_s)
        self.world_size, self.dtype = 1 + sum(self.tp_sizes), dtype
        self.group: dist.ProcessGroup | None = None
        self.state: dict[str, torch.Tensor] = {}

    def rank_offset(self, i: int) -> int:
        return 1 + sum(self.tp_sizes[:i])

    def _side_by_side(self, clients: list[SGLangEngine], call: Callable[[int, SGLangEngine], None],
                      trainer: Callable[[], None]) -> None:
        """Run `call` on every server in threads while this thread runs the trainer's collective(s)."""
        errors: dict[int, BaseException] = {}

        def run(i: int, c: SGLangEngine) -> None:
            try:
                call(i, c)
            except BaseException as e:  # noqa: BLE001 - raised below, naming the server
                errors[i] = e

        threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        trainer_error: BaseException | None = None
        try:
            trainer()
        except BaseException as e:  # noqa: BLE001 - the servers' errors say more; raised after the joins
            trainer_error = e
        for t in threads:
            t.join(self.timeout.total_seconds())
        if errors:
            i = min(errors)
            e = errors[i]
            detail = e.detail if isinstance(e, SGLangError) else repr(e)
            endpoint = getattr(e, "endpoint", "?")
            raise SGLangError(endpoint, f"sglang server {i} at {clients[i].base_url}: {detail}") from e
        if trainer_error is not None:
            raise trainer_error

    def connect(self, clients: list[SGLangEngine]) -> None:
        """Form the group: every server's /init_weights_update_group and the trainer's join, at once."""
        if len(clients) != len(self.tp_sizes):
            raise ValueError(f"{len(clients)} servers but tp_sizes for {len(self.tp_sizes)}")

        # The trainer's store listens before any server hears its port: a port found free and bound later was,
        # under load, taken by other work in between.
        store = dist.TCPStore(self.master_address, self.master_port, self.world_size, is_master=True,
                              timeout=self.timeout, wait_for_workers=False)

        def init(i: int, c: SGLangEngine) -> None:
            _checked(c, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": store.port,
                "rank_offset": self.rank_offset(i), "world_size": self.world_size, "group_name": self.group_name,
                "backend": self.backend}, f"joining group {self.group_name!r}")

        def join() -> None:
            self.group = init_custom_process_group(self.backend, store, self.world_size, 0, self.group_name,
                                                   self.timeout)

        self._side_by_side(clients, init, join)

    def prepare(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.state = cast_state(state, self.dtype)

    def apply_all(self, clients: list[SGLangEngine], version: int) -> None:
        """One version to every server: per bucket, the servers' requests and the trainer's broadcasts."""
        if self.group is None:
            self.connect(clients)
        parts = buckets(self.state, self.bucket_bytes)
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            body: dict[str, Any] = {"names": [n for n, _ in part], "dtypes": [dtype_name(t.dtype) for _, t in part],
                                    "shapes": [list(t.shape) for _, t in part], "group_name": self.group_name,
                                    "flush_cache": last}
            if last:
                body["weight_version"] = str(version)

            def receive(i: int, c: SGLangEngine, body: dict = body, k: int = k) -> None:
                _checked(c, "/update_weights_from_distributed", body,
                         f"bucket {k + 1}/{len(parts)} of version {version}")

            def send(part: list = part) -> None:
                for _, t in part:
                    dist.broadcast(t.detach().to(self.device).contiguous(), src=0, group=self.group)

            self._side_by_side(clients, receive, send)

    def apply(self, client: SGLangEngine, version: int) -> None:
        raise SGLangError("/update_weights_from_distributed", "a distributed update reaches every server of the "
                                                              "group at once: use apply_all")

    def resync(self, client: SGLangEngine) -> None:
        if self.group is None:
            return  # nothing was published yet: its initial weights are current
        raise SGLangError("/init_weights_update_group", f"{client.base_url} was restarted and has left the "
                          f"weight group {self.group_name!r}; a group cannot be rejoined mid-run (use "
                          "rollout.sglang.weight_update: disk or tensor to survive server restarts)")

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
