"""The trainer's step without host syncs (trainer.fused_optimizer) and its compiled decoder layers
(trainer.compile), against the plain path: the same numbers, no device read inside the minibatch loop, no graph
break and no recompile across batch lengths. On the CPU; the CUDA-only checks skip without a GPU."""

import copy
import threading
import warnings

import pytest
import torch
import torch._dynamo as dynamo

from factory.core.batch import TrainBatch
from factory.core.trainer.compiled import CompiledLayers, decoder_layers
from factory.core.trainer.distributed import DistributedTrainer
from factory.core.trainer.step import host_floats
from factory.core.trainer.torch_trainer import TorchTrainer, batch_to
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from tests.core.step_cases import GRPO, MASK_BUILDER, count_reads, nan_after, rl_batch, step_reads


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def trainer(tok, lr: float = 0.01, **switches) -> TorchTrainer:
    return TorchTrainer(build_model("micro", tok, seed=0), lr=lr, **switches)


def test_the_counter_sees_the_host_decided_skip(tok):
    """The counter catches a host sync: the unfused path reads the device to decide each skip (main read the loss,
    the gradient norm and the entropy too, .item() per metric)."""
    t = trainer(tok, fused_optimizer="off")
    reads = count_reads(t)
    t.step(rl_batch(tok, 4, 9, seed=1), GRPO, minibatches=2, generator=torch.Generator().manual_seed(0))
    assert len(reads) == 2 and all(any(r.startswith("__bool__ ") for r in mb) for mb in step_reads(reads)), reads


@pytest.mark.parametrize("switches", [{}, {"packing": "on"}, {"packing": "on", "fused_head": "on"}],
                         ids=["padded", "packed", "packed_fused_head"])
def test_the_fused_step_reads_nothing_inside_the_minibatch_loop(tok, switches):
    """Padded, transformers' sdpa mask builder reads the 2-D mask (`_ignore_causal_mask_sdpa`): the forward's, not
    the step's. Packed, the only read is the packer's plan of the CPU batch's mask (`sample_lengths`, host data): the
    decoder gets the plan's prebuilt document mask, so the mask builder reads nothing (no
    `find_packed_sequence_indices`)."""
    t = trainer(tok, fused_optimizer="on", **switches)
    assert t.optimizer.param_groups[0]["fused"] is True
    reads = count_reads(t)
    m = t.step(rl_batch(tok, 4, 9, seed=1), GRPO, minibatches=2, generator=torch.Generator().manual_seed(0))
    assert step_reads(reads, ("sample_lengths",)) == [[], []], reads
    if switches:
        assert [[r for r in mb if not r.endswith(" in sample_lengths")] for mb in reads] == [[], []], reads
    assert all(len(mb) <= 2 for mb in reads), reads  # the forward's, and nothing else
    assert t.version == 2 and m["nonfinite"] == 0.0
    assert {"loss", "grad_norm", "entropy", "clip_frac", "kl"} <= m.keys()
    assert all(isinstance(v, float) for v in m.values())


