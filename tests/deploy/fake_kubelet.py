"""The kubelet's part of the fake Kubernetes API server (tests/deploy/fake_kube.py), done locally: a Pod's first
container becomes a subprocess (no shell, its own session) with the container's env resolved and $(VAR)-expanded as
Kubernetes does, container paths rewritten to local ones by a path_map, ConfigMap volumes written as files, output
captured line by line with strictly increasing RFC3339Nano stamps, and served as (followed) log chunks.

No images, no isolation, no restarts: the process runs on this machine with PATH/HOME from the test's environment."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ConfigMaps = Callable[[str, dict], dict[str, str]]  # (namespace, {name, optional}) -> data; raises StartError if absent


class StartError(Exception):
    """The container cannot start (a kubelet would report StartError / CreateContainerConfigError)."""


@dataclass
class PodRun:
    """One pod's local process: what was started, its output lines and how it ended."""

    namespace: str
    pod: str
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    proc: subprocess.Popen | None = None
    lines: list[tuple[str, bytes]] = field(default_factory=list)  # (RFC3339Nano stamp, line ending in "\n")
    started: bool = False
    eof: bool = False
    returncode: int | None = None  # a signal's death is 128 + signal, as a container runtime reports it
    start_error: str | None = None

    def output(self) -> str:
        return b"".join(line for _, line in self.lines).decode(errors="replace")


def nano(ns: int) -> str:
    """Fixed-width RFC3339Nano UTC, as the kubelet stamps log lines (dagster-k8s compares stamp lengths)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names substituted, unknown left as written, $$ escapes a $."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(" and (end := text.find(")", i + 2)) != -1:
                name = text[i + 2:end]
                out.append(env.get(name, f"$({name})"))
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def map_paths(text: str, path_map: dict[str, str]) -> str:
    """Rewrite container paths to local ones: a prefix matches only as a whole path, not inside another path."""
    for prefix in sorted(path_map, key=len, reverse=True):
        pattern = r"(?<![\w.\-/])" + re.escape(prefix.rstrip("/")) + r"(?=/|$|[^\w.\-])"
        text = re.sub(pattern, lambda _m, p=prefix: path_map[p].rstrip("/"), text)
    return text


def mapped_path(container_path: str, path_map: dict[str, str]) -> str:
    for prefix in sorted(path_map, key=len, reverse=True):
        p = prefix.rstrip("/")
        if container_path == p or container_path.startswith(p + "/"):
            return path_map[prefix].rstrip("/") + container_path[len(p):]
    raise StartError(f"fake_kube: no path_map entry covers the container path {container_path}")


def field_value(pod: dict, path: str) -> str:
    """A downward-API fieldRef."""
    meta = pod["metadata"]
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return meta.get(m[1], {}).get(m[2], "")
    values = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
              "spec.nodeName": pod["spec"].get("nodeName", ""), "status.podIP": "127.0.0.1",
              "status.hostIP": "127.0.0.1", "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "")}
    if path not in values:
        raise StartError(f"fake_kube: fieldRef {path} is not emulated")
    return values[path]


def container_env(pod: dict, container: dict, configmaps: ConfigMaps) -> dict[str, str]:
    """The container's env as Kubernetes resolves it: envFrom first, then env in order, each value expanded against
    the variables defined before it."""
    ns, env = pod["metadata"]["namespace"], {}
    for src in container.get("envFrom", []):
        if "configMapRef" not in src:
            raise StartError(f"fake_kube: envFrom {src} is not emulated")
        env.update({src.get("prefix", "") + k: v for k, v in configmaps(ns, src["configMapRef"]).items()})
    for var in container.get("env", []):
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(var.get("value", ""), env)
        elif "fieldRef" in source:
            env[var["name"]] = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = configmaps(ns, ref).get(ref["key"], "")
        else:
            raise StartError(f"fake_kube: env {var['name']} valueFrom {source} is not emulated")
    return env


def write_configmap_volumes(pod: dict, container: dict, path_map: dict[str, str], configmaps: ConfigMaps) -> None:
    for vol in pod["spec"].get("volumes", []):
        if "configMap" not in vol:
            continue  # other volumes (emptyDir, PVC, ...) are whatever path_map points their mountPath at
        data = configmaps(pod["metadata"]["namespace"], vol["configMap"])
        items = vol["configMap"].get("items") or [{"key": k, "path": k} for k in data]
        for mount in (m for m in container.get("volumeMounts", []) if m["name"] == vol["name"]):
            local = Path(mapped_path(mount["mountPath"], path_map))
            for item in items:
                if mount.get("subPath") not in (None, item["path"]):
                    continue
                target = local if mount.get("subPath") else local / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(data.get(item["key"], ""))


@dataclass
class Machine:
    """What the test tells the fake about this machine, in place of images, volumes and cluster DNS."""

    workdir: Path  # the working directory of a container that names none
    path_map: dict[str, str] = field(default_factory=dict)  # container path prefix -> local dir
    hosts: dict[str, str] = field(default_factory=dict)  # cluster DNS name -> local address
    entrypoints: dict[str, list[str]] = field(default_factory=dict)  # image (or "*") -> its ENTRYPOINT
    extra_env: dict[str, str] = field(default_factory=dict)  # added to every process's env, last

    def rewrite(self, text: str) -> str:
        for name in sorted(self.hosts, key=len, reverse=True):  # a whole name: not part of a longer one
            text = re.sub(r"(?<![\w.\-])" + re.escape(name) + r"(?![\w.\-])", lambda _m, n=name: self.hosts[n], text)
        return map_paths(text, self.path_map)


def argv_of(container: dict, machine: Machine) -> list[str]:
    """command + args; without a command, as a runtime does: the image's ENTRYPOINT + args (an image's CMD is not
    known here, so a container with neither command nor args cannot start)."""
    if container.get("command"):
        return container["command"] + container.get("args", [])
    image = container.get("image", "")
    entry = machine.entrypoints.get(image, machine.entrypoints.get("*"))
    if entry is None:
        raise StartError(f"fake_kube: the container has no command and entrypoints has no entry for {image!r} or '*'")
    if not entry and not container.get("args"):
        raise StartError(f"fake_kube: nothing to run: no command, no args, empty entrypoint for {image!r}")
    return entry + container.get("args", [])


def launch(pod: dict, machine: Machine, configmaps: ConfigMaps) -> tuple[list[str], dict[str, str], str]:
    """argv, environment and working directory for the pod's first container; its volumes written or made."""
    container = pod["spec"]["containers"][0]
    env = container_env(pod, container, configmaps)
    argv = [machine.rewrite(expand(a, env)) for a in argv_of(container, machine)]
    write_configmap_volumes(pod, container, machine.path_map, configmaps)
    for mount in container.get("volumeMounts", []):  # emptyDir and friends: an empty directory, where mapped
        try:
            Path(mapped_path(mount["mountPath"], machine.path_map)).mkdir(parents=True, exist_ok=True)
        except (StartError, FileExistsError):
            pass  # unmapped, or a subPath file
    wd = container.get("workingDir")
    cwd = mapped_path(wd, machine.path_map) if wd else str(machine.workdir)
    full = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""), "HOSTNAME": pod["metadata"]["name"]}
    full.update({k: machine.rewrite(v) for k, v in env.items()})
    full.update(machine.extra_env)  # the test's word is last
    return argv, full, cwd


