"""Checkpoint uploads beside training, against a real S3 server (moto on 127.0.0.1) behind a real TCP proxy that
holds every connection until the test opens its gate: a store as slow as the test wants, with no sleeps. The run's
`record_checkpoint` returns while its upload cannot progress, the backlog is bounded, the row is recorded once the
checkpoint is on the store, and a failed upload is reported, not lost."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from factory.models.build import build_model
from factory.models.checkpoint import publish_checkpoint, save_checkpoint
from factory.models.checkpoint_store import MANIFEST_NAME
from factory.models.tokenizer import build_tokenizer
from factory.models.uploads import BackgroundUploads, UploadFailed
from factory.runs.rl_run import record_checkpoint
from tests.tcp_proxy import TcpProxy


@pytest.fixture(scope="module")
def micro():
    tok = build_tokenizer()
    return build_model("micro", tok, seed=7), tok


@pytest.fixture
def slow_store(s3_server, monkeypatch) -> Iterator[TcpProxy]:
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)), gated=True)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("FACTORY_CHECKPOINT_URI", f"s3://{s3_server.bucket}/team")
    yield proxy
    proxy.close()


def _saved(micro, factory_home, run: str, steps: tuple[int, ...]) -> list:
    return [save_checkpoint(*micro, factory_home.checkpoints / run / f"step-{s:06d}") for s in steps]


def test_the_loop_does_not_wait_for_a_slow_store(micro, lake, factory_home, s3_server, slow_store):
    # The S3 client gives up on a silent server after ~3 s a request (3 tries): the checkpoints are saved first, so
    # the store is held only while the test looks.
    infos = _saved(micro, factory_home, "run-7", (2, 4))
    uploads = BackgroundUploads(depth=2, log=lambda m: None)
    for step, info in zip((2, 4), infos, strict=True):  # what record_checkpoint does after saving
        uploads.submit(info.path, os.environ["FACTORY_CHECKPOINT_URI"], f"run-7/step-{step:06d}", info.sha256)
    # Both calls returned while the store answers nothing: the first upload is on the wire, held by the proxy.
    assert slow_store.reached.wait(timeout=60)
    assert uploads.pending() == 2 and uploads.uploaded == []
    slow_store.gate.set()
    assert uploads.close() == []
    assert {f"team/run-7/step-{s:06d}/{i.sha256}/{MANIFEST_NAME}" for s, i in zip((2, 4), infos, strict=True)} <= set(
        s3_server.keys("team"))


def test_a_run_records_a_checkpoint_once_its_background_upload_is_done(micro, lake, factory_home, s3_server,
                                                                       monkeypatch):
    monkeypatch.setenv("FACTORY_CHECKPOINT_URI", f"s3://{s3_server.bucket}/team")
    uploads = BackgroundUploads(depth=2, log=lambda m: None)
    infos = [record_checkpoint(*micro, factory_home, lake, "run-6", step, uploads=uploads) for step in (2, 4)]
    assert uploads.close() == []
    rows = sorted(lake.read("checkpoints").to_pylist(), key=lambda r: r["step"])
    assert [(r["step"], r["uri"]) for r in rows] == [
        (s, f"s3://{s3_server.bucket}/team/run-6/step-{s:06d}/{i.sha256}") for s, i in zip((2, 4), infos, strict=True)]


def test_the_backlog_is_bounded(micro, factory_home, slow_store):
    events: list[str] = []

    def publish(local, base_uri, name, digest):  # the real upload, its completion noted
        uri = publish_checkpoint(local, base_uri, name, digest)
        events.append(f"uploaded {name}")
        return uri

    infos = _saved(micro, factory_home, "run-8", (2, 4, 6))
    store = os.environ["FACTORY_CHECKPOINT_URI"]
    uploads = BackgroundUploads(depth=1, log=lambda m: None, publish=publish)
    uploads.submit(infos[0].path, store, "run-8/step-000002", infos[0].sha256)  # in flight, held by the proxy
    assert slow_store.reached.wait(timeout=60)
    uploads.submit(infos[1].path, store, "run-8/step-000004", infos[1].sha256)  # queued: depth 1 is now full

    def submit_third() -> None:
        uploads.submit(infos[2].path, store, "run-8/step-000006", infos[2].sha256)
        events.append("third submitted")

    t = threading.Thread(target=submit_third)
    t.start()
    t.join(timeout=0.5)  # room for a wrong, unbounded queue to let it through; a right one holds it until the gate
    assert t.is_alive() and uploads.pending() == 2
    slow_store.gate.set()
    t.join()
    assert uploads.close() == []
    # It got its place only once the first upload had finished and the second had left the queue.
    assert events.index("uploaded run-8/step-000002") < events.index("third submitted")
    assert events[-1] == "uploaded run-8/step-000006"


def test_a_failed_upload_is_logged_and_raised_not_lost(micro, lake, factory_home, s3_server, monkeypatch):
    monkeypatch.setenv("FACTORY_CHECKPOINT_URI", f"s3://{s3_server.bucket}-missing/team")  # no such bucket
    said: list[str] = []
    uploads = BackgroundUploads(depth=2, log=said.append)
    record_checkpoint(*micro, factory_home, lake, "run-9", 2, uploads=uploads)
    with pytest.raises(UploadFailed, match=r"1 checkpoint upload\(s\) failed: .*run-9/step-000002"):
        uploads.wait()
    assert len(said) == 1 and said[0].startswith("checkpoint upload failed: ") and "run-9/step-000002" in said[0]
    assert lake.read("checkpoints").num_rows == 0  # not recorded as on the store
    assert uploads.close() == [said[0].removeprefix("checkpoint upload failed: ")]  # raised once, kept in the list
