"""Checkpoints on an object store (FACTORY_CHECKPOINT_URI=s3://...), against a real S3 server (moto on 127.0.0.1):
published files with a manifest written last, loaded back through a verified local cache that the next load reuses,
refused when the manifest is missing (an upload that did not finish) or a file does not match it, and recorded by
a run under their store URI. Real AWS S3 and GCS are not exercised."""

from __future__ import annotations

import json

import pytest
import torch

from factory.digest import dir_digest
from factory.models.build import build_model
from factory.models.checkpoint import load_checkpoint, publish_checkpoint, recorded_uri, save_checkpoint
from factory.models.checkpoint_store import MANIFEST_NAME, IncompleteCheckpointError
from factory.models.tokenizer import build_tokenizer
from factory.runs.checkpoint_eval import _path as recorded_checkpoint_dir
from factory.runs.rl_run import record_checkpoint


@pytest.fixture(scope="module")
def micro():
    tok = build_tokenizer()
    return build_model("micro", tok, seed=7), tok


@pytest.fixture
def saved(micro, factory_home):
    model, tok = micro
    return save_checkpoint(model, tok, factory_home.checkpoints / "run-1" / "step-000002", meta={"step": 2})


def _logits(model, tok) -> torch.Tensor:
    return model(torch.tensor([tok("12+34=").input_ids])).logits


@pytest.mark.slow
def test_published_checkpoint_loads_from_the_store_and_the_cache_is_reused(micro, saved, factory_home, s3_server,
                                                                            monkeypatch):
    monkeypatch.setenv("FACTORY_CHECKPOINT_URI", f"s3://{s3_server.bucket}/ckpts/")
    uri = recorded_uri(saved, "run-1/step-000002")
    assert uri == f"s3://{s3_server.bucket}/ckpts/run-1/step-000002/{saved.sha256}"
    prefix = f"ckpts/run-1/step-000002/{saved.sha256}/"
    local_files = sorted(p.name for p in saved.path.iterdir())
    assert s3_server.keys("ckpts") == sorted(prefix + n for n in [*local_files, MANIFEST_NAME])
    with s3_server.fs().open_input_stream(f"{s3_server.bucket}/{prefix}{MANIFEST_NAME}") as f:
        manifest = json.loads(f.read())
    assert manifest["sha256"] == saved.sha256 and manifest["bytes"] == saved.bytes
    assert sorted(e["path"] for e in manifest["files"]) == local_files

    model, tok = load_checkpoint(uri)
    assert torch.equal(_logits(model, tok), _logits(*micro)) and model.name_or_path == uri
    cached = factory_home.checkpoint_cache / saved.sha256
    assert dir_digest(cached) == (saved.sha256, saved.bytes)
    assert [p.name for p in factory_home.checkpoint_cache.iterdir()] == [saved.sha256]  # no temp left

    # The next load reads the manifest but not the files: with the weights gone from the store, it still loads.
    s3_server.fs().delete_file(f"{s3_server.bucket}/{prefix}model.safetensors")
    again, tok2 = load_checkpoint(uri)
    assert torch.equal(_logits(again, tok2), _logits(*micro))
    assert recorded_uri(saved, "run-1/step-000002") == uri  # already published: nothing uploaded again


def test_an_upload_without_its_manifest_is_refused(saved, factory_home, s3_server):
    base = f"s3://{s3_server.bucket}/ckpts"
    uri = publish_checkpoint(saved.path, base, "run-1/step-000002")
    # What an upload killed before its last write leaves: every file, no manifest.
    s3_server.fs().delete_file(f"{uri.removeprefix('s3://')}/{MANIFEST_NAME}")
    with pytest.raises(IncompleteCheckpointError, match=rf"checkpoint {uri}: \d+ object\(s\) but no {MANIFEST_NAME}: "
                                                        "an upload that did not finish"):
        load_checkpoint(uri)
    with pytest.raises(IncompleteCheckpointError, match="nothing there"):
        load_checkpoint(f"{base}/run-1/never-published/{saved.sha256}")
    assert not factory_home.checkpoint_cache.exists() or not any(factory_home.checkpoint_cache.iterdir())


def test_a_file_that_does_not_match_the_manifest_is_refused_and_nothing_is_cached(saved, factory_home, s3_server):
    uri = publish_checkpoint(saved.path, f"s3://{s3_server.bucket}/ckpts", "run-1/step-000002", saved.sha256)
    with s3_server.fs().open_output_stream(f"{uri.removeprefix('s3://')}/config.json") as f:
        f.write(b'{"tampered": true}')
    with pytest.raises(IncompleteCheckpointError, match="config.json does not match its manifest"):
        load_checkpoint(uri)
    assert not any(factory_home.checkpoint_cache.iterdir())  # the partial download was removed


def test_a_run_records_its_checkpoint_under_the_store_uri(micro, lake, factory_home, s3_server, monkeypatch):
    monkeypatch.setenv("FACTORY_CHECKPOINT_URI", f"s3://{s3_server.bucket}/team")
    info = record_checkpoint(*micro, factory_home, lake, "run-9", 4)
    (row,) = lake.read("checkpoints").to_pylist()
    assert row["uri"] == f"s3://{s3_server.bucket}/team/run-9/step-000004/{info.sha256}"
    assert row["sha256"] == info.sha256
    # Periodic evals find the files through the same URI (a verified cache copy).
    assert dir_digest(recorded_checkpoint_dir(row["uri"], factory_home))[0] == info.sha256


def test_without_the_setting_checkpoints_stay_local(saved, monkeypatch):
    monkeypatch.delenv("FACTORY_CHECKPOINT_URI", raising=False)
    assert recorded_uri(saved, "run-1/step-000002") == str(saved.path)


@pytest.mark.parametrize("bad", ["/mnt/checkpoints", "file:///mnt/c", "s3:///no-bucket"])
def test_a_checkpoint_uri_that_is_not_an_object_store_is_refused(saved, monkeypatch, bad):
    monkeypatch.setenv("FACTORY_CHECKPOINT_URI", bad)
    with pytest.raises(ValueError, match=r"FACTORY_CHECKPOINT_URI=.*expected an object-store URI s3://"):
        recorded_uri(saved, "run-1/step-000002")
