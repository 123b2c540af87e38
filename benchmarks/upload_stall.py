"""How long a run's loop is held by a checkpoint with an object store whose network is slow: `record_checkpoint`
publishing in the loop (no `uploads`) against the run's way, through `BackgroundUploads` (models/uploads.py).

A real S3 server (moto, on 127.0.0.1) sits behind a TCP proxy that holds every new connection `--delay-s` seconds
before forwarding it (a slow network: each request of an upload pays it). A micro model's checkpoint is saved and
recorded `--checkpoints` times each way; printed: the seconds each call held the caller, and the wait at the end
of the run (`BackgroundUploads.close`). Needs moto (a test dependency). One JSON line last.

    .venv/bin/python benchmarks/upload_stall.py [--delay-s 1.0] [--checkpoints 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tcp_proxy import TcpProxy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delay-s", type=float, default=1.0, help="added to every connection to the store")
    ap.add_argument("--checkpoints", type=int, default=3)
    args = ap.parse_args()

    import pyarrow.fs as pafs
    import torch
    from moto.server import ThreadedMotoServer

    torch.set_num_threads(1)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    pafs.S3FileSystem(endpoint_override=f"http://{host}:{port}", access_key="k", secret_key="k", region="us-east-1",
                      allow_bucket_creation=True).create_dir("bench-bucket")
    home = tempfile.mkdtemp(prefix="upload-stall-")
    proxy = TcpProxy((host, port), delay_s=args.delay_s)  # holds each new connection delay_s first
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}",
                      AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="k", AWS_REGION="us-east-1",
                      FACTORY_CHECKPOINT_URI="s3://bench-bucket/runs", FACTORY_HOME=home)

    from factory.home import factory_home
    from factory.lake import Lake
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer
    from factory.models.uploads import BackgroundUploads
    from factory.runs.run_checkpoints import record_checkpoint

    paths = factory_home(home)
    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    out: dict = {"delay_s": args.delay_s}
    with Lake.open(paths) as lake:
        for mode in ("in_loop", "background"):
            uploads = BackgroundUploads(log=print) if mode == "background" else None
            held = []
            for i in range(args.checkpoints):
                t0 = time.perf_counter()
                record_checkpoint(model, tok, paths, lake, f"bench-{mode}", 2 * (i + 1), uploads=uploads)
                held.append(round(time.perf_counter() - t0, 3))
            t0 = time.perf_counter()
            if uploads is not None:
                uploads.close()
            end = round(time.perf_counter() - t0, 3)
            print(f"{mode}: the loop was held {held} s per checkpoint; the run's end waited {end} s")
            out[mode] = {"held_s": held, "end_wait_s": end}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
