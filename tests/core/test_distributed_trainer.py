"""DistributedTrainer: 2 gloo ranks (FSDP2 and DDP) against one process, grad_accum against none, the gathered
HF checkpoint, and the torchrun launcher's error surfacing.

Run as a script (by `run_ranks`), this file is the rank worker: it loads the job the test wrote, trains it with
`DistributedTrainer` and writes every rank's metrics and rank 0's checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from factory.config import AlgorithmSpec, parse_spec
from factory.core import algorithms
from factory.core.batch import TrainBatch, pack
from factory.core.trainer.distributed import DistributedTrainer
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
ROWS = 10  # per batch: 5 prompts x 2 samples; 2 minibatches of 5 rows split 3/2 over 2 ranks (unequal shards)
MINIBATCHES = 2
LR = 3e-3
# Measured (2 ranks vs 1 process, fp32, CPU, 4 steps x 2 minibatches): the loss, grad-norm, entropy, clip and KL
# curves agree to <= 1e-6 (loss <= 1e-7). Weights agree to ~1e-7 except a few elements whose true gradient is ~0
# (k_proj.bias: softmax ignores it), where AdamW divides float noise by its own tiny norm: up to 3.6e-5 of the
# ~2e-2 the weights moved. So: every element within 2e-4 (1% of the move), and on average within 1e-7.
LOSS_TOL = 1e-5
WEIGHT_TOL = 2e-4
WEIGHT_MEAN_TOL = 1e-7
LOGIT_TOL = 1e-4
BF16_LOSS_TOL = 1e-2  # bf16 vs fp32, one process, CPU autocast: measured 3.8e-4 (2 CPU ranks: <= 1e-3)


def _algorithm(name: str) -> AlgorithmSpec:
    return AlgorithmSpec(name=name, group_size=2, kl_coef=0.05, lr=LR)


def _batches(tok, model) -> list[TrainBatch]:
    """Fixed GRPO batches: varied prompt/completion lengths, a masked (environment) span, off-policy old
    logprobs (the start model's plus noise, so ratios clip sometimes), a reference for the KL term."""
    g = torch.Generator().manual_seed(1234)
    vocab = len(tok)
    out = []
    start = TorchTrainer(model, lr=0.0)
    for _ in range(STEPS):
        prompts, comps, masks = [], [], []
        for _ in range(ROWS):
            p = torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            c = torch.randint(3, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            m = [1] * len(c)
            if len(c) > 4:
                m[1:3] = [0, 0]
            prompts.append([tok.bos_token_id, *p])
            comps.append(c)
            masks.append(m)
        rewards = torch.randint(0, 2, (ROWS,), generator=g).float()
        adv = algorithms.group_advantages(rewards, 2)
        batch = pack(prompts, comps, tok.pad_token_id, {"old_logprobs": [[0.0] * len(c) for c in comps]},
                     {"advantages": adv.tolist()}, completion_masks=masks)
        lp = start.logprobs(batch)
        batch.per_token["ref_logprobs"] = lp
        batch.per_token["old_logprobs"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
        out.append(batch)
    return out


def _job(tmp: Path) -> Path:
    tok = build_tokenizer()
    model = build_model("tiny", tok, seed=0)
    job = {"state": model.state_dict(), "batches": [vars(b) for b in _batches(tok, model)]}
    path = tmp / "job.pt"
    torch.save(job, path)
    return path


def _load_job(path: Path):
    job = torch.load(path, weights_only=False)
    tok = build_tokenizer()
    model = build_model("tiny", tok, seed=0)
    model.load_state_dict(job["state"])
    return tok, model, [TrainBatch(**b) for b in job["batches"]]


class _NanAt:
    """The algorithm's loss, times NaN while the batch of index `bad` trains (`now` is set before each step)."""

    def __init__(self, loss_fn, bad: int):
        self.loss_fn, self.bad, self.now = loss_fn, bad, -1

    def __call__(self, logp, batch):
        loss, metrics = self.loss_fn(logp, batch)
        return (loss * float("nan") if self.now == self.bad else loss), metrics


def _train(trainer, batches: list[TrainBatch], algo: AlgorithmSpec,
           nan_at: int | None = None) -> list[dict[str, float]]:
    loss_fn = algorithms.make_loss(algo.for_rollout(16))
    if nan_at is not None:
        loss_fn = _NanAt(loss_fn, nan_at)
    shuffle = torch.Generator().manual_seed(7)
    history = []
    for i, b in enumerate(batches):
        if nan_at is not None:
            loss_fn.now = i
        history.append(trainer.step(b, loss_fn, MINIBATCHES, generator=shuffle))
    return history


def _curve(history: list[dict[str, float]], key: str) -> torch.Tensor:
    return torch.tensor([h[key] for h in history], dtype=torch.float64)


# ---------------------------------------------------------------- the rank worker (run by torchrun)


def _worker(job: str, out: str, strategy: str, algo_name: str, grad_accum: str, nan_on_rank1_at: str = "") -> None:
    from factory.core.trainer.distributed import init_ranks

    rank, world = init_ranks(threads=1, timeout_s=120)
    tok, model, batches = _load_job(Path(job))
    algo = _algorithm(algo_name)
    trainer = DistributedTrainer(model, lr=LR, aggregation=algo.aggregation(), strategy=strategy,
                                 grad_accum=int(grad_accum))
    history = _train(trainer, batches, algo, int(nan_on_rank1_at) if nan_on_rank1_at and rank == 1 else None)
    lp = trainer.logprobs(batches[0])
    out_dir = Path(out)
    (out_dir / f"rank{rank}.json").write_text(json.dumps({
        "history": [{k: v for k, v in h.items() if k != "train_s"} for h in history],
        "version": trainer.version, "world": world, "logprobs_sum": float(lp[batches[0].loss_mask].sum())}))
    trainer.save_full_checkpoint(tok, out_dir / "ckpt", meta={"strategy": strategy})
    torch.distributed.destroy_process_group()


def _lead(spec) -> None:
    """Rank 0's work under `ranks.main`: the job trained through make_trainer's LeaderTrainer (the followers run
    `ranks.follow`), then the model it publishes saved."""
    from factory.core.trainer.ranks import make_trainer
    from factory.models.checkpoint import save_checkpoint

    out = Path(os.environ["DP_OUT"])
    tok, model, batches = _load_job(Path(os.environ["DP_JOB"]))
    trainer = make_trainer(spec, model)
    history = _train(trainer, batches, spec.algorithm)
    lp = trainer.logprobs(batches[0])
    (out / "rank0.json").write_text(json.dumps({
        "history": [{k: v for k, v in h.items() if k != "train_s"} for h in history], "version": trainer.version,
        "world": torch.distributed.get_world_size(), "logprobs_sum": float(lp[batches[0].loss_mask].sum())}))
    save_checkpoint(trainer.model, tok, out / "ckpt")  # the loop's full model on rank 0 (fsdp: gathered into it)


if __name__ == "__main__":
    if sys.argv[1] == "ranks":
        from factory.core.trainer.ranks import main

        sys.exit(main(sys.argv[2:]))
    _worker(*sys.argv[1:])
    sys.exit(0)


# ---------------------------------------------------------------- tests

import functools  # noqa: E402

from factory.core.trainer.launch import RanksFailed, RanksTimedOut, run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return _job(tmp_path_factory.mktemp("dp-job"))


@functools.cache
def _reference(job: Path, algo_name: str):
    """One process, the plain TorchTrainer: the curve and weights the ranks must reproduce."""
    _, model, batches = _load_job(job)
    algo = _algorithm(algo_name)
    history = _train(TorchTrainer(model, lr=LR), batches, algo)
    return history, model


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_process(job, tmp_path):
    """FSDP2 fully_shard on gloo, GRPO's per-sequence mean over unequal shards (3 and 2 rows); the checkpoint
    written from the gathered state loads with transformers. (DDP: the leader/follower test below.)"""
    from transformers import AutoModelForCausalLM

    strategy, algo_name = "fsdp", "grpo"
    run_ranks(2, __file__, [job, tmp_path, strategy, algo_name, 1], timeout=300,
              env={"PYTHONPATH": str(REPO)}, cwd=REPO)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world"] == 2
    assert ranks[0]["history"] == ranks[1]["history"]  # every rank reports the same, bit for bit
    assert ranks[0]["logprobs_sum"] == ranks[1]["logprobs_sum"]  # logprobs: all ranks get all rows
    assert ranks[0]["version"] == STEPS * MINIBATCHES
    _check_against_one_process(tmp_path, job, algo_name, strategy)
    hist = ranks[0]["history"]
    # The curve moved: a test of equality between two runs that learn nothing would pass trivially.
    assert abs(hist[-1]["kl"] - hist[0]["kl"]) > 100 * LOSS_TOL

    _, ref_model = _reference(job, algo_name)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    ids = torch.tensor([[1, 5, 9, 12, 7, 3, 16, 4]])
    with torch.no_grad():
        diff = (loaded(input_ids=ids).logits - ref_model.eval()(input_ids=ids).logits).abs().max().item()
    assert diff <= LOGIT_TOL, f"{strategy}: logits of the checkpoint differ by {diff:.3g}"
    start = build_model("tiny", build_tokenizer(), seed=0)
    moved = max((v - start.state_dict()[k]).abs().max().item() for k, v in loaded.state_dict().items())
    assert moved > 100 * WEIGHT_TOL


@pytest.mark.slow
def test_a_nonfinite_loss_on_one_rank_skips_the_update_on_every_rank(job, tmp_path):
    """The non-finite rule on all-reduced values: rank 1's loss alone is NaN for the second batch, and both FSDP2
    ranks skip both its minibatches, report the same (bit for bit) and train on like one process that skipped it.
    Cost: one 2-rank launch, 30 s measured on the shared 2-core machine (load ~10)."""
    from transformers import AutoModelForCausalLM

    run_ranks(2, __file__, [job, tmp_path, "fsdp", "grpo", 1, 1], timeout=300, env={"PYTHONPATH": str(REPO)},
              cwd=REPO)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert json.dumps(ranks[0]["history"]) == json.dumps(ranks[1]["history"])  # NaN included
    hist = ranks[0]["history"]
    assert [h["nonfinite"] for h in hist] == [0.0, 1.0, 0.0, 0.0]
    assert ranks[0]["version"] == ranks[1]["version"] == (STEPS - 1) * MINIBATCHES
    _, model, batches = _load_job(job)
    ref = _train(TorchTrainer(model, lr=LR), batches, _algorithm("grpo"), nan_at=1)  # one process, same skip
    assert [h["nonfinite"] for h in ref] == [0.0, 1.0, 0.0, 0.0]
    for step in (0, 2, 3):
        assert abs(hist[step]["loss"] - ref[step]["loss"]) <= LOSS_TOL, step
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    diffs = torch.cat([(v - model.state_dict()[k]).abs().flatten() for k, v in loaded.state_dict().items()])
    assert diffs.max().item() <= WEIGHT_TOL


def _check_against_one_process(tmp_path: Path, job: Path, algo_name: str, label: str) -> None:
    from transformers import AutoModelForCausalLM

    hist = json.loads((tmp_path / "rank0.json").read_text())["history"]
    ref_hist, ref_model = _reference(job, algo_name)
    assert all(h["nonfinite"] == 0.0 for h in hist)
    for key in ("loss", "grad_norm", "entropy", "clip_frac", "kl"):
        diff = (_curve(hist, key) - _curve(ref_hist, key)).abs().max().item()
        assert diff <= LOSS_TOL, f"{label}: {key} curve differs from one process by {diff:.3g}"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    ref_state = ref_model.state_dict()
    diffs = torch.cat([(v - ref_state[k]).abs().flatten() for k, v in loaded.state_dict().items()])
    assert diffs.max().item() <= WEIGHT_TOL and diffs.mean().item() <= WEIGHT_MEAN_TOL, label


@pytest.mark.slow
def test_leader_and_follower_train_like_one_process(job, tmp_path):
    """`ranks.main` under torchrun: rank 0 trains through make_trainer (a LeaderTrainer: DDP, DAPO's token mean,
    grad_accum 2) while rank 1 follows with the loss rebuilt from the spec and a model of other weights (seed 5:
    rank 0's are broadcast); the curve and rank 0's published model match one process."""
    spec = parse_spec({"seed": 5, "model": {"preset": "tiny"},
                       "algorithm": {"name": "dapo", "group_size": 2, "kl_coef": 0.05, "lr": LR},
                       "rollout": {"prompts_per_step": ROWS // 2, "max_new_tokens": 16},
                       "trainer": {"world_size": 2, "strategy": "ddp", "grad_accum": 2, "minibatches": MINIBATCHES}})
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec.model_dump(mode="json")))
    run_ranks(2, __file__, ["ranks", "--spec", spec_path, "--leader", "__main__:_lead", "--timeout-s", "120"],
              timeout=300, env={"PYTHONPATH": str(REPO), "DP_JOB": str(job), "DP_OUT": str(tmp_path)}, cwd=REPO)
    assert json.loads((tmp_path / "rank0.json").read_text())["version"] == STEPS * MINIBATCHES
    _check_against_one_process(tmp_path, job, "dapo", "leader/follower")


@pytest.mark.slow
def test_make_trainer_keeps_the_plain_trainer_by_default():
    from factory.core.trainer.ranks import make_trainer

    tok = build_tokenizer()
    base = {"model": {"preset": "tiny"}, "algorithm": {"group_size": 2}, "rollout": {"prompts_per_step": 2}}
    assert type(make_trainer(parse_spec(base), build_model("tiny", tok))) is TorchTrainer
    accum = make_trainer(parse_spec({**base, "trainer": {"grad_accum": 2}}), build_model("tiny", tok))
    assert isinstance(accum, DistributedTrainer) and accum.grad_accum == 2 and accum.world_size == 1
    with pytest.raises(RuntimeError, match="trainer.world_size: 2 ranks wanted.*torchrun"):
        make_trainer(parse_spec({**base, "trainer": {"world_size": 2}}), build_model("tiny", tok))
    # the Megatron backend is picked by the spec, from one process; GPU-only (the tests pass device="cpu" directly)
    with pytest.raises(ValueError, match="trainer.world_size: the loop drives Megatron from one process"):
        make_trainer(parse_spec({**base, "trainer": {"backend": "megatron", "world_size": 2}}),
                     build_model("tiny", tok))
    import torch

    if not torch.cuda.is_available():
        pytest.importorskip("megatron.core", reason="megatron-core is the optional extra `megatron`")
        with pytest.raises(ValueError, match="trainer.backend: megatron runs on CUDA GPUs; none is available here"):
            make_trainer(parse_spec({**base, "trainer": {"backend": "megatron"}}), build_model("tiny", tok))


@pytest.mark.slow
@pytest.mark.parametrize("algo_name", ["grpo", "dapo"])
def test_grad_accum_matches_one_batch(job, algo_name):
    """grad_accum=2 in one process (no process group) against the plain trainer: same curve, same weights."""
    ref_hist, ref_model = _reference(job, algo_name)
    _, model, batches = _load_job(job)
    algo = _algorithm(algo_name)
    trainer = DistributedTrainer(model, lr=LR, aggregation=algo.aggregation(), grad_accum=2)
    hist = _train(trainer, batches, algo)
    for key in ("loss", "grad_norm", "entropy", "clip_frac"):
        diff = (_curve(hist, key) - _curve(ref_hist, key)).abs().max().item()
        assert diff <= LOSS_TOL, f"{key} differs by {diff:.3g}"
    ref_state = ref_model.state_dict()
    diffs = torch.cat([(v - ref_state[k]).abs().flatten() for k, v in model.state_dict().items()])
    assert diffs.max().item() <= WEIGHT_TOL and diffs.mean().item() <= WEIGHT_MEAN_TOL


def test_bf16_computes_in_bf16_and_steps_fp32_weights(job):
    """precision bf16 in one process (autocast on CPU): the curve moves off fp32's by bf16 rounding only, and the
    weights and AdamW moments the optimizer steps stay float32 (the master copy). On 2 CPU ranks the fsdp
    (MixedPrecisionPolicy) and ddp (autocast) paths were measured once, not tested: loss within 1e-3 of fp32."""
    ref_hist, _ = _reference(job, "grpo")
    _, model, batches = _load_job(job)
    trainer = DistributedTrainer(model, lr=LR, precision="bf16")
    hist = _train(trainer, batches, _algorithm("grpo"))
    diff = (_curve(hist, "loss") - _curve(ref_hist, "loss")).abs().max().item()
    assert 1e-6 < diff <= BF16_LOSS_TOL, f"bf16 loss curve differs from fp32 by {diff:.3g}"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}


def test_wrong_aggregation_gives_a_different_gradient(job):
    """The unit weighting matters: weighting GRPO's per-sequence loss by tokens moves the curve off one process's
    (so the matches above are not an accident of equal shards)."""
    ref_hist, _ = _reference(job, "grpo")
    _, model, batches = _load_job(job)
    hist = _train(DistributedTrainer(model, lr=LR, aggregation="token_mean", grad_accum=2), batches,
                  _algorithm("grpo"))
    assert (_curve(hist, "loss") - _curve(ref_hist, "loss")).abs().max().item() > 100 * LOSS_TOL


def test_unknown_aggregation_is_named():
    tok = build_tokenizer()
    with pytest.raises(ValueError, match="aggregation"):
        DistributedTrainer(build_model("tiny", tok), lr=1e-3, aggregation="median")


@pytest.mark.slow
def test_failing_rank_is_reported_with_its_traceback(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('rank one cannot go on')\n")
    with pytest.raises(RanksFailed, match=r"(?s)rank 1 failed first.*ValueError: rank one cannot go on"):
        run_ranks(2, script, timeout=120)


@pytest.mark.slow
def test_hung_ranks_are_killed_at_the_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import signal\nprint('waiting', flush=True)\nsignal.pause()\n")
    with pytest.raises(RanksTimedOut, match="did not finish within 3 s"):
        run_ranks(2, script, timeout=3)
