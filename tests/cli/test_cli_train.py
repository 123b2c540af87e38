"""`factory validate` and `factory run`: exit codes, messages, and a real (tiny) run recorded in the lake."""

import json

import pytest

from factory.cli import main

TINY = ["--set", "name=cli", "--set", "model.preset=micro", "--set", "task.n_train=200", "--set", "task.n_eval=24",
        "--set", "sft.steps=10", "--set", "sft.stop_at_accuracy=null", "--set", "rollout.prompts_per_step=4",
        "--set", "algorithm.group_size=2", "--set", "schedule.steps=2", "--set", "schedule.eval_pass_k=2"]


def test_validate_ok_and_show(capsys):
    assert main(["validate", "examples/quickstart.yaml", "--show"]) == 0
    out = capsys.readouterr().out
    assert "examples/quickstart.yaml: ok" in out and "group_size: 8" in out


def test_validate_bad_spec_exits_2_naming_fields(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm:\n  group_size: 1\nmodel:\n  preset: huge\nrolout: {}\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err
    assert "algorithm.group_size: must be >= 2, got 1" in err
    assert "model.preset: unknown model preset 'huge'; valid presets: micro, small, tiny, tiny-llama" in err
    assert "rolout: unknown key" in err


def test_validate_missing_file_exits_2(capsys):
    assert main(["validate", "nope.yaml"]) == 2
    assert "no such spec file: nope.yaml" in capsys.readouterr().err


@pytest.mark.slow
def test_run_records_one_row_per_step_and_lists_the_run(factory_home, capsys):
    assert main(["run", "examples/quickstart.yaml", *TINY]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    assert main(["runs", "--format", "json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)
    assert run["name"] == "cli" and run["status"] == "succeeded" and run["final_step"] == 2
    assert main(["query", f"SELECT step, count(*) AS n FROM steps WHERE run_id = '{run['run_id']}' "
                          "GROUP BY step ORDER BY step", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"step": 1, "n": 1}, {"step": 2, "n": 1}]


def test_validate_refuses_lora_targets_the_model_does_not_have(tmp_path, capsys):
    spec = tmp_path / "lora.yaml"
    spec.write_text("model: {preset: micro}\ntrainer:\n  lora: {target_modules: [q_proj, wq]}\n")
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "trainer.lora.target_modules: ['wq'] match no module of Qwen2ForCausalLM" in err and "'v_proj'" in err
    spec.write_text("model: {preset: micro}\ntrainer:\n  lora: {target_modules: [q_proj, v_proj]}\n")
    assert main(["validate", str(spec)]) == 0
