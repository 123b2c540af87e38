"""The paged model runner against transformers itself: tiny random-init models (seed 0, fp32) of each architecture,
driven through BlockManager + PageStore + BlockTables + PagedRunner + argmax, must generate what `generate` does and
give the logits of the model's own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from factory.core.rollout.engines.kv_budget import KVBudget, kv_bytes_per_token
from factory.core.rollout.engines.paged.blocks import BlockManager
from factory.core.rollout.engines.paged.pages import BlockTables, PageStore
from factory.core.rollout.engines.paged.runner import PagedRunner, supports
from tests.core.paged_models import ATOL, CONFIGS, PAGE, generate, hf_logits, prompts, tiny


class Driver:
    """What the scheduler will do, in the open: admit/prefill, append/decode at a fixed batch of `rows`, fork,
    free."""

    def __init__(self, model, pages: int, rows: int = 6, width: int = 10):
        per = kv_bytes_per_token(model.config, torch.float32)
        self.mgr = BlockManager(KVBudget(pages * PAGE * per, per), PAGE)
        assert self.mgr.num_pages == pages
        self.store = PageStore.for_model(model.config, pages, PAGE, torch.float32, "cpu")
        # stale K/V everywhere (what freed pages and the scratch page hold): a read of an unwritten slot shows
        self.store.kv.normal_(generator=torch.Generator().manual_seed(2))
        self.runner = PagedRunner(model, self.store)
        self.tables = BlockTables(rows, width, self.store.scratch, "cpu")
        self.row: dict[str, int] = {}

    def _place(self, seq: str) -> None:
        self.row[seq] = min(set(range(self.tables.shape[0])) - set(self.row.values()))
        self.tables.set(self.row[seq], self.mgr.block_table(seq))

    def add(self, batch: dict[str, list[int]], max_tokens: int | dict[str, int]) -> dict[str, torch.Tensor]:
        for seq, ids in batch.items():
            self.mgr.admit(seq, len(ids), len(ids) + (max_tokens[seq] if isinstance(max_tokens, dict) else max_tokens))
            self._place(seq)
        logits = self.runner.prefill(list(batch.values()), [self.mgr.block_table(s) for s in batch])
        return dict(zip(batch, logits, strict=True))

    def step(self, feed: dict[str, int]) -> dict[str, torch.Tensor]:
        rows = self.tables.shape[0]
        tokens, positions = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
        for seq, token in feed.items():
            positions[self.row[seq]] = self.mgr.tokens(seq)
            tokens[self.row[seq]] = token
            self.mgr.append(seq)
            self.tables.set(self.row[seq], self.mgr.block_table(seq))
        logits = self.runner.decode(tokens, positions, self.tables.sync())
        return {seq: logits[self.row[seq]] for seq in feed}

    def fork(self, parent: str, child: str) -> None:
        if (copy := self.mgr.fork(parent, child)) is not None:
            self.store.copy_pages([copy[0]], [copy[1]])
        self._place(child)

    def free(self, seq: str) -> None:
        self.mgr.free(seq)
        self.tables.clear(self.row.pop(seq))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_greedy_decode_matches_generate_and_forward(arch):
    model = tiny(arch)
    assert supports(model) is None
    batch = dict(zip("abc", prompts(5, 9, 14), strict=True))
    drv = Driver(model, pages=24)
    logits = drv.add(batch, max_tokens=12)
    out = {s: [] for s in batch}
    for _ in range(12):
        for s, lg in logits.items():
            torch.testing.assert_close(lg, hf_logits(model, batch[s] + out[s]), atol=ATOL, rtol=0)
            out[s].append(int(lg.argmax()))
        if len(out["a"]) < 12:
            logits = drv.step({s: out[s][-1] for s in batch})
    for s, prompt in batch.items():
        assert out[s] == generate(model, prompt, 12), s


def test_fork_shares_full_pages_and_matches_unforked_runs():
    model = tiny("qwen3")
    prompt = prompts(10)[0]  # two full pages of 4 and a partial one
    drv = Driver(model, pages=24)
    first = drv.add({"s0": prompt}, max_tokens=6)["s0"]
    torch.testing.assert_close(first, hf_logits(model, prompt), atol=ATOL, rtol=0)
    for child in ("s1", "s2", "s3"):
        drv.fork("s0", child)
    shared = drv.mgr.block_table("s0")[:2]
    assert all(drv.mgr.block_table(s)[:2] == shared for s in ("s1", "s2", "s3"))
    assert [drv.mgr.refcount(p) for p in shared] == [4, 4]
    # each sample continues differently (what sampling gives a group): its own tokens, its own logits
    g = torch.Generator().manual_seed(1)
    feeds = {s: torch.randint(1, 128, (5,), generator=g).tolist() for s in ("s0", "s1", "s2", "s3")}
    for t in range(5):
        logits = drv.step({s: f[t] for s, f in feeds.items()})
        for s, f in feeds.items():
            torch.testing.assert_close(logits[s], hf_logits(model, prompt + f[: t + 1]), atol=ATOL, rtol=0)
    assert [drv.mgr.refcount(p) for p in shared] == [4, 4]


def test_requests_join_and_leave_mid_run():
    model = tiny("llama")
    prompt = dict(zip("abcd", prompts(5, 9, 14, 7), strict=True))
    want = {"a": 4, "b": 12, "c": 12, "d": 8}
    # 17 pages: a (3), b (6), c (7) reserve 16; d (4) fits only once a's are back (the store starts full of stale K/V)
    drv = Driver(model, pages=17)
    logits = drv.add({s: prompt[s] for s in "abc"}, max_tokens=want)
    out: dict[str, list[int]] = {s: [] for s in "abc"}
    joined_at = None
    while logits:
        for s, lg in logits.items():
            torch.testing.assert_close(lg, hf_logits(model, prompt[s] + out[s]), atol=ATOL, rtol=0)
            out[s].append(int(lg.argmax()))
        if "d" not in out and len(out["a"]) == want["a"]:  # a leaves, d joins the decode batch in its place
            assert not drv.mgr.can_admit(len(prompt["d"]), len(prompt["d"]) + want["d"])
            drv.free("a")
            logits = drv.add({"d": prompt["d"]}, max_tokens=want)
            joined_at, out["d"] = len(out["b"]), []
            continue
        live = {s: o[-1] for s, o in out.items() if s in drv.row and len(o) < want[s]}
        logits = drv.step(live) if live else {}
    assert joined_at == 4 and "a" not in drv.mgr
    for s in "abcd":
        assert out[s] == generate(model, prompt[s], want[s]), s


@pytest.mark.parametrize(("arch", "overrides", "says"), [
    ("mistral", {"sliding_window": 4096}, "sliding_window=4096"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
               "layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "'dynamic'"),
])
def test_supports_names_why_a_model_is_off_the_path(arch, overrides, says):
    model = tiny(arch, **overrides)
    why = supports(model)
    assert why is not None and says in why
    with pytest.raises(ValueError, match="paged runner cannot run"):
        PagedRunner(model, PageStore.for_model(model.config, 4, PAGE, torch.float32, "cpu"))


def test_supports_rejects_other_architectures():
    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert "model_type 'gpt2'" in supports(gpt2)


def test_prefill_from_prefix_cache_reads_the_cached_pages():
    model = tiny("qwen2")
    per = kv_bytes_per_token(model.config, torch.float32)
    mgr = BlockManager(KVBudget(16 * PAGE * per, per), PAGE, prefix_cache=True)
    store = PageStore.for_model(model.config, mgr.num_pages, PAGE, torch.float32, "cpu")
    store.kv.normal_(generator=torch.Generator().manual_seed(2))
    runner = PagedRunner(model, store)
    first, tail = prompts(10, 5)
    mgr.admit("first", len(first), len(first) + 4, token_ids=first)
    runner.prefill([first], [mgr.block_table("first")])
    second = first[:9] + tail  # its first two pages are first's
    mgr.admit("second", len(second), len(second) + 4, token_ids=second)
    assert mgr.cached_tokens("second") == 8 and mgr.block_table("second")[:2] == mgr.block_table("first")[:2]
    logits = runner.prefill([second], [mgr.block_table("second")], starts=[mgr.cached_tokens("second")])
    torch.testing.assert_close(logits[0], hf_logits(model, second), atol=ATOL, rtol=0)


def test_prefill_names_mismatched_inputs():
    model = tiny("llama")
    runner = PagedRunner(model, PageStore.for_model(model.config, 4, PAGE, torch.float32, "cpu"))
    with pytest.raises(ValueError, match="prefill got 0 prompts"):
        runner.prefill([], [])
    with pytest.raises(ValueError, match="2 prompts, 1 block tables"):
        runner.prefill([[1, 2], [3]], [[0]])
    with pytest.raises(ValueError, match="prompt 0: start 0 of 5 tokens in 1 pages"):
        runner.prefill([[1, 2, 3, 4, 5]], [[0]])
