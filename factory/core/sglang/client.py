"""SGLang client: the `RolloutEngine` interface against a running SGLang server's native HTTP API.

It owns the request and response shapes of SGLang's native endpoints and nothing else:
- POST /generate with `input_ids` (token in), `sampling_params`, `return_logprob: true`; each output's
  `meta_info.output_token_logprobs` ([logprob, token_id, text|null] per generated token) gives the
  exact token ids and the sampler's logprobs (token out; nothing is re-tokenized), `finish_reason`
  is {"type": "stop" | "length" | "abort", ...}, and `weight_version` is the server's version label;
- POST /update_weights_from_disk {"model_path", "weight_version", "load_format"?} → {"success",
  "message"}; POST /flush_cache; GET /get_model_info; GET /health;
- `post_checked` for the other {"success", "message"} endpoints (tensor and distributed updates,
  weight groups, /update_weight_version: `sglang_weights.py`), `server_weight_version` (GET
  /model_info, else the older /get_model_info, else the older still /get_weight_version, which
  current servers answer with 404), POST /pause_generation {"mode"} and /continue_generation.

Several servers, their processes and weight updates: `sglang_servers.py`, `sglang_router.py`,
`sglang_weights.py`, and `factory/core/sglang/producer.py`.

Every sampling parameter that changes the distribution is sent with each request (top_k -1, min_p 0,
neutral repetition/frequency/presence penalties, min_new_tokens 0, besides temperature, top_p and
max_new_tokens): SGLang's default `--sampling-defaults model` fills the ones a request leaves out from
the checkpoint's generation_config.json, and the samples would then not come from the policy the
trainer scores.

`server_version` reads the server's sglang version (GET /server_info, else the older /get_server_info);
`check_server_version` refuses one older than `MIN_SGLANG_VERSION`: 0.5.5 and older ignore
/pause_generation's `mode` (added by sglang PR #10071, after 0.5.5) and abort every request instead.
`flush_cache` retries SGLang's busy answer (HTTP 400 while requests run) with bounded backoff.

Completions from a batch of n samples per prompt are requested as n copies of each prompt with
n=1 (SGLang's own advice for batches with parallel sampling), in one /generate call per
`max_batch` sequences, and regrouped by prompt. A completion's `weight_version` is the oldest
version it may contain: the client's version when the request left, or the server's label when
it finished, if older; both are in `meta["weight_versions"]` (a weight update can land while a
request is in flight, since this client never asks SGLang to abort requests).

Logprobs: SGLang returns them under the temperature-scaled distribution (before top-p/top-k),
the same convention as the embedded engine, unless the server runs with
SGLANG_RETURN_ORIGINAL_LOGPROB set; greedy requests (temperature 0) return untempered ones.

Not run against a real SGLang server (docs/hardware.md). The tests drive this client against a fake
server on 127.0.0.1 that answers in SGLang's documented shapes (docs/basic_usage/native_api,
io_struct GenerateReqInput / UpdateWeightFromDiskReqInput, the tokenizer manager's meta_info) and
checks the requests it receives. Not exercised: real sampling and logprob values, the server's
handling of `sampling_seed` (only recent servers with deterministic inference accept it, so it is
off unless `send_seed=True`), whether a given server version includes `output_ids` /
`weight_version` in its answers (both are optional here), update_weights_from_disk loading the
safetensors file `load_weights` writes (it must be on a filesystem the server can read, named with
the model's parameter names), and the SGLang router.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from factory.core.rollout.base import Completion, SamplingParams
from factory.infra import http_client

MIN_SGLANG_VERSION = "0.5.6"  # the first release whose /pause_generation honours `mode` (pyproject's gpu extra)

# Neutral values of the sampling parameters Factory does not use, sent so that no server default applies.
NEUTRAL_SAMPLING: dict[str, Any] = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                                    "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0}


def _release(version: str) -> tuple[int, ...] | None:
    """(0, 5, 6) for "0.5.6", "0.5.6.post2", "0.5.10rc0"; None when it does not start with a number."""
    parts: list[int] = []
    for piece in version.strip().lstrip("v").split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break  # "6rc0": the release part ends here
    return tuple(parts) or None


class SGLangError(RuntimeError):
    """An SGLang endpoint failed; the message names the endpoint, the server and what went wrong."""

    def __init__(self, endpoint: str, message: str, status: int | None = None):
        self.endpoint = endpoint
        self.status = status
        self.detail = message
        super().__init__(f"SGLang {endpoint}: {message}")


class SGLangTimeout(SGLangError, TimeoutError):
    """An SGLang endpoint did not answer within the client's timeout."""


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        if "message" in body:
            return str(body["message"])[:500]
    return str(body)[:500]


