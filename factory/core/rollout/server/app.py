"""The rollout server: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over an embedded engine (`EngineControl`:
the paged engine, or `ContinuousEngine` for models it does not run; `served.py` and `factory serve --engine` pick).

Owns the HTTP surface (the routes) and the launcher; the routes' logic is in `api.py`, the request bodies and
errors in `api_models.py`, the chat template and tool calls in `chat.py` and `tools.py`, the session records in
`sessions.py`, checkpoint loading in `served.py`; sampling and the KV budget are the engine's.
Endpoints:

- OpenAI: `GET /v1/models`, `GET /v1/models/{model}`, `POST /v1/completions`, `POST /v1/chat/completions` (no
  streaming). The `openai` client works unchanged. `model` is one of the served names (`model_names`, default the
  engine's) or `policy` (what Factory's environments send), or left out; any other is OpenAI's 404
  `model_not_found`. A completions request has at most `MAX_PROMPTS` (64) prompts; a body holding more values
  than that allows is refused before it is parsed (`body_gate.py`). A request the engine's KV budget could never
  hold is a 400 naming the budget; others wait for room in it (`kv_budget.py`). A chat request without
  max_tokens gets as many as fit the context and the budget.
- Transport: request headers must be complete within `header_timeout_s` (10 s) of a connection opening or of
  its last response, else the connection is closed (`factory/infra/http_protocol.py`); a JSON body that is not
  UTF-8 or is nested deeper than 128 levels is a 400 naming the byte (`factory/infra/json_body.py`).
- Control, named as SGLang names them: `GET /health`, `GET /get_model_info`, `GET /get_server_info`,
  `POST /update_weights_from_disk` {"model_path", "version"?, "mode"?}, `POST /pause_generation`
  {"mode"?: "drain" | "in_place", "wait"?}, `POST /continue_generation`, `POST /flush_cache`; and (SGLang has no
  such endpoint) `POST /update_weights_from_delta`: the body is a serialized `factory.core.weights.WeightUpdate`
  (`to_bytes()`; full or delta against the served version), `?mode=`; 409 when the delta's base version is not
  the served one (send a full update). `POST /attach_shared_weights` {the handle of a
  `factory.core.weights.shared.SharedWeightsWriter`} maps the trainer's shared buffer once (host shared memory, or
  the same GPU by CUDA IPC; a bad field is a 400 naming it), and `POST /update_weights_from_shared` `?mode=` applies
  its newest whole version if it is newer than the served one (409 if nothing is attached). Update modes:
  "finish_old" (default; running requests end on the old weights) or "in_flight" (they continue on the new ones;
  see `engine_control.py`).
- Sessions: `GET /sessions/{id}`, `DELETE /sessions/{id}`.

Extension fields on every choice (the exact tokens, so the trainer never re-tokenizes):
  `prompt_token_ids`  the prompt as the engine ran it (chat: after the template),
  `token_ids`         the generated ids, including a stop token / stop-string tokens that ended the completion
                      (the OpenAI `text` excludes a stop string; `token_ids` keep what was sampled),
  `token_logprobs`    the sampler's logprob of each generated token (temperature-scaled, before top-p),
  `token_versions`    the weight version that sampled each token,
  `weight_version`    the oldest of them (all equal unless an in-flight update happened mid-completion),
  `stop_reason`       the stop token id or stop string that ended it (null for EOS-free length stops).
Extension request fields (the openai client's `extra_body`): `session_id`, `stop_token_ids`, `ignore_eos`.
Tool calls: when a chat request offers `tools`, they are shown through the model's chat template (`chat.py`) and
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in a reply (Hermes style) come back as OpenAI
`tool_calls` (finish_reason "tool_calls"); an assistant message with `tool_calls` sent back renders through the
template, and still continues the turn's exact ids in a session. `tool_choice`, `parallel_tool_calls` and
`response_format` follow `tools.py` (honoured, or refused with a 400 naming the field): a required or forced
call names one of `tools`, and one that ended with arguments that are not a JSON object is OpenAI's 500
`model_error`.
Log-probs (`logprobs.py`): the listed tokens join up to exactly the returned `text` (completions) or the generated
text (chat: the `content`, unless tool calls were taken out of it); eos, pad and stop-string tokens are not listed,
and `bytes` are each token's true bytes. The extension `token_ids`/`token_logprobs` keep every sampled token.
temperature=0 is greedy; its logprobs are those of the untempered distribution (temperature 1).

Sessions: a request names its session with the `X-Session-Id` header or a `session_id` body field. Every choice
is recorded as a turn (prompt ids, completion ids, logprobs, versions). For chat, when the request's messages
continue a recorded turn (same earlier messages, then that turn's reply verbatim as an assistant message), the
prompt is built from that turn's exact prompt + completion ids followed by the template of the new messages:
the episode's token stream is never re-tokenized, and the last turn's `prompt_token_ids + token_ids` is the whole
episode. A turn that a stop string ended is closed with the template's end-of-message ids (ChatML `<|im_end|>\n`,
the built-in template's eos) before the new messages, as the template renders a reply.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from torch import Tensor

from factory.core.rollout.engines.engine_control import PAUSE_MODES, EngineControl
from factory.core.rollout.server.api import SESSION_HEADER, DeltaDecoder, RolloutServer
from factory.core.rollout.server.api_models import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_N,
    MAX_VERSION,
    APIError,
    ChatRequest,
    CompletionRequest,
    PauseRequest,
    UpdateFromDiskRequest,
    _error_response,
    openai_render,
)
from factory.core.rollout.server.body_gate import CompletionBodyGate
from factory.core.rollout.server.chat import TOOL_CALL, ChatTemplate, parse_tool_calls
from factory.core.rollout.server.served import engine_from_checkpoint, load_weights_dir
from factory.core.rollout.server.sessions import SessionStore, Turn
from factory.core.weights import WeightUpdate, apply_update
from factory.infra.device import host_copy
from factory.infra.faults import fault_point
from factory.infra.http_guard import MAX_JSON_BYTES, guard
from factory.infra.http_protocol import HEADER_TIMEOUT_S, guarded_http
from factory.text import clip

# The request handling, request models, chat template, sessions and checkpoint loading live in their own modules;
# their public names are importable from here too.
__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "MAX_N", "SESSION_HEADER", "TOOL_CALL", "APIError", "ChatRequest",
           "ChatTemplate", "CompletionRequest", "DeltaDecoder", "PauseRequest", "RolloutServer", "ServerHandle",
           "SessionStore", "Turn", "UpdateFromDiskRequest", "create_app", "engine_from_checkpoint", "launch_server",
           "load_weights_dir", "parse_tool_calls", "serve", "weight_update_decoder"]

MAX_UPDATE_BYTES = 16 << 30  # a full weight update of a ~8B bf16 model; the JSON endpoints take MAX_JSON_BYTES


def weight_update_decoder(payload: bytes, current: Mapping[str, Tensor],
                          current_version: int) -> tuple[Mapping[str, Tensor], int | None]:
    """The default decoder: a serialized `factory.core.weights.WeightUpdate` (full, or a lossless delta whose base
    version must be the served version; every tensor is checked against its checksum)."""
    update = WeightUpdate.from_bytes(payload)
    return apply_update(dict(current), update, current_version), update.version


def create_app(engine: EngineControl, model_path: str | None = None, delta_decoder: DeltaDecoder | None = None,
               max_sessions: int = 10_000, max_body_bytes: int = MAX_JSON_BYTES,
               max_update_bytes: int = MAX_UPDATE_BYTES, model_names: Sequence[str] | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (which must be driven by its background thread: `engine.start()`).
    Bodies over `max_body_bytes` (`max_update_bytes` for a weight update) are refused with a 413. A request's
    `model` must be one of `model_names` (default: the engine's name) or `policy`, else a 404."""
    srv = RolloutServer(engine, model_path, delta_decoder, max_sessions, model_names)
    app = FastAPI(title="factory rollout server", docs_url=None, redoc_url=None)
    app.state.rollout = srv
    # A token-id body that no acceptable request could be is refused from its bytes, before the loop decodes and
    # validates it (seconds for millions of ids). Added before `guard`: inside its body limit and crash guard.
    app.add_middleware(CompletionBodyGate, max_seq_len=engine.max_seq_len)
    # 400 for a malformed body, as OpenAI answers it (the openai client raises BadRequestError).
    guard(app, validation_status=400, render=openai_render, max_body_bytes=max_body_bytes,
          body_limits={"/update_weights_from_delta": max_update_bytes}, raw_paths=("/update_weights_from_delta",))

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": srv.created, "owned_by": "factory",
                "max_model_len": engine.max_seq_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in srv.model_names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        return model_card(srv.check_model(model))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> dict:
        fault_point("serve_completion")  # chaos tests: a server that dies on its requests (a crash loop)
        return await srv.completions(request, body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest) -> dict:
        return await srv.chat(request, body)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return srv.model_info()

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {**engine.info(), "model_path": srv.model_path, "sessions": len(srv.sessions._sessions)}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(body: UpdateFromDiskRequest) -> dict:
        version = body.version
        if version is None and body.weight_version is not None:
            try:
                version = int(body.weight_version)
            except ValueError:
                version = -1
            if not 0 <= version <= MAX_VERSION:
                raise APIError(400, f"weight_version must be an integer in [0, {MAX_VERSION}], got "
                                    f"{clip(body.weight_version)!r}", "weight_version")
        result = await srv.update(lambda: (load_weights_dir(body.model_path), None), version, body.mode)
        srv.model_path = body.model_path
        return result

    @app.post("/update_weights_from_delta")
    async def update_from_delta(request: Request, version: Annotated[int | None, Query(ge=0, le=MAX_VERSION)] = None,
                                mode: str = "finish_old") -> dict:
        payload = await request.body()

        def decode() -> tuple[Mapping[str, Tensor], int | None]:
            # a host copy: a decoder that patches tensors in place must not touch the weights being sampled from,
            # and the decoders work on CPU tensors (the engine copies the result to its model's device)
            current = {k: host_copy(v) for k, v in engine.model.state_dict().items()}
            try:
                return srv.delta_decoder(payload, current, engine.weight_version)
            except ImportError as e:
                raise APIError(501, f"no weight-update decoder available: {e}", kind="not_implemented") from e
            except Exception as e:  # a corrupt payload, a checksum mismatch, a delta against another base
                stale = type(e).__name__ == "WeightVersionMismatch"
                raise APIError(409 if stale else 400, f"cannot apply the weight update: {e}") from e

        return await srv.update(decode, version, mode)

    @app.post("/attach_shared_weights")
    async def attach_shared(body: dict[str, Any]) -> dict:
        return await srv.attach_shared(body)

    @app.post("/update_weights_from_shared")
    async def update_from_shared(mode: str = "finish_old") -> dict:
        return await srv.update_from_shared(mode)

    @app.post("/pause_generation")
    async def pause(body: PauseRequest | None = None) -> dict:
        body = body or PauseRequest()
        if body.mode not in PAUSE_MODES:
            raise APIError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {body.mode!r}", "mode")
        engine.pause(body.mode)  # type: ignore[arg-type]
        drained = None
        if body.wait and body.mode == "drain":
            drained = await asyncio.to_thread(engine.wait_until, lambda: engine.running == 0, body.timeout)
        return {"success": True, "paused": body.mode, "running": engine.running, "queued": engine.queued,
                "drained": drained}

    @app.post("/continue_generation")
    async def resume() -> dict:
        engine.resume()
        return {"success": True, "paused": None}

    @app.post("/flush_cache")
    async def flush() -> JSONResponse:
        if engine.flush_cache():
            return JSONResponse({"success": True, "message": "cache flushed"})
        return _error_response(400, "cache not flushed: requests are running or queued")

    @app.get("/sessions/{sid}")
    async def session(sid: str) -> dict:
        turns = srv.sessions.get(sid)
        if turns is None:
            raise APIError(404, f"no session with session_id {clip(sid)!r}", "session_id", "not_found_error")
        return {"session_id": sid, "turns": [t.to_json(i) for i, t in enumerate(turns)]}

    @app.delete("/sessions/{sid}")
    async def drop_session(sid: str) -> dict:
        if not srv.sessions.delete(sid):
            raise APIError(404, f"no session with session_id {clip(sid)!r}", "session_id", "not_found_error")
        return {"success": True}

    return app


