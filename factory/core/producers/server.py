"""`ServerProducer` (`rollout.engine: server`): the overlapped producer with its engine in a supervised rollout
server process (`factory serve`) reached over HTTP on 127.0.0.1, and how each version reaches it
(`rollout.weight_transport`). With `rollout.environment: service`, trainer, rollout server and environment
workers are three processes on loopback; the producer threads here only move requests between them."""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import openai
import torch
from transformers import PreTrainedModel

from factory.config import ExperimentSpec
from factory.core.buffer import Group, Reservation, Sample
from factory.core.producers.overlapped import OverlappedProducer
from factory.core.rollout.engines.paged.serving import model_dtype, serving_dtype
from factory.core.weights import WeightSyncError, encode_delta, encode_full
from factory.core.weights.shared import SharedWeightsWriter
from factory.core.weights.staging import HostStaging
from factory.envs.protocol import tokens_from_session
from factory.envs.registry import load_environment
from factory.infra import http_client, spare
from factory.infra.device import host_copy, run_device
from factory.infra.supervisor import CONNECTION_ERRORS, ServiceProcess, ServiceUnavailable, retry
from factory.models import lora
from factory.models.checkpoint import remove_checkpoint, save_checkpoint
from factory.problem import Problem
from factory.protocols.engine import Completion, SamplingParams


