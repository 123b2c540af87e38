"""Tools, tool_choice and log-probs through the real rollout server on 127.0.0.1, called with the openai client and
its response models validated strictly (no coercion: every field present with its exact type)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion
from transformers import AutoConfig, AutoModelForCausalLM

from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.server.app import launch_server
from factory.core.rollout.server.tools import CALL_CLOSE
from tests.core.qwen_template import CLOCK, WEATHER, load_qwen_tokenizer

QUESTION = [{"role": "user", "content": "What is the weather in Paris? Café, 中文, 🙂"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny random Qwen2 (hidden 32, 2 layers) with a byte-level BPE tokenizer and a Qwen2.5-style template."""
    tok = load_qwen_tokenizer(tmp_path_factory.mktemp("qwen-tok"))
    config = AutoConfig.for_model("qwen2", vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                  max_position_embeddings=1024, tie_word_embeddings=True,
                                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with launch_server(ContinuousEngine(model, tok, max_batch=8, name="qwen-tools")) as handle:
        yield handle


def client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=60)


def strict_chat(handle, **kwargs) -> tuple[ChatCompletion, dict]:
    """The typed response and its raw JSON, which must validate against openai's model with strict=True."""
    raw = client(handle).chat.completions.with_raw_response.create(model="qwen-tools", **kwargs)
    data = raw.http_response.json()
    ChatCompletion.model_validate(data, strict=True)
    return raw.parse(), data


def generated_text(tok, choice) -> str:
    """The text the sampled tokens make, cut before the stop string that ended it (what logprobs join up to)."""
    text = tok.decode(choice.token_ids, skip_special_tokens=True)
    stop = choice.stop_reason
    return text[: text.find(stop)] if isinstance(stop, str) else text


def assert_logprobs_join_up(tok, choice, k: int) -> None:
    text = generated_text(tok, choice)
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == text
    assert bytes(b for e in entries for b in e.bytes).decode(errors="replace") == text
    # the listed tokens are the first non-special ones (special tokens and a stop string's tail are left out)
    plain = [i for i, t in enumerate(choice.token_ids) if t not in tok.all_special_ids]
    assert [e.logprob for e in entries] == [choice.token_logprobs[i] for i in plain[: len(entries)]]
    for e in entries:  # every alternative has its own key and its true bytes
        assert len(e.top_logprobs) == k and len({a.token for a in e.top_logprobs}) == k
        assert len({bytes(a.bytes) for a in e.top_logprobs}) == k


@pytest.mark.parametrize(("tool_choice", "parallel"), [
    ("auto", None), ("auto", False), ("none", None), ("required", None), ("required", False),
    ({"type": "function", "function": {"name": "get_weather"}}, None),
])
def test_tool_answers_pass_the_openai_clients_strict_models(server, tool_choice, parallel):
    tok = server.engine.tokenizer
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r, data = strict_chat(server, messages=QUESTION, tools=[WEATHER, CLOCK], tool_choice=tool_choice, n=3,
                          max_tokens=24, temperature=1.0, seed=5, logprobs=True, top_logprobs=3, **extra)
    assert len(r.choices) == 3
    for c in r.choices:
        prompt = tok.decode(c.prompt_token_ids)
        assert ('"name": "get_weather"' in prompt) == (tool_choice != "none")  # the schemas reach the prompt
        if tool_choice == "none":
            assert c.message.tool_calls is None and isinstance(c.message.content, str)
        if tool_choice not in ("auto", "none"):  # the reply is exactly one call, started by the prompt
            (call,) = c.message.tool_calls
            # required: the model picked one of the tools (never an invented name) and the prompt wrote it
            assert call.function.name in (("get_weather",) if isinstance(tool_choice, dict) else
                                          ("get_weather", "get_time"))
            assert prompt.endswith(f'<|im_start|>assistant\n<tool_call>\n{{"name": "{call.function.name}", '
                                   '"arguments": ')
            assert c.finish_reason in ("tool_calls", "length") and c.message.content is None
            assert call.type == "function" and isinstance(call.function.arguments, str)
            if c.finish_reason == "tool_calls":  # a finished call's arguments are a JSON object
                assert c.stop_reason in (CALL_CLOSE, tok.eos_token_id)
                assert isinstance(json.loads(call.function.arguments), dict)
        if parallel is False:
            assert len(c.message.tool_calls or []) <= 1
        assert_logprobs_join_up(tok, c, 3)
    assert data["object"] == "chat.completion" and all(c["logprobs"]["refusal"] is None for c in data["choices"])


def test_chat_logprobs_join_up_to_the_content_and_completions_to_the_text(server):
    tok = server.engine.tokenizer
    r, _ = strict_chat(server, messages=QUESTION, n=4, max_tokens=16, temperature=1.0, seed=11, logprobs=True,
                       top_logprobs=5)
    for c in r.choices:
        assert generated_text(tok, c) == c.message.content
        assert_logprobs_join_up(tok, c, 5)
    raw = client(server).completions.with_raw_response.create(model="qwen-tools", prompt="Café 中", max_tokens=12, n=4,
                                                              temperature=1.0, seed=3, logprobs=4)
    data = raw.http_response.json()
    OpenAICompletion.model_validate(data, strict=True)
    for c in raw.parse().choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert all(len(alts) == 4 for alts in lp.top_logprobs)  # distinct keys: none collapsed


