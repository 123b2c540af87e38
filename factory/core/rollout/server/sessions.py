"""Rollout-server sessions: the turns (exact prompt and completion ids, logprobs, versions) recorded per session id.

A request names its session with the `X-Session-Id` header or a `session_id` body field; every choice it returns
is recorded as a `Turn`. The store keeps the most recently used `max_sessions` sessions.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Turn:
    endpoint: str  # "completions" or "chat"
    choice: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    weight_version: int
    finish_reason: str
    text: str
    messages: list[dict[str, str]] | None = None  # chat: the request's messages (normalized)
    continues_turn: int | None = None  # chat: the turn whose exact ids start this prompt
    reply: dict[str, str] | None = None  # chat: the reply as a normalized assistant message (tool calls parsed)
    created: float = field(default_factory=time.time)

    def to_json(self, index: int) -> dict:
        return {"turn": index, **{k: v for k, v in vars(self).items()}}


class SessionStore:
    """Turns recorded per session id, the least recently used sessions dropped past `max_sessions`."""

    def __init__(self, max_sessions: int = 10_000):
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, list[Turn]] = OrderedDict()

    def get(self, sid: str) -> list[Turn] | None:
        turns = self._sessions.get(sid)
        if turns is not None:
            self._sessions.move_to_end(sid)
        return turns

    def add(self, sid: str, turns: list[Turn]) -> int:
        """Record turns; return the index of the first."""
        rec = self._sessions.setdefault(sid, [])
        self._sessions.move_to_end(sid)
        first = len(rec)
        rec.extend(turns)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return first

    def delete(self, sid: str) -> bool:
        return self._sessions.pop(sid, None) is not None
