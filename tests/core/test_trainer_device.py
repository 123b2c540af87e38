"""The trainers honour the device the run placed the model on, and the precision: routing checked on this CPU.

No GPU here: where the code path CUDA takes must be reached, `torch.cuda` answers as on a one- or two-GPU machine
(monkeypatched) and moving a module to CUDA is recorded instead of done (`cuda_moves`). What runs is real torch:
the bf16 step is a real bf16-autocast step on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from factory.config import parse_spec
from factory.core import algorithms
from factory.core.batch import pack
from factory.core.loop import train_rl
from factory.core.trainer.distributed import DistributedTrainer
from factory.core.trainer.ranks import make_trainer
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem


def _spec(**trainer):
    return parse_spec({"seed": 0, "model": {"preset": "micro"}, "algorithm": {"group_size": 4, "lr": 0.01},
                       "rollout": {"prompts_per_step": 2, "max_new_tokens": 3}, "schedule": {"steps": 1},
                       "trainer": {"threads": 1, **trainer}})


def _batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 17, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    completions = [torch.randint(4, 17, (n,), generator=g).tolist() for n in (4, 2, 3, 4)]
    old = [(-torch.rand(len(c), generator=g) - 2.0).tolist() for c in completions]
    return pack(prompts, completions, pad_id=0, completion_values={"old_logprobs": old},
                per_seq={"advantages": [1.0, -0.5, 0.7, -1.2]})


@pytest.fixture
def model():
    torch.set_num_threads(1)
    return build_model("micro", build_tokenizer(), seed=0)


@pytest.fixture
def cuda_moves(monkeypatch) -> list[tuple[str, torch.device]]:
    """torch reports two CUDA devices; `Module.to(<cuda device>)` is recorded (class name, device) and leaves the
    module where it is. Every other move runs as usual."""
    moves: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    to = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, str | torch.device) and torch.device(target).type == "cuda":
            moves.append((type(self).__name__, torch.device(target)))
            return self
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    return moves


def test_bf16_at_world_size_1_stays_in_process_and_trains_under_autocast(model):
    """precision: bf16 in one process is the plain TorchTrainer (before: a lone DistributedTrainer, which moved the
    shared model to CUDA); the forward runs under bf16 autocast, the logprobs and loss come out float32 and the
    AdamW step updates the float32 master weights."""
    trainer = make_trainer(_spec(precision="bf16"), model)
    assert type(trainer) is TorchTrainer and trainer.precision == "bf16"
    seen: list[tuple[bool, torch.dtype]] = []
    # The head: the chunked log-probs (trainer/logprobs.py) run the decoder and the head, not the model's forward.
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(
        (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    batch = _batch()
    before = [p.detach().clone() for p in model.parameters()]
    logp = trainer.logprobs(batch)
    assert logp.dtype == torch.float32 and logp.device.type == "cpu"
    loss_fn = algorithms.make_loss(_spec().algorithm)
    metrics = trainer.step(batch, loss_fn)
    assert seen == [(True, torch.bfloat16)] * 2  # logprobs, then the training forward
    assert metrics["nonfinite"] == 0.0 and trainer.version == 1
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_bf16_loss_is_fp32s_up_to_bf16_rounding(model):
    """The same step in fp32 and bf16 (same weights, same batch): losses agree to bf16 precision, and differ (the
    autocast really applied)."""
    loss_fn = algorithms.make_loss(_spec().algorithm)
    fp32 = TorchTrainer(model, lr=0.01).step(_batch(), loss_fn)
    again = build_model("micro", build_tokenizer(), seed=0)
    bf16 = TorchTrainer(again, lr=0.01, precision="bf16").step(_batch(), loss_fn)
    assert 0 < abs(fp32["loss"] - bf16["loss"]) <= 1e-2 * max(1.0, abs(fp32["loss"]))


def test_a_bad_precision_names_the_field(model):
    with pytest.raises(ValueError, match="trainer.precision: expected 'fp32' or 'bf16', got 'fp16'"):
        TorchTrainer(model, lr=0.01, precision="fp16")


@pytest.mark.parametrize("layout", [{"grad_accum": 2}, {"precision": "bf16"}, {"grad_accum": 2, "precision": "bf16"}],
                         ids=["grad_accum", "bf16", "both"])
def test_one_process_computes_where_the_model_is_and_moves_nothing(model, cuda_moves, layout):
    """grad_accum > 1 or bf16 at world_size 1 used to take a lone DistributedTrainer that, with CUDA present, put
    itself on cuda:LOCAL_RANK and moved the shared model there behind the engines' and evals' back (a device
    mismatch at step 0). Now the trainer computes on the model's device (where the run placed it) and moves
    nothing; bf16 alone is the plain TorchTrainer."""
    trainer = make_trainer(_spec(**layout), model)
    assert isinstance(trainer, DistributedTrainer if "grad_accum" in layout else TorchTrainer)
    assert cuda_moves == [] and trainer.device == torch.device("cpu")
    loss_fn = algorithms.make_loss(_spec().algorithm)
    assert trainer.step(_batch(), loss_fn)["nonfinite"] == 0.0


def test_the_kl_reference_goes_to_the_policys_device(model, monkeypatch):
    """The KL reference model is placed where the policy is (it used to stay on the CPU whatever the run's device).
    The loop is told the policy is on cuda:1; the reference's own `to` records where it is sent (and stays on the
    CPU, so the step still runs here)."""
    import factory.core.loop as loop

    tok = build_tokenizer()
    reference = build_model("micro", tok, seed=0)
    moves: list[torch.device] = []
    reference.to = lambda device: moves.append(torch.device(device)) or reference
    original = getattr(loop, "model_device", lambda m: next(m.parameters()).device)
    monkeypatch.setattr(loop, "model_device", lambda m: torch.device("cuda", 1) if m is model else original(m),
                        raising=False)
    spec = parse_spec({**_spec().model_dump(mode="json"),
                       "algorithm": {"group_size": 4, "lr": 0.01, "kl_coef": 0.1}})
    problems = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(4)]
    records = train_rl(spec, model, tok, problems, reference_model=reference)
    assert moves == [torch.device("cuda", 1)] and len(records) == 1


def test_a_bf16_run_trains_in_process_with_the_engine_sharing_the_model(model):
    """The loop at precision bf16 in one process: the sync engine samples from the trainer's own model, the KL
    reference runs at the same precision, and every step is finite and applied."""
    tok = build_tokenizer()
    spec = parse_spec({**_spec(precision="bf16").model_dump(mode="json"),
                       "algorithm": {"group_size": 4, "lr": 0.01, "kl_coef": 0.1}, "schedule": {"steps": 2}})
    problems = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(4)]
    records = train_rl(spec, model, tok, problems)
    assert [r.step for r in records] == [1, 2] and all(r.nonfinite == 0.0 for r in records)
    assert all(torch.isfinite(torch.tensor([r.loss, r.kl, r.grad_norm, r.logprob_mismatch])).all() for r in records)
    assert all(p.dtype == torch.float32 for p in model.parameters())
