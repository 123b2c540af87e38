"""A fake SGLang server: a real process on 127.0.0.1 answering SGLang's native HTTP shapes.

Run as `python tests/core/fake_sglang_server.py <sglang.launch_server arguments> [--fake-* knobs]`
(the tests reach it through a `python` wrapper that drops `-m sglang.launch_server`). It checks
requests strictly (unknown fields, wrong types and list lengths are 400s, as SGLang's pydantic
models would refuse them), records them for the tests (GET /fake/state), and really loads weights:
safetensors from disk, pickled named tensors from /update_weights_from_tensor (an allowlisted
unpickler like SGLang's), and broadcasts over a gloo group for /update_weights_from_distributed.
Shapes: io_struct GenerateReqInput, UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput,
InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput, UpdateWeightVersionReqInput,
PauseGenerationReqInput; /model_info with weight_version; /server_info (and the older
/get_server_info) with the sglang `version`; /get_weight_version answers 404 as on current servers;
/flush_cache answers 400 while "busy" (`--fake-flush-busy N`: the first N calls), as SGLang does while
requests run. Generation is deterministic: not a model. Each /generate is recorded with the sampling
parameters in effect (`--fake-sampling-defaults` fills the ones a request leaves out, as SGLang's
`--sampling-defaults model` does from generation_config.json), the weight version and how many
buckets of a multi-bucket update had been applied without their last one (`partial_buckets`).
Loaded tensors are recorded with their dtypes; `--dtype` is the dtype the fake "serves".
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import json
import os
import pickle
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

GENERATE_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                 "return_text_in_logprobs", "stream", "rid"}
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed",
                 "skip_special_tokens", "ignore_eos", "stop", "no_stop_trim", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty", "min_new_tokens", "n"}
DISK_KEYS = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
             "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache"}
TENSOR_KEYS = {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
               "disable_draft_model", "torch_empty_cache"}
GROUP_KEYS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
DIST_KEYS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
             "load_format"}
EOS = 2


class _Unpickler(pickle.Unpickler):
    """Like SGLang's SafeUnpickler: only torch, builtins and collections may be rebuilt."""

    def find_class(self, module: str, name: str):
        if module.split(".")[0] in {"torch", "builtins", "collections", "copyreg", "_codecs"}:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"blocked {module}.{name}")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--fake-version", default="0.5.23", help="the sglang version /server_info reports")
    p.add_argument("--fake-flush-busy", type=int, default=0, help="answer /flush_cache 400 (busy) this many times")
    p.add_argument("--fake-sampling-defaults", default="{}",
                   help="JSON of sampling params filled in where a request leaves them out")
    p.add_argument("--fake-warmup-polls", type=int, default=0, help="answer /health 503 this many times first")
    p.add_argument("--fake-never-healthy", action="store_true")
    p.add_argument("--fake-exit-code", type=int, help="print an error and exit with this code at once")
    p.add_argument("--fake-vocab", type=int, help="keep token ids below this (3 .. vocab-1; EOS 2)")
    p.add_argument("--fake-stale-version", action="store_true", help="report 'default' whatever was loaded")
    return p.parse_args(argv)