def _version_number(label: Any) -> int | None:
    """SGLang's weight_version is a free-form string ("default" until the first update)."""
    try:
        return int(label)
    except (TypeError, ValueError):
        return None


class SGLangEngine:
    """A client of one SGLang server (or its router): `generate` and weight updates over HTTP."""

    def __init__(
        self,
        base_url: str,
        weight_version: int = 0,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        max_batch: int = 256,
        stop_token_ids: list[int] | None = None,
        weights_dir: str | Path | None = None,
        send_seed: bool = False,
        client: httpx.Client | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.weight_version = weight_version
        self.timeout = timeout
        self.max_batch = max_batch
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids else None
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.send_seed = send_seed
        self._client = client or http_client.client(timeout=httpx.Timeout(timeout, connect=connect_timeout))

    # ------------------------------------------------------------ HTTP

    def _request(self, method: str, endpoint: str, payload: dict[str, Any] | None = None,
                 ok_statuses: tuple[int, ...] = (200,)) -> httpx.Response:
        try:
            r = self._client.request(method, self.base_url + endpoint, json=payload)
        except httpx.TimeoutException as e:
            raise SGLangTimeout(endpoint, f"no answer from {self.base_url} within {self.timeout:g} s "
                                          f"({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise SGLangError(endpoint, f"cannot reach {self.base_url}: {e}") from e
        if r.status_code not in ok_statuses:
            raise SGLangError(endpoint, f"HTTP {r.status_code} from {self.base_url}: {_error_text(r)}", r.status_code)
        return r

    def _json(self, r: httpx.Response, endpoint: str) -> Any:
        try:
            return r.json()
        except ValueError as e:
            raise SGLangError(endpoint, f"answer is not JSON: {r.text[:200]!r}") from e

    # ------------------------------------------------------------ generation

    def _sampling_params(self, params: SamplingParams) -> dict[str, Any]:
        sp: dict[str, Any] = {**NEUTRAL_SAMPLING, "max_new_tokens": params.max_new_tokens, "top_p": params.top_p,
                              "temperature": 0.0 if params.greedy else params.temperature}
        if params.greedy:
            sp["top_p"] = 1.0
        # getattr: stop / stop_token_ids / ignore_eos are newer SamplingParams fields.
        stop_ids = sorted({*(self.stop_token_ids or ()), *getattr(params, "stop_token_ids", ())})
        if stop_ids:
            sp["stop_token_ids"] = stop_ids
        if getattr(params, "stop", ()):
            sp["stop"] = list(params.stop)
        if getattr(params, "ignore_eos", False):
            sp["ignore_eos"] = True
        return sp

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, `params.n` completions with the server's exact tokens and logprobs."""
        flat = [p for p in prompts for _ in range(params.n)]
        base = self._sampling_params(params)
        out: list[Completion] = []
        for start in range(0, len(flat), self.max_batch):
            chunk = flat[start : start + self.max_batch]
            if self.send_seed and params.seed is not None:
                # One seed per sequence, so the n copies of a prompt do not sample the same tokens.
                sp: dict[str, Any] | list[dict[str, Any]] = [
                    {**base, "sampling_seed": params.seed + start + i} for i in range(len(chunk))]
            else:
                sp = base
            out.extend(self._generate_chunk(chunk, sp, getattr(params, "top_logprobs", 0)))
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_chunk(self, prompts: list[list[int]], sampling_params: Any, top_k: int) -> list[Completion]:
        endpoint = "/generate"
        payload: dict[str, Any] = {"input_ids": [list(map(int, p)) for p in prompts],
                                   "sampling_params": sampling_params, "return_logprob": True}
        if top_k:
            payload["top_logprobs_num"] = top_k
        sent_version = self.weight_version
        body = self._json(self._request("POST", endpoint, payload), endpoint)
        if isinstance(body, dict) and len(prompts) == 1:
            body = [body]  # a one-prompt batch may come back unwrapped
        if not isinstance(body, list) or len(body) != len(prompts):
            got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
            raise SGLangError(endpoint, f"expected a list of {len(prompts)} outputs, got {got}")
        return [self._completion(p, o, sent_version, endpoint, top_k) for p, o in zip(prompts, body, strict=True)]

    def _completion(self, prompt: list[int], out: Any, sent_version: int, endpoint: str, top_k: int) -> Completion:
        if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
            raise SGLangError(endpoint, f"output without meta_info: {str(out)[:200]}")
        meta = out["meta_info"]
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind == "abort":
            detail = reason.get("message", "") if isinstance(reason, dict) else ""
            raise SGLangError(endpoint, f"request {meta.get('id')} was aborted by the server: {detail}")
        if kind not in ("stop", "length"):
            raise SGLangError(endpoint, f"unexpected finish_reason {reason!r} (request {meta.get('id')})")
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list):
            raise SGLangError(endpoint, "meta_info.output_token_logprobs is missing: the server ignored "
                                        "return_logprob, and the trainer needs the sampler's logprobs")
        try:
            token_ids = [int(e[1]) for e in entries]
            logprobs = [float(e[0]) for e in entries]
        except (TypeError, ValueError, IndexError) as e:
            raise SGLangError(endpoint, f"malformed output_token_logprobs entry ({e}); expected "
                                        "[logprob, token_id, text]") from e
        output_ids = out.get("output_ids")
        if output_ids is not None and list(output_ids) != token_ids:
            raise SGLangError(endpoint, f"output_ids {list(output_ids)[:8]}... disagree with the token ids of "
                                        f"output_token_logprobs {token_ids[:8]}...")
        n_done = meta.get("completion_tokens")
        if n_done is not None and n_done != len(token_ids):
            raise SGLangError(endpoint, f"completion_tokens {n_done} but {len(token_ids)} logprob entries")
        versions = {sent_version}
        server_version = _version_number(meta.get("weight_version"))
        if server_version is not None:
            versions.add(server_version)
        extra: dict[str, Any] = {}
        if top_k:
            # meta_info.output_top_logprobs: per generated token, [[logprob, token_id, text], ...]
            top = meta.get("output_top_logprobs")
            if not isinstance(top, list) or len(top) != len(token_ids):
                raise SGLangError(endpoint, f"asked for top_logprobs_num={top_k} but output_top_logprobs is "
                                            f"missing or has the wrong length")
            extra["top_logprobs"] = [[(int(e[1]), float(e[0])) for e in step] for step in top]
        # Which tokens came from which version is unknown here, so per-token versions are left empty;
        # weight_version (the oldest possible) is what staleness rules use.
        return Completion(
            prompt_ids=list(prompt), token_ids=token_ids, logprobs=logprobs, text=out.get("text") or "",
            finish_reason=kind, weight_version=min(versions),
            meta={"weight_versions": sorted(versions), "id": meta.get("id"),
                  "server_weight_version": meta.get("weight_version"), "finish": reason,
                  "cached_tokens": meta.get("cached_tokens")},
            **extra,
        )

    # ------------------------------------------------------------ weights and server state

    def update_weights_from_disk(self, model_path: str | Path, version: int, load_format: str | None = None,
                                 verify: bool = True) -> None:
        """Ask the server to load weights from `model_path` (a path it can read) as `version`.

        Requests in flight are not aborted; they may finish with the new weights (their completions
        then list both versions). With `verify`, /get_model_info must report the new version label
        (servers too old to know `weight_version` ignore the field and report none: not checked).
        Fails loudly on any refusal; the server flushes its prefix cache itself after an update.
        """
        endpoint = "/update_weights_from_disk"
        payload: dict[str, Any] = {"model_path": str(model_path), "weight_version": str(version)}
        if load_format is not None:
            payload["load_format"] = load_format
        # SGLang answers a refused update with 400 and {"success": false, "message": ...}.
        r = self._request("POST", endpoint, payload, ok_statuses=(200, 400))
        body = self._json(r, endpoint)
        if not isinstance(body, dict) or body.get("success") is not True:
            msg = body.get("message") if isinstance(body, dict) else body
            raise SGLangError(endpoint, f"server refused weights {model_path} as version {version}: {msg}",
                              r.status_code)
        if verify:
            label = self.model_info().get("weight_version")
            if label is not None and str(label) != str(version):
                raise SGLangError(endpoint, f"update reported success but the server reports weight_version "
                                            f"{label!r}, expected {str(version)!r}")
        self.weight_version = version

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Write `state_dict` as `weights_dir/v{version}/model.safetensors`, then load it on the server.

        `weights_dir` must be readable by the server at the same path (a shared filesystem). The
        directory appears atomically (written under a temporary name, then renamed). Keys must be
        the Hugging Face parameter names the server's model expects.
        """
        if self.weights_dir is None:
            raise SGLangError("/update_weights_from_disk", "load_weights needs weights_dir, a directory the "
                                                           "server can read; or call update_weights_from_disk")
        from safetensors.torch import save_file  # noqa: PLC0415 heavy (torch): the HTTP client needs none until it saves weights

        target = self.weights_dir / f"v{version:08d}"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version:08d}-", dir=self.weights_dir))
        try:
            # clone(): safetensors refuses tensors that share storage (tied embeddings).
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()},
                      str(tmp / "model.safetensors"))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        self.update_weights_from_disk(target, version)

    def post_checked(self, endpoint: str, payload: dict[str, Any], what: str) -> dict[str, Any]:
        """POST to one of SGLang's {"success", "message"} endpoints (weight updates, groups); a refusal
        (HTTP 400 with success false) is an error naming `what`, the endpoint and the server."""
        r = self._request("POST", endpoint, payload, ok_statuses=(200, 400))
        body = self._json(r, endpoint)
        if not isinstance(body, dict) or body.get("success") is not True:
            msg = body.get("message") if isinstance(body, dict) else body
            raise SGLangError(endpoint, f"{self.base_url} refused {what}: {msg}", r.status_code)
        return body

    def server_weight_version(self) -> str | None:
        """The server's weight_version label: GET /model_info (current servers), else /get_model_info
        (older ones; deprecated since), else /get_weight_version (older still; now answers 404)."""
        for endpoint in ("/model_info", "/get_model_info", "/get_weight_version"):
            r = self._request("GET", endpoint, ok_statuses=(200, 404))
            if r.status_code == 200:
                body = self._json(r, endpoint)
                if not isinstance(body, dict):
                    raise SGLangError(endpoint, f"expected an object, got {type(body).__name__}")
                label = body.get("weight_version")
                return None if label is None else str(label)
        raise SGLangError("/model_info", f"{self.base_url} answers none of /model_info, /get_model_info, "
                                         "/get_weight_version")

    def pause_generation(self, mode: str = "retract") -> None:
        """POST /pause_generation {"mode"} (PauseGenerationReqInput: "abort" | "retract" | "in_place")."""
        self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._request("POST", "/continue_generation", {})

    def flush_cache(self, attempts: int = 8, first_wait_s: float = 0.05, max_wait_s: float = 2.0,
                    wait: Callable[[float], None] = time.sleep) -> int:
        """Drop the server's prefix (radix) cache. SGLang refuses (HTTP 400) while requests are running or
        waiting; that answer is retried up to `attempts` times, waiting `first_wait_s` doubling to at most
        `max_wait_s` in between (`wait`: injectable). Returns the retries it took; raises after `attempts`."""
        for k in range(attempts):
            r = self._request("POST", "/flush_cache", ok_statuses=(200, 400))
            if r.status_code == 200:
                return k
            if k + 1 < attempts:
                wait(min(first_wait_s * 2**k, max_wait_s))
        raise SGLangError("/flush_cache", f"{self.base_url} stayed busy (HTTP 400: requests running or waiting) "
                                          f"through {attempts} attempts", 400)

    def server_version(self) -> str:
        """The server's sglang version: GET /server_info (current), else /get_server_info (older)."""
        for endpoint in ("/server_info", "/get_server_info"):
            r = self._request("GET", endpoint, ok_statuses=(200, 404))
            if r.status_code == 200:
                body = self._json(r, endpoint)
                if not isinstance(body, dict) or not isinstance(body.get("version"), str):
                    raise SGLangError(endpoint, f"{self.base_url} reports no sglang version (no string "
                                                f"'version' in the answer)")
                return body["version"]
        raise SGLangError("/server_info", f"{self.base_url} answers neither /server_info nor /get_server_info")

    def check_server_version(self, minimum: str = MIN_SGLANG_VERSION) -> str:
        """The server's version; an error naming it and `minimum` when it is older (or unreadable)."""
        found = self.server_version()
        have, need = _release(found), _release(minimum)
        if have is None or need is None or have < need:
            raise SGLangError("/server_info", f"{self.base_url} runs sglang {found!r}; Factory needs sglang >= "
                                              f"{minimum} (older servers ignore /pause_generation's mode and "
                                              "abort every request at a weight update): upgrade sglang in "
                                              "rollout.sglang.python's environment")
        return found

    def model_info(self) -> dict[str, Any]:
        body = self._json(self._request("GET", "/get_model_info"), "/get_model_info")
        if not isinstance(body, dict):
            raise SGLangError("/get_model_info", f"expected an object, got {type(body).__name__}")
        return body

    def health(self) -> bool:
        """True when /health answers 200; False when it answers otherwise or cannot be reached."""
        try:
            self._request("GET", "/health")
        except SGLangError:
            return False
        return True

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
