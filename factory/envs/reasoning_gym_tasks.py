"""reasoning-gym tasks: any of its procedural datasets by name, as rows, and the `reasoning_gym` verifier.

A dataset is `reasoning_gym.create_dataset(task, seed=seed, size=size, **config)`; its entry i is a pure
function of (task, config, seed, i) (reasoning-gym seeds each entry with `seed + i`), so rows are made on
demand and the verifier can make the very entry it scores again from what the row's meta names.

Prompt: the entry's question, then `ANSWER_INSTRUCTION` (reasoning-gym's own prompts ask for the final answer
between `<answer>` tags; the tag form is what its `extract_answer` reads), or the source's own `instruction`
line ("" for the question alone). The reward is the task's own
`score_answer(extracted answer, entry)`, clipped to [0, 1]. The answer is the last `<answer>...</answer>`
content, stripped (`reasoning_gym.utils.extract_answer`); a completion without one answers nothing (0), except
where the entry's answer is a number: then its last number is the answer. Small chat models rarely write the
tags (SmolLM2-135M-Instruct wrote none in 96 tries, docs/results.md) but often end on the number, so a numeric
task still gives them a learning signal.

Row meta (JSON-safe): `rg_task`, `rg_config`, `rg_seed`, `rg_size`, `rg_index` (which entry), and the entry's
`rg_metadata` (JSON-safe copy, for reading; scoring uses the regenerated entry, whose metadata keeps its types).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
from importlib import metadata
from typing import Any

from factory.problem import Problem

EXTRA = "real"  # the pyproject extra that installs reasoning-gym
ANSWER_INSTRUCTION = "Give only your final answer between <answer> and </answer> tags."
_RESERVED = ("seed", "size")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # reasoning-gym config fields that are the source's own fields


def _rg():
    try:
        import reasoning_gym  # noqa: PLC0415 optional: the `real` extra; only reasoning_gym sources need it
        import reasoning_gym.factory  # noqa: PLC0415 as above
        import reasoning_gym.utils  # noqa: PLC0415 as above
    except ImportError as e:
        raise ImportError(f"reasoning_gym sources need the reasoning-gym package: pip install "
                          f"'factory[{EXTRA}]'") from e
    return reasoning_gym


def rg_version() -> str:
    """The installed reasoning-gym's version (its distribution's: the module's __version__ lags)."""
    _rg()
    return metadata.version("reasoning-gym")


def rg_config_problem(task: Any, config: Any) -> str | None:
    """What is wrong with a reasoning-gym task name and config, as `<field>: <why>` (field `task` or
    `config[.key]`), or None when `create_dataset` accepts them (the config's own checks included)."""
    registry = _rg().factory.DATASETS
    if not isinstance(task, str) or task not in registry:
        close = difflib.get_close_matches(str(task), list(registry), n=3)
        hint = f"did you mean {', '.join(map(repr, close))}" if close else "see reasoning_gym.factory.DATASETS"
        return f"task: unknown reasoning-gym task {task!r} ({hint})"
    if not isinstance(config, dict):
        return f"config: must be a mapping of {task}'s config fields, got {type(config).__name__}"
    fields = [f.name for f in dataclasses.fields(registry[task][1]) if f.name not in _RESERVED]
    for key in config:
        if key in _RESERVED:
            return f"config.{key}: set the source's own `{key}`, not the config's"
        if key not in fields:
            return (f"config.{key}: not a config field of reasoning-gym task {task!r}; its fields are "
                    f"{', '.join(fields)}")
    try:
        _dataset(task, json.dumps(config, sort_keys=True), 0, 1)
    except Exception as e:  # noqa: BLE001 - reasoning-gym's checks are asserts and ValueErrors, any is a bad config
        return f"config: reasoning-gym task {task!r} refuses it: {type(e).__name__}: {e}"
    return None


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_json: str, seed: int, size: int) -> Any:
    return _rg().create_dataset(task, seed=seed, size=size, **json.loads(config_json))


@functools.lru_cache(maxsize=4096)
def rg_entry(task: str, config_json: str, seed: int, size: int, index: int) -> dict[str, Any]:
    """Entry `index` of the dataset (a dict with question, answer, metadata)."""
    return _dataset(task, config_json, seed, size)[index]


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))  # tuples become lists, anything else exotic its repr


def rg_problem(task: str, config: dict[str, Any], seed: int, size: int, index: int, source: str,
               verifier: str = "reasoning_gym", instruction: str | None = None) -> Problem:
    """Entry `index` as a row: the question plus `instruction` (default `ANSWER_INSTRUCTION`; "" adds nothing),
    the entry's answer, and in meta what the verifier needs to make the entry again."""
    config_json = json.dumps(config, sort_keys=True)
    e = rg_entry(task, config_json, seed, size, index)
    meta = {"source": source, "verifier": verifier, "rg_task": task, "rg_config": config_json, "rg_seed": seed,
            "rg_size": size, "rg_index": index, "rg_metadata": _json_safe(e.get("metadata", {}))}
    # op names the verifier: tasks.verify dispatches on it (math_verify may score a reasoning-gym row too)
    line = ANSWER_INSTRUCTION if instruction is None else instruction
    return Problem(id=f"{task}/{seed}/{index}", prompt=f"{e['question']}\n{line}" if line else e["question"],
                   answer=str(e["answer"]), op=verifier, digits=0, meta=meta)


def rg_answer(completion: str, gold: str) -> str | None:
    """The completion's answer: its last `<answer>` content; without one, its last number if `gold` is a number;
    else None."""
    tagged = _rg().utils.extract_answer(completion)
    if tagged is not None or not _NUMBER.fullmatch(gold.strip()):
        return tagged
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def rg_reward(completion: str, problem: Problem) -> float:
    """The task's own `score_answer` on the completion's answer (`rg_answer`), clipped to [0, 1]."""
    m = problem.meta
    entry = rg_entry(m["rg_task"], m["rg_config"], int(m["rg_seed"]), int(m["rg_size"]), int(m["rg_index"]))
    dataset = _dataset(m["rg_task"], m["rg_config"], int(m["rg_seed"]), int(m["rg_size"]))
    score = float(dataset.score_answer(rg_answer(completion, str(entry["answer"])), entry))
    return min(1.0, max(0.0, score)) if score == score else 0.0
