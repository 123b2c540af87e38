"""The paged engine's on-device sampler (`factory/core/rollout/engines/paged/sampling.py`): its distributions, batch
invariance, logprobs against the trainer's, determinism of the counter-based noise, no host sync, and one
`fullgraph` graph with no recompile over 50 steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2
from torch._dynamo.utils import counters

from factory.core.rollout.engines.paged.sampling import (
    Knobs,
    _inverse_cdf,
    knobs,
    noise_bits,
    row_uniform,
    sample,
    uniforms,
)
from factory.core.trainer.logprobs import logprobs_from_logits
from tests.core.host_sync import NoHostCopy, NoHostSync

# Logits over 8 tokens whose softmax (and every truncation below) keeps clear of the top-p boundaries.
LOGITS = [2.0, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0, -2.0]
DRAWS = 40_000


def _expected(logits: list[float], temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """The reference distribution in float64: softmax(logits / T), top-k, renormalize, top-p, renormalize."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    kept = p[order][: top_k or len(p)]
    kept = kept / kept.sum()
    n = int(np.sum(np.cumsum(kept) - kept < top_p)) if top_p < 1 else len(kept)
    keep[order[:max(n, 1)]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def _draws(temperature: float, top_p: float, top_k: int, seed: int = 7) -> np.ndarray:
    """Token counts of DRAWS steps of one seeded request (counters 0..DRAWS-1), drawn in one batched call."""
    k = knobs([temperature] * DRAWS, [top_p] * DRAWS, [top_k] * DRAWS, [False] * DRAWS, [seed] * DRAWS,
              list(range(DRAWS)))
    tokens = sample(torch.tensor([LOGITS] * DRAWS), k).tokens
    return np.bincount(tokens.numpy(), minlength=len(LOGITS))


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [
    (1.0, 1.0, 0), (0.6, 1.0, 0), (1.5, 1.0, 0), (1.0, 0.8, 0), (1.0, 1.0, 3), (0.8, 0.9, 5), (1.0, 0.5, 0),
    (1.0, 0.7, 3)])
def test_frequencies_match_the_tempered_truncated_softmax(temperature, top_p, top_k):
    counts = _draws(temperature, top_p, top_k)
    q = _expected(LOGITS, temperature, top_p, top_k)
    assert counts[q == 0].sum() == 0  # truncated tokens are never drawn
    support = q > 0
    stat = float(np.sum((counts[support] - DRAWS * q[support]) ** 2 / (DRAWS * q[support])))
    # Deterministic at this seed; the bound is the chi-square 0.999 quantile at the support's degrees of freedom.
    assert stat < chi2.ppf(0.999, int(support.sum()) - 1), (stat, counts, DRAWS * q)


def test_a_wrong_distribution_fails_the_same_bound():
    """The test above can fail: the draws at temperature 0.6 against the temperature-1 distribution."""
    counts, q = _draws(0.6, 1.0, 0), _expected(LOGITS, 1.0, 1.0, 0)
    assert np.sum((counts - DRAWS * q) ** 2 / (DRAWS * q)) > chi2.ppf(0.999, len(LOGITS) - 1)