def make_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI()
    st = {"version": "default", "requests": [], "weights": {}, "dtypes": {}, "health_polls": 0, "paused": False,
          "groups": {}, "partial": 0, "flushes": 0}
    defaults = json.loads(args.fake_sampling_defaults)

    def bad(msg: str) -> JSONResponse:
        print(f"400: {msg}", flush=True)
        return JSONResponse({"error": {"message": msg}}, status_code=400)

    def refuse(msg: str) -> JSONResponse:
        print(f"refused: {msg}", flush=True)
        return JSONResponse({"success": False, "message": msg}, status_code=400)

    def loaded(named: dict[str, torch.Tensor], version: str | None, how: str) -> None:
        for k, v in named.items():
            st["weights"][k] = float(v.double().sum())
            st["dtypes"][k] = str(v.dtype).removeprefix("torch.")
        if version is not None:
            st["version"] = version
        # a bucket without the version is part of an unfinished multi-bucket update
        st["partial"] = 0 if version is not None or how == "disk" else st["partial"] + 1
        print(f"loaded {len(named)} tensors ({how}), version {st['version']}", flush=True)

    @app.get("/health")
    async def health() -> Response:
        st["health_polls"] += 1
        if args.fake_never_healthy or st["health_polls"] <= args.fake_warmup_polls:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        if set(body) - GENERATE_KEYS:
            return bad(f"unknown fields {sorted(set(body) - GENERATE_KEYS)}")
        ids = body.get("input_ids")
        single = bool(ids) and isinstance(ids[0], int)
        batch = [ids] if single else ids
        if not batch or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in batch):
            return bad("input_ids must be a list of token id lists")
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(batch)
        if len(sps) != len(batch) or any(set(sp) - SAMPLING_KEYS for sp in sps):
            return bad("bad sampling_params")
        sps = [{**defaults, **sp} for sp in sps]  # what the sampler runs with
        st["requests"].append({"endpoint": "/generate", "input_ids": batch, "sampling_params": sps,
                               "version": st["version"], "partial_buckets": st["partial"]})
        outs, seen = [], {}
        for p, sp in zip(batch, sps, strict=True):
            copy = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
            max_new = int(sp.get("max_new_tokens", 16))
            tokens = [10 + (sum(p) + copy + j) % 50 for j in range(max_new)]
            if args.fake_vocab:
                tokens = [3 + (sum(p) + copy + j) % (args.fake_vocab - 3) for j in range(max_new)]
            finish = {"type": "length", "length": max_new}
            if sum(p) % 2 == 0 and max_new >= 2:
                tokens, finish = tokens[:1] + [EOS], {"type": "stop", "matched": EOS}
            meta = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(p),
                    "completion_tokens": len(tokens), "cached_tokens": 0, "weight_version": st["version"]}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[-0.1 * (j + 1), t, None] for j, t in enumerate(tokens)]
            outs.append({"text": " ".join(map(str, tokens)), "output_ids": tokens, "meta_info": meta})
        return JSONResponse(outs[0] if single else outs)

    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request) -> Response:
        body = await request.json()
        if set(body) - DISK_KEYS or not isinstance(body.get("model_path"), str):
            return bad(f"bad update_weights_from_disk request {sorted(body)}")
        st["requests"].append({"endpoint": "/update_weights_from_disk", **body})
        path = Path(body["model_path"])
        files = sorted(path.glob("*.safetensors"))
        if not files or not (path / "config.json").is_file():
            return refuse(f"Failed to get weights iterator: {path} has no *.safetensors or no config.json")
        from safetensors.torch import load_file

        named = {}
        for f in files:
            named.update(load_file(str(f)))
        loaded(named, body.get("weight_version"), "disk")
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": 0})

    @app.post("/update_weights_from_tensor")
    async def from_tensor(request: Request) -> Response:
        body = await request.json()
        entries = body.get("serialized_named_tensors")
        if set(body) - TENSOR_KEYS or not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            return bad(f"bad update_weights_from_tensor request {sorted(body)}")
        if len(entries) != args.tp_size:
            return refuse(f"serialized_named_tensors has {len(entries)} entries, tp_size is {args.tp_size}")
        if body.get("load_format") not in (None, "direct"):
            return refuse(f"load_format {body['load_format']!r} not supported by the fake")
        named = _Unpickler(io.BytesIO(base64.b64decode(entries[0], validate=True))).load()
        if not all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in named):
            return refuse("entry is not a list of (name, tensor)")
        st["requests"].append({"endpoint": "/update_weights_from_tensor", "names": [n for n, _ in named],
                               "weight_version": body.get("weight_version"), "flush_cache": body.get("flush_cache")})
        loaded(dict(named), body.get("weight_version"), "tensor")
        return JSONResponse({"success": True, "message": "Succeeded to update model weights."})

    @app.post("/init_weights_update_group")
    def init_group(body: dict) -> Response:  # sync: blocks a worker thread until the group forms
        if set(body) != GROUP_KEYS:
            return bad(f"init_weights_update_group fields {sorted(body)}, expected {sorted(GROUP_KEYS)}")
        from factory.core.sglang.weights import init_custom_process_group

        st["requests"].append({"endpoint": "/init_weights_update_group", **body})
        try:
            st["groups"][body["group_name"]] = init_custom_process_group(
                body["backend"], f"tcp://{body['master_address']}:{body['master_port']}", body["world_size"],
                body["rank_offset"], body["group_name"], datetime.timedelta(seconds=60))
        except Exception as e:  # noqa: BLE001 - reported as SGLang does
            return refuse(f"Failed to init group: {e}")
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    @app.post("/update_weights_from_distributed")
    def from_distributed(body: dict) -> Response:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if set(body) - DIST_KEYS or not (isinstance(names, list) and isinstance(dtypes, list)
                                         and isinstance(shapes, list) and len(names) == len(dtypes) == len(shapes)):
            return bad(f"bad update_weights_from_distributed request {sorted(body)}")
        group = st["groups"].get(body.get("group_name", "weight_update_group"))
        if group is None:
            return refuse(f"no group {body.get('group_name')!r}: call /init_weights_update_group first")
        st["requests"].append({"endpoint": "/update_weights_from_distributed", "names": names, "dtypes": dtypes,
                               "weight_version": body.get("weight_version")})
        named = {}
        for n, d, s in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(s, dtype=getattr(torch, d))
            torch.distributed.broadcast(t, src=0, group=group)
            named[n] = t
        loaded(named, body.get("weight_version"), "distributed")
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    @app.post("/update_weight_version")
    async def update_version(request: Request) -> Response:
        body = await request.json()
        st["version"] = str(body["new_version"])
        return JSONResponse({"success": True, "message": f"Weight version updated to {st['version']}",
                             "new_version": st["version"]})

    @app.post("/pause_generation")
    async def pause(request: Request) -> Response:
        body = await request.json()
        if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
            return bad(f"bad pause mode {body.get('mode')!r}")
        st["paused"] = True
        st["requests"].append({"endpoint": "/pause_generation", **body})
        return JSONResponse({"message": "Generation paused successfully."})

    @app.post("/continue_generation")
    async def cont(request: Request) -> Response:
        st["paused"] = False
        st["requests"].append({"endpoint": "/continue_generation"})
        return JSONResponse({"message": "Generation continued successfully."})

    @app.post("/flush_cache")
    async def flush() -> Response:
        st["flushes"] += 1
        if st["flushes"] <= args.fake_flush_busy:  # SGLang: 400 while requests are running or waiting
            return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running "
                            "or waiting requests, the operation will not be performed.)\n", status_code=400)
        return Response("Cache flushed.\n")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        return JSONResponse({"model_path": args.model_path, "tp_size": args.tp_size, "dtype": args.dtype,
                             "version": args.fake_version})

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Response:
        version = "default" if args.fake_stale_version else st["version"]
        return JSONResponse({"model_path": args.model_path, "tokenizer_path": args.model_path, "is_generation": True,
                             "preferred_sampling_params": None, "weight_version": version})

    @app.get("/get_weight_version")
    async def old_version() -> Response:
        return JSONResponse({"detail": "Endpoint '/get_weight_version' is deprecated. Please use '/model_info'."},
                            status_code=404)

    @app.get("/fake/state")
    async def state() -> Response:
        return JSONResponse({"pid": os.getpid(), "port": args.port, "version": st["version"],
                             "requests": st["requests"], "weights": st["weights"], "paused": st["paused"],
                             "dtypes": st["dtypes"], "dtype": args.dtype, "flushes": st["flushes"],
                             "argv": sys.argv[1:], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})

    return app


