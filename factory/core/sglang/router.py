"""`SGLangRouter`: one `RolloutEngine` over N SGLang servers: routes prompts, fans weight updates out.

Routing (the idea of sglang-router's cache_aware policy, done client-side so no extra process is
needed): a prompt goes to the server its prefix hashes to (the first `prefix_tokens` tokens), so a
group's n samples, and prompts that share a long prefix, meet one server's radix cache; unless that
server has `balance_slack` more sequences outstanding than the least busy one, which then gets it.
A prompt's n copies always go to one server, in one /generate call (`SGLangEngine.generate`).
Calls to different servers run side by side; completions come back in prompt order, each with
`meta["server"]` (its server's index).

Weight updates: `load_weights(state, version)` prepares the update once (`sglang_weights`), sends
it to every server side by side (distributed: the whole group at once), then asks every server for
its weight_version (/model_info, falling back to older endpoints) and raises
`SGLangVersionMismatch` naming each server that does not report the published version.
`update_mode` "finish_old" holds this router's new generate calls, lets those in flight finish on the
old weights, sends every bucket, then lets the held calls go: SGLang's model-update lock covers one
update request, and an update in several buckets (tensor, distributed) is several requests, between
which a server would admit new requests onto half-updated weights labelled with the old version.
"in_flight" wraps it in POST /pause_generation {"mode":
"retract"} ... POST /continue_generation (sglang PR #10071: "retract" moves running requests back
to the waiting queue, so they continue on the new weights with their KV recomputed, and the radix
cache can be flushed; "in_place" would leave old-weight KV in use and make flush_cache fail). Their
completions then list both versions, and `weight_version` is the older one, as with the embedded
engine.

Failures: with `servers` (an `SGLangServers`), a call that cannot reach server i restarts it (bounded
by the supervisor), brings it to the current weights (`WeightUpdate.resync`) and retries the call
once; otherwise, or when that fails too, an `SGLangError` names the server.

Not run against a real SGLang server or sglang-router (docs/hardware.md). Tests run two fake servers
(`tests/core/fake_sglang_server.py`, real processes on 127.0.0.1) through this router. Not checked
against real SGLang: the pause/continue semantics with requests in flight, and how well prefix
hashing matches the radix cache's reuse on real prompts.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch

from factory.core.rollout.base import Completion, SamplingParams
from factory.core.sglang.client import MIN_SGLANG_VERSION, SGLangEngine, SGLangError
from factory.core.sglang.servers import SGLangServers
from factory.core.sglang.weights import DistributedUpdate, WeightUpdate
from factory.infra.supervisor import CONNECTION_ERRORS


class SGLangVersionMismatch(SGLangError):
    """After an update, a server reports a weight version other than the published one."""


def prefix_key(prompt: list[int], prefix_tokens: int) -> int:
    """A stable hash of the prompt's first tokens (the same across processes and runs)."""
    data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in prompt[:prefix_tokens])
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class SGLangRouter:
    """Spreads generation over SGLang servers and keeps their weights at one published version."""

    def __init__(self, urls: list[str], updater: WeightUpdate | None = None, *, weight_version: int = 0,
                 servers: SGLangServers | None = None, prefix_tokens: int = 64, balance_slack: int = 32,
                 update_mode: Literal["in_flight", "finish_old"] = "finish_old", timeout: float = 600.0,
                 max_batch: int = 256, stop_token_ids: list[int] | None = None):
        if not urls:
            raise ValueError("SGLangRouter needs at least one server url")
        self.clients = [SGLangEngine(u, weight_version=weight_version, timeout=timeout, max_batch=max_batch,
                                     stop_token_ids=stop_token_ids) for u in urls]
        self.updater, self.servers = updater, servers
        self.weight_version = weight_version
        self.prefix_tokens, self.balance_slack, self.update_mode = prefix_tokens, balance_slack, update_mode
        self.outstanding = [0] * len(urls)  # sequences in flight per server
        self.routed = [0] * len(urls)  # prompts sent per server, ever
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._publish_lock = threading.Lock()  # one load_weights at a time
        # finish_old: generate calls in flight through this router, and whether an update holds new ones back
        self._gate = threading.Condition()
        self._running = 0
        self._updating = False
        self.held = 0  # generate calls now waiting for an update to finish
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(urls)), thread_name_prefix="sglang-route")

    def describe(self, i: int) -> str:
        if self.servers is not None:
            return self.servers.describe(i)
        return f"sglang server {i} at {self.clients[i].base_url}"

    # ------------------------------------------------------------ routing

    def pick(self, prompt: list[int], n: int = 1) -> int:
        """The server for one prompt's n samples; counts them as outstanding there (see `done`)."""
        with self._lock:
            home = prefix_key(prompt, self.prefix_tokens) % len(self.clients)
            least = min(range(len(self.clients)), key=lambda i: (self.outstanding[i], i))
            i = home if self.outstanding[home] - self.outstanding[least] <= self.balance_slack else least
            self.outstanding[i] += n
            self.routed[i] += 1
            return i

    def _done(self, i: int, n: int) -> None:
        with self._lock:
            self.outstanding[i] -= n

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, `params.n` completions; each prompt's samples from one server. While a
        finish_old update is being applied, waits for it (no request runs on half-updated weights)."""
        with self._gate:
            if self._updating:
                self.held += 1
                while self._updating:
                    self._gate.wait()
                self.held -= 1
            self._running += 1
        try:
            return self._generate(prompts, params)
        finally:
            with self._gate:
                self._running -= 1
                self._gate.notify_all()

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        by_server: dict[int, list[int]] = {}
        for k, p in enumerate(prompts):
            by_server.setdefault(self.pick(p, params.n), []).append(k)
        if len(by_server) == 1:  # the producers' case (one group per call): no hop through the pool,
            (i, ks), = by_server.items()  # whose few threads would cap the requests in flight
            return self._generate_on(i, prompts, params)
        futures = {i: self._pool.submit(self._generate_on, i, [prompts[k] for k in ks], params)
                   for i, ks in by_server.items()}
        out: list[list[Completion]] = [[] for _ in prompts]
        for i, ks in by_server.items():
            for k, group in zip(ks, futures[i].result(), strict=True):
                out[k] = group
        return out

    def _generate_on(self, i: int, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        n = len(prompts) * params.n
        try:
            groups = self._call(i, lambda c: c.generate(prompts, params))
        finally:
            self._done(i, n)
        for g in groups:
            for c in g:
                c.meta["server"] = i
        return groups

    def _call(self, i: int, fn):
        """`fn(client i)`; through a dead server: restart it, resync its weights, try once more."""
        try:
            return fn(self.clients[i])
        except SGLangError as e:
            if self.servers is None or not isinstance(e.__cause__, CONNECTION_ERRORS):
                raise SGLangError(e.endpoint, f"{self.describe(i)}: {e.detail}", e.status) from e
            with self._update_lock:  # no update lands on a half-synced server
                if self.servers.recover(i) and self.updater is not None:
                    self.updater.resync(self.clients[i])  # a restarted server is back at its initial weights
                self.clients[i].weight_version = self.weight_version
        try:
            return fn(self.clients[i])
        except SGLangError as e:
            raise SGLangError(e.endpoint, f"{self.describe(i)} (after a restart): {e.detail}", e.status) from e

    # ------------------------------------------------------------ weights

    def _each(self, fn) -> None:
        """`fn(i, client)` on every server side by side; the first failure, naming its server, is raised."""
        futures = [self._pool.submit(fn, i, c) for i, c in enumerate(self.clients)]
        errors = []
        for i, f in enumerate(futures):
            try:
                f.result()
            except SGLangError as e:
                errors.append((i, e))
        if errors:
            i, e = errors[0]
            raise SGLangError(e.endpoint, f"{self.describe(i)}: {e.detail}", e.status) from e

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Publish `version` to every server, then check each reports it."""
        if self.updater is None:
            raise SGLangError("/update_weights", "this router has no weight updater (rollout.sglang.weight_update)")
        with self._publish_lock:
            with self._update_lock:
                self.updater.prepare(state_dict, version)
            if self.update_mode != "in_flight":
                # Drained before taking _update_lock: a call in flight may need it to resync a restarted server.
                with self._gate:  # hold new generate calls; those in flight finish on the old weights
                    self._updating = True
                    while self._running:
                        self._gate.wait()
            try:
                with self._update_lock:
                    self._apply(version)
            finally:
                if self.update_mode != "in_flight":  # the held calls go, labelled with the new version
                    with self._gate:
                        self._updating = False
                        self._gate.notify_all()

    def _apply(self, version: int) -> None:
        if self.update_mode == "in_flight":
            self._each(lambda i, c: c.pause_generation("retract"))
        try:
            if isinstance(self.updater, DistributedUpdate):
                self.updater.apply_all(self.clients, version)
            else:
                self._each(lambda i, c: self.updater.apply(c, version))
        finally:
            if self.update_mode == "in_flight":
                self._each(lambda i, c: c.continue_generation())
        self.check_versions(version)
        for c in self.clients:
            c.weight_version = version
        self.weight_version = version

    def check_server_versions(self, minimum: str = MIN_SGLANG_VERSION) -> list[str]:
        """Every server's sglang version (/server_info); an error naming each server older than `minimum`."""
        found: list[str] = [""] * len(self.clients)

        def ask(i: int, c: SGLangEngine) -> None:
            found[i] = c.check_server_version(minimum)

        self._each(ask)
        return found

    def check_versions(self, version: int) -> None:
        """Every server must report weight_version str(version); else an error naming each that does not."""
        labels: list[str | None] = [None] * len(self.clients)

        def ask(i: int, c: SGLangEngine) -> None:
            labels[i] = c.server_weight_version()

        self._each(ask)
        wrong = [f"{self.describe(i)} reports {label!r}" for i, label in enumerate(labels) if label != str(version)]
        if wrong:
            raise SGLangVersionMismatch("/model_info", f"after publishing version {version}: " + "; ".join(wrong))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if isinstance(self.updater, DistributedUpdate):
            self.updater.close()
        for c in self.clients:
            c.close()

    def __enter__(self) -> SGLangRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
