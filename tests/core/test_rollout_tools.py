"""Tools in the rollout server's chat template and its tool_choice / parallel_tool_calls / response_format rules."""

from __future__ import annotations

import json

import pytest

from factory.core.rollout.server.api_models import APIError
from factory.core.rollout.server.chat import ChatTemplate, _message_text, parse_tool_calls
from factory.core.rollout.server.tools import (
    CALL_CLOSE,
    NAME_PREFILL,
    check_response_format,
    forced_call,
    name_choices,
    plan_tools,
)
from factory.models.bpe import build_bpe_tokenizer
from tests.core.qwen_template import CLOCK, WEATHER, load_qwen_tokenizer

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def rendered(template: ChatTemplate, messages: list[dict], **kwargs) -> str:
    normal = [_message_text(m, i) for i, m in enumerate(messages)]
    return template.tokenizer.decode(template.render(normal, generation_prompt=True, **kwargs))


def test_a_tool_aware_template_shows_the_schemas_calls_and_results_its_own_way(tmp_path):
    template = ChatTemplate(load_qwen_tokenizer(tmp_path))
    assert template.shows_tools and template.shows_tool_calls
    text = rendered(template, CONVERSATION, tools=[WEATHER, CLOCK])
    # the schemas, as the template writes them (tojson), in its system message
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert json.dumps(WEATHER["function"]["parameters"]) in text and '"name": "get_time"' in text
    # the call through the template (arguments as an object), the tool's answer as a <tool_response>
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # without tools the template shows none
    assert "# Tools" not in rendered(template, CONVERSATION[:1])


def test_a_template_that_ignores_tools_gets_the_fallback_block_in_its_system_message():
    template = ChatTemplate(build_bpe_tokenizer(seed=0))  # plain ChatML: no tools, no tool_calls
    assert template.native and not template.shows_tools and not template.shows_tool_calls
    text = rendered(template, [{"role": "system", "content": "Be brief."}, *CONVERSATION], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in text and "<tool_call></tool_call> XML tags" in text
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' \
        in text  # the call written into the content
    # no system message: one is added for the tools
    assert rendered(template, CONVERSATION[:1], tools=[WEATHER]).startswith("<|im_start|>system\n# Tools\n")


def test_the_prefill_ends_the_prompt(tmp_path):
    template = ChatTemplate(load_qwen_tokenizer(tmp_path))
    plan = plan_tools([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}}, None)
    text = rendered(template, CONVERSATION[:1], tools=plan.tools, prefill=plan.prefill)
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": ')
    # what closes a reply that a stop string (`</tool_call>`) cut before its end-of-message tokens
    assert template.tokenizer.decode(template.closing) == "<|im_end|>\n"


def test_tool_choice_plans():
    auto = plan_tools([WEATHER], None, None)
    assert auto.tools == [WEATHER] and auto.parse and not auto.forced and auto.stop == ()
    assert plan_tools([WEATHER], "auto", False).stop == (CALL_CLOSE,)  # parallel_tool_calls=false: one call
    none = plan_tools([WEATHER], "none", None)
    assert none.tools is None and not none.parse
    assert plan_tools(None, None, None).tools is None
    lone = plan_tools([WEATHER], "required", None)  # one tool: required is that tool
    assert lone.forced and lone.prefill == '<tool_call>\n{"name": "get_weather", "arguments": '
    several = plan_tools([WEATHER, CLOCK], "required", True)
    assert several.forced and several.prefill == '<tool_call>\n{"name": "' and several.stop == (CALL_CLOSE,)
    assert several.choose and several.name is None  # the model picks the function first


