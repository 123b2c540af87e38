"""What every embedded serving engine does around its model: requests as futures, the background thread, weight
updates between steps, pause / resume, and the scheduler step that ties them together.

`EngineControl` is the base of `ContinuousEngine` (continuous.py) and `PagedEngine` (paged/engine.py), and the
type the HTTP server (`server.py`, `api.py`) and the producers drive. A subclass holds its own queue, rows and KV
cache and fills in the hooks: `_request` (a new `Sequence`), `_enqueue`, `_drain_queue`, `running`, `queued`,
`_head_fits`, `_take_admissions`, `_prefill`, `_decode`, `_retire`, `_fail`, plus `check`, `info`,
`max_new_tokens` and `flush_cache`.

One step (`step`): due weight updates; admissions (none while paused or while an update waits); the admitted
requests' prefill (their first tokens); one decode step of every running sequence unless paused in place;
retirements. A step that raises fails the requests it was running (`_fail`) and re-raises; the background thread
logs it and goes on, so one bad request does not take the server down.

Weight updates (`update_weights`) apply between steps. "in_flight": at once; running sequences keep their K/V
(computed by the old weights, as PipelineRL does) and their later tokens carry the new version. "finish_old":
admissions stop, running sequences finish on the old weights, then the swap happens and queued requests start on
the new ones. The swap copies into the model's existing parameter tensors (`load_state_dict`), never replaces
them, so anything that holds them (captured CUDA graphs, compiled steps) keeps reading the live weights.

Locks: `_cond` guards the queue, the pending updates and the pause state (callers' threads touch them);
`_step_lock` is held while the model, the rows or the KV cache are in use.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_futures
from typing import Any, Literal

import torch
from torch import Tensor

from factory.core.rollout.base import Completion, SamplingParams
from factory.core.rollout.engines.kv_budget import KVBudget
from factory.core.rollout.engines.sequences import EngineStats, PendingUpdate, Sequence, load_state_dict_into, mix_seed

log = logging.getLogger(__name__)

UpdateMode = Literal["finish_old", "in_flight"]
PauseMode = Literal["drain", "in_place"]
UPDATE_MODES: tuple[str, ...] = ("finish_old", "in_flight")
PAUSE_MODES: tuple[str, ...] = ("drain", "in_place")


class EngineControl:
    """The control surface of an embedded engine (see the module docstring); subclasses set `model`, `tokenizer`,
    `name`, `max_batch`, `max_seq_len` and `_version`, call `_init_control()`, and fill in the hooks."""

    model: Any
    tokenizer: Any
    name: str
    max_batch: int
    max_seq_len: int
    kv: KVBudget  # the KV cache's budget in bytes
    _version: int

    def _init_control(self) -> None:
        self._updates: deque[PendingUpdate] = deque()
        self._paused: str | None = None  # None, "drain" (no admissions) or "in_place" (no admissions, no decoding)
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._seeds = random.Random()
        self.stats = EngineStats()

    # ------------------------------------------------------------------ the hooks
    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def running(self) -> int:
        """Sequences decoding now."""
        raise NotImplementedError

    @property
    def queued(self) -> int:
        """Sequences waiting to be admitted."""
        raise NotImplementedError

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, with a message for the caller, if this request cannot run."""
        raise NotImplementedError

    def info(self) -> dict:
        raise NotImplementedError

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most completion tokens a prompt of `prompt_len` tokens can have, running alone."""
        raise NotImplementedError

    def flush_cache(self) -> bool:
        """Drop what the KV cache keeps beyond running sequences if nothing runs or waits; return whether it did."""
        raise NotImplementedError

    def _request(self, prompt_ids: list[int], params: SamplingParams, seed: int, now: float) -> Sequence:
        raise NotImplementedError

    def _enqueue(self, req: Sequence) -> None:
        """Queue a request (caller holds _cond)."""
        raise NotImplementedError

    def _drain_queue(self) -> list[Sequence]:
        """Remove and return every queued request (caller holds _cond)."""
        raise NotImplementedError

    def _head_fits(self) -> bool:
        """Whether the first live queued request could join now (caller holds _cond)."""
        raise NotImplementedError

    def _take_admissions(self) -> list[Any]:
        """Take the queued requests that join now (caller holds _cond); `_prefill` runs them."""
        raise NotImplementedError

    def _prefill(self, admitted: list[Any]) -> None:
        raise NotImplementedError

    def _decode(self) -> None:
        raise NotImplementedError

    def _retire(self) -> None:
        """Remove finished and cancelled sequences; resolve their futures."""
        raise NotImplementedError

    def _reset(self) -> None:
        """After a failed step: forget every running sequence and start over with an empty cache."""
        raise NotImplementedError

    def _running_requests(self) -> list[Sequence]:
        raise NotImplementedError

    def _admitted_requests(self, admitted: list[Any]) -> list[Sequence]:
        """The requests of what `_take_admissions` returned."""
        return list(admitted)

    def _load(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy new weights into the model's parameters (in place: `load_state_dict` copies)."""
        load_state_dict_into(self.model, state_dict)
        self.model.eval()

    # ------------------------------------------------------------------ public state
    @property
    def weight_version(self) -> int:
        return self._version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        # In-process publication: the caller changed the model's weights itself (e.g. it shares the trainer's model).
        self._version = version

    @property
    def paused(self) -> str | None:
        return self._paused

    @property
    def started(self) -> bool:
        """Whether the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer(p).input_ids for p in prompts]

    def _control_info(self) -> dict:
        return {"weight_version": self._version, "running": self.running, "queued": self.queued,
                "paused": self._paused, "pending_updates": len(self._updates), "max_batch": self.max_batch,
                "max_seq_len": self.max_seq_len, "device": str(self.device)}

    # ------------------------------------------------------------------ requests
    def submit(self, prompt_ids: list[int], params: SamplingParams, sample_index: int = 0) -> Future:
        """Queue one completion of `prompt_ids` (params.n is ignored here; callers submit n times with distinct
        `sample_index`). Returns a Future of a `Completion`; cancelling the future (queued or running; the
        future stays pending until the result is set) drops the request at the next step."""
        return self.submit_many([(prompt_ids, sample_index)], params)[0]

    def submit_many(self, samples: Seq[tuple[list[int], int]], params: SamplingParams) -> list[Future]:
        """`submit` for each (prompt, sample index), queued at once (so the samples of one prompt are admitted
        together); every prompt is checked before any is queued."""
        for p in dict.fromkeys(tuple(p) for p, _ in samples):
            self.check(list(p), params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        now = time.perf_counter()
        reqs = [self._request(list(p), params, mix_seed(seed, i), now) for p, i in samples]
        with self._cond:
            for r in reqs:
                self._enqueue(r)
            self._cond.notify_all()
        return [r.future for r in reqs]

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | Seq[SamplingParams]) -> list[list[Completion]]:
        """For each prompt, `params.n` completions (the `RolloutEngine` call). Sample j of prompt i draws from
        seed (params.seed, i * n + j), so results do not depend on how requests were batched. `params` may also be
        one `SamplingParams` per prompt (their own lengths, say), all queued together."""
        if isinstance(params, SamplingParams):
            n = params.n
            flat = self.submit_many([(p, i * n + j) for i, p in enumerate(prompts) for j in range(n)], params)
            groups = [flat[i * n:(i + 1) * n] for i in range(len(prompts))]
        else:
            each = list(params)
            if len(each) != len(prompts):
                raise ValueError(f"params: expected one SamplingParams or one per prompt ({len(prompts)}), got "
                                 f"{len(each)}")
            for p, ps in zip(prompts, each, strict=True):  # every prompt checked before any is queued
                self.check(p, ps)
            groups = [self.submit_many([(p, i * ps.n + j) for j in range(ps.n)], ps)
                      for i, (p, ps) in enumerate(zip(prompts, each, strict=True))]
        flat = [f for g in groups for f in g]
        if self.started:
            wait_futures(flat)
        else:
            while not all(f.done() for f in flat):
                if not self.step():
                    raise RuntimeError("the engine cannot make progress (paused, or a weight update is waiting)")
        return [[f.result() for f in g] for g in groups]

    # ------------------------------------------------------------------ control
    def update_weights(self, state_dict: Mapping[str, Tensor], version: int, mode: UpdateMode = "finish_old") -> Future:
        """Swap in new weights between decode steps; returns a Future resolved with `version` once applied (on a
        GPU: once the copy is done on the device). The engine copies from `state_dict`'s tensors when it applies the
        update, not now: a caller that passes live tensors must not change them until the future resolves, or must
        `cancel()` it first (which succeeds only while the copy has not begun)."""
        if mode not in UPDATE_MODES:
            raise ValueError(f"mode must be one of {', '.join(UPDATE_MODES)}, got {mode!r}")
        upd = PendingUpdate(state_dict, int(version), mode, Future())
        with self._cond:
            self._updates.append(upd)
            self._cond.notify_all()
        return upd.future

    def load_weights(self, state_dict: dict, version: int) -> None:
        """The `RolloutEngine` call: apply now if idle, else after running sequences finish on the old weights."""
        fut = self.update_weights(state_dict, version, "finish_old")
        if not self.started:
            while not fut.done():
                if not self.step():
                    raise RuntimeError("the engine cannot apply the update (paused in place with running sequences)")
        fut.result()

    def pause(self, mode: PauseMode = "drain") -> None:
        """Stop admitting requests; "in_place" also stops decoding (running sequences keep their rows and KV)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        with self._cond:
            self._paused = mode
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = None
            self._cond.notify_all()

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until `predicate()` holds (checked after every scheduler step) or `timeout` seconds pass."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    # ------------------------------------------------------------------ the background thread
    def start(self, thread_init: Callable[[], None] | None = None) -> Any:
        """Start the decoding thread; `thread_init` runs first in it (placement: its cores and torch threads).
        Returns the engine."""
        if not self.started:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, args=(thread_init,),
                                            name="rollout-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the background thread; requests still queued or running fail (nothing would finish them)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._step_lock:
            with self._cond:
                queued = self._drain_queue()
            if queued or self.running:
                self._fail(queued, RuntimeError("the rollout engine stopped"))

    def _has_work(self) -> bool:
        if self._updates and (self._updates[0].mode == "in_flight" or not self.running):
            return True
        decoding = self.running > 0 and self._paused != "in_place"
        return decoding or (self.queued > 0 and self._admitting() and self._head_fits())

    def _admitting(self) -> bool:
        # A pending finish_old update holds new requests back until the old weights have drained.
        return self._paused is None and not self._updates

    def _run(self, thread_init: Callable[[], None] | None = None) -> None:
        if thread_init is not None:
            thread_init()
        device = self.device
        if device.type == "cuda":  # the current CUDA device is per thread: this thread's is the model's
            torch.cuda.set_device(device)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._has_work())
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # step() already failed the affected requests; the server goes on
                log.exception("rollout engine step failed")

    def _fail(self, requests: list[Sequence], err: Exception) -> None:
        """Fail `requests` and every running sequence, and start over with an empty cache (caller holds
        _step_lock)."""
        with self._cond:
            for req in [*requests, *self._running_requests()]:
                if not req.future.done():
                    try:
                        req.future.set_exception(err)
                    except InvalidStateError:  # cancelled meanwhile
                        pass
            self._reset()
            self._cond.notify_all()

    # ------------------------------------------------------------------ the scheduler step
    @torch.no_grad()
    def step(self) -> bool:
        """One scheduler iteration: due weight updates, admissions, one decode step, retirements.
        Returns whether anything happened. Do not call it while the background thread runs. If the model
        raises, the requests it was running fail with that error, and so does this call."""
        with self._step_lock:
            did = self._apply_updates()
            with self._cond:
                admitted = self._take_admissions() if self._admitting() else []
            try:
                if admitted:
                    self._prefill(admitted)
                    self._retire()  # a first token may already end a request
                    did = True
                if self.running and self._paused != "in_place":
                    self._decode()
                    did = True
                self._retire()
            except Exception as e:
                self._fail(self._admitted_requests(admitted), e)
                raise
            if did and not self.running:
                self._apply_updates()  # a finish_old update may be due now that the last row left
        with self._cond:
            self._cond.notify_all()
        return did

    def _apply_updates(self) -> bool:
        applied = False
        while True:
            with self._cond:
                if not self._updates or (self._updates[0].mode == "finish_old" and self.running):
                    return applied
                upd = self._updates.popleft()
            if not upd.future.set_running_or_notify_cancel():
                continue  # withdrawn by its publisher (it gave up waiting): its tensors may have changed since
            try:
                self._load(upd.state_dict)
                if self.device.type == "cuda":
                    # resolved only once copied: a publisher that handed over its live tensors may change them
                    # as soon as the future resolves, on whatever stream it uses
                    torch.cuda.current_stream(self.device).synchronize()
            except Exception as e:
                upd.future.set_exception(e)
            else:
                self._version = upd.version
                upd.future.set_result(upd.version)
            applied = True

    def _resolve(self, finished: list[Sequence]) -> None:
        """Set the results of finished requests (their rows are already freed)."""
        for req in finished:
            try:
                req.future.set_result(req.completion(self.tokenizer))
            except InvalidStateError:  # cancelled since it was retired
                continue
            self.stats.completed += 1
