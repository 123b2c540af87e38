"""The run resolves its device once, places the model there, and records it: on this CPU for real (device cpu), and
the CUDA routing with `torch.cuda` answering as on a two-GPU machine (no GPU here: moving a module to CUDA is
recorded instead of done)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from factory.cockpit.tracking import Tracker
from factory.config import parse_spec
from factory.lake.writer import Lake
from factory.models.build import build_model
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem, Splits
from factory.runs.rl_run import run_rl
from factory.runs.stages import place, train_sft_checkpoint

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(12)]
SPLITS = Splits(train=PROBLEMS[:8], eval=PROBLEMS[8:])


def spec(**over):
    base = {"name": "dev", "model": {"preset": "micro"}, "algorithm": {"group_size": 2, "lr": 1e-3},
            "rollout": {"prompts_per_step": 2, "max_new_tokens": 2}, "trainer": {"threads": 1},
            "sft": {"steps": 2, "stop_at_accuracy": None},
            "schedule": {"steps": 1, "eval_pass_k": 1, "log_rollouts": 1, "wait_timeout_s": 60},
            "ops": {"preflight": "off"}}
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_spec(base)


@pytest.fixture
def two_gpus(monkeypatch) -> Iterator[dict]:
    """torch sees two CUDA devices; what is made current and every module sent to CUDA is recorded."""
    seen: dict = {"current": [], "moves": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen["current"].append(torch.device(device)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"Fake GPU {index}")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # restored after the test
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    to = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, str | torch.device) and torch.device(target).type == "cuda":
            seen["moves"].append((type(self).__name__, torch.device(target)))
            return self
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    yield seen
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def test_place_puts_the_model_on_the_runs_device_and_says_so(two_gpus):
    """trainer.devices: [1] at world_size 1 places the one trainer process (it used to be ignored there): the model
    goes to cuda:1, which is made current with TF32 on, and the log names it."""
    model = build_model("micro", build_tokenizer(), seed=0)
    said: list[str] = []
    device = place(spec(trainer={"devices": [1]}), model, said.append)
    assert device == torch.device("cuda", 1)
    assert two_gpus["moves"] == [("Qwen2ForCausalLM", torch.device("cuda", 1))]
    assert two_gpus["current"] == [torch.device("cuda", 1)]
    assert torch.backends.cuda.matmul.allow_tf32 and said == ["device: cuda:1 (Fake GPU 1)"]


def test_place_on_the_cpu_moves_nothing_and_keeps_the_weights():
    model = build_model("micro", build_tokenizer(), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    said: list[str] = []
    assert place(spec(device="cpu"), model, said.append) == torch.device("cpu")
    assert said[0].startswith("device: cpu (") and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_sft_trains_and_evaluates_on_the_runs_device(factory_home, two_gpus):
    """The SFT warm start (and so the control, which is more of it) places its model on the run's device, and so
    does the evaluation of its checkpoint."""
    s = spec(device="cuda:1")
    train_sft_checkpoint(s, factory_home, SPLITS, log=lambda _: None)
    assert two_gpus["moves"] == [("Qwen2ForCausalLM", torch.device("cuda", 1))] * 2  # trained, then evaluated


def test_the_run_records_its_device_in_the_lake_and_mlflow(factory_home, lake: Lake):
    tok = build_tokenizer()
    init = save_checkpoint(build_model("micro", tok, seed=0), tok, factory_home.checkpoints / "init").path
    said: list[str] = []
    tracker = Tracker(factory_home)
    res = run_rl(spec(device="cpu"), factory_home, init, SPLITS, lake, tracker, log=said.append)
    row = lake.read("runs").to_pylist()[0]
    assert row["device"].startswith("cpu (") and row["device"] == f"cpu ({torch.get_num_threads()} threads)"
    assert tracker.client.get_run(res.mlflow_run_id).data.tags["factory.device"] == row["device"]
    assert f"run {res.run_id}: device {row['device']}" in said
