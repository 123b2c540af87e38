"""The determinism check: one seeded forward/backward/SGD step of the `micro` preset, run twice on one thread, must be
bit-identical, and must match the golden recorded for this software and CPU kernel set.

Why a tolerance against the golden, and none between the two runs: two runs in one process on one thread execute
the same instructions on the same data, so any difference is a fault (nondeterministic kernels, bad memory, a
flaky core) and is held to exact equality. The golden was recorded on another machine: with the same torch,
transformers and CPU capability (the kernel set ATen dispatches to: AVX512, AVX2, DEFAULT...) the kernels are the
same, but the BLAS library may still pick a different blocking for another CPU model of that capability, which
reorders float sums and moves the last bits (measured across kernel sets on one CPU, as a stand-in: the losses agree to
the bit, the gradient bytes differ, their norm by 4e-9 relative AVX2 vs AVX512 and 2e-8 DEFAULT vs AVX512). A wrong
stack (a library version that changed numerics or initialisation, a broken kernel, a miscompiled build) moves them
by far more. So loss, loss after one step and gradient norm are held to a relative tolerance of 1e-5 (500x the
largest difference measured), and the message says whether the gradients matched the golden to the bit.
An unknown combination passes with "no golden for ..." and the measured values, to be added with
`python -m factory.ops.preflight.determinism --record`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.ops.preflight.perf import torch_threads
from factory.ops.preflight.result import CheckResult

GOLDEN_FILE = Path(__file__).with_name("goldens.json")
RTOL = 1e-5
SEED = 0
BATCH, SEQ = 4, 24
COMPARED = ("loss", "loss_after_step", "grad_norm")  # held to RTOL against the golden


def golden_key() -> str:
    return (f"torch {torch.__version__} / transformers {transformers.__version__} / "
            f"{torch.backends.cpu.get_cpu_capability()}")


def micro_step(seed: int = SEED) -> dict[str, Any]:
    """Loss, loss after one SGD step, and a digest of every gradient's bytes, for a freshly built `micro` model."""
    # fork_rng: the check seeds torch, and must not change the random stream of a run in the same process.
    with torch.random.fork_rng(devices=[]), torch_threads(1):
        tok = build_tokenizer()
        model = build_model("micro", tok, seed=seed)
        model.train()
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, len(tok), (BATCH, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        digest, sq = hashlib.sha256(), 0.0
        for name, p in model.named_parameters():
            digest.update(name.encode())
            digest.update(p.grad.numpy().tobytes())
            sq += float(p.grad.double().square().sum())
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        with torch.no_grad():
            after = model(input_ids=ids, labels=ids).loss
    return {"loss": loss.item(), "loss_after_step": after.item(), "grad_norm": sq**0.5,
            "grad_sha256": digest.hexdigest()}


def load_goldens(path: Path = GOLDEN_FILE) -> dict[str, dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def determinism_check(goldens: dict[str, dict[str, Any]] | None = None) -> CheckResult:
    first, second = micro_step(), micro_step()
    key = golden_key()
    value = first["loss_after_step"]
    if first != second:
        return CheckResult("determinism", False, value, None, "loss", "two runs bit-identical",
                           f"two identical seeded one-thread steps differ ({first} vs {second}): nondeterministic "
                           f"kernels, bad memory or a faulty core ({key})")
    golden = (load_goldens() if goldens is None else goldens).get(key)
    if golden is None:
        return CheckResult("determinism", True, value, None, "loss", "two runs bit-identical",
                           f"two runs bit-identical; no golden for {key}: recorded loss {first['loss']!r}, after one "
                           f"step {value!r} (add it: python -m factory.ops.preflight.determinism --record)")
    want = golden["loss_after_step"]
    diffs = [abs(first[k] - golden[k]) / max(abs(golden[k]), 1e-12) for k in COMPARED]
    expected = f"golden {want!r} within {RTOL:g} relative ({key})"
    if max(diffs) > RTOL:
        got = ", ".join(f"{k} {first[k]!r} (golden {golden[k]!r})" for k in COMPARED)
        return CheckResult("determinism", False, value, want, "loss", expected,
                           f"{got}: relative difference {max(diffs):.2e} > {RTOL:g}: this node computes different "
                           f"numbers than the reference for {key}")
    exact = first["grad_sha256"] == golden.get("grad_sha256") and max(diffs) == 0
    how = "bit-identical to the golden" if exact else f"within {max(diffs):.1e} of the golden (last bits differ)"
    return CheckResult("determinism", True, value, want, "loss", expected,
                       f"two runs bit-identical, {how} for {key}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.ops.preflight.determinism",
                                description="Print this node's micro-step values, or record them as the golden.")
    p.add_argument("--record", action="store_true", help=f"add/replace this node's entry in {GOLDEN_FILE.name}")
    args = p.parse_args(argv)
    key, values = golden_key(), micro_step()
    print(json.dumps({key: values}, indent=2))
    if args.record:
        goldens = load_goldens()
        goldens[key] = values
        tmp = GOLDEN_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(sorted(goldens.items())), indent=2) + "\n")
        os.replace(tmp, GOLDEN_FILE)
        print(f"recorded in {GOLDEN_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
