"""The rollout server's chat side: messages to prompt ids (the chat template) and Hermes-style tool calls.

Chat template for tokenizers without one (our character tokenizers): `<bos>`, then each message's content
tokens in order, with `<eos>` after every assistant message; nothing is added for the reply. So a single user
message gives exactly the completions prompt of its text. Roles are not marked (the character vocabularies have
no role tokens) and `tools` are not shown: such a model is not a chat model, and learns its tool calls from its
environment's prompts. Tokenizers with a `chat_template` use it (`apply_chat_template`, add_generation_prompt=True).

Tools through a real template: `tools` are passed to `apply_chat_template(tools=...)` and an assistant message's
`tool_calls` go in as structured calls (arguments as objects), so a template that shows them (Qwen2.5, Llama 3.1,
Hermes) renders them its own way. Whether a template shows them is found once by rendering a probe. A template
that ignores `tools` (plain ChatML, e.g. SmolLM2's) gets them as text instead: the tools block of `tools.py`
(Qwen2.5's wording) at the end of the system message (a system message is added when there is none), and tool
calls written into the assistant's content.

Tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in a reply come back as OpenAI
`tool_calls`; an assistant message with `tool_calls` sent back renders to that text (or through the template).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection, Mapping
from typing import Any

from factory.core.rollout.server.api_models import APIError
from factory.core.rollout.server.tools import fallback_tools_text
from factory.text import clip


def _message_text(msg: dict[str, Any], i: int) -> dict[str, str]:
    """A message (a `ChatMessage` dumped, or a reply built here) normalized to role and content text, its tool calls
    as canonical JSON (`tool_calls`: compared between requests, rendered by `ChatTemplate`) and a tool message's
    `tool_call_id`/`name`; APIError naming `messages.<i>....` when it cannot be rendered."""
    role = msg.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise APIError(400, f"messages.{i}.role must be system, user, assistant or tool, got {clip(role)!r}",
                       f"messages.{i}.role")
    content = msg.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):  # content parts: only text is supported
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages.{i}.content: only text parts are supported", f"messages.{i}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise APIError(400, f"messages.{i}.content must be a string or a list of text parts", f"messages.{i}.content")
    out = {"role": role, "content": content}
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(msg.get(key), str):
                out[key] = msg[key]
    if role == "assistant" and msg.get("tool_calls"):
        calls = []
        for k, c in enumerate(msg["tool_calls"]):
            fn = c["function"]
            where = f"messages.{i}.tool_calls.{k}.function.arguments"
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise APIError(400, f"{where} must be a JSON object written as a string, got "
                                    f"{clip(fn.get('arguments'))!r}", where)
            calls.append({"name": fn["name"], "arguments": args})
        out["tool_calls"] = json.dumps(calls, sort_keys=True)
    return out


def _calls(msg: dict[str, str]) -> list[dict[str, Any]]:
    return json.loads(msg["tool_calls"]) if msg.get("tool_calls") else []


def _flat_content(msg: dict[str, str]) -> str:
    """A message's content with its tool calls written in (Hermes style): for templates that do not show calls."""
    return msg["content"] + "".join(_tool_call_text(c) for c in _calls(msg))


TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def _tool_call_text(call: dict[str, Any]) -> str:
    """How a tool call is written in the conversation (Hermes style): what the model emits, and what an assistant
    message with tool_calls renders to."""
    return f"<tool_call>{json.dumps({'name': call['name'], 'arguments': call['arguments']})}</tool_call>"


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """Tool calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in a reply: the text
    around them and the calls in OpenAI's shape. A block that is not such JSON, or (given `names`, the declared
    functions) that calls another function, stays text."""
    calls, kept, pos = [], [], 0
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            continue
        if names is not None and obj["name"] not in names:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{secrets.token_hex(8)}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args)}})
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def _same_reply(sent: dict[str, str], reply: dict[str, str], raw_text: str) -> bool:
    """Whether an assistant message a client sent back is the reply this turn gave: the same content and the same
    tool calls (ids and JSON formatting aside), or the raw text itself."""
    if sent.get("role") != "assistant":
        return False
    if "tool_calls" in reply or "tool_calls" in sent:
        return sent.get("tool_calls") == reply.get("tool_calls") and \
            (sent["content"] == reply["content"])
    return sent["content"] in (reply["content"], raw_text)


