"""Model presets: listing, resolution of names and local dirs, and clear errors."""

import pytest

from metachunk import models
from metachunk.cli import main


def test_models_list_names_every_preset(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in models.PRESETS:
        assert name in out


def test_local_dir_is_accepted(tiny_model_dir):
    assert models.resolve(str(tiny_model_dir)) == tiny_model_dir


def test_unknown_name_and_non_model_dir(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="not a preset"):
        models.resolve("no-such-model")
    with pytest.raises(models.ModelNotFoundError, match="no config.json"):
        models.resolve(str(tmp_path))
    with pytest.raises(models.ModelNotFoundError, match="unknown preset"):
        models.fetch("no-such-model")


def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("METACHUNK_CACHE", str(tmp_path))
    assert models.preset_dir("smollm2") == tmp_path / "models" / "smollm2"


@pytest.mark.integration
def test_fetch_smollm2_converts_once_into_a_plain_hf_folder():
    path = models.fetch("smollm2")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert "quantization_config" not in (path / "config.json").read_text()
    mtime = (path / "model.safetensors").stat().st_mtime
    assert models.fetch("smollm2") == path  # second call loads from the cache, no reconversion
    assert (path / "model.safetensors").stat().st_mtime == mtime
