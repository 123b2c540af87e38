"""Weight updates to SGLang servers: time per update, full weights vs Factory's lossless delta, side by side.

The model is a randomly initialised Qwen2-0.5B-shaped Qwen2 (fp32 master weights on the GPU, AdamW at `--lr`,
default 1e-6 as in RL on real LLMs). Each version is one real optimizer step (token-mean NLL of a random batch,
bf16 autocast) and is published as bf16 (what the servers serve). Per version, in one run, against the same
SGLang server(s) (`SGLangServers`, started on the initial weights from `--sglang-python`):

- full_disk:   `SGLangRouter.load_weights` with `DiskUpdate` (safetensors directory, /update_weights_from_disk);
- full_tensor: `SGLangRouter.load_weights` with `TensorUpdate` (/update_weights_from_tensor; CUDA tensors go
               as CUDA IPC handles, so the trainer and the servers share the node);
- delta:       the lossless delta (`factory.core.weights.encode_delta` against the previous version: bit-exact,
               sha256-checked), serialized, parsed and applied to the receiver's copy of the previous version
               (`apply_update`), and the tensors it changed sent through /update_weights_from_tensor.

SGLang has no endpoint that takes Factory's delta encoding, so the delta is decoded next to the servers (here: in
this process, one node) and enters SGLang as full tensors of the changed parameters. What the delta saves is bytes
across a link between the trainer's node and the rollout nodes; one node has no such link, so the table also
prints bytes and, for `--link-gbps`, the transfer time those bytes would take (arithmetic, not a measurement).
Every update is checked by the router (every server must report the new weight_version). Times are medians over
`--versions` versions after one warm-up version; each includes the router's version check.

On one H100 (sglang in its own venv; this script in Factory's venv with CUDA torch):

    python benchmarks/gpu/weight_update.py --sglang-python /opt/sglang-venv/bin/python

`--smoke`: the `micro` shape on CPU against the fake SGLang server (tests/core/fake_sglang_server.py), which
really loads the weights (disk: safetensors; tensor: unpickled): the code path ran, the numbers mean nothing; the
smoke run also checks that every path left the fake server with the new version's weights.

What was NOT run in this repository's sessions: any of it against a real SGLang server or on a GPU (none was
lent); only --smoke, on CPU. Not covered at all: `weight_update: distributed` (NCCL broadcast; on one node
full_tensor's CUDA IPC is the fast path).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device, random_model, sglang_python, sglang_spec, smoke_note, sync  # noqa: E402

from factory.core.sglang.router import SGLangRouter  # noqa: E402
from factory.core.sglang.servers import SGLangServers  # noqa: E402
from factory.core.sglang.weights import DiskUpdate, TensorUpdate  # noqa: E402
from factory.core.weights import WeightUpdate, apply_update, encode_delta  # noqa: E402

PATHS = ("full_disk", "full_tensor", "delta")


def published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a server is sent: the state dict in bf16, on the model's device."""
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, rows: int, seq: int) -> float:
    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=gen).to(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        logits = model(input_ids=ids).logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def server_sums(urls: list[str]) -> list[dict[str, float]]:
    from tests.core.fake_sglang_server import fake_state

    return [fake_state(u)["weights"] for u in urls]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="micro shape, CPU, fake SGLang server")
    ap.add_argument("--sglang-python", default=None, help="python of sglang's venv (default: $SGLANG_PYTHON)")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--versions", type=int, default=None, help="timed versions (default 5; smoke 2)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--rows", type=int, default=4, help="rows of the random batch per optimizer step")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--mem-fraction", type=float, default=0.5,
                    help="--mem-fraction-static of the servers (they share the GPU with the trainer)")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="a trainer-to-rollout link for the bytes arithmetic")
    ap.add_argument("--sglang-arg", action="append", default=[], help="more sglang.launch_server arguments")
    a = ap.parse_args(argv)
    n_versions = a.versions or (2 if a.smoke else 5)
    torch.manual_seed(0)
    if a.smoke:
        torch.set_num_threads(1)
    dev = torch.device("cpu") if a.smoke else device()
    work = Path(tempfile.mkdtemp(prefix="gpu-weight-update-"))
    model = random_model("micro" if a.smoke else "qwen2-0.5b", seed=0)
    model.save_pretrained(work / "initial", safe_serialization=True)  # the servers start from version 0
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    spec = sglang_spec(smoke=a.smoke, workdir=work, servers=a.servers, python=sglang_python(a.sglang_python),
                       mem_fraction=a.mem_fraction,
                       extra_args=["--skip-tokenizer-init", "--dtype", "bfloat16", *a.sglang_arg])
    servers = SGLangServers(spec, work / "initial", work / "logs").start()
    print(f"{a.servers} server(s) up: {servers.urls} (logs {work / 'logs'})", flush=True)
    disk = SGLangRouter(servers.urls, DiskUpdate(work / "weights", config_dir=work / "initial"), servers=servers,
                        update_mode="finish_old")
    tensor = SGLangRouter(servers.urls, TensorUpdate(tp_size=1), servers=servers, update_mode="finish_old")
    prev_cpu = {k: v.cpu() for k, v in published(model).items()}
    receiver = {k: v.clone() for k, v in prev_cpu.items()}  # the rollout node's copy of the current version
    rows: list[dict] = []
    checks: list[bool] = []
    try:
        for v in range(1, n_versions + 2):  # version 1 is the warm-up
            loss = train_step(model, opt, gen, a.rows, a.seq)
            new = published(model)
            sync()
            r: dict = {"version": v, "loss": loss}
            # delta first: the servers hold version v-1, so sending only the changed tensors is complete
            t0 = time.perf_counter()
            new_cpu = {k: t.cpu() for k, t in new.items()}
            t_enc = time.perf_counter()
            upd = encode_delta(prev_cpu, new_cpu, v, v - 1)
            blob = upd.to_bytes()
            r["encode_s"] = time.perf_counter() - t_enc
            t_app = time.perf_counter()
            got = WeightUpdate.from_bytes(blob)
            receiver = apply_update(receiver, got, v - 1, inplace=True)
            r["apply_s"] = time.perf_counter() - t_app
            changed = {tp.name for tp in got.tensors if tp.scheme != "same"}
            send = {k: t.to(dev) for k, t in receiver.items() if k in changed}
            tensor.load_weights(send, v)
            r["delta_s"] = time.perf_counter() - t0
            r["delta_bytes"], r["changed_tensors"], r["tensors"] = len(blob), len(changed), len(new)
            r["full_bytes"] = sum(t.numel() * t.element_size() for t in new.values())
            r["bit_exact"] = all(torch.equal(receiver[k].view(torch.int16), new_cpu[k].view(torch.int16))
                                 for k in new_cpu)
            if a.smoke:
                checks.append(all(s.get(k) == float(new_cpu[k].double().sum()) for s in server_sums(servers.urls)
                                  for k in changed))
            t0 = time.perf_counter()
            tensor.load_weights(new, v)
            sync()
            r["full_tensor_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            disk.load_weights(new, v)
            r["full_disk_s"] = time.perf_counter() - t0
            if a.smoke:
                checks.append(all(s == {k: float(t.double().sum()) for k, t in new_cpu.items()}
                                  for s in server_sums(servers.urls)))
            prev_cpu = new_cpu
            rows.append(r)
            print(f"version {v}: full_disk {r['full_disk_s']:.3f}s  full_tensor {r['full_tensor_s']:.3f}s  "
                  f"delta {r['delta_s']:.3f}s ({r['delta_bytes'] / 1e6:.1f} of {r['full_bytes'] / 1e6:.1f} MB, "
                  f"{r['changed_tensors']}/{r['tensors']} tensors changed)", flush=True)
    finally:
        for router in (disk, tensor):
            router.close()
        servers.stop()

    timed = rows[1:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    link = a.link_gbps * 1e9 / 8
    print()
    note = smoke_note(a.smoke)
    if note:
        print(note)
    print(f"{'path':>12} {'s / update':>11} {'MB sent':>9} {'at ' + format(a.link_gbps, 'g') + ' Gb/s':>11}")
    print(f"{'full_disk':>12} {med('full_disk_s'):11.3f} {med('full_bytes') / 1e6:9.1f} "
          f"{med('full_bytes') / link:10.3f}s")
    print(f"{'full_tensor':>12} {med('full_tensor_s'):11.3f} {med('full_bytes') / 1e6:9.1f} "
          f"{med('full_bytes') / link:10.3f}s")
    print(f"{'delta':>12} {med('delta_s'):11.3f} {med('delta_bytes') / 1e6:9.2f} {med('delta_bytes') / link:10.3f}s"
          f"   (encode {med('encode_s'):.3f}s, apply {med('apply_s'):.3f}s; {med('changed_tensors'):.0f}/"
          f"{timed[0]['tensors']} tensors changed)")
    print(f"medians over {len(timed)} versions after 1 warm-up; lr {a.lr:g}; {a.servers} server(s); delta bit-exact: "
          f"{all(r['bit_exact'] for r in rows)}" + (f"; fake server holds the sent weights: {all(checks)}"
                                                   if a.smoke else ""))
    print(json.dumps({
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "model": "micro" if a.smoke else "qwen2-0.5b", "params": sum(p.numel() for p in model.parameters()),
        "servers": a.servers, "lr": a.lr, "versions": len(timed),
        "full_disk_s": round(med("full_disk_s"), 4), "full_tensor_s": round(med("full_tensor_s"), 4),
        "delta_s": round(med("delta_s"), 4), "delta_encode_s": round(med("encode_s"), 4),
        "delta_apply_s": round(med("apply_s"), 4), "full_mb": round(med("full_bytes") / 1e6, 2),
        "delta_mb": round(med("delta_bytes") / 1e6, 3), "delta_ratio": round(med("full_bytes") / med("delta_bytes"), 2),
        "changed_tensors": med("changed_tensors"), "tensors": timed[0]["tensors"],
        "bit_exact": all(r["bit_exact"] for r in rows), "link_gbps": a.link_gbps,
        "server_weights_checked": all(checks) if a.smoke else None, "smoke": a.smoke, "note": note,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