_PROBE = "factory_probe_fn_7c1e"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


class ChatTemplate:
    """Renders messages to prompt token ids (see the module docstring for the built-in template and tools)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.native = bool(getattr(tokenizer, "chat_template", None))
        hi = {"role": "user", "content": "hi"}
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": _PROBE, "arguments": {}}}]}
        # Whether the template itself writes `tools` / an assistant's `tool_calls` into the prompt.
        self.shows_tools = self.native and _PROBE in self._text([hi], tools=[_PROBE_TOOL])
        self.shows_tool_calls = self.native and _PROBE in self._text([hi, call])
        self.closing = self._closing()

    def _closing(self) -> list[int]:
        """The ids the template writes after an assistant message's content (ChatML: `<|im_end|>\\n`): what closes a
        recorded turn that ended without them (a stop string, max_tokens) when a session continues it."""
        tok = self.tokenizer
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        if not self.native:
            return eos
        text = self._text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}])
        if _PROBE not in text:
            return eos
        return list(tok(text[text.index(_PROBE) + len(_PROBE):], add_special_tokens=False).input_ids)

    def _text(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception:  # a template that refuses the probe does not show it
            return ""

    def render(self, messages: list[dict[str, str]], generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None, prefill: str = "") -> list[int]:
        """Prompt ids of `messages` (with `tools` shown when given), then `prefill` (the reply's forced start)."""
        tok = self.tokenizer
        tail = _encode(tok, prefill, special=False, field="tool_choice") if prefill else []
        if not self.native:
            out = [tok.bos_token_id] if tok.bos_token_id is not None else []
            for i, m in enumerate(messages):
                out += _encode(tok, _flat_content(m), special=False, field=f"messages.{i}.content")
                if m["role"] == "assistant":
                    out.append(tok.eos_token_id)
            return out + tail
        plain: list[dict[str, Any]] = []
        for m in messages:
            if self.shows_tool_calls and m.get("tool_calls"):
                plain.append({"role": m["role"], "content": m["content"],
                              "tool_calls": [{"type": "function", "function": c} for c in _calls(m)]})
            else:
                extra = {k: m[k] for k in ("tool_call_id", "name") if k in m}
                plain.append({"role": m["role"], "content": _flat_content(m), **extra})
        kwargs: dict[str, Any] = {}
        if tools and self.shows_tools:
            kwargs["tools"] = tools
        elif tools:  # the template ignores tools: the fallback block goes in the system message
            block = fallback_tools_text(tools)
            if plain and plain[0]["role"] == "system":
                plain[0] = {**plain[0], "content": (plain[0]["content"] + "\n\n" + block).lstrip("\n")}
            else:
                plain.insert(0, {"role": "system", "content": block})
        try:
            ids = tok.apply_chat_template(plain, add_generation_prompt=generation_prompt, tokenize=True, **kwargs)
        except Exception as e:  # the template's own checks (e.g. roles must alternate)
            raise APIError(400, f"messages: the chat template cannot render them: {type(e).__name__}: "
                                f"{clip(str(e))}", "messages") from e
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids) + tail


def _encode(tokenizer, text: str, special: bool = True, field: str = "prompt") -> list[int]:
    try:
        return list(tokenizer(text, add_special_tokens=special).input_ids)
    except Exception as e:  # e.g. a character outside a character tokenizer's alphabet
        raise APIError(400, f"the tokenizer cannot encode {clip(text, 40)!r}: {clip(str(e))}", field) from e
