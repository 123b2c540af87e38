"""OpenAI tool calls through the rollout server: a reply's <tool_call> blocks come back as `tool_calls` to the real
openai client, the tool's answer goes back as a `tool` message, and the session keeps the exact tokens."""

import json

import openai
import pytest

from factory.config import SFTSpec
from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.server.app import launch_server, parse_tool_calls
from factory.core.sft import run_sft
from factory.envs.protocol import tokens_from_session
from factory.models.build import build_model
from factory.models.tokenizer import tokenizer_for
from factory.problem import Problem

CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "python", "description": "run Python code",
                                           "parameters": {"type": "object",
                                                          "properties": {"code": {"type": "string"}}}}}]


def test_parse_tool_calls():
    content, calls = parse_tool_calls("Let me run it. " + CALL)
    assert content == "Let me run it."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "python", {"code": "print(6*7)"})]
    assert parse_tool_calls(CALL + CALL)[0] is None and len(parse_tool_calls(CALL + CALL)[1]) == 2
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name: stays text
    assert parse_tool_calls("plain answer") == ("plain answer", [])


@pytest.fixture(scope="module")
def tool_caller():
    """A micro model with the ASCII tokenizer taught to answer any question with the same python tool call."""
    tok = tokenizer_for("code")
    model = build_model("micro", tok, seed=0, max_positions=256)
    data = [Problem(id=f"q{i}", prompt=f"Q{i}?", answer=CALL, op="code", digits=0) for i in range(8)]
    run_sft(model, tok, data, SFTSpec(steps=400, batch_size=8, lr=3e-3, stop_at_accuracy=None), seed=0,
            max_new_tokens=len(CALL) + 2)
    engine = ContinuousEngine(model.eval(), tok, max_batch=8, name="tool-caller")
    with launch_server(engine) as handle:
        yield handle


@pytest.mark.slow
def test_tool_calls_reach_the_openai_client_and_the_session_keeps_exact_tokens(tool_caller):
    client = openai.OpenAI(base_url=tool_caller.url + "/v1", api_key="x", max_retries=0, timeout=60,
                           default_headers={"x-session-id": "tools-1"})
    messages = [{"role": "user", "content": "Q1?"}]
    first = client.chat.completions.create(model="tool-caller", messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=len(CALL) + 2)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "python" and json.loads(call.function.arguments) == {"code": "print(6*7)"}
    # Without tools offered, the same text stays text.
    other = openai.OpenAI(base_url=tool_caller.url + "/v1", api_key="x", max_retries=0, timeout=60)
    plain = other.chat.completions.create(model="tool-caller", messages=messages, temperature=0,
                                          max_tokens=len(CALL) + 2)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content == CALL
    # The environment answers the call and asks again, sending the reply back as the client returned it.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    client.chat.completions.create(model="tool-caller", messages=messages, tools=TOOLS, temperature=0, max_tokens=4)
    session = client.get("/../sessions/tools-1", cast_to=object)
    assert [t["continues_turn"] for t in session["turns"]] == [None, 0]  # the second turn extends the first's ids
    ep = tokens_from_session(session)
    tok = tool_caller.engine.tokenizer
    inserted = tok.decode([t for t, m in zip(ep.token_ids, ep.mask, strict=True) if not m], skip_special_tokens=True)
    assert inserted == "42"  # only the tool's output is outside the loss
    first_turn = tok.decode(ep.token_ids[: ep.mask.index(0)], skip_special_tokens=True)
    assert first_turn == CALL  # the model's call, as sampled


@pytest.mark.slow
def test_the_python_tool_environment_runs_calls_in_the_sandbox(tool_caller, require_sandbox):
    import asyncio

    from factory.envs import pool, tasks
    from factory.envs.protocol import run_episodes
    from factory.envs.registry import load_environment

    env = load_environment("python_tool")
    task = {"id": "q1", "prompt": "Q1?", "answer": "42", "op": "word", "digits": 0,
            "sampling": {"temperature": 0, "max_tokens": len(CALL) + 2}}
    before = tasks.sandbox_pool().metrics()["executions"]
    try:
        (result,) = asyncio.run(run_episodes(env, [task], ["py-1"], tool_caller.url, 60))
        executions = tasks.sandbox_pool().metrics()["executions"]
    finally:
        tasks.sandbox_pool().close()
        pool._POOL = None
    # the model only learned to call: after the tool's output its (greedy) reply is no call and no answer
    assert result.info["tool_calls"] == 1 and result.reward == 0.0, result
    assert executions == before + 1  # the call ran in the pool
    client = openai.OpenAI(base_url=tool_caller.url + "/v1", api_key="x", max_retries=0, timeout=60)
    ep = tokens_from_session(client.get("/../sessions/py-1", cast_to=object))
    tok = tool_caller.engine.tokenizer
    inserted = tok.decode([t for t, m in zip(ep.token_ids, ep.mask, strict=True) if not m], skip_special_tokens=True)
    assert inserted == "42\n"  # the tool's output, and nothing the model wrote
    assert ep.turns == 2


@pytest.mark.slow
def test_parallel_tool_calls_false_stops_at_the_first_call_and_the_session_closes_the_turn(tool_caller):
    """Generation stops at `</tool_call>` (a stop string, so no eos was sampled); the next turn continues the exact
    ids with the template's end of message (the built-in template's eos) before the tool's answer."""
    tok = tool_caller.engine.tokenizer
    client = openai.OpenAI(base_url=tool_caller.url + "/v1", api_key="x", max_retries=0, timeout=60,
                           default_headers={"x-session-id": "tools-2"})
    messages = [{"role": "user", "content": "Q2?"}]
    first = client.chat.completions.create(model="tool-caller", messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=len(CALL) + 8, parallel_tool_calls=False).choices[0]
    assert first.finish_reason == "tool_calls" and first.stop_reason == "</tool_call>"
    assert len(first.message.tool_calls) == 1 and tok.eos_token_id not in first.token_ids
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": "42"}]
    second = client.chat.completions.create(model="tool-caller", messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=2).choices[0]
    assert second.prompt_token_ids == (first.prompt_token_ids + first.token_ids + [tok.eos_token_id]
                                       + tok("42", add_special_tokens=False).input_ids)
