"""A tokenizer directory with a Qwen2.5-style, tool-aware chat template, for the rollout server's tool tests.

The template (`qwen25_template.jinja`) is Qwen2.5-Instruct's (tools listed as JSON in the system message,
assistant tool calls written as `<tool_call>` blocks, tool results as `<tool_response>` in a user turn) without
its default system prompt text.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from factory.models.bpe import build_bpe_tokenizer

QWEN25_TEMPLATE = (Path(__file__).parent / "qwen25_template.jinja").read_text().strip()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "the time now",
                                          "parameters": {"type": "object", "properties": {}}}}


def qwen_tokenizer_dir(path: Path) -> Path:
    """Save `factory bpe-model`'s byte-level BPE tokenizer with the Qwen2.5-style template to `path`."""
    tok = build_bpe_tokenizer(seed=0)
    tok.chat_template = QWEN25_TEMPLATE
    tok.save_pretrained(path)
    return path


def load_qwen_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir(path))
