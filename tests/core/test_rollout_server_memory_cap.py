"""`factory serve` on an 8k-context model under a memory cap (RLIMIT_DATA: the kernel refuses the process's private
memory past it; a cgroup is not available everywhere): long prompts served side by side are all answered, the KV
budget it sized by default from the memory left under the cap holds them, and `/health` answers meanwhile.

Before the KV budget, one 4000-token prompt made the slot cache allocate all 64 rows at twice its width (64 x 8002
columns x 2 KiB: 1 GiB), past this cap: the requests failed with the allocator's error."""

from __future__ import annotations

import sys
import threading

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from factory.core.rollout.engines.kv_budget import _proc_kb
from factory.infra.supervisor import ServiceProcess
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer

CONTEXT = 8192
PROMPT_TOKENS = 4000
ABOVE_SELF = 1 << 30  # the cap: this much over the test process's own private memory (a server's, imports alike)
STUCK_S = 600.0  # bounds that only turn a hang into a failure (long prompts on two loaded cores)

CAPPED = """import resource, runpy, sys
cap = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
sys.argv = ["factory", *sys.argv[2:]]
runpy.run_module("factory.cli", run_name="__main__")
"""


@pytest.mark.slow  # a `factory serve` process and four 4000-token prefills: 44 s measured, two cores at load 13
def test_long_prompts_side_by_side_under_a_memory_cap(tmp_path):
    tok = build_tokenizer()
    # 4 layers x 4 KV heads x 16 x (K, V) x fp32: 2 KiB per token, cheap to run (hidden 64)
    config = AutoConfig.for_model("qwen2", vocab_size=len(tok), hidden_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                                  max_position_embeddings=CONTEXT, tie_word_embeddings=True,
                                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    save_checkpoint(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tok, tmp_path / "long")
    cap = _proc_kb("/proc/self/status")["VmData"] + ABOVE_SELF
    argv = [sys.executable, "-c", CAPPED, str(cap), "serve", "--checkpoint", str(tmp_path / "long"), "--port",
            "{port}", "--threads", "1", "--max-batch", "64"]
    with ServiceProcess("capped rollout server", argv, log_path=tmp_path / "serve.log", startup_timeout=STUCK_S,
                        max_restarts=0) as svc, httpx.Client(base_url=svc.url, timeout=STUCK_S) as probe:
        info = probe.get("/get_server_info").json()
        assert info["max_seq_len"] == CONTEXT and info["kv_token_bytes"] == 2048
        assert 0 < info["kv_budget_bytes"] < cap // 2  # half of what was left under the cap, not of the machine
        answers, done = [], threading.Event()

        def ask(i: int) -> None:
            prompt = "".join(str((i + k) % 10) + "+" for k in range(PROMPT_TOKENS))[: PROMPT_TOKENS - 1]
            r = httpx.post(svc.url + "/v1/completions", timeout=STUCK_S,
                           json={"prompt": prompt, "max_tokens": 8, "seed": i, "ignore_eos": True})
            answers.append((r.status_code, r.text[:300]))

        clients = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in clients:
            t.start()
        health = []
        while not done.is_set():  # /health answers while the long prompts are prefilled and decoded
            health.append(probe.get("/health").status_code)
            done.wait(0.05)
            if not any(t.is_alive() for t in clients):
                done.set()
        for t in clients:
            t.join(STUCK_S)
        assert [s for s, _ in answers] == [200] * 4, answers
        assert health and set(health) == {200}
        info = probe.get("/get_server_info").json()
        assert info["completed"] == 4 and info["kv_allocated_bytes"] <= info["kv_budget_bytes"]
        assert svc.alive()