# ---------------------------------------------------------------------------------------------- launching
class _Server(uvicorn.Server):
    """uvicorn's server, with an event set once it listens (or failed to start)."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()


@dataclass
class ServerHandle:
    """A server running in a thread of this process."""

    host: str
    port: int
    engine: EngineControl
    app: FastAPI
    _server: _Server
    _thread: threading.Thread
    _stop_engine: bool

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self.app.state.rollout.close()
        if self._stop_engine:
            self.engine.stop(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_server(engine: EngineControl, host: str = "127.0.0.1", port: int = 0, model_path: str | None = None,
                  delta_decoder: DeltaDecoder | None = None, startup_timeout: float = 30.0,
                  log_level: str = "warning", max_body_bytes: int = MAX_JSON_BYTES,
                  max_update_bytes: int = MAX_UPDATE_BYTES, model_names: Sequence[str] | None = None,
                  header_timeout_s: float = HEADER_TIMEOUT_S) -> ServerHandle:
    """Serve `engine` from a background thread (port 0: any free port); starts the engine's thread if needed."""
    stop_engine = not engine.started
    engine.start()
    app = create_app(engine, model_path=model_path, delta_decoder=delta_decoder, max_body_bytes=max_body_bytes,
                     max_update_bytes=max_update_bytes, model_names=model_names)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                    access_log=False, http=guarded_http(header_timeout_s)))
    thread = threading.Thread(target=server.run, name="rollout-server", daemon=True)
    thread.start()
    if not server.ready.wait(startup_timeout) or not server.started:
        server.should_exit = True
        thread.join(5)
        if stop_engine:
            engine.stop()
        raise RuntimeError(f"the rollout server did not start on {host}:{port}")
    bound = server.servers[0].sockets[0].getsockname()[1]
    return ServerHandle(host, bound, engine, app, server, thread, stop_engine)


def serve(engine: EngineControl, host: str = "127.0.0.1", port: int = 8000, model_path: str | None = None,
          delta_decoder: DeltaDecoder | None = None, log_level: str = "info", max_body_bytes: int = MAX_JSON_BYTES,
          max_update_bytes: int = MAX_UPDATE_BYTES, model_names: Sequence[str] | None = None,
          header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
    """Serve `engine` in the foreground until interrupted (the `factory serve` command)."""
    engine.start()
    try:
        app = create_app(engine, model_path=model_path, delta_decoder=delta_decoder, max_body_bytes=max_body_bytes,
                         max_update_bytes=max_update_bytes, model_names=model_names)
        uvicorn.run(app, host=host, port=port, log_level=log_level, lifespan="off",
                    http=guarded_http(header_timeout_s))
    finally:
        engine.stop()
