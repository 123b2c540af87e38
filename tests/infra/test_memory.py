"""factory/infra/memory.py: a spec whose one step cannot fit this machine's memory is refused by `factory validate`
and `factory run` before anything is written, one line naming the field to change; specs that fit pass. The bound
is computed from the spec and the model (a preset, or a real config.json), against memory given here or read from
this machine (MemTotal, the cgroup's limit, RLIMIT_AS in a child process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from factory.config import apply_overrides, load_spec
from factory.infra.memory import (
    GIB,
    Memory,
    decoder_params,
    host_memory,
    memory_problem,
    model_dims,
    step_need,
)

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
LONG = {"model.max_positions": 8192, "rollout.max_new_tokens": 8000}  # completions of up to 8000 tokens


def gib(n: float) -> Memory:
    return Memory(int(n * GIB), "given")


def spec(**overrides):
    return apply_overrides(load_spec(QUICKSTART), {k.replace("__", "."): v for k, v in overrides.items()})


def test_the_quickstart_fits_in_a_gibibyte():
    s = load_spec(QUICKSTART)
    need = step_need(s, model_dims(s.model))
    # 256 samples x 9 tokens x 37 bytes; 16 bytes x the tiny preset's 851,968 projection weights; 128 samples x 9
    # tokens x 128 x 4 layers x 4 bytes of activations
    assert (need.batch, need.state, need.activations) == (256 * 9 * 37, 16 * 851_968, 128 * 9 * 128 * 4 * 4)
    assert memory_problem(s, host=gib(1), on_gpu=False) is None


def test_activations_past_the_memory_name_the_minibatches():
    s = spec(**LONG, rollout__prompts_per_step=64, algorithm__group_size=64, trainer__minibatches=1)
    problem = memory_problem(s, host=gib(16), on_gpu=False)
    assert problem is not None and "\n" not in problem
    assert problem.startswith("trainer.minibatches: one step needs at least 63.6 GiB (the batch 1.1 GiB, ")
    assert "but this machine has 16.0 GiB (given)" in problem
    assert memory_problem(s.model_copy(update={"trainer": s.trainer.model_copy(update={"minibatches": 64})}),
                          host=gib(16), on_gpu=False) is None  # 1 GiB of activations a minibatch


def test_a_batch_that_alone_cannot_fit_names_its_sizes():
    s = spec(**LONG, rollout__prompts_per_step=1024, algorithm__group_size=1024)
    problem = memory_problem(s, host=gib(64), on_gpu=False)
    assert problem is not None and problem.startswith(
        "rollout.prompts_per_step x algorithm.group_size x rollout.max_new_tokens: one step needs at least ")
    assert "the batch 289.1 GiB" in problem and "1048576 samples of up to 8001 tokens" in problem


def test_a_model_too_big_for_the_gpu_names_the_model_and_lora_or_ranks_fit(tmp_path):
    model = tmp_path / "seven-b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 32,
                                                   "num_attention_heads": 32, "num_key_value_heads": 8,
                                                   "intermediate_size": 14336, "vocab_size": 32000}))
    s = spec(model__path=str(model), rollout__max_new_tokens=8)
    dims = model_dims(s.model)
    assert dims is not None and dims.params == decoder_params(4096, 32, 32, 8, 14336) == 6_979_321_856
    problem = memory_problem(s, host=gib(512), gpu=gib(80), on_gpu=True)
    assert problem is not None and problem.startswith("model.path: one step needs at least ")
    assert "but each GPU has 80.0 GiB" in problem and "the weights, gradients and optimizer state 104.0 GiB" in problem
    lora = apply_overrides(s, {"trainer.lora": {"r": 8}})
    assert memory_problem(lora, host=gib(512), gpu=gib(80), on_gpu=True) is None  # the frozen base: 26 GiB
    fsdp = apply_overrides(s, {"trainer.world_size": 2, "device": "cpu"})
    assert memory_problem(fsdp, host=gib(512), gpu=gib(80), on_gpu=True) is None  # 52 GiB a GPU


def test_an_unreadable_model_counts_the_batch_only(tmp_path):
    s = spec(model__path=str(tmp_path / "model.gguf"), rollout__max_new_tokens=8)
    assert model_dims(s.model) is None
    need = step_need(s, None)
    assert need.state == need.activations == 0 and need.batch == 256 * 9 * 37


def test_the_hosts_memory_is_the_least_of_meminfo_cgroup_and_rlimit():
    have = host_memory()
    assert have.bytes > 0 and have.source
    limit = 3 << 30
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); "
            "from factory.infra.memory import host_memory; m = host_memory(); print(m.bytes, m.source)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).parents[2]).stdout.split(maxsplit=1)
    if have.bytes > limit:
        assert out == [str(limit), "RLIMIT_AS\n"]


@pytest.mark.parametrize("cmd", ["validate", "run"])
def test_validate_and_run_refuse_a_step_this_machine_cannot_hold(cmd, tmp_path, monkeypatch, capsys):
    from factory.cli import main

    home = tmp_path / "home"
    monkeypatch.setenv("FACTORY_HOME", str(home))
    # within every sane maximum, but 2**20 samples of 8001 tokens: 289 GiB of batch alone
    argv = [cmd, str(QUICKSTART), "--set", "model.max_positions=8192", "--set", "rollout.max_new_tokens=8000",
            "--set", "rollout.prompts_per_step=1024", "--set", "algorithm.group_size=1024"]
    assert main(argv) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert line.startswith("factory: error: rollout.prompts_per_step x algorithm.group_size x rollout.max_new_tokens"
                           ": one step needs at least ") and "factory/infra/memory.py" in line
    assert not [p for p in home.rglob("*") if p.is_file()]  # nothing written