# ------------------------------------------------------------------ helpers for the tests


def python_wrapper(directory: Path) -> str:
    """An executable standing in for sglang's venv python: `<it> -m sglang.launch_server ARGS` runs this
    fake with ARGS (what `rollout.sglang.python` would point at)."""
    path = Path(directory) / "sglang-python"
    path.write_text(f"#!/bin/sh\n# drops '-m sglang.launch_server'\nshift 2\n"
                    f"exec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


# Sockets that keep reserve_ports' ports bound for this process's life, by base port.
_RESERVED: dict[int, list[socket.socket]] = {}


def _reuseport_socket() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return s


def reserve_ports(n: int) -> int:
    """A port p such that p .. p+n-1 (servers take base_port + i) stay reserved for fakes until this process exits.

    A port found free and closed again was, under load, taken by other work (another server, an outgoing
    connection's local port) in the seconds before the fake bound it: "address already in use". Here each port
    stays bound by a socket with SO_REUSEPORT that never listens: the kernel hands it to no one else, while a
    fake started on it binds beside that socket (SO_REUSEPORT, same user) and is the only one accepting."""
    for _ in range(50):
        first = _reuseport_socket()
        first.bind(("127.0.0.1", 0))  # a port scan never shares a port, SO_REUSEPORT or not
        base, held = first.getsockname()[1], [first]
        try:
            for k in range(1, n):
                with socket.socket() as probe:  # without SO_REUSEPORT: fails if anyone holds it, reservations too
                    probe.bind(("127.0.0.1", base + k))
                held.append(_reuseport_socket())
                held[-1].bind(("127.0.0.1", base + k))
        except OSError:
            for s in held:
                s.close()
            continue
        _RESERVED[base] = held
        return base
    raise RuntimeError(f"no run of {n} free ports found")


def release_ports(base: int) -> None:
    """Give reserve_ports(n)'s ports back (for servers that bind without SO_REUSEPORT, such as real SGLang)."""
    for s in _RESERVED.pop(base):
        s.close()


def listen_socket(host: str, port: int) -> socket.socket:
    """The fake's listening socket, bound beside reserve_ports' reservation of `port` (uvicorn listens on it)."""
    s = _reuseport_socket()
    s.bind((host, port))
    return s


def fake_state(url: str) -> dict:
    import httpx

    r = httpx.get(url + "/fake/state", timeout=10)
    r.raise_for_status()
    return r.json()


def main(argv: list[str]) -> None:
    args = parse(argv)
    print(f"fake sglang server starting on {args.host}:{args.port} (model {args.model_path})", flush=True)
    if args.fake_exit_code is not None:
        print("RuntimeError: CUDA error: no CUDA-capable device is detected (fake)", flush=True)
        sys.exit(args.fake_exit_code)
    torch.set_num_threads(1)
    threading.current_thread().name = f"fake-sglang-{args.port}"
    t0 = time.monotonic()
    config = uvicorn.Config(make_app(args), log_level="warning")
    uvicorn.Server(config).run(sockets=[listen_socket(args.host, args.port)])
    print(f"fake sglang server on {args.port} stopped after {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