class ServerProducer(OverlappedProducer):
    """As `OverlappedProducer`, but the engine is a rollout server in its own process (`factory serve`),
    reached over HTTP on 127.0.0.1 and supervised: if it dies, it is restarted, the trainer's last
    published weights are pushed to it in full, and the interrupted groups are requested again whole.
    A group enters the buffer only once complete (keyed by its draw), so none is lost or counted twice.
    Weights travel by `rollout.weight_transport` (`weight_transport`): "shared", a `SharedWeightsWriter` whose handle
    the server attaches once (again after a restart, when it reads the newest version instead of a full push), each
    version a cast-copy into it and one small POST; or "codec", lossless deltas (`core/weights`) against the version
    the server holds."""

    def _start_engine(self, model: PreTrainedModel, version: int) -> None:
        self._workdir = Path(tempfile.mkdtemp(prefix="factory-rollout-"))
        # With LoRA the server starts from the base weights and receives only adapters (merged there: its
        # UpdateDecoder), the current ones pushed as soon as it is up.
        save_checkpoint(lora.base_copy(model) if lora.attached(model) else model, self.tok, self._workdir / "initial")
        self._version = version
        self._shared: SharedWeightsWriter | None = None
        self._state: dict | None = None
        if weight_transport(self.spec) == "shared":  # the server reads versions from this buffer, in its dtype
            self._shared = shared_writer(self.spec, model)
            self._shared.publish(model.state_dict(), version)
        else:
            self._state = _published_state(model, self._staging)
        self._restart_lock = threading.RLock()  # publish holds it and may restart inside
        try:
            self.service = ServiceProcess(
                "rollout-server", server_argv(self.spec, self._workdir / "initial", self.rows, version),
                log_path=self._workdir / "server.log", startup_timeout=self.timeout,
                breaker_restarts=self.spec.ops.breaker_restarts, breaker_window_s=self.spec.ops.breaker_window_s,
                hang_timeout_s=self.spec.ops.hang_timeout_s, cpus=self.spec.rollout.cpus,
                spare=spare.take()).start()  # a warm process where the attempt was forked warm (runs/standby.py)
        except BaseException:
            if self._shared is not None:
                self._shared.close()
            raise
        self._retired: list[httpx.Client] = []
        self._renew_client()
        if self._shared is not None:
            self._call(self._attach)  # the handle goes once; after a restart `_push` sends it again
        if lora.attached(model):
            self._call(self._push)

    def _renew_client(self) -> None:
        # A fresh connection pool: the old one's keep-alive connections went to the dead process, and a
        # retry that picked one would fail again. Requests still running on the old client finish or fail
        # there; it is closed with the producer.
        if getattr(self, "_http", None) is not None:
            self._retired.append(self._http)
        self._http = http_client.client(base_url=self.service.url, timeout=self.timeout,
                                  limits=httpx.Limits(max_connections=max(100, len(getattr(self, "_threads", ())) + 8)))

    def _call(self, fn):
        """Run an HTTP call; through a server crash, restart it, re-send the weights, and run it again."""
        return retry(fn, attempts=3, on=CONNECTION_ERRORS, between=self._recover,
                     give_up=lambda e: ServiceUnavailable(f"rollout server: 3 attempts failed; last: {e!r}"))

    def _recover(self, attempt: int, error: BaseException) -> None:
        with self._restart_lock:  # one thread restarts and re-syncs; the others wait, then retry
            if self.service.recover():
                self._renew_client()
                self._push()

    def _push(self) -> None:
        """Send the whole current state (after a restart, the server is back at its initial weights); with the
        shared buffer, attach it again and let the server read the newest version from it."""
        if self._shared is not None:
            self._attach()
            self._apply_shared(self._version)
            return
        update = encode_full(self._state, self._version)
        r = self._http.post("/update_weights_from_delta", content=bytes(update.to_bytes()),
                            params={"version": self._version, "mode": self.spec.rollout.update_mode})
        r.raise_for_status()

    def post(self, path: str, body: dict) -> dict:
        """POST `body` to the server's `path` and return its JSON, through a server crash as `_call` does (the
        step-0 gate asks the chat endpoint this way)."""
        def once() -> dict:
            r = self._http.post(path, json=body)
            r.raise_for_status()
            return r.json()

        return self._call(once)

    def _sample(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        out = self.post("/v1/completions", {"prompt": prompt_ids, "n": params.n, "max_tokens": params.max_new_tokens,
                                            "temperature": params.temperature, "top_p": params.top_p,
                                            "seed": params.seed})
        return [Completion(prompt_ids=c["prompt_token_ids"], token_ids=c["token_ids"], logprobs=c["token_logprobs"],
                           text=c["text"], finish_reason=c["finish_reason"], weight_version=c["weight_version"],
                           token_versions=c["token_versions"]) for c in out["choices"]]

    @functools.cached_property
    def _staging(self) -> HostStaging:
        """Host buffers for versions that leave the process through the codec, in the dtype the engine serves
        (bf16 for trainer.precision bf16 on CUDA: the server's deltas are then against its own bf16 weights)."""
        dtype = serving_dtype(run_device(self.spec.resolved), self.spec.resolved.precision, torch.float32)
        return HostStaging(None if dtype == torch.float32 else dtype)  # fp32: the tensors as they are

    def _attach(self) -> None:
        r = self._http.post("/attach_shared_weights", json=self._shared.handle())
        r.raise_for_status()

    def _apply_shared(self, version: int) -> None:
        """Have the server apply the shared buffer's newest version, which must be `version`."""
        params = {"mode": self.spec.rollout.update_mode}
        r = self._http.post("/update_weights_from_shared", params=params)
        if r.status_code == 409:  # a server that never saw the handle (restarted without `_recover`)
            self._attach()
            r = self._http.post("/update_weights_from_shared", params=params)
        r.raise_for_status()
        if (served := r.json()["weight_version"]) != version:
            raise WeightSyncError(f"the rollout server serves version {served} after reading the shared buffer, "
                                  f"version {version} was published")

    def publish(self, model: PreTrainedModel, version: int) -> None:
        if self._shared is not None:
            with self._restart_lock:
                self._shared.publish(model.state_dict(), version)
                self._version = version
                self._call(lambda: self._apply_shared(version))
            self._published = version
            return
        new = _published_state(model, self._staging)
        update = encode_delta(self._state, new, version, base_version=self._version)

        def post() -> None:
            r = self._http.post("/update_weights_from_delta", content=bytes(update.to_bytes()),
                                params={"version": version, "mode": self.spec.rollout.update_mode})
            if r.status_code == 409:  # the server holds another base (e.g. it was restarted): send it all
                self._state, self._version = new, version
                self._push()
                return
            r.raise_for_status()

        with self._restart_lock:
            self._call(post)
            self._state, self._version = new, version
        self._published = version

    @functools.cached_property
    def _episodic(self) -> bool:
        """Whether the spec's environment runs multi-turn episodes (looked up once, not per group)."""
        env = self.spec.task.environment
        return env is not None and load_environment(env).kind == "multi_turn"

    def _group(self, k: int, problem: Problem, slot: Reservation) -> Group | None:
        if not self._episodic:
            return super()._group(k, problem, slot)
        return self._episode_group(k, problem, slot)

    def _episode_group(self, k: int, problem: Problem, slot: Reservation) -> Group | None:
        """G multi-turn episodes of the problem: the environment drives each against this server under its own
        session; the exact tokens, logprobs and the mask of the model's turns come back from the session
        records. If the server dies meanwhile, it is restarted and the whole group runs again (new sessions)."""
        r, g = self.spec.rollout, self.spec.algorithm.group_size
        tasks = [{**problem.to_dict(), "sampling": {"temperature": r.temperature, "top_p": r.top_p,
                                                    "max_tokens": r.max_new_tokens,
                                                    "seed": (self.spec.seed * 1_000_003 + k) * 1009 + j}}
                 for j in range(g)]
        tries = itertools.count(1)
        sids: list[str] = []  # the sessions of the attempt in flight
        errors = (*CONNECTION_ERRORS, openai.APIConnectionError, httpx.HTTPStatusError)

        def episodes() -> tuple[list, list[dict]] | None:
            attempt = next(tries)
            sids[:] = [f"draw-{k}-{j}-try{attempt}" for j in range(g)]
            try:
                results = self.env.run_episodes(self.spec.task.environment, tasks, sids, self.service.url,
                                                self.spec.task.episode_timeout_s)
                return None if results is None else (results, [self._session(sid) for sid in sids])
            except errors:
                if self._stop.is_set():
                    return None
                raise

        def recover(attempt: int, error: BaseException) -> None:
            self._recover(attempt, error)  # sessions live in the server: after a restart they are gone
            self._end_sessions(sids)  # after the recovery: through the new server's client

        try:
            out = retry(episodes, attempts=3, on=errors, between=recover,
                        give_up=lambda e: ServiceUnavailable(f"episodes of draw {k}: 3 attempts failed; last: {e!r}"))
        finally:
            self._end_sessions(sids)
        if out is None:
            return None
        results, records = out
        tokens = [tokens_from_session(rec) for rec in records]
        slot.generated_at(min(min(t.versions) for t in tokens))
        samples = [Sample(t.prompt_ids, t.token_ids, t.logprobs, res.reward, t.versions,
                          {"text": str(res.info.get("answer", "")), "reason": res.reason, "turns": t.turns},
                          mask=t.mask) for t, res in zip(tokens, results, strict=True)]
        return Group(samples, uid=f"draw-{k}", meta={"prompt_id": problem.id, "prompt": problem.prompt, "draw": k,
                                                     "latency_s": 0.0, "source": problem.meta.get("source"),
                                                     "hack_checked": False})  # episodes have no hack detectors

    def _end_sessions(self, sids: list[str]) -> None:
        for sid in sids:
            with contextlib.suppress(*CONNECTION_ERRORS):
                self._http.delete(f"/sessions/{sid}")

    def _session(self, sid: str) -> dict:
        resp = self._http.get(f"/sessions/{sid}")
        resp.raise_for_status()  # 404: the server lost it (restarted); the group is run again
        return resp.json()

    def _stop_engine(self) -> None:
        self.service.stop()
        for client in (self._http, *self._retired):
            client.close()
        if self._shared is not None:
            self._shared.close()
        remove_checkpoint(self._workdir / "initial")  # the small server.log stays for post-mortems


def server_argv(spec: ExperimentSpec, checkpoint: Path, rows: int, version: int) -> list[str]:
    """The `factory serve` command of a run's rollout server (`{port}` filled in by the supervisor): it serves
    `checkpoint` on the run's device, in the trainer's precision."""
    budget = [] if spec.rollout.kv_budget_mb is None else ["--kv-budget-mb", str(spec.rollout.kv_budget_mb)]
    return [sys.executable, "-m", "factory.cli", "serve", "--checkpoint", str(checkpoint), "--port", "{port}",
            "--threads", str(spec.rollout.threads or 1), "--max-batch", str(rows), "--weight-version", str(version),
            "--device", str(run_device(spec.resolved)), "--precision", spec.resolved.precision, *budget]


def weight_transport(spec: ExperimentSpec) -> str:
    """How a run's versions reach its rollout server: `rollout.weight_transport`, auto resolved ("shared" where the
    run computes on CUDA, unless LoRA adapters are what travels; "codec" otherwise)."""
    setting = spec.rollout.weight_transport
    if setting != "auto":
        return setting
    return "shared" if run_device(spec.resolved).type == "cuda" and spec.trainer.lora is None else "codec"


def shared_writer(spec: ExperimentSpec, model: PreTrainedModel) -> SharedWeightsWriter:
    """The shared buffer of a run's versions: on the run's device (the server's), in the dtype the server serves."""
    device = run_device(spec.resolved)
    return SharedWeightsWriter.create(model.state_dict(), serving_dtype(device, spec.trainer.precision,
                                                                         model_dtype(model)), device)


def _published_state(model: PreTrainedModel, staging: HostStaging | None = None) -> dict:
    """What a version sends the rollout server: a host copy of the weights, or with LoRA of the adapters alone.
    `staging` (`ServerProducer._staging`): buffers kept between versions, pinned from a GPU, one sync per
    version, tied weights once, in the dtype the server serves; it alternates two sets, so the copy before (the
    delta's base) stays whole while this one is written. Without it, fresh copies as they are."""
    if lora.attached(model):
        return lora.adapter_state(model)  # already fresh CPU copies
    if staging is None:
        return {k: host_copy(v) for k, v in model.state_dict().items()}
    return staging.snapshot(model.state_dict())


