"""`SGLangServers` against fake SGLang servers: real processes on 127.0.0.1 started through the same command
line as `sglang.launch_server` (a `rollout.sglang.python` wrapper runs tests/core/fake_sglang_server.py).
No real SGLang runs here."""

from __future__ import annotations

import errno
import os
import socket

import httpx
import pytest

from factory.config import SGLangSpec
from factory.core.sglang.servers import (
    SGLangServerError,
    SGLangServers,
    launch_command,
    served_dtype,
    visible_devices,
)
from tests.core.fake_sglang_server import fake_state, python_wrapper, reserve_ports


def test_launch_command_is_built_from_the_spec():
    spec = SGLangSpec(servers=2, python="/venvs/sglang/bin/python", tp_size=2, base_port=31000,
                      mem_fraction_static=0.7, extra_args=["--dtype", "bfloat16"])
    assert launch_command(spec, "/ckpt/initial", 1) == [
        "/venvs/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/ckpt/initial", "--host",
        "127.0.0.1", "--port", "31001", "--tp-size", "2", "--base-gpu-id", "2", "--mem-fraction-static", "0.7",
        "--dtype", "bfloat16"]
    placed = launch_command(SGLangSpec(), "m", 0, python="py", placed=True)
    assert placed[:3] == ["py", "-m", "sglang.launch_server"] and placed[-4:-2] == ["--base-gpu-id", "0"]


def test_servers_serve_bf16_unless_the_user_chose_a_dtype():
    # SGLang's default `auto` reads torch_dtype from the fp32 checkpoint and serves it as float16.
    argv = launch_command(SGLangSpec(), "m", 0, python="py")
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv.count("--dtype") == 1
    assert served_dtype(SGLangSpec()) == "bfloat16"
    chosen = ((["--dtype", "float16"], "float16"), (["--dtype=half"], "float16"), (["--dtype", "auto"], None))
    for extra, dtype in chosen:
        spec = SGLangSpec(extra_args=extra)
        argv = launch_command(spec, "m", 0, python="py")
        assert sum(a == "--dtype" or a.startswith("--dtype=") for a in argv) == 1  # the user's, once
        assert served_dtype(spec) == dtype
    with pytest.raises(SGLangServerError, match="--dtype 'fp8'"):
        served_dtype(SGLangSpec(extra_args=["--dtype", "fp8"]))


def test_server_gpus_are_mapped_through_the_parents_visible_devices():
    assert visible_devices([0, 2], parent="") == ["0", "2"]
    assert visible_devices([0, 2], parent="4,5,6") == ["4", "6"]
    uuid = "GPU-2b6c8a1e-0000-1111-2222-333344445555"
    assert visible_devices([1], parent=f"3,{uuid}") == [uuid]  # UUIDs (and MIG ids) passed on as written
    with pytest.raises(SGLangServerError, match=r"rollout.devices \[0, 3\]: \[3\] not among"):
        visible_devices([0, 3], parent="4,5")


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def _spec(tmp_path, n: int = 2, **kw) -> SGLangSpec:
    return SGLangSpec(servers=n, python=python_wrapper(tmp_path), base_port=reserve_ports(n),
                      startup_timeout_s=kw.pop("startup_timeout_s", 60.0), **kw)


def test_reserved_ports_are_taken_by_no_one_else_and_the_fakes_still_start_on_them(tmp_path, model_dir):
    spec = _spec(tmp_path)
    for port in (spec.base_port, spec.base_port + 1):  # what other work binding these ports meets: they are held
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
    with SGLangServers(spec, model_dir, tmp_path / "logs") as servers:
        assert [fake_state(u)["port"] for u in servers.urls] == [spec.base_port, spec.base_port + 1]


def test_a_started_server_gets_the_parents_gpu_and_serves_bf16(tmp_path, model_dir, monkeypatch):
    uuid = "GPU-2b6c8a1e-0000-1111-2222-333344445555"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"6,{uuid},7")  # this process sees 3 GPUs; rollout gets its 2nd
    with SGLangServers(_spec(tmp_path, n=1), model_dir, tmp_path / "logs", gpus=[1]) as servers:
        st = fake_state(servers.urls[0])
    assert st["cuda_visible_devices"] == uuid
    assert st["dtype"] == "bfloat16"


