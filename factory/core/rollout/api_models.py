"""The rollout server's request bodies (pydantic models), its error type and its error responses.

Errors use OpenAI's shape, so the `openai` client raises BadRequestError etc. with the message.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
MAX_N = 256


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error_response(status: int, message: str, param: str | None = None,
                    kind: str = "invalid_request_error") -> JSONResponse:
    # OpenAI's error shape; the openai client raises BadRequestError etc. with this message.
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None},
                         "success": False, "message": message}, status_code=status)


# ---------------------------------------------------------------------------------------------- request bodies
class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use (user, metadata, ...)

    model: str | None = None
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
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # offered: replies' <tool_call> blocks come back as tool_calls
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


class UpdateFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # SGLang's load_format, flush_cache, ... are accepted and ignored

    model_path: str
    version: int | None = None
    weight_version: int | str | None = None  # SGLang's name for it
    mode: str = "finish_old"


class PauseRequest(BaseModel):
    mode: str = "drain"
    wait: bool = False  # drain mode: answer once running sequences have finished
    timeout: float = 60.0
