"""The rollout server's request handling: the `RolloutServer` state behind the HTTP routes (engine, chat template,
sessions) and the logic of the OpenAI and control routes; `server.py` declares the routes and launches the server
(its docstring describes the API)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import Request
from torch import Tensor

from factory.core.rollout.base import Completion, SamplingParams
from factory.core.rollout.engines.engine_control import UPDATE_MODES, EngineControl
from factory.core.rollout.engines.sequences import mix_seed
from factory.core.rollout.server.api_models import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_N,
    MAX_PROMPTS,
    APIError,
    ChatRequest,
    CompletionRequest,
    _SamplingRequest,
)
from factory.core.rollout.server.chat import ChatTemplate, _encode, _message_text, _same_reply, parse_tool_calls
from factory.core.rollout.server.logprobs import TokenBytes, token_pieces
from factory.core.rollout.server.prompt_gate import PromptGate
from factory.core.rollout.server.sessions import SessionStore, Turn
from factory.core.rollout.server.shared_updates import SharedUpdates
from factory.core.rollout.server.tools import (
    CALL_CLOSE,
    INVALID_OUTPUT,
    ToolPlan,
    check_response_format,
    forced_call,
    name_choices,
    plan_tools,
)
from factory.core.rollout.server.update_decoder import UpdateDecoder
from factory.core.weights import WeightSyncError
from factory.core.weights.shared import SharedHandleError
from factory.text import clip

SESSION_HEADER = "x-session-id"
POLICY_NAME = "policy"  # the model name Factory's environments call the policy by: every server answers to it

# Turns a weight-update request body, the served weights (a copy) and their version into the new state dict and
# the version the payload names (None: the request's ?version=, else the current version + 1).
DeltaDecoder = Callable[[bytes, Mapping[str, Tensor], int], tuple[Mapping[str, Tensor], int | None]]


def _engine_field(message: str, prompt_field: str, max_tokens_field: str) -> str | None:
    """The request field an engine refusal (`EngineControl.check`) is about."""
    if "context length" in message or "max_tokens" in message:
        return max_tokens_field
    if "prompt" in message:
        return prompt_field
    for name in ("temperature", "top_p", "top_logprobs"):
        if name in message:
            return name
    return None


class RolloutServer:
    """The state behind the HTTP routes: the engine, the chat template, the sessions."""

    def __init__(self, engine: EngineControl, model_path: str | None = None,
                 delta_decoder: DeltaDecoder | None = None, max_sessions: int = 10_000,
                 model_names: Sequence[str] | None = None):
        self.engine = engine
        # what a request's `model` may be: the served names (default: the engine's), and POLICY_NAME
        self.model_names = list(dict.fromkeys([*(model_names or [engine.name]), POLICY_NAME]))
        self.tokenizer = engine.tokenizer
        self.model_path = model_path
        self.delta_decoder = delta_decoder or UpdateDecoder()  # full weights, or LoRA adapters
        self.template = ChatTemplate(engine.tokenizer)
        self.token_bytes = TokenBytes(engine.tokenizer)
        self.sessions = SessionStore(max_sessions)
        self.gate = PromptGate(engine.tokenizer, engine.max_seq_len)  # length bound first, large prompts off-loop
        self.created = int(time.time())
        self._update_lock = asyncio.Lock()  # one weight update at a time, in arrival order
        self.shared = SharedUpdates(engine)  # the trainer's shared buffer, once attached

    @property
    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt may have (None: no character bound; see `prompt_gate.py`)."""
        return self.gate.max_prompt_chars

    def close(self) -> None:
        self.gate.close()
        self.shared.close()

    # -- helpers
    def check_model(self, name: str | None) -> str:
        """The name to answer with: `name` if this server serves it (a request may leave it out), else the 404
        OpenAI answers (`model_not_found`)."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(404, f"The model `{clip(name)}` does not exist: this server serves "
                                f"{', '.join(self.model_names)}", "model", code="model_not_found")
        return name

    def _session_id(self, request: Request, body: _SamplingRequest) -> str | None:
        header = request.headers.get(SESSION_HEADER)
        if header and body.session_id and header != body.session_id:
            raise APIError(400, f"session id differs between the {SESSION_HEADER} header and the body", "session_id")
        return body.session_id or header or None

    def _params(self, body: _SamplingRequest, max_tokens: int, top_logprobs: int,
                max_tokens_field: str = "max_tokens", extra_stop: tuple[str, ...] = ()) -> SamplingParams:
        if body.stream:
            raise APIError(400, "stream=true is not supported by this server", "stream")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported", name)
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if not 1 <= body.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {body.n}", "n")
        if max_tokens < 1:
            raise APIError(400, f"{max_tokens_field} must be at least 1, got {max_tokens}", max_tokens_field)
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < 0:
            raise APIError(400, f"temperature must be >= 0, got {temperature}", "temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must be non-empty", "stop")
        stop += [s for s in extra_stop if s not in stop]
        return SamplingParams(
            n=body.n, temperature=temperature if temperature > 0 else 1.0, top_p=top_p,
            max_new_tokens=max_tokens, greedy=temperature == 0, seed=body.seed, stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, top_logprobs=top_logprobs,
        )

    async def _run(self, prompts: list[list[int]], params: SamplingParams, prompt_field: str = "prompt",
                   max_tokens_field: str = "max_tokens") -> list[Completion]:
        """All n samples of every prompt, submitted together so that they batch; choice order is prompt-major."""
        # Distinct sample indexes keep seeded samples of different prompts independent.
        samples = [(p, i * params.n + j) for i, p in enumerate(prompts) for j in range(params.n)]
        return await self._run_samples(samples, params, prompt_field, max_tokens_field)

    async def _run_samples(self, samples: list[tuple[list[int], int]], params: SamplingParams,
                           prompt_field: str = "prompt", max_tokens_field: str = "max_tokens") -> list[Completion]:
        """One completion per (prompt, sample index), in that order, submitted together so that they batch."""
        try:
            for p in dict.fromkeys(tuple(p) for p, _ in samples):  # all checked before any is queued
                self.engine.check(list(p), params)
        except ValueError as e:
            field = _engine_field(str(e), prompt_field, max_tokens_field)
            raise APIError(400, f"{field}: {e}" if field else str(e), field) from e
        futures = self.engine.submit_many(samples, params)  # queued at once: a prompt's samples share its K/V
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except asyncio.CancelledError:
            for f in futures:  # the client went away: free the rows
                f.cancel()
            raise

    def _extension(self, c: Completion) -> dict:
        return {"prompt_token_ids": c.prompt_ids, "token_ids": c.token_ids, "token_logprobs": c.logprobs,
                "token_versions": c.token_versions, "weight_version": c.weight_version,
                "stop_reason": c.meta.get("stop_reason")}

    def _usage(self, prompts: list[list[int]], comps: list[Completion]) -> dict:
        p = sum(len(x) for x in prompts)
        c = sum(len(x.token_ids) for x in comps)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _record(self, sid: str | None, turns: list[Turn]) -> None:
        if sid is not None:
            self.sessions.add(sid, turns)

    # -- /v1/completions
    async def completions(self, request: Request, body: CompletionRequest) -> dict:
        model = self.check_model(body.model)
        if body.echo:
            raise APIError(400, "echo=true is not supported", "echo")
        if body.best_of not in (None, 1, body.n):
            raise APIError(400, "best_of is not supported", "best_of")
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        check_response_format((body.model_extra or {}).get("response_format"))  # not OpenAI's here: never ignored
        k = body.logprobs
        if k is not None and not 0 <= k <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {k}", "logprobs")
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) \
                and len(body.prompt) > MAX_PROMPTS:
            raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(body.prompt)}", "prompt")
        sid = self._session_id(request, body)
        texts = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
        for text in texts:  # before any tokenizing: a prompt that cannot fit costs nothing
            self.gate.check(len(text), "prompt")
        prompts = await self.gate.run(sum(map(len, texts)), self._completion_prompts, body.prompt)
        params = self._params(body, DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
                              k or 0)
        comps = await self._run(prompts, params)
        choices = []
        for i, c in enumerate(comps):
            choices.append({"index": i, "text": c.text, "finish_reason": c.finish_reason,
                            "logprobs": None if k is None else self._completion_logprobs(c, k),
                            **self._extension(c)})
        self._record(sid, [Turn("completions", i, c.prompt_ids, c.token_ids, c.logprobs, c.token_versions,
                                c.weight_version, c.finish_reason, c.text) for i, c in enumerate(comps)])
        return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": self._usage(prompts, comps),
                "session_id": sid}

    def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str):
            return [_encode(self.tokenizer, prompt)]
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        if all(isinstance(p, str) for p in prompt):
            return [_encode(self.tokenizer, p) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [list(p) for p in prompt]

    def _completion_logprobs(self, c: Completion, k: int) -> dict:
        pieces = token_pieces(self.token_bytes, c.token_ids, c.text)
        top = None
        if k and c.top_logprobs is not None:
            top = [{self.token_bytes.name(t): lp for t, lp in c.top_logprobs[i]} for i in pieces.index]
        return {"tokens": pieces.text, "token_logprobs": [c.logprobs[i] for i in pieces.index],
                "top_logprobs": top, "text_offset": pieces.offset}

    # -- /v1/chat/completions
    async def chat(self, request: Request, body: ChatRequest) -> dict:
        model = self.check_model(body.model)
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        k = body.top_logprobs
        if k is not None and not 0 <= k <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {k}", "top_logprobs")
        if k and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        check_response_format(body.response_format)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        sid = self._session_id(request, body)
        messages = [_message_text(m.model_dump(), i) for i, m in enumerate(body.messages)]
        chars = sum(len(m["content"]) for m in messages)
        self.gate.check(chars, "messages")  # the template only adds to the contents
        turns = list(self.sessions.get(sid) or []) if sid is not None else []  # read here: sessions are the loop's
        prompt, continues = await self.gate.run(chars, self._chat_prompt, messages, turns, plan)
        given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(body, given)
        params = self._params(body, 1 if max_tokens is None else max_tokens, k or 0, given, extra_stop=plan.stop)
        plans = [plan] * params.n
        if plan.choose:  # "required" with several tools: the model picks each sample's function first
            plans = [plan.with_name(name) for name in await self._choose_names(prompt, params, plan)]
            prompts = {p.name: (await self.gate.run(chars, self._chat_prompt, messages, turns, p))[0] for p in plans}
            samples = [(prompts[p.name], j) for j, p in enumerate(plans)]
        else:
            samples = [(prompt, j) for j in range(params.n)]
        if max_tokens is None:  # as many as fit the context and the KV budget
            most = min(self.engine.max_new_tokens(len(p)) for p, _ in samples)
            params = dataclasses.replace(params, max_new_tokens=max(1, most))
        comps = await self._run_samples(samples, params, "messages", given)
        choices, replies = [], []
        for i, (c, p) in enumerate(zip(comps, plans, strict=True)):
            message, finish = self._reply(c, p, i)
            try:
                replies.append(_message_text(message, 0))
            except APIError:  # a call cut by max_tokens, its arguments unfinished: the session keeps its text
                replies.append({"role": "assistant", "content": c.text})
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": self._chat_logprobs(c) if body.logprobs else None, **self._extension(c)})
        self._record(sid, [Turn("chat", i, c.prompt_ids, c.token_ids, c.logprobs, c.token_versions, c.weight_version,
                                c.finish_reason, c.text, messages, continues, reply=r)
                           for i, (c, r) in enumerate(zip(comps, replies, strict=True))])
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": self._usage([comps[0].prompt_ids], comps),
                "session_id": sid}

    async def _choose_names(self, prompt: list[int], params: SamplingParams, plan: ToolPlan) -> list[str]:
        """The function each of the n samples calls: the model's choice among `plan.names`, sampled (greedy at
        temperature 0) with its completion constrained to one of them (`tools.name_choices`). Seeded requests draw
        it from their own stream, apart from the call's."""
        choices = name_choices(self.tokenizer, plan.names)
        step = dataclasses.replace(params, max_new_tokens=max(map(len, choices)), choices=choices, stop=(),
                                   stop_token_ids=(), ignore_eos=True, top_logprobs=0,
                                   seed=None if params.seed is None else mix_seed(params.seed, 1 << 32))
        comps = await self._run([prompt], step, "messages", "max_tokens")
        by_ids = dict(zip(choices, plan.names, strict=True))
        names = [by_ids.get(tuple(c.token_ids)) for c in comps]
        if None in names:  # the context ended inside a name
            raise APIError(400, f"messages: the prompt leaves no room in this model's context of "
                                f"{self.engine.max_seq_len} tokens for a tool call", "messages")
        return names  # type: ignore[return-value]

    def _reply(self, c: Completion, plan: ToolPlan, index: int = 0) -> tuple[dict[str, Any], str]:
        """The assistant message of a completion and its finish_reason, tool calls taken out as `plan` says. A
        forced call that ended with arguments that are not a JSON object is OpenAI's 500 `model_error`."""
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if plan.forced:  # the prompt started the call: the reply is that call, however it ended
            call, ok = forced_call(plan, c.text, f"call_{secrets.token_hex(8)}")
            if not ok and c.finish_reason == "stop":
                raise APIError(500, f"{INVALID_OUTPUT} (choice {index}: the call to {plan.name} ended with arguments "
                                    f"that are not a JSON object: {clip(call['function']['arguments'])!r})",
                               kind="model_error")
            # cut by max_tokens (its arguments whole or not): the client sees finish_reason "length"
            return ({"role": "assistant", "content": None, "tool_calls": [call]},
                    "tool_calls" if c.finish_reason == "stop" else c.finish_reason)
        if plan.parse:
            closed = c.meta.get("stop_reason") == CALL_CLOSE  # parallel_tool_calls=false stopped at the first call
            content, calls = parse_tool_calls(c.text + (CALL_CLOSE if closed else ""), plan.names)
            if calls:
                return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return message, c.finish_reason

    def _chat_prompt(self, messages: list[dict[str, str]], turns: list[Turn],
                     plan: ToolPlan) -> tuple[list[int], int | None]:
        """Prompt ids for `messages`; in a session (its `turns`), continue the exact ids of the turn these messages
        extend. Runs on a worker thread for a large prompt: it reads only its arguments and the template."""
        full = self.template.render(messages, generation_prompt=True, tools=plan.tools, prefill=plan.prefill)
        for idx in range(len(turns) - 1, -1, -1):
            t = turns[idx]
            j = len(t.messages or [])
            reply = t.reply or {"role": "assistant", "content": t.text}
            if (t.endpoint == "chat" and len(messages) > j and messages[:j] == t.messages
                    and _same_reply(messages[j], reply, t.text)):
                head = self.template.render(messages[: j + 1], generation_prompt=False, tools=plan.tools)
                if full[: len(head)] == head:  # the template renders the conversation prefix-stably
                    # A turn cut by a stop string (e.g. `</tool_call>`) has no end-of-turn token: it gets the
                    # template's closing, as the rendered reply has it. (eos and stop tokens close a turn; a turn cut
                    # by max_tokens is continued as it stands.)
                    cut = t.finish_reason == "stop" and bool(t.completion_ids) \
                        and not self.token_bytes.is_special(t.completion_ids[-1])
                    closing = self.template.closing if cut else []
                    return t.prompt_ids + t.completion_ids + closing + full[len(head):], idx
        return full, None

    def _chat_logprobs(self, c: Completion) -> dict:
        pieces = token_pieces(self.token_bytes, c.token_ids, c.text)
        content = []
        for i, s, b in zip(pieces.index, pieces.text, pieces.bytes, strict=True):
            alts = c.top_logprobs[i] if c.top_logprobs is not None else []
            content.append({"token": s, "logprob": c.logprobs[i], "bytes": list(b),
                            "top_logprobs": [{"token": self.token_bytes.name(at), "logprob": alp,
                                              "bytes": list(self.token_bytes(at) or self.token_bytes.name(at).encode())}
                                             for at, alp in alts]})
        return {"content": content, "refusal": None}

    # -- control
    def model_info(self) -> dict:
        cfg = json.loads(self.engine.model.config.to_json_string())
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "served_model_name": self.engine.name, "weight_version": self.engine.weight_version,
                "max_seq_len": self.engine.max_seq_len, "config": cfg}

    def _check_update_mode(self, mode: str) -> None:
        if mode not in UPDATE_MODES:
            raise APIError(400, f"mode must be one of {', '.join(UPDATE_MODES)}, got {mode!r}", "mode")
        if mode == "finish_old" and self.engine.paused == "in_place" and self.engine.running:
            raise APIError(400, "running requests cannot finish on the old weights while generation is paused in "
                                "place: continue_generation first, or use mode=in_flight", "mode")

    async def update(self, state_fn: Callable[[], tuple[Mapping[str, Tensor], int | None]], version: int | None,
                     mode: str) -> dict:
        self._check_update_mode(mode)
        async with self._update_lock:
            try:
                state, carried = await asyncio.to_thread(state_fn)
            except (FileNotFoundError, ValueError, KeyError) as e:
                raise APIError(400, f"cannot load the weights: {e}") from e
            if carried is not None and version is not None and int(carried) != int(version):
                raise APIError(400, f"the update is version {carried} but the request says {version}", "version")
            version = carried if carried is not None else version
            new_version = self.engine.weight_version + 1 if version is None else int(version)
            try:
                applied = await asyncio.wrap_future(self.engine.update_weights(state, new_version, mode))
            except ValueError as e:
                raise APIError(400, f"cannot load the weights: {e}") from e
        return {"success": True, "message": f"weights updated to version {applied} ({mode})",
                "weight_version": applied, "num_paused_requests": 0}

    # -- the shared-buffer handoff (`shared_updates.py`)
    async def attach_shared(self, handle: Mapping[str, Any]) -> dict:
        """Attach the trainer's shared weights buffer (replacing one attached before); nothing is applied yet."""
        async with self._update_lock:  # not while an update reads the buffer attached before
            try:
                available = await asyncio.to_thread(self.shared.attach, handle)
            except SharedHandleError as e:
                raise APIError(400, str(e)) from e
        return {"success": True, "message": "shared weights attached", "available_version": available,
                "weight_version": self.engine.weight_version}

    async def update_from_shared(self, mode: str) -> dict:
        """Apply the newest whole version of the attached buffer, if it is newer than the served one."""
        self._check_update_mode(mode)
        async with self._update_lock:
            if not self.shared.attached:
                raise APIError(409, "no shared weights buffer attached: POST its handle to /attach_shared_weights "
                                    "first")
            available = self.shared.reader.available()  # type: ignore[union-attr]
            if available is None or available <= self.engine.weight_version:
                return {"success": True, "message": f"no version newer than {self.engine.weight_version} in the "
                                                    f"shared buffer", "weight_version": self.engine.weight_version,
                        "num_paused_requests": 0}
            try:
                version = await asyncio.to_thread(self.shared.read)
                if version is None:  # read before (an update the engine refused), yet not served: read it again
                    self.shared.forget()
                    version = await asyncio.to_thread(self.shared.read)
            except WeightSyncError as e:  # the writer overtook every copy for the read's timeout
                raise APIError(503, f"cannot read the shared weights buffer: {e}", kind="unavailable") from e
            if version is None:
                raise APIError(409, "the shared weights buffer holds nothing newer to read; attach it again")
            try:
                applied = await asyncio.wrap_future(self.engine.update_weights(self.shared.staging, version, mode))
            except ValueError as e:
                self.shared.forget()
                raise APIError(400, f"cannot load the weights: {e}") from e
        return {"success": True, "message": f"weights updated to version {applied} ({mode}) from the shared buffer",
                "weight_version": applied, "num_paused_requests": 0}
