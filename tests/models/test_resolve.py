"""`model.path` in its three forms (factory/model_source.py, factory/models/resolve.py): a directory, a `.gguf`
file converted once under FACTORY_HOME, a Hugging Face Hub id read from a local cache built here (no network)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from factory.config import apply_overrides, load_spec
from factory.home import FactoryPaths
from factory.model_source import HubCacheError, hub_cache_dir, model_source, source_files
from factory.models.build import policy_for
from factory.models.hf import ModelDirError
from factory.models.resolve import check_model_path, model_provenance, resolve_model_path
from tests.models.hub_cache import add_snapshot

QUICKSTART = "examples/quickstart.yaml"
REPO = "acme/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def hub(tmp_path, monkeypatch, bpe_model_dir) -> Path:
    """A hub cache holding REPO at COMMIT (refs main and dev), with HF_HUB_CACHE pointing at it."""
    cache = tmp_path / "hf-cache"
    add_snapshot(cache, REPO, bpe_model_dir, COMMIT, refs=("main", "dev"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # relative names are looked up here, not in the repository
    return cache


def test_the_form_of_a_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model_source("acme/model").kind == "hub"
    assert model_source("acme/model@v1.0").kind == "hub"
    assert model_source("models/SmolLM2.Q4_1.GGUF").kind == "gguf"  # by its name, even before it exists
    # Not hub-shaped: a bare name, deeper or dotted relative paths, absolute paths are directories.
    for value in ("gpt2", ".factory/models/bpe-tiny", "a/b/c", "./acme/model", str(tmp_path / "x"), "a--b/c"):
        assert model_source(value).kind == "dir", value
    (tmp_path / "acme" / "model").mkdir(parents=True)
    assert model_source("acme/model").kind == "dir"  # an existing directory wins over the hub id


def test_a_hub_id_resolves_to_its_cached_snapshot(hub, tmp_path):
    home = FactoryPaths(tmp_path / "home")
    snapshot = hub / "models--acme--tiny-chat" / "snapshots" / COMMIT
    assert resolve_model_path(REPO, home) == snapshot  # refs/main
    assert resolve_model_path(f"{REPO}@dev", home) == snapshot  # a branch the cache has a ref for
    assert resolve_model_path(f"{REPO}@{COMMIT}", home) == snapshot  # a full commit
    assert check_model_path(REPO, home) == f"model.path: Hugging Face model {REPO}, cached in {snapshot}"
    assert not home.root.exists()  # nothing written for a hub id
    assert model_provenance(REPO, snapshot) == {"path": REPO, "kind": "hub", "dir": str(snapshot.resolve())}


def test_the_cache_comes_from_the_environment_in_huggingface_hubs_order(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert hub_cache_dir() == tmp_path / "user" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_dir() == tmp_path / "hub"


@pytest.mark.parametrize("value,missing", [("acme/absent", "acme/absent"), (f"{REPO}@v9", f"{REPO} at revision v9")])
def test_a_missing_hub_id_is_one_line_naming_the_id_and_the_cache(hub, tmp_path, value, missing):
    with pytest.raises(HubCacheError) as e:
        resolve_model_path(value, FactoryPaths(tmp_path / "home"))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"model.path: {value} is neither a directory nor in the Hugging Face cache {hub}: ")
    assert f"no snapshot of {missing} there" in msg and "hf download acme/" in msg


def test_a_snapshot_without_model_files_is_refused_by_name(hub, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("no model here\n")
    snapshot = add_snapshot(hub, "acme/readme-only", empty, OTHER)
    with pytest.raises(ModelDirError, match=f"no config.json in {snapshot}"):
        resolve_model_path("acme/readme-only", FactoryPaths(tmp_path / "home"))


def test_a_gguf_file_resolves_to_its_conversion(smollm2_gguf, smollm2_dir):
    home = FactoryPaths(smollm2_dir.parents[2])  # the test cache the fixture converted into: nothing converts again
    messages: list[str] = []
    assert resolve_model_path(smollm2_gguf, home, log=messages.append) == smollm2_dir
    assert messages == []
    assert check_model_path(smollm2_gguf, home) == f"model.path: GGUF file {smollm2_gguf}, converted in {smollm2_dir}"
    assert model_provenance(smollm2_gguf, smollm2_dir)["kind"] == "gguf"


def test_checking_a_gguf_file_converts_nothing(smollm2_gguf, tmp_path):
    home = FactoryPaths(tmp_path / "fresh")
    assert check_model_path(smollm2_gguf, home) == (f"model.path: GGUF file {smollm2_gguf}, to be converted once "
                                                    f"under {home.root / 'models' / 'gguf'}")
    assert not home.root.exists()


def test_policy_for_loads_a_hub_id(hub, tmp_path, bpe_model_dir):
    spec = apply_overrides(load_spec(Path(__file__).parents[2] / QUICKSTART), {"model.path": REPO})
    model, tok = policy_for(spec, FactoryPaths(tmp_path / "home"))
    assert model.config.model_type == "qwen2" and tok.eos_token == "<|im_end|>"
    assert tok.get_vocab() == json.loads((bpe_model_dir / "tokenizer.json").read_text())["model"]["vocab"]


def test_the_warm_start_follows_what_the_hub_id_names(hub, tmp_path, bpe_model_dir):
    """A warm start is keyed by the weights the id resolves to: moving refs/main to other weights changes it."""
    spec = apply_overrides(load_spec(Path(__file__).parents[2] / QUICKSTART), {"model.path": REPO})
    assert source_files(REPO) == hub / "models--acme--tiny-chat" / "snapshots" / COMMIT
    before = spec.warm_start_fingerprint()
    changed = shutil.copytree(bpe_model_dir, tmp_path / "changed")
    (changed / "generation_config.json").write_text('{"do_sample": false}\n')
    add_snapshot(hub, REPO, changed, OTHER)  # refs/main now names OTHER
    assert spec.warm_start_fingerprint() != before
    assert source_files("acme/absent") is None
