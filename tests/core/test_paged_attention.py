"""The paged attention kernel (`factory/core/rollout/engines/paged/attention.py`) without a GPU: its cases
(`paged_attention_cases.py`: equal to SDPA over the gathered pages in fp32 to 1e-5 and in bf16 within its rounding,
shared and forked pages, ragged lengths, NaN past every row's length never read, the runner's own tests on it) run
in Triton's interpreter in a child pytest; the kernel compiles to a cubin for the H200 (sm_90) with triton's own
ptxas, no device needed; and the runner says which attention it took."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from factory.core.rollout.engines.paged import attention
from factory.core.rollout.engines.paged.pages import PageStore
from factory.core.rollout.engines.paged.runner import PagedRunner
from tests.core.paged_models import PAGE, tiny

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not attention.available(), reason="triton is not installed (extra: kernels)")


@needs_triton
def test_kernel_cases_in_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          str(ROOT / "tests/core/paged_attention_cases.py")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "7 passed" in run.stdout, run.stdout[-2000:]


@needs_triton
@pytest.mark.parametrize(("q", "kv"), [("*bf16", "*bf16"), ("*fp32", "*fp32")])
def test_kernel_compiles_for_an_h200(q, kv):
    """The compiled path (what CUDA runs), through triton's frontend, LLVM and ptxas for sm_90: Qwen2-0.5B's
    shape (14 heads over 2 KV heads: groups of 7, padded to 8; head_dim 64; pages of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if triton.knobs.runtime.interpret:
        pytest.skip("this process interprets triton (TRITON_INTERPRET=1): nothing compiles here")
    sig = {"q_ptr": q, "k_ptr": kv, "v_ptr": kv, "table_ptr": "*i32", "pos_ptr": "*i64", "out_ptr": q}
    sig |= {f"stride_{n}": "i64" for n in ("qb", "qs", "qh", "kp", "kt", "kh", "tb", "pb", "ob", "os", "oh")}
    consts = dict(GROUP=7, BLOCK_G=8, HEAD_DIM=64, BLOCK_D=64, PAGE_SIZE=16, BLOCK_N=32)
    sig |= {"scale_log2": "fp32"} | dict.fromkeys(consts, "constexpr")
    kernel = triton.compile(triton.compiler.ASTSource(fn=attention._kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"] and ".entry _kernel_source" in kernel.asm["ptx"]


def test_runner_takes_the_gather_path_on_the_cpu_and_names_a_bad_choice():
    model = tiny("llama")
    store = PageStore.for_model(model.config, 4, PAGE, torch.float32, "cpu")
    runner = PagedRunner(model, store)
    assert runner.attention == "gather" and not runner.reads_real_lengths
    with pytest.raises(ValueError, match="attention must be one of paged, gather, got 'flex'"):
        PagedRunner(model, store, attention="flex")


def test_kernel_refuses_cpu_tensors_outside_the_interpreter():
    if not attention.available() or attention._interpreting():
        pytest.skip("needs triton, compiled mode")
    q = torch.zeros(1, 1, 2, 4)
    kv = torch.zeros(2, 4, 1, 4)
    with pytest.raises(ValueError, match="run only in Triton's interpreter; set TRITON_INTERPRET=1"):
        attention.paged_attention(q, kv, kv, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.long),
                                  1.0)
