"""The rollout server's tool-calling rules: `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`.

The tool-call form is Hermes style, as Qwen2.5, Hermes and the ChatML templates write it:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

- `tools`: each `{"type": "function", "function": {"name", "description"?, "parameters"?}}`, names unique.
  `function.strict: true` (schema-exact arguments) is refused: arguments are not constrained to the schema.
- `tool_choice`: "auto" (the default when tools are given): tools are shown and `<tool_call>` blocks in the
  reply come back as `tool_calls`. "none": tools are neither shown nor parsed (the reply is text).
  "required" and `{"type": "function", "function": {"name": N}}`: the reply is a tool call: the prompt ends with
  the start of one (`<tool_call>\\n{"name": "` or, for a forced N or a lone tool, `<tool_call>\\n{"name": "N",
  "arguments": `), generation stops at `</tool_call>`, and exactly one call comes back. As OpenAI documents for
  non-strict function calling, its arguments are the model's text (normally a JSON object; not checked against
  the schema) and, under "required" with several tools, its name is the model's choice. A forced name not among
  `tools`, or a choice without tools, is a 400 naming `tool_choice`.
- `parallel_tool_calls: false`: generation stops at the first `</tool_call>`, so at most one call comes back.
- `response_format`: {"type": "text"} is accepted; "json_object" and "json_schema" need constrained decoding, which
  this server does not do: a 400 naming `response_format` (never silently ignored).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from factory.core.rollout.api_models import APIError
from factory.text import clip

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# What the prompt shows when the model's chat template ignores `tools` (Qwen2.5's own wording, appended to the
# system message), so that a ChatML model without tool support in its template still sees the schemas.
FALLBACK_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
FALLBACK_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call>"
)


def fallback_tools_text(tools: list[dict[str, Any]]) -> str:
    """The tools block a template that ignores `tools` gets in its system message."""
    return FALLBACK_TOOLS_HEADER + "".join("\n" + json.dumps(t) for t in tools) + FALLBACK_TOOLS_FOOTER


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: what the prompt shows, the text the reply starts with, extra stop
    strings, and whether the reply's calls are parsed."""

    tools: list[dict[str, Any]] | None  # shown in the prompt (None: no tools)
    parse: bool  # turn <tool_call> blocks of the reply into tool_calls
    prefill: str = ""  # appended to the prompt: the reply's first characters
    forced: bool = False  # the reply must be (exactly one) tool call
    stop: tuple[str, ...] = ()


def check_response_format(value: Any) -> None:
    """Accept `{"type": "text"}` (or nothing); refuse what would need constrained decoding."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise APIError(400, f"response_format type {kind!r} is not supported: this server does not constrain "
                            "decoding to JSON; use {\"type\": \"text\"} and validate the reply", "response_format")
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {clip(kind)!r}",
                   "response_format.type")


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The request's tools, checked: each a function with a unique string name."""
    seen: set[str] = set()
    for i, t in enumerate(tools or []):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise APIError(400, f"{where}.type must be \"function\"", f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON Schema object",
                           f"{where}.function.parameters")
        if fn.get("strict"):
            raise APIError(400, f"{where}.function.strict=true is not supported: this server does not constrain "
                                "arguments to the schema", f"{where}.function.strict")
        if fn["name"] in seen:
            raise APIError(400, f"{where}.function.name {clip(fn['name'])!r} is given twice", f"{where}.function.name")
        seen.add(fn["name"])
    return list(tools or [])


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    """The `ToolPlan` of a request (see the module docstring); APIError naming the field at fault."""
    tools = check_tools(tools)
    names = [t["function"]["name"] for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    forced_name: str | None = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        forced_name = fn["name"]
        if forced_name not in names:
            raise APIError(400, f"tool_choice names function {clip(forced_name)!r}, which is not among tools "
                                f"({', '.join(names) or 'none given'})", "tool_choice.function.name")
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or a function, got "
                            f"{clip(choice)!r}", "tool_choice")
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice \"required\" needs tools", "tool_choice")
    if not tools or choice == "none":
        return ToolPlan(None, parse=False)
    one = (CALL_CLOSE,) if parallel_tool_calls is False else ()
    if choice == "auto":
        return ToolPlan(tools, parse=True, stop=one)
    if forced_name is None and len(names) == 1:
        forced_name = names[0]
    prefill = f"{CALL_OPEN}\n{{\"name\": " + (
        f"{json.dumps(forced_name)}, \"arguments\": " if forced_name is not None else "\"")
    return ToolPlan(tools, parse=True, prefill=prefill, forced=True, stop=(CALL_CLOSE,))


def forced_call(prefill: str, text: str, call_id: str) -> dict[str, Any]:
    """The one tool call of a forced reply: `prefill` (the prompt's start of the call) + `text` (the reply, cut
    before `</tool_call>` or at max_tokens). Arguments that do not parse as a JSON object are returned as written."""
    body = (prefill + text)[len(CALL_OPEN):].strip()
    for k in range(len(CALL_CLOSE) - 1, 1, -1):  # cut at max_tokens inside `</tool_call>`: not part of the call
        if body.endswith(CALL_CLOSE[:k]):
            body = body[:-k].rstrip()
            break
    name, args = "", body
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        name = obj["name"]
        args = obj.get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args)
    else:  # unfinished or malformed JSON: read the name and the arguments' text from where the prefill put them
        head = '{"name": "'
        rest = body[len(head):] if body.startswith(head) else body
        name, _, after = rest.partition('"')
        after = after.lstrip()
        marker = ', "arguments": '
        args = after[len(marker):] if after.startswith(marker) else after.lstrip(",").strip()
        args = args.rstrip()
        if args.endswith("}") and args.count("}") > args.count("{"):  # the call object's own closing brace
            args = args[:-1].rstrip()
        try:
            parsed = json.loads(args)
            if isinstance(parsed, dict):
                args = json.dumps(parsed)
        except ValueError:
            pass
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
