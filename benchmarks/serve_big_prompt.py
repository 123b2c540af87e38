"""A maximum-size request against the rollout server: how long `/health` takes to answer while it is handled.

A real server on 127.0.0.1 (the `micro` preset, the character tokenizer, the default 8 MiB body limit) gets one
request whose body is just under the limit, sent from a thread; meanwhile `/health` is asked again and again on a
keep-alive connection until that request has its answer. Three bodies: a text prompt (refused by the character bound
before tokenizing), a chat message (the same, for `messages`), and a prompt of token ids (about 4M ints: refused
from the raw bytes by `body_gate.py`, more values than any acceptable request holds). A fourth sends a prompt within
the character bound of a model with a long context (`--context`, default 65536 positions), so it is tokenized (off
the loop) and then refused by the token count. Prints a table, then one JSON line: per case the request's status
and seconds, and the /health latencies seen meanwhile (count, p50, max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx
import torch

from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.server.app import launch_server
from factory.infra.http_guard import MAX_JSON_BYTES
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer


def _case(url: str, path: str, body: bytes) -> dict:
    done = threading.Event()
    out: dict = {}

    def send() -> None:
        t = time.perf_counter()
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=600)
        out["status"], out["request_s"] = r.status_code, round(time.perf_counter() - t, 3)
        done.set()

    lat = []
    with httpx.Client(base_url=url, timeout=600) as c:
        c.get("/health")
        sender = threading.Thread(target=send)
        sender.start()
        while not done.is_set():
            t = time.perf_counter()
            c.get("/health").raise_for_status()
            lat.append(time.perf_counter() - t)
        sender.join()
    return {**out, "body_bytes": len(body), "health_n": len(lat),
            "health_p50_s": round(statistics.median(lat), 4) if lat else None,
            "health_max_s": round(max(lat), 4) if lat else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=65536, help="positions of the long-context model (case 4)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    room = MAX_JSON_BYTES - 256
    results = {}
    tok = build_tokenizer()
    with launch_server(ContinuousEngine(build_model("micro", tok, seed=0), tok, max_batch=2)) as h:
        results["text_prompt"] = _case(h.url, "/v1/completions", json.dumps(
            {"prompt": "1" * room, "max_tokens": 1}).encode())
        results["chat_message"] = _case(h.url, "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "1" * room}], "max_tokens": 1}).encode())
        ids = "[" + ",".join(["5"] * (room // 2 - 8)) + "]"
        results["token_ids"] = _case(h.url, "/v1/completions", ('{"max_tokens": 1, "prompt": ' + ids + "}").encode())
    engine = ContinuousEngine(build_model("micro", tok, seed=0, max_positions=args.context), tok, max_batch=1)
    with launch_server(engine) as h:
        srv = h.app.state.rollout
        n = min(room, srv.max_prompt_chars)
        results["tokenized_prompt"] = _case(h.url, "/v1/completions", json.dumps(
            {"prompt": "1" * n, "max_tokens": 1}).encode())
    print(f"{'case':18} {'status':>6} {'bytes':>9} {'request_s':>9} {'health_n':>8} {'p50_s':>7} {'max_s':>7}")
    for k, r in results.items():
        print(f"{k:18} {r['status']:>6} {r['body_bytes']:>9} {r['request_s']:>9} {r['health_n']:>8} "
              f"{r['health_p50_s']!s:>7} {r['health_max_s']!s:>7}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