def test_a_vanishing_top_p_keeps_the_most_likely_token():
    """Never an empty support (all -inf draws argmax to token 0): top-p 0 degenerates to the argmax."""
    rows, vocab = 32, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2))
    out = sample(logits, knobs([1.0] * rows, [0.0] * (rows // 2) + [1e-9] * (rows // 2), [0] * rows,
                               [False] * rows, list(range(rows)), [0] * rows))
    assert torch.equal(out.tokens, logits.argmax(-1))


def _step_logits(generator: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=generator) * 2


def test_a_seeded_row_draws_the_same_tokens_alone_or_anywhere_in_a_batch():
    vocab, steps = 300, 20
    mine = torch.stack([_step_logits(torch.Generator().manual_seed(100 + s), 1, vocab)[0] for s in range(steps)])
    rng = torch.Generator().manual_seed(1)

    def run(batch: int, at: int) -> tuple[list[int], list[float]]:
        tokens, logps = [], []
        for s in range(steps):
            logits = _step_logits(rng, batch, vocab)
            logits[at] = mine[s]
            others = torch.rand(batch, generator=rng)  # other rows: other temperatures, top-p, top-k, seeds, counters
            t = (0.3 + others).tolist()
            p = (0.5 + others / 2).tolist()
            k = [int(x * 40) for x in others]
            seed = [int(x * 1e9) for x in others]
            ctr = [s + 3 * i for i in range(batch)]
            t[at], p[at], k[at], seed[at], ctr[at] = 0.9, 0.95, 0, 12345, s
            out = sample(logits, knobs(t, p, k, [False] * batch, seed, ctr))
            tokens.append(int(out.tokens[at]))
            logps.append(float(out.logprobs[at]))
        return tokens, logps

    alone = run(1, 0)
    assert run(7, 0) == alone and run(7, 5) == alone
    assert len(set(alone[0])) > 10  # a real stream, not one repeated token


def test_greedy_is_the_argmax_and_logprobs_are_the_trainers():
    rows, vocab = 6, 500
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 3
    temps = [0.7, 1.0, 1.3, 0.5, 2.0, 0.9]
    greedy = [False, True, False, True, False, False]
    k = knobs(temps, [1.0, 1.0, 0.9, 1.0, 0.7, 1.0], [0, 0, 0, 5, 20, 0], greedy, list(range(rows)), [4] * rows)
    out = sample(logits, k, top_logprobs=3)
    assert torch.equal(out.tokens[[1, 3]], logits[[1, 3]].argmax(-1))
    for i in range(rows):
        at = 1.0 if greedy[i] else temps[i]  # greedy: the untempered distribution
        trainer, _ = logprobs_from_logits(logits[i : i + 1, None, :], out.tokens[i : i + 1, None], temperature=at)
        torch.testing.assert_close(out.logprobs[i], trainer[0, 0], atol=1e-5, rtol=0)
        top = torch.log_softmax(logits[i] / at, -1).topk(3)
        assert torch.equal(out.top_ids[i], top.indices)
        torch.testing.assert_close(out.top_logprobs[i], top.values, atol=1e-5, rtol=0)
    half = logits.bfloat16()  # the serving dtype on a GPU: computed in float32, as the trainer does
    out = sample(half, k)
    for i in range(rows):
        trainer, _ = logprobs_from_logits(half[i : i + 1, None, :], out.tokens[i : i + 1, None],
                                          temperature=1.0 if greedy[i] else temps[i])
        torch.testing.assert_close(out.logprobs[i], trainer[0, 0], atol=1e-5, rtol=0)


def test_the_draw_is_the_inverse_cdf_of_one_uniform_per_row():
    """One counter-based uniform per row (not a noise word per vocabulary entry): the token is where u times the
    row's total falls in its cumulative distribution, in vocabulary order, or in sorted order once truncated."""
    rows, vocab = 64, 3000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)) * 2
    seeds, ctrs = list(range(100, 100 + rows)), [7 * i for i in range(rows)]
    u = row_uniform(torch.tensor(seeds), torch.tensor(ctrs)).double().numpy()
    assert torch.equal(row_uniform(torch.tensor(seeds), torch.tensor(ctrs)),
                       uniforms(torch.tensor(seeds), torch.tensor(ctrs), vocab)[:, 0])
    p = torch.softmax(logits.double(), -1).numpy()
    out = sample(logits, knobs([1.0] * rows, [1.0] * rows, [0] * rows, [False] * rows, seeds, ctrs), truncate=False)
    want = [int(np.searchsorted(np.cumsum(p[i]), u[i] * p[i].sum())) for i in range(rows)]
    assert out.tokens.tolist() == want
    top_k = 50  # truncated: the same search over the 50 most likely, in descending order
    out = sample(logits, knobs([1.0] * rows, [1.0] * rows, [top_k] * rows, [False] * rows, seeds, ctrs))
    order = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    kept = np.take_along_axis(p, order, -1)
    want = [int(order[i, np.searchsorted(np.cumsum(kept[i]), u[i] * kept[i].sum())]) for i in range(rows)]
    assert out.tokens.tolist() == want