def test_fused_and_unfused_steps_agree(tok):
    """Three steps of two minibatches (n = 6 optimizer steps): losses, metrics and parameters within 1e-6.

    At lr 1e-4: Adam divides by sqrt(v), so on a parameter whose gradient is nearly 0 a last-bit difference of the
    two kernels' arithmetic moves the next update by up to ~lr; at lr 1e-2 the two drift 1.4e-5 apart in 6 steps.
    One step from the same state (below) is the kernels' own difference."""
    fused, plain = trainer(tok, lr=1e-4, fused_optimizer="on"), trainer(tok, lr=1e-4, fused_optimizer="off")
    for step in range(3):
        batch = rl_batch(tok, 4, 9, seed=10 + step)
        a = fused.step(batch, GRPO, minibatches=2, generator=torch.Generator().manual_seed(step))
        b = plain.step(batch, GRPO, minibatches=2, generator=torch.Generator().manual_seed(step))
        for k in ("loss", "grad_norm", "entropy", "clip_frac", "kl", "ratio_mean"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), (step, k)
    assert fused.version == plain.version == 6
    for p, q in zip(fused.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_one_fused_step_from_the_same_state_is_the_unfused_one(tok):
    """At lr 1e-2, after a step of each from one state: parameters and moments within 1e-7 (measured 7.5e-9)."""
    fused, plain = trainer(tok, fused_optimizer="on"), trainer(tok, fused_optimizer="off")
    plain.step(rl_batch(tok, 4, 9, seed=11), GRPO)
    fused.model.load_state_dict(plain.model.state_dict())
    fused.optimizer.load_state_dict(copy.deepcopy(plain.optimizer.state_dict()))  # a copy: a resume point's
    batch = rl_batch(tok, 4, 9, seed=12)
    fused.step(batch, GRPO)
    plain.step(batch, GRPO)
    moved = False
    for p, q in zip(fused.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
        a, b = fused.optimizer.state[p], plain.optimizer.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-7)
        assert int(a["step"]) == int(b["step"]) == 2
        moved |= not torch.equal(p, q)
    assert moved  # two different kernels, not one path run twice


def snapshot(t: TorchTrainer):
    return [p.detach().clone() for p in t.model.parameters()], copy.deepcopy(t.optimizer.state_dict()["state"])


@pytest.mark.parametrize("bad", ["nan_loss", "inf_grad"])
def test_a_nonfinite_minibatch_is_skipped_on_the_device_bit_exact(tok, bad):
    t = trainer(tok, fused_optimizer="on")
    batch = rl_batch(tok, 4, 9, seed=3)
    t.step(batch, GRPO)  # AdamW has moments and a step count to protect
    before = snapshot(t)
    reads = count_reads(t)
    if bad == "nan_loss":
        loss_fn = nan_after(0)
    else:
        def loss_fn(logp, b):
            loss, metrics = GRPO(logp, b)
            return loss + 0.0 * logp.sum() / torch.zeros(()), metrics  # finite? no: 0/0 in the gradient too
    m = t.step(batch, loss_fn)
    assert step_reads(reads) == [[]], reads
    assert m["nonfinite"] == 1.0 and t.version == 1
    params, state = snapshot(t)
    assert all(torch.equal(x, y) for x, y in zip(before[0], params, strict=True))
    for k, s in before[1].items():
        assert all(torch.equal(v, state[k][n]) for n, v in s.items()), k
    assert int(state[0]["step"]) == 1
    assert all(p.grad is None for p in t.model.parameters())
    after = t.step(batch, GRPO)  # and trains on from there
    assert after["nonfinite"] == 0.0 and t.version == 2 and int(t.optimizer.state_dict()["state"][0]["step"]) == 2


def test_with_minibatches_the_device_skips_only_the_bad_one(tok):
    t = trainer(tok, fused_optimizer="on")
    m = t.step(rl_batch(tok, 4, 9, seed=4), nan_after(1), minibatches=2, generator=torch.Generator().manual_seed(0))
    assert m["nonfinite"] == 0.5 and t.version == 1
    assert int(t.optimizer.state_dict()["state"][0]["step"]) == 1


def old_step(t: TorchTrainer, batch: TrainBatch, loss_fn, minibatches: int, generator) -> dict[str, float]:
    """main's TorchTrainer.step before issue 34 (3983386), line for line: AdamW unfused, each value read with
    .item() / float() per minibatch, the skip decided on the host."""
    order = torch.randperm(len(batch), generator=generator) if minibatches > 1 else torch.arange(len(batch))
    chunks = order.chunk(minibatches)
    sums: dict[str, float] = {}
    for chunk in chunks:
        mb = batch.select(chunk)
        logp, entropy = t._logprobs(mb, with_entropy=True)
        loss, metrics = loss_fn(logp, mb)
        metrics = {k: float(v) for k, v in metrics.items()}  # the algorithms returned .item()
        t.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), t.grad_clip)
        if bool(torch.isfinite(loss.detach()).all() and torch.isfinite(grad_norm)):
            t.optimizer.step()
        else:
            t.optimizer.zero_grad(set_to_none=True)
        ent = (entropy * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1)
        for k, v in {**metrics, "loss": loss.item(), "grad_norm": float(grad_norm), "entropy": ent.item()}.items():
            sums[k] = sums.get(k, 0.0) + v / minibatches
    return sums


def test_auto_on_the_cpu_is_bit_identical_to_the_old_step(tok):
    new = trainer(tok)  # every switch at auto: off on the CPU
    assert not new.fused and new.optimizer.param_groups[0]["fused"] is None
    old = trainer(tok)
    old.optimizer = torch.optim.AdamW(old.model.parameters(), lr=0.01, weight_decay=0.0, betas=(0.9, 0.99))
    old.model.train()
    for step in range(3):
        batch = rl_batch(tok, 5, 11, seed=20 + step)
        a = new.step(batch, GRPO, minibatches=2, generator=torch.Generator().manual_seed(step))
        b = old_step(old, batch, GRPO, 2, torch.Generator().manual_seed(step))
        assert {k: a[k] for k in b} == b  # exact floats
    assert all(torch.equal(p, q) for p, q in zip(new.model.parameters(), old.model.parameters(), strict=True))


