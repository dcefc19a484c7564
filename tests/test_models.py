"""Model presets: listing, resolution of names and local dirs, and clear errors."""

import json

import pytest

from metachunk import models
from metachunk.artifacts import read_run_log
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


AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
OLD = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"


def test_auto_dtype_is_bfloat16_where_the_cpu_computes_it_natively():
    from metachunk.models import native_bf16_flag, pick_dtype

    assert native_bf16_flag(AMX) == "amx_bf16" and native_bf16_flag(ZEN4) == "avx512_bf16"
    assert native_bf16_flag(OLD) is None and native_bf16_flag("") is None
    assert pick_dtype("auto", "cpu", AMX) == (
        "bfloat16",
        "auto: the CPU computes bfloat16 natively (amx_bf16)",
    )
    assert pick_dtype("auto", "cpu", ZEN4)[0] == "bfloat16"
    assert pick_dtype("auto", "cpu", OLD) == (
        "float32",
        "auto: the CPU has no native bfloat16 (amx_bf16 or avx512_bf16)",
    )
    assert pick_dtype("auto", "cuda:0", OLD)[0] == "bfloat16"
    assert pick_dtype("float32", "cpu", AMX) == ("float32", "asked for")  # the exact path stays exact


def test_the_chunk_run_log_records_the_dtype_and_why(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from metachunk import models

    src = tmp_path / "d.jsonl"
    src.write_text('{"id": "a", "text": "Emma was clever. She was rich. Her home was Hartfield."}\n')
    for cpuinfo, picked in ((AMX, "bfloat16"), (OLD, "float32")):
        monkeypatch.setattr(models, "native_bf16_flag", lambda text=None, c=cpuinfo: models.NATIVE_BF16_FLAGS[0]
                            if "amx_bf16" in c else None)  # fmt: skip
        out = tmp_path / f"{picked}.jsonl"
        assert main(["chunk", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--lang", "en"]) == 0
        dtype = read_run_log(out)[-1]["workers_report"][0]["dtype"]
        assert dtype["dtype"] == picked and dtype["why"].startswith("auto:")
        # the meta records what auto picked: machines that chunk differently never write the same meta
        assert json.loads(out.with_suffix(".meta.json").read_text())["config"]["dtype"] == picked
    # a folder started where auto means bfloat16 is not resumed where it means float32
    for cpuinfo in (AMX, OLD):
        monkeypatch.setattr(models, "native_bf16_flag", lambda text=None, c=cpuinfo: models.NATIVE_BF16_FLAGS[0]
                            if "amx_bf16" in c else None)  # fmt: skip
        code = main(["chunk", str(src), "-o", str(tmp_path / "folder"), "--model", str(tiny_model_dir)])
    assert code == 2
    assert (
        "written by another run (changed: config: dtype 'bfloat16' -> 'float32')" in capsys.readouterr().err
    )
    out = tmp_path / "exact.jsonl"
    assert (
        main(["chunk", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32"]) == 0
    )
    assert read_run_log(out)[-1]["workers_report"][0]["dtype"] == {
        "dtype": "float32",
        "why": "asked for",
    }


def test_a_loaded_model_has_already_run_one_short_forward(tiny_model_dir, monkeypatch):
    """A process's one-off setup (on a GPU: cuBLAS handles, lazily loaded kernels) is paid by the
    load, so `metachunk chunk`'s model-load seconds hold it and its first batch does not."""
    warmed = []
    real = models.warm_up
    monkeypatch.setattr(models, "warm_up", lambda model, **k: warmed.append(model) or real(model, **k))
    model, _ = models.load_causal_lm(str(tiny_model_dir), device="cpu", dtype="float32")
    assert warmed == [model] and not model.training


def test_a_device_torch_cannot_use_is_refused_before_the_model_loads(tiny_model_dir, monkeypatch):
    import torch

    monkeypatch.setattr(models, "resolve", lambda name: pytest.fail("resolved a model for a bad device"))
    with pytest.raises(models.DeviceNotFoundError, match="'tpux' is not a torch device"):
        models.load_causal_lm_model(str(tiny_model_dir), device="tpux")
    if not torch.cuda.is_available():
        with pytest.raises(models.DeviceNotFoundError, match="torch sees no CUDA device here"):
            models.load_causal_lm_model(str(tiny_model_dir), device="cuda")
    assert models.check_device("cpu") == "cpu"


def test_an_attention_transformers_does_not_know_is_refused_before_loading():
    with pytest.raises(models.ModelNotFoundError, match="attn_implementation 'bogus' is none of eager"):
        models.pick_attention("bogus", "cpu")
    assert models.pick_attention("sdpa", "cpu") == "sdpa"
    assert models.pick_attention("kernels-community/flash-attn", "cuda") == "kernels-community/flash-attn"


@pytest.mark.parametrize("damage", ["weights", "shape"])
def test_a_model_folder_that_does_not_load_is_named_not_a_traceback(tmp_path, tiny_model_dir, capsys, damage):
    """Weights cut short, or a config.json whose shapes the weights do not have: `chunk` (and every
    verb that loads a model through `models.load_causal_lm_model`) printed transformers' traceback, exit 1."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    if damage == "weights":
        weights = broken / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        config = json.loads((broken / "config.json").read_text())
        (broken / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    src = tmp_path / "d.jsonl"
    src.write_text('{"id": "a", "text": "Emma was clever. She was rich."}\n')
    code = main(
        ["chunk", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(broken), "--method", "ppl"]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"{broken}: does not load (" in err and "Traceback" not in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_model_retrained_into_the_same_folder_has_another_fingerprint(tiny_model_dir, tmp_path):
    """Its weight files keep their names and sizes: fingerprinted by those alone, a resumed chunk run
    took the retrained model for the one it started with and mixed the two models' chunks."""
    import shutil

    from metachunk.models import fingerprint

    copy = tmp_path / "retrained"
    shutil.copytree(tiny_model_dir, copy)
    assert fingerprint(str(copy))["sha256"] == fingerprint(str(tiny_model_dir))["sha256"]
    (weights,) = copy.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(
        b ^ 0xFF for b in data[middle : middle + 64]
    )  # same size, other values
    weights.write_bytes(bytes(data))
    assert fingerprint(str(copy))["sha256"] != fingerprint(str(tiny_model_dir))["sha256"]


def test_a_chat_template_file_is_part_of_the_fingerprint_and_a_card_is_not(tiny_model_dir, tmp_path):
    """transformers 5 saves a chat template in chat_template.jinja, and build-sft renders its rows with it:
    edited, it left `metachunk run` taking the old rows for current. A rewritten card changes no output."""
    import shutil

    from metachunk.models import fingerprint

    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    before = fingerprint(str(copy))["sha256"]
    (copy / "README.md").write_text("# a card pushed since\n")
    (copy / ".cache" / "huggingface").mkdir(parents=True)
    (copy / ".cache" / "huggingface" / "x.lock").write_text("")
    assert fingerprint(str(copy))["sha256"] == before
    (copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with_template = fingerprint(str(copy))["sha256"]
    assert with_template != before
    (copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert fingerprint(str(copy))["sha256"] != with_template