def test_the_inverse_cdf_never_takes_a_zero_probability_token():
    """Not even where u * total rounds up to the total (u at its cap) with zero-probability entries at the end,
    nor where u is tiny and the first entry has probability 0."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 3)
    u = torch.tensor([2.0**-33, 0.5, 1.0 - 2.0**-24])
    assert _inverse_cdf(probs, u).tolist() == [1, 1, 3]
    odd = torch.tensor([[0.0, 0.3, 0.0, 0.7 + 2.0**-23, 0.0]])  # a total whose product with the cap rounds up
    assert _inverse_cdf(odd, torch.tensor([1.0 - 2.0**-24])).tolist() == [3]


def test_allowed_tokens_renormalize_the_draw_and_the_logprobs():
    rows, vocab = 50, 40
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5))
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    allowed[:, [3, 17, 29]] = True
    out = sample(logits, knobs([1.0] * rows, [1.0] * rows, [0] * rows, [False] * rows, [9] * rows, list(range(rows))),
                 allowed=allowed)
    assert set(out.tokens.tolist()) <= {3, 17, 29} and len(set(out.tokens.tolist())) == 3
    expect = torch.log_softmax(logits[:, [3, 17, 29]], -1)
    col = {3: 0, 17: 1, 29: 2}
    got = torch.stack([expect[i, col[int(t)]] for i, t in enumerate(out.tokens)])
    torch.testing.assert_close(out.logprobs, got, atol=1e-6, rtol=0)


def test_noise_is_a_pure_function_of_seed_counter_and_token():
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 0x9E3779B97F4A7C15 - 2**64])
    counters = torch.tensor([0, 1, 2, 3, 2**31, 2**32 - 1])
    bits = noise_bits(seeds, counters, 1000)
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**32
    for i in range(len(seeds)):  # a row computed alone equals the row computed in the batch
        assert torch.equal(noise_bits(seeds[i : i + 1], counters[i : i + 1], 1000)[0], bits[i])
    for i in range(len(seeds)):  # the int64 tensor arithmetic is the plain 32-bit unsigned hash, exactly
        assert bits[i, :50].tolist() == [_reference_bits(int(seeds[i]), int(counters[i]), v) for v in range(50)]
    # Pinned: any change to the noise function changes every seeded stream, which must be a deliberate choice.
    assert noise_bits(torch.tensor([1]), torch.tensor([0]), 4)[0].tolist() == GOLDEN_NOISE
    u = uniforms(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.002  # n = 262,144: the mean's sd is 0.00056
    lag = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(float(lag)) < 0.01  # neighbouring tokens' noise is uncorrelated


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = x * 0x7FEB352D & 0xFFFFFFFF
    x ^= x >> 15
    x = x * 0x846CA68B & 0xFFFFFFFF
    return x ^ (x >> 16)


def _reference_bits(seed: int, counter: int, token: int) -> int:
    """The noise word in plain Python integers (unsigned 32-bit arithmetic), as the module docstring defines it."""
    seed &= (1 << 64) - 1
    lo, hi, ctr = seed & 0xFFFFFFFF, seed >> 32, counter & 0xFFFFFFFF
    k1 = _lowbias32(_lowbias32(_lowbias32(lo ^ 0x9E3779B9) ^ hi) ^ ctr)
    k2 = _lowbias32(_lowbias32(_lowbias32(hi ^ 0x7F4A7C15) ^ ctr) ^ lo)
    return _lowbias32(_lowbias32(_lowbias32(token ^ 0xBF58476D) ^ k1) ^ k2)


GOLDEN_NOISE = [1346359392, 2331610794, 2205934534, 3578739015]


def test_same_seed_and_counter_give_the_same_token_other_seeds_other_streams():
    vocab, steps = 1000, 30
    logits = torch.zeros(steps, vocab)  # flat: every token is equally likely, so streams differ only by noise

    def stream(seed: int, start: int = 0) -> list[int]:
        k = knobs([1.0] * steps, [1.0] * steps, [0] * steps, [False] * steps, [seed] * steps,
                  list(range(start, start + steps)))
        return sample(logits, k, truncate=False).tokens.tolist()

    a = stream(42)
    assert stream(42) == a
    assert stream(42, start=10)[:20] == a[10:]  # the token at a counter does not depend on the other steps
    assert sum(x != y for x, y in zip(stream(43), a, strict=True)) >= steps - 2  # flat: collisions 1 in 1000
    assert len(set(a)) >= steps - 2


def _some_knobs(rows: int, step: int) -> Knobs:
    g = torch.Generator().manual_seed(step)
    r = torch.rand(rows, generator=g)
    return Knobs(0.2 + r, 0.3 + r * 0.7, (r * 30).long(), r > 0.8, torch.randint(-2**62, 2**62, (rows,), generator=g),
                 torch.randint(0, 5000, (rows,), generator=g))


def test_sampling_makes_no_host_sync():
    logits = torch.randn(8, 300)
    with NoHostSync(), NoHostCopy():
        sample(logits, _some_knobs(8, 0), top_logprobs=2)
        sample(logits, _some_knobs(8, 1), truncate=False, allowed=logits > 0)
    for sync in (lambda: logits.sum().item(), lambda: logits.tolist(), lambda: bool(logits.sum() > 0)):
        with pytest.raises(AssertionError, match="host sync"), NoHostSync(), NoHostCopy():
            sync()  # the guards catch what they are there for


def test_one_fullgraph_graph_and_no_recompile_over_50_steps():
    rows, vocab = 16, 512
    explained = torch._dynamo.explain(sample)(torch.randn(rows, vocab), _some_knobs(rows, 0))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    logits = torch.randn(rows, vocab)
    other = torch._dynamo.explain(sample)(logits, _some_knobs(rows, 1), truncate=False, allowed=logits > 0,
                                          top_logprobs=4)
    assert other.graph_break_count == 0 and other.graph_count == 1
    torch._dynamo.reset()
    counters.clear()
    # aot_eager: also traced by AOT autograd (functionalized), as inductor and CUDA-graph capture trace it.
    compiled = torch.compile(sample, backend="aot_eager", fullgraph=True)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(50):
            k = _some_knobs(rows, step)
            out = compiled(logits, k)
            if step % 10 == 0:  # the compiled graph computes what eager does
                ref = sample(logits, k)
                assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.logprobs, ref.logprobs)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
