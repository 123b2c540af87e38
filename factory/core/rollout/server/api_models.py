"""The rollout server's request bodies (pydantic models), its error type and its error body.

Errors use OpenAI's shape, so the `openai` client raises BadRequestError etc. with the message, plus the field
path (`param`, and `field` as Factory's other services name it) and SGLang's top-level `success`/`message`.
Numbers must be finite (NaN and infinities are refused, not read as defaults), and a malformed message (tool
calls included) is refused naming its path, e.g. `messages.1.tool_calls.0.function`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from factory.infra.http_guard import RequestError, error_response

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
MAX_N = 256
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each sampled n times); bounds what its body may hold
MAX_VERSION = (1 << 63) - 1  # weight versions are int64 in the lake
MAX_WAIT_S = 3600.0  # the longest a control request may block the caller (pause with wait)

# OpenAI clients send fields we do not use (user, metadata, ...): accepted and ignored. NaN and infinities are
# refused everywhere (Python's JSON reader accepts NaN, Infinity and 1e999).
_OPEN = ConfigDict(extra="allow", allow_inf_nan=False)


class APIError(RequestError):
    """A refused request in OpenAI's terms: `param` is the field at fault, `code` OpenAI's error code (e.g.
    `model_not_found`)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(status, message, param, kind, code)

    @property
    def param(self) -> str | None:
        return self.field


def openai_render(status: int, message: str, field: str | None, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": field, "field": field, "code": None},
            "success": False, "message": message}


def _error_response(status: int, message: str, param: str | None = None,
                    kind: str = "invalid_request_error") -> JSONResponse:
    return error_response(status, message, param, kind, openai_render)


# ---------------------------------------------------------------------------------------------- request bodies
class _SamplingRequest(BaseModel):
    model_config = _OPEN

    model: str | None = None  # a served name or "policy" (`RolloutServer.check_model`); may be left out
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    session_id: str | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ToolCallFunction(BaseModel):
    model_config = _OPEN

    name: str
    arguments: str | None = None  # a JSON object, written as a string (OpenAI); checked when rendered


class ToolCall(BaseModel):
    model_config = _OPEN

    id: str | None = None
    type: str | None = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message; its role and content parts are checked when rendered (`chat._message_text`)."""

    model_config = _OPEN  # name, tool_call_id, refusal, ...

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None


class ChatRequest(_SamplingRequest):
    messages: list[ChatMessage]
    tools: list[Any] | None = None  # checked and used as `tools.py` says
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None  # only {"type": "text"}: see tools.check_response_format
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


class UpdateFromDiskRequest(BaseModel):
    model_config = _OPEN  # SGLang's load_format, flush_cache, ... are accepted and ignored

    model_path: str
    version: int | None = Field(None, ge=0, le=MAX_VERSION)
    weight_version: Annotated[int, Field(ge=0, le=MAX_VERSION)] | str | None = None  # SGLang's name for it
    mode: str = "finish_old"


class PauseRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    mode: str = "drain"
    wait: bool = False  # drain mode: answer once running sequences have finished
    timeout: float = Field(60.0, ge=0, le=MAX_WAIT_S)
