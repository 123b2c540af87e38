"""The rollout server's tool-calling rules: `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`.

The tool-call form is Hermes style, as Qwen2.5, Hermes and the ChatML templates write it:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

- `tools`: each `{"type": "function", "function": {"name", "description"?, "parameters"?}}`, names unique and, as
  OpenAI requires, of at most 64 letters, digits, `_` and `-`. `function.strict: true` (schema-exact arguments) is
  refused: arguments are not constrained to the schema.
- `tool_choice`: "auto" (the default when tools are given): tools are shown and `<tool_call>` blocks in the
  reply that call one of `tools` with a JSON object come back as `tool_calls` (any other block stays text).
  "none": tools are neither shown nor parsed (the reply is text).
  "required" and `{"type": "function", "function": {"name": N}}`: the reply is exactly one call to one of `tools`.
  The prompt ends with the start of the call, `<tool_call>\\n{"name": "N", "arguments": `, and generation stops
  at `</tool_call>`. N is the forced name, the lone tool's, or, under "required" with several tools, the model's
  choice among them: a first, constrained step samples one of the names (`name_choices`: each name and its
  closing quote; the request's temperature, greedy at 0) and the call is then forced with it, so a name is never
  invented. The arguments are the model's text, which must parse as a JSON object: a call that ended
  (`</tool_call>` or eos) with anything else is answered as OpenAI answers a model's invalid output, a 500
  `model_error`, never passed on; a call cut by max_tokens comes back as it stands, with
  finish_reason "length". The arguments are not checked against the schema (non-strict function calling).
  A forced name not among `tools`, or a choice without tools, is a 400 naming `tool_choice`.
- `parallel_tool_calls: false`: generation stops at the first `</tool_call>`, so at most one call comes back.
- `response_format`: {"type": "text"} is accepted; "json_object" and "json_schema" need constrained decoding, which
  this server does not do: a 400 naming `response_format` (never silently ignored).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from factory.core.rollout.server.api_models import APIError
from factory.text import clip

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
NAME_PREFILL = f"{CALL_OPEN}\n{{\"name\": \""  # what the prompt ends with while the model picks a name
INVALID_OUTPUT = ("The model produced invalid content. Consider modifying your prompt if you are seeing this error "
                  "persistently.")  # OpenAI's words for it

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
    names: tuple[str, ...] = ()  # the declared functions
    name: str | None = None  # a forced call's function; None while the model is to choose it (`choose`)

    @property
    def choose(self) -> bool:
        """Whether the model picks the forced call's function first ("required" with several tools)."""
        return self.forced and self.name is None

    def with_name(self, name: str) -> ToolPlan:
        """This forced plan with its function chosen: the prompt starts the call with `name`'s arguments."""
        if name not in self.names:
            raise ValueError(f"{name!r} is not among the tools ({', '.join(self.names)})")
        return replace(self, name=name, prefill=NAME_PREFILL + f"{name}\", \"arguments\": ")


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
        if not NAME_PATTERN.fullmatch(fn["name"]):
            raise APIError(400, f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got "
                                f"{clip(fn['name'])!r}", f"{where}.function.name")
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
        return ToolPlan(tools, parse=True, stop=one, names=tuple(names))
    plan = ToolPlan(tools, parse=True, prefill=NAME_PREFILL, forced=True, stop=(CALL_CLOSE,), names=tuple(names))
    if forced_name is None and len(names) == 1:
        forced_name = names[0]
    return plan if forced_name is None else plan.with_name(forced_name)


def name_choices(tokenizer: Any, names: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Per function name, the tokens that follow `NAME_PREFILL` to write it and close its string: the choices of the
    constrained step that picks a forced call's function. A closing quote ends every one and no name holds one
    (`NAME_PATTERN`), so none is a prefix of another."""
    return tuple(tuple(tokenizer(f'{name}"', add_special_tokens=False).input_ids) for name in names)


def forced_call(plan: ToolPlan, text: str, call_id: str) -> tuple[dict[str, Any], bool]:
    """The one tool call of a forced reply, and whether its arguments are a JSON object: `text` is the reply after
    the prompt's `plan.prefill` (`{"name": "N", "arguments": `), cut before `</tool_call>` or at max_tokens. The
    function is the plan's (the prompt wrote it); arguments that do not parse are returned as written."""
    args = text.strip()
    for k in range(len(CALL_CLOSE) - 1, 1, -1):  # cut at max_tokens inside `</tool_call>`: not part of the call
        if args.endswith(CALL_CLOSE[:k]):
            args = args[:-k].rstrip()
            break
    parsed, ok = _json_object(args)
    if not ok and args.endswith("}"):  # the call object's own closing brace after the arguments
        parsed, ok = _json_object(args[:-1].rstrip())
        if not ok and args.count("}") > args.count("{"):
            args = args[:-1].rstrip()
    if ok:
        args = json.dumps(parsed)
    return {"id": call_id, "type": "function", "function": {"name": plan.name or "", "arguments": args}}, ok


def _json_object(text: str) -> tuple[Any, bool]:
    try:
        value = json.loads(text)
    except ValueError:
        return None, False
    return value, isinstance(value, dict)
