"""LoRA vs full fine-tuning: bytes of each published weight update, through the real publishing path.

The model of `--model DIR` (an HF causal-LM directory, e.g. SmolLM2-135M-Instruct) is trained for `--steps` real
optimizer steps (`TorchTrainer`, AdamW, a policy-gradient loss -A * log p over chat-templated prompts with fixed
completions and advantages +-1), once with full fine-tuning and once per `--ranks` with LoRA adapters
(`trainer.lora`: alpha 2r, default targets 'all-linear'). After every step the version is published with
`WeightPublisher` over a `SharedDirTransport` (files in a temp dir, as the trainer and a rollout process on one host
share them): version 1 as a full update, the later ones as lossless deltas against the previous version. Bytes are
`WeightUpdate.nbytes` of what was sent, which equals the file written (checked).

Published states: full fine-tuning, the model's state dict; LoRA, `lora.adapter_state` (A, B and the scaling per
adapted module: what the embedded engine receives and merges); and for reference LoRA's merged weights (what the
rollout server path still receives: deltas of the merged state). Prints a table, then one JSON line.

    .venv/bin/python benchmarks/lora_update.py --model /path/to/smollm2 [--ranks 8,16] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from factory.config import LoraSpec  # noqa: E402
from factory.core.batch import pack  # noqa: E402
from factory.core.trainer.torch_trainer import TorchTrainer  # noqa: E402
from factory.core.weights import SharedDirTransport, WeightPublisher  # noqa: E402
from factory.models import lora  # noqa: E402

PROMPTS = ["What is 17 + 25? Answer with just the number.", "Name a prime number larger than 10.",
           "What is the capital of France?", "Spell 'cat' backwards."]
ANSWERS = ["42", "11", "Paris", "tac"]


def batch_for(tok):
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    completions = [tok(a + "<|im_end|>", add_special_tokens=False).input_ids for a in ANSWERS]
    adv = [1.0, -1.0, 1.0, -1.0]
    return pack(prompts, completions, tok.pad_token_id or 0, {}, {"advantages": adv})


def loss_fn(logp, mb):
    mask = mb.loss_mask
    return -(logp * mb.per_seq["advantages"][:, None] * mask).sum() / mask.sum(), {}


def run(model_dir: str, rank: int | None, steps: int, lr: float, batch) -> dict:
    """Train `steps` steps (LoRA of `rank`, or full with None); publish after each; the bytes of every version."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    if rank is not None:
        lora.attach(model, LoraSpec(r=rank, alpha=2.0 * rank))
    trainer = TorchTrainer(model, lr=lr)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out = {"rank": rank, "params": params, "trainable": trainable, "versions": []}
    streams = {"published": lambda: lora.adapter_state(model) if rank is not None else model.state_dict()}
    if rank is not None:
        streams["merged"] = lambda: lora.merged_state(model)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        pubs = {k: WeightPublisher(SharedDirTransport(Path(tmp) / k, keep=2), full_every=0) for k in streams}
        for version in range(1, steps + 1):
            t0 = time.perf_counter()
            trainer.step(batch, loss_fn)
            row = {"version": version, "train_s": time.perf_counter() - t0}
            for name, state in streams.items():
                t0 = time.perf_counter()
                upd = pubs[name].publish(state(), version)
                files = list((Path(tmp) / name).glob(f"v{version:012d}-*.fwu"))
                on_disk = files[0].stat().st_size if files else None
                assert on_disk == upd.nbytes, (name, on_disk, upd.nbytes)
                row[name] = {"encoding": upd.encoding, "bytes": upd.nbytes, "tensors": len(upd.tensors),
                             "publish_s": time.perf_counter() - t0}
            out["versions"].append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF causal-LM directory (e.g. SmolLM2-135M-Instruct)")
    ap.add_argument("--ranks", default="8,16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW lr, both full and LoRA")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    batch = batch_for(tok)
    results = [run(args.model, None, args.steps, args.lr, batch)]
    results += [run(args.model, int(r), args.steps, args.lr, batch) for r in args.ranks.split(",")]
    full_first = results[0]["versions"][0]["published"]["bytes"]
    print(f"{'run':<10} {'trainable':>12} {'version':>7} {'encoding':>8} {'published B':>14} {'vs full':>9} "
          f"{'merged B':>14}")
    for res in results:
        name = "full" if res["rank"] is None else f"lora r={res['rank']}"
        for v in res["versions"]:
            pub, merged = v["published"], v.get("merged")
            print(f"{name:<10} {res['trainable']:>12,} {v['version']:>7} {pub['encoding']:>8} {pub['bytes']:>14,} "
                  f"{pub['bytes'] / full_first:>9.5f} {merged['bytes'] if merged else '-':>14}")
    summary = {"model": str(args.model), "steps": args.steps, "lr": args.lr, "params": results[0]["params"],
               "runs": [{"rank": r["rank"], "trainable": r["trainable"],
                         "bytes": [v["published"]["bytes"] for v in r["versions"]],
                         "encodings": [v["published"]["encoding"] for v in r["versions"]],
                         "merged_bytes": [v["merged"]["bytes"] for v in r["versions"]] if r["rank"] else None}
                        for r in results]}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
