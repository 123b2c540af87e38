"""A real S3 server for tests: moto's ThreadedMotoServer on 127.0.0.1 (one per test session), and the `s3_server`
fixture giving each test a fresh bucket and the standard AWS_* settings pointing at it. Conftests that need it
import the fixtures (`from tests.s3_server import s3_server, moto_endpoint  # noqa: F401`)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.fs as pafs
import pytest


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:<port>
    bucket: str  # fresh for the test

    def fs(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(endpoint_override=self.endpoint, access_key="testing", secret_key="testing",
                                 region="us-east-1")

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key in the bucket under `prefix`, sorted."""
        infos = self.fs().get_file_info(pafs.FileSelector(f"{self.bucket}/{prefix}".rstrip("/"), recursive=True,
                                                          allow_not_found=True))
        return sorted(i.path.removeprefix(f"{self.bucket}/") for i in infos if i.type == pafs.FileType.File)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_server(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """A fresh bucket on the session's moto server; AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
    AWS_REGION point at it (and settings that would override them are removed) for the test."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    server = S3Server(moto_endpoint, f"factory-test-{uuid.uuid4().hex[:12]}")
    pafs.S3FileSystem(endpoint_override=moto_endpoint, access_key="testing", secret_key="testing",
                      region="us-east-1", allow_bucket_creation=True).create_dir(server.bucket)
    return server