@pytest.mark.parametrize(("tools", "choice", "param", "needle"), [
    ([WEATHER], {"type": "function", "function": {"name": "send_mail"}}, "tool_choice.function.name",
     "'send_mail', which is not among tools (get_weather)"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, "tool_choice.function.name", "none given"),
    (None, "required", "tool_choice", "needs tools"),
    ([WEATHER], "always", "tool_choice", "got 'always'"),
    ([WEATHER], {"type": "function"}, "tool_choice", "must be"),
    ([{"type": "retrieval"}], None, "tools.0.type", "must be \"function\""),
    ([{"type": "function", "function": {}}], None, "tools.0.function.name", "non-empty string"),
    ([{"type": "function", "function": {"name": "the weather"}}], None, "tools.0.function.name",
     "letters, digits, underscores or dashes"),
    ([WEATHER, WEATHER], None, "tools.1.function.name", "given twice"),
    ([{"type": "function", "function": {"name": "f", "strict": True}}], None, "tools.0.function.strict",
     "not supported"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools.0.function.parameters",
     "JSON Schema"),
])
def test_bad_tool_choices_and_tools_are_refused_naming_the_field(tools, choice, param, needle):
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice, None)
    assert e.value.status == 400 and e.value.param == param and needle in str(e.value)


def test_response_format():
    check_response_format(None)
    check_response_format({"type": "text"})
    for kind in ("json_object", "json_schema"):
        with pytest.raises(APIError) as e:
            check_response_format({"type": kind, "json_schema": {"name": "x", "schema": {}}})
        assert e.value.param == "response_format" and "does not constrain decoding" in str(e.value)
    with pytest.raises(APIError) as e:
        check_response_format({"type": "yaml"})
    assert e.value.param == "response_format.type"


def test_forced_calls_are_read_however_the_reply_ended():
    forced = plan_tools([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert forced.prefill == '<tool_call>\n{"name": "get_weather", "arguments": '
    call, ok = forced_call(forced, '{"city": "Paris"}}\n', "call_x")
    assert ok and call == {"id": "call_x", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert forced_call(forced, '{"city": "Paris"}}\n</tool', "c")[0]["function"]["arguments"] == '{"city": "Paris"}'
    # cut at max_tokens, or not JSON: the arguments as the model wrote them, and not ok
    assert forced_call(forced, '{"city": "Pa', "c") == ({"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Pa'}}, False)
    assert forced_call(forced, "sunny}", "c")[0]["function"]["arguments"] == "sunny"
    assert not forced_call(forced, "[1, 2]}", "c")[1]  # JSON, but not an object
    # whatever the reply writes, the function is the one the prompt named (a duplicate "name" key included)
    call, ok = forced_call(forced, '{}, "name": "Paris"}', "c")
    assert call["function"]["name"] == "get_weather" and not ok


def test_a_required_call_among_several_tools_chooses_a_declared_name(tmp_path):
    tok = load_qwen_tokenizer(tmp_path)
    several = plan_tools([WEATHER, CLOCK], "required", None)
    assert several.choose and several.prefill == NAME_PREFILL and several.names == ("get_weather", "get_time")
    choices = name_choices(tok, several.names)
    assert [tok.decode(c) for c in choices] == ['get_weather"', 'get_time"']
    assert not any(a[: len(b)] == b for a in choices for b in choices if a != b)  # none is a prefix of another
    chosen = several.with_name("get_time")
    assert not chosen.choose and chosen.prefill == '<tool_call>\n{"name": "get_time", "arguments": '
    with pytest.raises(ValueError, match="not among the tools"):
        several.with_name("Paris")


def test_auto_calls_to_undeclared_functions_stay_text():
    text = '<tool_call>{"name": "the weather in Paris", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, ("get_weather",)) == (text, [])
    assert parse_tool_calls(text)[1][0]["function"]["name"] == "the weather in Paris"  # no names: any is taken


def test_smollm2s_chatml_template_gets_the_tools_block_and_its_tokens_have_distinct_bytes(smollm2_dir):
    from transformers import AutoTokenizer

    from factory.core.rollout.server.logprobs import TokenBytes

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    template = ChatTemplate(tok)
    assert template.native and not template.shows_tools  # its template ignores tools: the fallback shows them
    text = rendered(template, CONVERSATION, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(WEATHER) in text
    assert "named SmolLM" not in text  # the tools' system message stands in for the template's default one
    tb = TokenBytes(tok)
    names = {tb.name(i) for i in range(len(tok))}
    assert len(names) == len(tok)  # top-logprob keys never collide
    assert sum(name.startswith("bytes:") for name in names) > 0