def start(run: PodRun, argv: list[str], env: dict[str, str], cwd: str) -> None:
    run.argv, run.env, run.cwd = argv, env, cwd
    run.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    run.started = True


def pump(run: PodRun, cond: threading.Condition, timeout: float) -> int:
    """Capture the process's merged output until it exits (killed after timeout s); its container exit code."""
    proc = run.proc
    assert proc is not None and proc.stdout is not None
    killer = threading.Timer(timeout, kill, (run, 0.0))
    killer.daemon = True
    killer.start()
    reaper = threading.Thread(target=_reap, args=(proc, timeout), daemon=True)
    reaper.start()
    last = 0
    for line in iter(proc.stdout.readline, b""):
        last = max(time.time_ns(), last + 1)  # strictly increasing: dagster-k8s joins lines that share a stamp
        with cond:
            run.lines.append((nano(last), line if line.endswith(b"\n") else line + b"\n"))
            cond.notify_all()
    code = proc.wait(timeout=timeout + 30)  # the killer has fired by then
    killer.cancel()
    reaper.join(timeout=10)
    return code if code >= 0 else 128 - code


def _reap(proc: subprocess.Popen, timeout: float) -> None:
    """When the container's main process exits, the runtime kills what it left behind (which would hold the pipe)."""
    try:
        proc.wait(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return
    _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: int) -> bool:
    try:
        os.killpg(proc.pid, sig)  # the process's session: its children die with it, as in a container
        return True
    except ProcessLookupError:
        return False


def kill(run: PodRun, grace: float) -> None:
    """SIGTERM to the process group, SIGKILL to what is left after grace seconds (none: SIGKILL at once)."""
    proc = run.proc
    if proc is None or proc.poll() is not None:
        return  # after the main process, _reap has killed the rest; its pid may belong to someone else by now
    if grace > 0 and _signal_group(proc, signal.SIGTERM):
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass  # unkillable (uninterruptible sleep): pump's bounded wait reports it


def log_chunks(run: PodRun, cond: threading.Condition, start: int, follow: bool, stamps: bool,
               stopping: Callable[[], bool]) -> Iterator[bytes]:
    """The pod's log from line `start`: what there is, or with follow, every line as it comes until the process ends."""
    sent = start
    while True:
        with cond:
            if follow:
                cond.wait_for(lambda n=sent: len(run.lines) > n or run.eof or stopping(), timeout=1.0)
            new, done = run.lines[sent:], run.eof or stopping() or not follow
        sent += len(new)
        if new:
            yield b"".join((ts.encode() + b" " if stamps else b"") + line for ts, line in new)
        if done and sent >= len(run.lines):
            return