@pytest.mark.slow
def test_two_servers_start_with_their_ports_gpus_and_logs_and_stop(tmp_path, model_dir, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = _spec(tmp_path, extra_args=["--fake-warmup-polls", "2"])  # /health says 503 twice first
    servers = SGLangServers(spec, model_dir, tmp_path / "logs", gpus=[4, 5]).start()
    try:
        states = [fake_state(u) for u in servers.urls]
        assert servers.urls == [f"http://127.0.0.1:{spec.base_port + i}" for i in range(2)]
        for i, st in enumerate(states):
            argv = st["argv"]
            assert argv[argv.index("--port") + 1] == str(spec.base_port + i)
            assert argv[argv.index("--model-path") + 1] == str(model_dir)
            assert argv[argv.index("--base-gpu-id") + 1] == "0"  # placed: its GPUs are renumbered from 0
            assert st["cuda_visible_devices"] == str(4 + i)
        assert "fake sglang server starting" in (tmp_path / "logs" / "sglang-1.log").read_text()
        pids = [st["pid"] for st in states]
    finally:
        servers.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_unplaced_servers_take_consecutive_gpu_ranges(tmp_path, model_dir):
    spec = _spec(tmp_path, tp_size=2)
    with SGLangServers(spec, model_dir, tmp_path / "logs") as servers:
        argvs = [fake_state(u)["argv"] for u in servers.urls]
    assert [a[a.index("--base-gpu-id") + 1] for a in argvs] == ["0", "2"]


def test_placement_with_too_few_gpus_is_refused(tmp_path, model_dir):
    with pytest.raises(SGLangServerError, match=r"2 servers x tp_size 2 need 4 GPUs, placement gives 3"):
        SGLangServers(_spec(tmp_path, tp_size=2), model_dir, tmp_path / "logs", gpus=[0, 1, 2])


@pytest.mark.slow
def test_a_server_that_exits_at_startup_is_named_with_its_log(tmp_path, model_dir):
    spec = _spec(tmp_path, n=1, extra_args=["--fake-exit-code", "3"])
    with pytest.raises(SGLangServerError) as e:
        SGLangServers(spec, model_dir, tmp_path / "logs").start()
    msg = str(e.value)
    assert "sglang-0 at http://127.0.0.1:" in msg and "exited with code 3" in msg
    assert str(tmp_path / "logs" / "sglang-0.log") in msg and "no CUDA-capable device is detected" in msg


def test_a_python_that_cannot_run_is_named(tmp_path, model_dir):
    spec = SGLangSpec(python=str(tmp_path / "no-venv" / "bin" / "python"), base_port=reserve_ports(1))
    with pytest.raises(SGLangServerError, match=r"sglang-0 at .*: cannot run '.*no-venv/bin/python' "
                                                r"\(rollout.sglang.python"):
        SGLangServers(spec, model_dir, tmp_path / "logs").start()


def test_startup_timeout_names_the_server_and_its_log(tmp_path, model_dir):
    spec = _spec(tmp_path, n=1, startup_timeout_s=1.0, extra_args=["--fake-never-healthy"])
    servers = SGLangServers(spec, model_dir, tmp_path / "logs")
    with pytest.raises(SGLangServerError, match=r"sglang-0 at .* \(log .*sglang-0.log\): sglang-0: not healthy "
                                                r"at .*/health after 1s") as e:
        servers.start()
    assert f"last lines of {tmp_path / 'logs' / 'sglang-0.log'}:" in str(e.value)
    assert not servers.alive(0)  # the unhealthy process was stopped


@pytest.mark.slow
def test_a_killed_server_is_restarted_on_the_same_port(tmp_path, model_dir):
    with SGLangServers(_spec(tmp_path), model_dir, tmp_path / "logs") as servers:
        before = fake_state(servers.urls[1])["pid"]
        servers.kill(1)
        assert not servers.alive(1)
        assert servers.recover(1) is True
        assert servers.restarts() == [0, 1]
        assert fake_state(servers.urls[1])["pid"] != before
        assert servers.recover(0) is False  # alive and healthy: nothing to do


@pytest.mark.slow
def test_restarts_are_bounded(tmp_path, model_dir):
    with SGLangServers(_spec(tmp_path, n=1), model_dir, tmp_path / "logs", max_restarts=1) as servers:
        servers.kill(0)
        assert servers.recover(0) is True
        servers.kill(0)
        with pytest.raises(SGLangServerError, match=r"sglang-0 at .*already restarted 1 times"):
            servers.recover(0)


@pytest.mark.slow
def test_external_urls_are_waited_on_not_started(tmp_path, model_dir):
    with SGLangServers(_spec(tmp_path, n=1), model_dir, tmp_path / "logs") as running:
        external = SGLangServers(SGLangSpec(urls=[running.urls[0] + "/"], startup_timeout_s=10), None, tmp_path / "x")
        assert external.start().urls == running.urls and external.services == []
        assert external.describe(0) == f"sglang server 0 at {running.urls[0]}"
    with pytest.raises(SGLangServerError, match=r"sglang server 0 at .*: not healthy .* after 0.5 s"):
        SGLangServers(SGLangSpec(urls=[running.urls[0]], startup_timeout_s=0.5), None, tmp_path / "x").start()
    with pytest.raises(httpx.ConnectError):
        httpx.get(running.urls[0] + "/health")