def test_a_stop_string_cut_mid_token_lists_only_the_text_part(server):
    base = dict(model="qwen-tools", prompt="Weather in Paris", max_tokens=24, temperature=1.0, seed=1, logprobs=0,
                extra_body={"ignore_eos": True})
    full = client(server).completions.create(**base).choices[0]
    pieces = full.logprobs.tokens
    # a stop string that starts inside a token of two or more characters (same seed: the same tokens again)
    at = next(i for i, p in enumerate(pieces) if len(p) >= 2 and i > 0)
    start = sum(len(p) for p in pieces[:at]) + 1
    stop = full.text[start:start + 3]
    cut = client(server).completions.create(stop=[stop], **base).choices[0]
    assert cut.text == full.text[: full.text.find(stop)]
    assert "".join(cut.logprobs.tokens) == cut.text
    last = len(cut.logprobs.tokens) - 1
    assert cut.logprobs.tokens[last] != pieces[last] and pieces[last].startswith(cut.logprobs.tokens[last])
    assert len(cut.logprobs.tokens) < len(cut.token_ids)  # the rest of the stop string's tokens are not listed
    assert cut.logprobs.token_logprobs == cut.token_logprobs[: last + 1]


def test_refusals_reach_the_openai_client_naming_the_field(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="qwen-tools", messages=QUESTION, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "send_mail"}})
    assert e.value.body["param"] == "tool_choice.function.name" and "send_mail" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="qwen-tools", messages=QUESTION, response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="qwen-tools", prompt="x", extra_body={"response_format": {"type": "json_schema"}})
    assert e.value.body["param"] == "response_format"
    ok = c.chat.completions.create(model="qwen-tools", messages=QUESTION, response_format={"type": "text"},
                                   max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


def test_a_forced_call_sent_back_renders_through_the_template(server):
    """The call goes back as a structured call with the tool's answer; the template renders both its own way."""
    tok = server.engine.tokenizer
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60,
                      default_headers={"x-session-id": "tools-qwen"})
    first = c.chat.completions.create(model="qwen-tools", messages=QUESTION, tools=[CLOCK], tool_choice="required",
                                      max_tokens=8, temperature=0)
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    call.function.arguments = '{"tz": "UTC"}'  # the environment's reading of whatever the random model wrote
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    second = c.chat.completions.create(model="qwen-tools", messages=messages, tools=[CLOCK], max_tokens=2,
                                       temperature=0)
    prompt = tok.decode(second.choices[0].prompt_token_ids)
    assert "<tool_response>\n12:00\n</tool_response>" in prompt and json.dumps(CLOCK) in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
            '<|im_end|>') in prompt


def test_a_turn_cut_by_a_stop_string_is_closed_by_the_template_when_the_session_goes_on(server):
    tok = server.engine.tokenizer
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60,
                      default_headers={"x-session-id": "stop-closing"})
    sampling = dict(model="qwen-tools", max_tokens=12, temperature=1.0, seed=2, extra_body={"ignore_eos": True})
    probe = c.chat.completions.create(messages=QUESTION, **sampling).choices[0].message.content
    stop = probe[len(probe) // 2:][:2]  # a string the same seeded sample reaches part-way
    first = c.chat.completions.create(messages=QUESTION, stop=[stop], **sampling).choices[0]
    assert first.finish_reason == "stop" and first.stop_reason == stop
    messages = [*QUESTION, {"role": "assistant", "content": first.message.content},
                {"role": "user", "content": "And in Rome?"}]
    second = c.chat.completions.create(messages=messages, **sampling).choices[0]
    closing = tok("<|im_end|>\n", add_special_tokens=False).input_ids
    new_turn = tok("<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False).input_ids
    assert second.prompt_token_ids == first.prompt_token_ids + first.token_ids + closing + new_turn


def test_required_among_two_tools_never_invents_a_name(server):
    """Sampled at temperature 1 from a random model, which left to itself writes any name: every call of six
    requests (two samples each) is to one of the two tools, and the prompt shows that the call was started with it."""
    tok = server.engine.tokenizer
    seen = set()
    for seed in range(6):
        r, _ = strict_chat(server, messages=QUESTION, tools=[WEATHER, CLOCK], tool_choice="required", n=2,
                           max_tokens=6, temperature=1.0, seed=seed)
        for c in r.choices:
            (call,) = c.message.tool_calls
            assert call.function.name in ("get_weather", "get_time"), call.function.name
            assert tok.decode(c.prompt_token_ids).endswith(f'{{"name": "{call.function.name}", "arguments": ')
            seen.add(call.function.name)
    assert seen == {"get_weather", "get_time"}  # a choice, not a fixed pick


def test_a_finished_call_whose_arguments_are_not_json_is_openais_model_error(server):
    """A call that ended (here: every token is a stop token, so it ends after one) with arguments that are not a
    JSON object is never passed on: the openai client gets the 500 `model_error` OpenAI answers with."""
    tok = server.engine.tokenizer
    stops = [t for t in range(len(tok)) if not tok.decode([t]).strip().startswith("{")]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(openai.InternalServerError) as e:
            client(server).chat.completions.create(
                model="qwen-tools", messages=QUESTION, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=4,
                temperature=0, extra_body={"stop_token_ids": stops})
        assert e.value.body["type"] == "model_error" and "The model produced invalid content" in e.value.message
        assert "not a JSON object" in e.value.message
    assert httpx.get(server.url + "/health").status_code == 200
