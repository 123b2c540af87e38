"""Fixtures for tests of the deploy layer: `fake_kube`, a fake Kubernetes API server (tests/deploy/fake_kube.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.fake_kube import FakeKube


@pytest.fixture
def fake_kube(tmp_path) -> Iterator[FakeKube]:
    """A FakeKube on a free 127.0.0.1 port, its pods' working directory under tmp_path; at teardown every pod process
    is killed and the server stopped, and the test fails if the fake itself raised (fake.errors)."""
    with FakeKube(workdir=tmp_path / "fake-kube") as fake:
        yield fake
    assert not fake.errors, "fake_kube raised:\n" + "\n".join(fake.errors)
