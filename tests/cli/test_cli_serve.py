"""`factory serve --device/--precision`: the served model is placed on the device asked for, and a device this
machine does not have is one clear error line."""

from __future__ import annotations

import pytest
import torch

import factory.cli.serve as serve_cli
from factory.cli import main


@pytest.fixture
def served(monkeypatch) -> dict:
    """What `factory serve` would serve (the foreground HTTP loop itself is not started)."""
    seen: dict = {}
    monkeypatch.setattr(serve_cli, "serve", lambda engine, **kw: seen.update(engine=engine, **kw))
    return seen


def test_device_defaults_to_auto_which_is_the_cpu_here(served, capsys):
    assert main(["serve", "--preset", "micro", "--threads", "1"]) == 0
    eng = served["engine"]
    assert eng.device == torch.device("cpu") and eng.precision == "fp32"
    assert "on cpu (" in capsys.readouterr().err  # the startup line says where it computes


def test_the_model_is_placed_on_the_device_asked_for(served, monkeypatch, tmp_path):
    """No GPU here: `--device` resolves to the meta device (a real torch device a model can move to), which shows
    the checkpoint's model is moved where --device says and the engine computes there, in the precision asked."""
    from factory.models.build import build_model
    from factory.models.checkpoint import save_checkpoint
    from factory.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    save_checkpoint(build_model("micro", tok, seed=0), tok, tmp_path / "ckpt")
    asked: list[tuple[str, str]] = []

    def resolve(setting: str, field: str = "device") -> torch.device:
        asked.append((setting, field))
        return torch.device("meta")

    monkeypatch.setattr(serve_cli, "resolve_device", resolve)
    assert main(["serve", "--checkpoint", str(tmp_path / "ckpt"), "--device", "cuda:1", "--precision", "bf16",
                 "--threads", "1"]) == 0
    eng = served["engine"]
    assert asked == [("cuda:1", "--device")]
    assert eng.device == torch.device("meta") and eng.precision == "bf16"
    assert all(p.device.type == "meta" for p in eng.model.parameters())


def test_a_gpu_this_machine_lacks_is_one_error_line(served, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["serve", "--preset", "micro", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device" in err and "no CUDA device" in err and "engine" not in served
    assert main(["serve", "--preset", "micro", "--device", "tpu"]) == 2
    assert "expected auto, cpu, cuda or cuda:N" in capsys.readouterr().err


def test_a_checkpoint_that_does_not_exist_is_one_line_naming_the_flag(served, tmp_path, capsys):
    """It used to retry for 20 s and end in a traceback saying the checkpoint "was replaced 5 times"."""
    from factory.models.checkpoint import load_checkpoint

    missing = tmp_path / "no" / "such" / "dir"
    assert main(["serve", "--checkpoint", str(missing)]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert line.startswith(f"factory: error: --checkpoint: {missing} is not a directory")
    assert "engine" not in served  # nothing was served
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {missing}"):  # at once, not after retries
        load_checkpoint(missing)


def test_kv_budget_and_served_model_names(served, capsys):
    assert main(["serve", "--preset", "micro", "--threads", "1", "--kv-budget-mb", "64", "--served-model-name", "a",
                 "--served-model-name", "org/b", "--engine", "continuous"]) == 0
    assert served["engine"].kv.total_bytes == 64 << 20 and served["model_names"] == ["a", "org/b"]
    err = capsys.readouterr().err
    assert "model names: a, org/b, policy" in err and "KV cache budget 64 MiB" in err and "continuous engine" in err
    # the default engine for a Qwen2 model is the paged one; its store holds no more than 64 rows of the full
    # context (64 positions of 512 bytes each)
    assert main(["serve", "--preset", "micro", "--threads", "1", "--kv-budget-mb", "64"]) == 0
    assert served["engine"].kv.total_bytes == 64 * 64 * 512 and "paged engine" in capsys.readouterr().err
    assert main(["serve", "--preset", "micro", "--kv-budget-mb", "0"]) == 2
    assert "--kv-budget-mb: want a number of MiB >= 1, got 0" in capsys.readouterr().err