def test_a_resumed_optimizer_keeps_its_kernels(tok):
    """A resume point written by the unfused optimizer loads into a fused one (and back): the kernels stay as
    configured and the step count moves to where they keep it."""
    plain, fused = trainer(tok, fused_optimizer="off"), trainer(tok, fused_optimizer="on")
    batch = rl_batch(tok, 4, 9, seed=5)
    plain.step(batch, GRPO)
    fused.optimizer.load_state_dict(copy.deepcopy(plain.optimizer.state_dict()))
    assert fused.optimizer.param_groups[0]["fused"] is True
    fused.model.load_state_dict(plain.model.state_dict())
    fused.step(batch, GRPO)
    plain.step(batch, GRPO)
    assert int(fused.optimizer.state_dict()["state"][0]["step"]) == 2
    for p, q in zip(fused.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    plain.optimizer.load_state_dict(copy.deepcopy(fused.optimizer.state_dict()))
    assert plain.optimizer.param_groups[0]["fused"] is None
    assert plain.optimizer.state[plain.optimizer.param_groups[0]["params"][0]]["step"].device.type == "cpu"


def test_a_metric_that_is_not_a_number_is_named():
    with pytest.raises(ValueError, match="metric 'kl'.*0-dim tensor, got shape \\(2,\\)"):
        host_floats([torch.zeros(()), torch.zeros(2)], ["loss", "kl"])


def test_batch_to_the_cpu_copies_nothing(tok):
    batch = rl_batch(tok, 2, 5, seed=6)
    assert batch_to(batch, torch.device("cpu")) is batch


# ---------------------------------------------------------------- the distributed trainer's step

# Host reads of the CPU batch (never the device): the loss units and token counts that weight the micro-batches.
HOST_BATCH_READS = ("n_tokens", "loss_units")


def test_fused_grad_accum_reads_the_device_once_per_step_and_skips_there():
    """grad_accum 2 in one process with trainer.fused_optimizer on: no device read inside the minibatch loop, the
    same curve and weights as the host-decided path within 1e-6 (lr 1e-4, n = 2 steps x 2 minibatches), and a NaN
    minibatch skipped with the parameters and AdamW state bit-identical."""
    tok = build_tokenizer()
    fused, plain = (DistributedTrainer(build_model("micro", tok, seed=0), lr=1e-4, grad_accum=2, fused_optimizer=f)
                    for f in ("on", "off"))
    assert fused.optimizer.param_groups[0]["fused"] is True and plain.optimizer.param_groups[0]["fused"] is None
    reads = count_reads(fused)
    for s in range(2):
        batch = rl_batch(tok, 6, 9, seed=s)
        a = fused.step(batch, GRPO, 2, generator=torch.Generator().manual_seed(s))
        b = plain.step(batch, GRPO, 2, generator=torch.Generator().manual_seed(s))
        for key in ("loss", "grad_norm", "entropy", "clip_frac", "kl"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (s, key)
    assert step_reads(reads, HOST_BATCH_READS) == [[], [], [], []], reads
    assert fused.version == plain.version == 4
    for p, q in zip(fused.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    before = [p.detach().clone() for p in fused.model.parameters()]
    moments = {k: {n: v.clone() for n, v in s.items()} for k, s in fused.optimizer.state.items()}
    m = fused.step(rl_batch(tok, 6, 9, seed=5), nan_after(0), 1)
    assert m["nonfinite"] == 1.0 and fused.version == 4
    assert all(torch.equal(x, p) for x, p in zip(before, fused.model.parameters(), strict=True))
    assert all(torch.equal(v, fused.optimizer.state[k][n]) for k, s in moments.items() for n, v in s.items())


# ---------------------------------------------------------------- compiled decoder layers


class CountingBackend:
    """A dynamo backend that runs the captured graph as it is and counts graphs and their runs."""

    def __init__(self):
        self.graphs = 0
        self.runs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)
        return run


@pytest.fixture
def fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def compiled_trainer(tok, backend, **switches) -> TorchTrainer:
    t = trainer(tok, compile="on", **switches)
    t._layers = CompiledLayers(t.model, backend=backend)  # instead of inductor: no C++ build in a unit test
    return t


def test_a_decoder_layer_compiles_without_a_graph_break(tok, fresh_dynamo):
    model = build_model("micro", tok, seed=0)
    layer = decoder_layers(model)[0]
    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    batch = rl_batch(tok, 3, 9, seed=7)
    model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    handle.remove()
    args, kwargs = seen["call"]
    explained = dynamo.explain(layer.forward)(*args, **kwargs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("packing", ["off", "on"])
def test_compiled_layers_train_like_eager_without_recompiling(tok, fresh_dynamo, packing):
    """aot_eager (the compiled graph's autograd without inductor): after the warm-up no batch length or row count
    recompiles (n = 4 padded batches of 2 to 4 rows and 5 to 40 tokens), and losses and parameters match eager
    (padded or packed alike) within 1e-6. Dynamo specializes a size of 1: packed, a batch that fits one row is one
    more graph (and one sample alone in it has no mask, another), so the warm-up has those; so is a padded batch
    without padding (HF passes no mask)."""
    eager, compiled = trainer(tok, packing=packing), compiled_trainer(tok, "aot_eager", packing=packing)
    warm = [rl_batch(tok, 4, 8, seed=30)]
    if packing == "on":  # packed into one row: a lone sample, and several
        warm += [rl_batch(tok, 1, 6, seed=51), rl_batch(tok, 3, 12, seed=52)]
    batches = [rl_batch(tok, rows, longest, seed=32 + i) for i, (rows, longest) in
               enumerate([(4, 14), (3, 21), (2, 5), (4, 30)])]
    assert len({b.input_ids.shape for b in batches} - {b.input_ids.shape for b in warm}) == 4
    assert all(bool((b.attention_mask == 0).any()) for b in batches)
    for batch in warm:
        compiled.step(batch, GRPO)
        eager.step(batch, GRPO)
    with dynamo.config.patch(error_on_recompile=True):
        for batch in batches:
            a = compiled.step(batch, GRPO)
            b = eager.step(batch, GRPO)
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    for p, q in zip(compiled.model.parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    logp = compiled.logprobs(batches[-1])  # the old-logprob forward: compiled too (no grad: one more graph)
    torch.testing.assert_close(logp, eager.logprobs(batches[-1]), rtol=0, atol=1e-6)


def test_the_shared_model_stays_eager_outside_the_trainer(tok, fresh_dynamo):
    """An engine or eval calling the same model (another thread, or after the step) runs the plain layers."""
    backend = CountingBackend()
    t = compiled_trainer(tok, backend)
    batch = rl_batch(tok, 3, 9, seed=8)
    t.step(batch, GRPO)
    assert backend.graphs >= 1 and backend.runs == 2  # two layers, one forward
    layers = decoder_layers(t.model)
    assert all("forward" not in layer.__dict__ for layer in layers)
    with torch.no_grad():
        t.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    assert backend.runs == 2
    other: list[int] = []
    with t._layers.active():  # while the trainer is inside, another thread's forward is eager
        thread = threading.Thread(target=lambda: other.append(
            t.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.shape[0]))
        thread.start()
        thread.join(timeout=60)
    assert other == [3] and backend.runs == 2
    copy.deepcopy(t.model)(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    assert backend.runs == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the device check runs it")
def test_on_cuda_a_fused_step_does_not_sync_inside_the_loop(tok):
    t = TorchTrainer(build_model("micro", tok, seed=0).cuda(), lr=0.01)
    assert t.fused and t.uses("compile")
    batch = rl_batch(tok, 4, 9, seed=9)
    t.step(batch, GRPO, minibatches=2, generator=torch.Generator().manual_seed(0))  # warm-up: compiles
    inner = t._minibatch
    syncs: list[str] = []

    def watched(mb, loss_fn):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = inner(mb, loss_fn)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs.extend(f"{w.filename}:{w.lineno} {w.message}" for w in caught if "synchroniz" in str(w.message))
        return out

    t._minibatch = watched
    m = t.step(batch, GRPO, minibatches=2, generator=torch.Generator().manual_seed(1))
    assert m["nonfinite"] == 0.0 and t.version == 4
    assert [s for s in syncs if MASK_BUILDER not in s] == [], syncs
    moved = batch_to(batch, t.device)
    assert moved.input_ids.is_cuda and torch.equal(moved.input_ids.cpu(), batch.input_ids)
