"""The shared-buffer weight handoff (`factory/core/weights/shared.py`) against the lossless delta codec, on the CPU.

A Qwen2-0.5B-shaped state (hidden 896, MLP 4864, vocabulary 151936, tied head; `--layers` decoder layers, default 4
of its 24, to fit a small shared machine) in fp32, as a trainer holds it, handed over in bf16, as a server serves it:

- shared publish: `SharedWeightsWriter.publish` (cast-copy fp32 -> bf16 into a /dev/shm slot, seqlock);
- shared read:    `SharedWeightsReader.read_into` of that version into bf16 tensors (another process would do the
                  same copy from the same pages; here the reader is in this process);
- codec:          `encode_delta` of the bf16 cast against the previous version + `to_bytes` + `from_bytes` +
                  `apply_update` (what `ServerProducer` did per version, without HTTP).

Each version is one small step (every weight + N(0, 1e-3)). Medians and ranges over `--versions` versions after one
warm-up. Prints one JSON line.

    python benchmarks/shared_weights.py --layers 4 --versions 5

`--smoke` (in the suite: tests/benchmarks/test_shared_weights_bench.py) runs the code path on a tiny state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from factory.core.weights import WeightUpdate, apply_update, encode_delta
from factory.core.weights.shared import SharedWeightsReader, SharedWeightsWriter


def qwen2_05b_state(layers: int, seed: int = 0, vocab: int = 151936) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, m, v, kv = 896, 4864, vocab, 128
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (m, h),
                       p + "mlp.up_proj.weight": (m, h), p + "mlp.down_proj.weight": (h, m),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    state = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied, as in Qwen2-0.5B
    return state


def step(state: dict[str, torch.Tensor], g: torch.Generator) -> None:
    seen = set()
    for t in state.values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            t.add_(torch.randn(t.shape, generator=g) * 1e-3)


def bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.to(torch.bfloat16) for k, v in state.items() if k != "lm_head.weight"}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="1 layer, a 1024-token vocabulary, 2 versions: the code "
                    "path runs (every version checked bit for bit), the numbers mean nothing")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.versions = 1, 2
    state = qwen2_05b_state(args.layers, vocab=1024 if args.smoke else 151936)
    g = torch.Generator().manual_seed(1)
    params = sum(t.numel() for k, t in state.items() if k != "lm_head.weight")
    times: dict[str, list[float]] = {"shared_publish_s": [], "shared_read_s": [], "codec_s": []}
    dst = bf16(state)
    previous = bf16(state)
    with SharedWeightsWriter.create(state, torch.bfloat16, "cpu") as writer, \
            SharedWeightsReader.attach(writer.handle()) as reader:
        for version in range(1, args.versions + 2):
            step(state, g)
            t0 = time.perf_counter()
            writer.publish(state, version)
            t1 = time.perf_counter()
            assert reader.read_into(dst) == version
            t2 = time.perf_counter()
            new = bf16(state)
            t3 = time.perf_counter()
            update = encode_delta(previous, new, version, base_version=version - 1)
            applied = apply_update(dict(previous), WeightUpdate.from_bytes(bytes(update.to_bytes())), version - 1)
            t4 = time.perf_counter()
            assert all(torch.equal(applied[k], dst[k]) and torch.equal(new[k], dst[k]) for k in new)  # same bits
            previous = new
            if version > 1:  # the first is a warm-up
                for key, dt in zip(times, (t1 - t0, t2 - t1, t4 - t3), strict=True):
                    times[key].append(dt)
    out = {"params": params, "bytes_bf16": params * 2, "versions": args.versions, "threads": torch.get_num_threads()}
    for key, values in times.items():
        out[key] = round(statistics.median(values), 4)
        out[key.replace("_s", "_range_s")] = [round(min(values), 4), round(max(values), 4)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
