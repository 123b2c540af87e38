"""The continuous engine's KV memory budget: what one cached token costs, the default budget from the machine, and
the admission arithmetic the engine's scheduler uses.

The budget bounds the bytes of K/V the engine holds at once: its slot cache (allocated rows x columns, every layer)
plus, while a prefill is copied in, that prefill's own K/V. A request joins only when, with it, every running
sequence can still grow to its final length (prompt + max_tokens) inside the budget; until then it waits in the
queue. One that could not fit even alone is refused (`KVBudget.problem`), naming the setting.

Default (`default_kv_budget`): a fraction of the memory free where the cache lives, read when the engine is built
(its weights already loaded): on a GPU `torch.cuda.mem_get_info`; on the host the least of MemAvailable
(/proc/meminfo), the process's cgroup headroom (v2 memory.max - memory.current, v1 memory.limit_in_bytes -
memory.usage_in_bytes) and its RLIMIT_DATA / RLIMIT_AS headroom (the limit - VmData / VmSize). The rest of that
memory is left to prefill activations (bounded by the engine's prefill size), tokenization and the requests.
The budget is a ceiling, not a reservation: the cache is allocated as sequences need it.
"""

from __future__ import annotations

import logging
import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FREE_FRACTION = 0.5  # of the free memory at start: the default budget
SETTING = "--kv-budget-mb (factory serve) / rollout.kv_budget_mb"
MIB = 1 << 20


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the K/V a model with `config` caches per token."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(cfg.num_hidden_layers), kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of K and V that one token of one sequence holds across every layer of a model with `config`, cached in
    `dtype` (an estimate from the config; the cache measures its real buffers once it has them)."""
    layers, kv_heads, head_dim = kv_shape(config)
    return layers * kv_heads * head_dim * 2 * torch.empty((), dtype=dtype).element_size()


def default_kv_budget(device: torch.device) -> int:
    """`FREE_FRACTION` of the memory free for a KV cache on `device` (see the module docstring), in bytes."""
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * FREE_FRACTION)
        except (RuntimeError, AssertionError) as e:  # no driver here (a test's stand-in device): the host's
            log.warning("cannot read free memory on %s (%s); sizing the KV budget from host memory", device, e)
    return int(host_headroom() * FREE_FRACTION)


def host_headroom() -> int:
    """The bytes this process can still allocate on the host: the least of the machine's available memory, its
    cgroup's headroom and its rlimits' headroom."""
    status = _proc_kb("/proc/self/status")
    options = [_proc_kb("/proc/meminfo").get("MemAvailable")]
    options.append(_cgroup_headroom())
    for limit, used in ((resource.RLIMIT_DATA, "VmData"), (resource.RLIMIT_AS, "VmSize")):
        soft, _ = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY and status.get(used) is not None:
            options.append(max(0, soft - status[used]))
    known = [x for x in options if x is not None]
    if not known:  # not Linux: the physical memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(known)


def _proc_kb(path: str) -> dict[str, int]:
    """`Key: N kB` lines of a /proc file, in bytes ({} where there is no such file)."""
    out: dict[str, int] = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _cgroup_headroom() -> int | None:
    """memory limit - usage of this process's cgroup (v2, else v1), or None when it has no limit or none is
    readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    root = Path("/sys/fs/cgroup")
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            pairs = [(root / path.lstrip("/"), "memory.max", "memory.current"), (root, "memory.max", "memory.current")]
        elif "memory" in controllers.split(","):
            v1 = root / "memory"
            pairs = [(v1 / path.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes"),
                     (v1, "memory.limit_in_bytes", "memory.usage_in_bytes")]
        else:
            continue
        for where, limit_file, usage_file in pairs:
            try:
                limit = (where / limit_file).read_text().strip()
                usage = int((where / usage_file).read_text().strip())
            except (OSError, ValueError):
                continue
            if limit == "max" or int(limit) >= 1 << 60:  # unlimited ("max", or v1's page-rounded LONG_MAX)
                break
            return max(0, int(limit) - usage)
    return None


def mib(n: float) -> str:
    """`n` bytes as MiB for a message (one decimal below 10 MiB)."""
    v = n / MIB
    return f"{v:.1f} MiB" if v < 10 else f"{math.floor(v):,} MiB"


@dataclass
class KVBudget:
    """The budget in bytes and the arithmetic on it. Sizes are in slot-columns: one token of one row in every
    layer (`per_token` bytes)."""

    total_bytes: int
    per_token: int  # bytes of one slot-column

    @property
    def columns(self) -> int:
        """Slot-columns the budget holds."""
        return self.total_bytes // max(1, self.per_token)

    def fits(self, rows: int, cols: int, prefill_tokens: int = 0) -> bool:
        """Whether `rows` sequences of up to `cols` columns each, plus a prefill of `prefill_tokens` (padded
        prompts x length) being copied in, fit."""
        return rows * cols + prefill_tokens <= self.columns

    def problem(self, prompt_tokens: int, final_length: int) -> str | None:
        """Why one sequence (a prompt of `prompt_tokens`, growing to `final_length` positions) could never run
        inside the budget even alone, or None."""
        need = final_length + 1 + prompt_tokens  # its row at full length, and its prefill while copied in
        if self.fits(1, final_length + 1, prompt_tokens):
            return None
        return never_fits(need * self.per_token, f"{prompt_tokens} prompt tokens, up to {final_length} positions "
                          f"with the completion, {self.per_token:,} bytes each, and its prefill", self.total_bytes)


def never_fits(need_bytes: int, detail: str, total_bytes: int) -> str:
    """The message for a request that needs `need_bytes` of KV cache (`detail` says of what) and can never run inside
    a budget of `total_bytes`, naming the setting: one wording for every engine's cache."""
    return (f"the request needs {mib(need_bytes)} of KV cache ({detail}); the KV cache budget is {mib(total_bytes)} "
            f"({SETTING}): lower max_tokens or the prompt, or raise the budget")
