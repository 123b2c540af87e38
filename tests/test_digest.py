"""One directory digest and one manifest format: checkpoints, model directories and resume points hash alike,
and manifests written before the one format still read."""

import pytest

from factory.digest import dir_digest, hash_blobs, hash_files, manifest, manifest_entries, model_dir_digest, tree_files


def test_a_tree_hashes_the_same_from_its_files_and_from_the_bytes_written(tmp_path):
    blobs = {"config.json": b"{}", "model.safetensors": b"w" * 3_000_000, "sub/tokenizer.json": b"[]"}
    for name, data in blobs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    tree = hash_files(tree_files(tmp_path), tmp_path, per_file=True)
    assert tree == hash_blobs(blobs)
    assert dir_digest(tmp_path) == (tree.sha256, 3_000_004) == (tree.sha256, tree.bytes)
    assert model_dir_digest(tmp_path) == tree.sha256  # files in more than one place: names from the root either way
    assert [e["path"] for e in tree.files] == sorted(blobs)


def test_a_model_directory_names_files_from_their_common_folder(tmp_path):
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "config.json").write_text("{}")
    (tmp_path / "only" / "vocab.json").write_text("{}")
    assert model_dir_digest(tmp_path) == model_dir_digest(tmp_path / "only") != dir_digest(tmp_path)[0]
    assert model_dir_digest(tmp_path / "missing") is None


def test_manifests_of_this_format_and_both_earlier_ones_list_the_same_entries():
    tree = hash_blobs({"a": b"1", "b": b"22"})
    entries = tree.files
    assert manifest_entries(manifest(tree, step=3)) == entries
    published_before = {"format": 1, "sha256": tree.sha256, "bytes": 3, "files": entries}
    resume_point_before = {"format": 1, "step": 3, "files": {e["path"]: {"sha256": e["sha256"], "bytes": e["bytes"]}
                                                             for e in entries}}
    assert manifest_entries(published_before) == manifest_entries(resume_point_before) == entries
    with pytest.raises(ValueError, match="format 7"):
        manifest_entries({"format": 7, "files": []})
