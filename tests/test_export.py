"""metachunk export: a training run -> a clean HF model folder with a true card, pushed to a fake Hub.

Each training test runs the real CPU smoke recipe for 2 steps on the tiny Qwen2 (a few seconds);
the ZeRO-3 test launches 2 DeepSpeed CPU processes (about 30-45 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from metachunk.train.export import ExportConfig, export
from support.fixtures import free_port

from metachunk.artifacts import InputError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train" / "cpu_smoke.yaml"
TOKEN = "not-a-real-hub-token-metachunk-export-tests"
REPO = "someone/metachunk-rewriter-tiny"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _train(sft_dataset, tiny_model_dir, out: Path, *extra: str) -> Path:
    from metachunk.train.sft import main

    argv = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
            "--output_dir", str(out), "--max_steps", "2", "--max_length", "4096", *extra]  # fmt: skip
    assert main(argv) == 0
    return out


def _export(checkpoint: Path, out: Path, **kw):
    return export(ExportConfig(checkpoint=checkpoint, out=out, **kw), progress=lambda msg: None)


def _front_matter(text: str) -> dict:
    import yaml

    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, "no YAML front matter"
    return yaml.safe_load(match.group(1))


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _no_pickles(folder: Path) -> None:
    names = [p.name for p in folder.rglob("*")]
    assert not [n for n in names if n.endswith(PICKLE_SUFFIXES)], names


def test_export_of_a_trained_run_reloads_generates_and_has_a_true_card(
    sft_dataset,
    tiny_model_dir,
    tmp_path,
    capsys,
    monkeypatch,
):
    import torch
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from metachunk.cli import main

    run = _train(sft_dataset, tiny_model_dir, tmp_path / "run")
    out = tmp_path / "models" / "rewriter"
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    files = sorted(p.name for p in out.iterdir())
    size = sum((out / f).stat().st_size for f in files)
    assert (
        f"{out}: {len(files)} files, {size:,} bytes, 172,608 parameters (float32, from full weights)" in err
    )
    assert set(files) == {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                          "tokenizer_config.json", "chat_template.jinja", "README.md", "loss.png"}  # fmt: skip
    _no_pickles(out)  # the run dir's training_args.bin stays behind, unread
    assert "the card's license is 'other' with no name" in err  # the tiny base has no card

    # the weights are the trained ones, and the folder is an ordinary HF model
    trained = AutoModelForCausalLM.from_pretrained(run, use_safetensors=True)
    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)
    assert model.config.use_cache is True  # training switched it off; the export is for generation
    exported = model.state_dict()
    assert exported.keys() == trained.state_dict().keys()
    assert all(torch.equal(w, exported[k]) for k, w in trained.state_dict().items())
    assert _tensors(out).keys() == _tensors(run).keys()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(run).chat_template
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Rewrite: he said so."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert inputs["input_ids"].shape[1] < generated.shape[1] <= inputs["input_ids"].shape[1] + 4
    assert (out / "generation_config.json").read_bytes() == (run / "generation_config.json").read_bytes()
    assert (out / "loss.png").read_bytes() == (run / "loss.png").read_bytes()

    # the card: the run's own numbers, a front matter the Hub parses, nothing invented
    facts = json.loads((run / "metachunk_run.json").read_text())
    card = (out / "README.md").read_text()
    meta = _front_matter(card)
    assert meta == {
        "language": ["en"],
        "library_name": "transformers",
        "license": "other",  # the base model's folder has no card to take it from
        "pipeline_tag": "text-generation",
        "tags": ["metachunk", "text-chunking", "rag", "rewrite"],
    }  # no base_model: a local dir has no Hub id; no datasets: none given
    assert ModelCard.load(out / "README.md").data.pipeline_tag == "text-generation"
    for line in (
        f"| final training loss | {facts['final_train_loss']:.4f} |",
        f"| final validation loss | {facts['final_eval_loss']:.4f} |",
        "| optimizer steps | 2 |",
        f"| rows in the training set | {facts['rows']} |",
        "| epochs trained | ",
        f"| training tokens | {facts['tokens']:,} |",
        f"| completion tokens (carrying the loss) | {facts['completion_tokens']:,} |",
        f"- Base model: `…/{tiny_model_dir.name}`",  # an absolute path shows only its last part
        "- Dataset: metachunk-rewrite-ds (Hub id: not recorded; its card is README.md in the dataset folder)",
        "- Rows: train 11, validation 3",
        "| learning_rate | 1e-05 |",
        "| max_steps | 2 |",
        "| lr_scheduler_type | cosine |",
        "| deepspeed | none |",
        "| world_size (processes) | 1 |",
        "![Training and validation loss](loss.png)",
        "--rewrite path/to/rewriter",
        "Evaluation beyond the validation loss: not recorded.",
        "- Trained on a set of 11 rows (",  # (E epochs of them): 2 steps of a batch see part of it
        " for 2 optimizer steps.",
    ):
        assert line in card, line
    # the recipe: the run's arguments, an absolute path by its last part (shlex quotes the "…")
    assert f"--output_dir '…/{run.name}'" in card
    assert str(tmp_path) not in card
    assert "sha256 `" in card and "{chunk}" in card  # the student prompt it was trained on
    assert card.count("not recorded") == 2

    # another folder is replaced only with --overwrite, an earlier export anyway (a rerun); a failed
    # export leaves --out as it was
    notes = tmp_path / "models" / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    assert main(["export", "--checkpoint", str(run), "--out", str(notes)]) == 2
    assert "not a metachunk export; pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]
    before = {f: (out / f).read_bytes() for f in files}
    import metachunk.train.export

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(metachunk.train.export, "render_model_card", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        _export(run, out)
    assert {f: (out / f).read_bytes() for f in sorted(p.name for p in out.iterdir())} == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["notes", "rewriter"]  # no temp folder left
    monkeypatch.undo()
    result = _export(run, out, dtype="bfloat16", dataset_id="someone/metachunk-rewrite")
    assert result.dtype == "bfloat16" and sorted(p.name for p in out.parent.iterdir()) == [
        "notes",
        "rewriter",
    ]
    card = (out / "README.md").read_text()
    assert _front_matter(card)["datasets"] == ["someone/metachunk-rewrite"]
    assert "[metachunk-rewrite-ds](https://huggingface.co/datasets/someone/metachunk-rewrite)" in card
    with pytest.raises(InputError, match="replace the checkpoint"):
        _export(run, run.parent, overwrite=True)


def test_lora_adapter_is_merged_and_matches_the_peft_model(sft_dataset, tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = _train(sft_dataset, tiny_model_dir, tmp_path / "lora", "--use_peft", "true", "--lora_r", "4",
                 "--learning_rate", "1e-2")  # fmt: skip
    out = tmp_path / "merged"
    with pytest.raises(InputError, match="a LoRA adapter: pass --merge-lora"):
        _export(run, out)
    assert not out.exists()
    result = _export(run, out, merge_lora=True)
    assert result.kind == "lora"
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").exists()
    _no_pickles(out)

    merged = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True)
    peft_model = PeftModel.from_pretrained(base, run).eval()
    ids = torch.tensor([[1, 5, 17, 300, 42, 7, 900, 2]])
    with torch.no_grad():
        expected, got = peft_model(ids).logits, merged(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True)(ids).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-3)  # the adapter was trained: merging changed the model
    card = (out / "README.md").read_text()
    assert "- Fine-tuning: LoRA (r=4, alpha=32, dropout=0.05), merged into the base weights" in card
    with pytest.raises(InputError, match="no adapter"):
        _export(tiny_model_dir, tmp_path / "x", merge_lora=True)


def test_sharded_checkpoint_exports_to_shards_that_reload_exactly(sft_dataset, tiny_model_dir, tmp_path):
    """A 3B checkpoint comes as model-0000K-of-0000N.safetensors + index, and a 3B export (12 GB in
    fp32) is split the same way (--max-shard-size, 5GB by default). Both directions, on the tiny
    model cut into ~200 KB files."""
    import torch
    from transformers import AutoModelForCausalLM

    run = _train(sft_dataset, tiny_model_dir, tmp_path / "run")
    trained = AutoModelForCausalLM.from_pretrained(run, use_safetensors=True).state_dict()
    (run / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True).save_pretrained(
        tmp_path / "base"
    )  # a model whose weights differ, to write the shards from the trained ones below
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", use_safetensors=True)
    model.load_state_dict(trained)
    model.save_pretrained(run, max_shard_size="300KB")
    assert len(list(run.glob("model-*.safetensors"))) > 1 and (run / "model.safetensors.index.json").is_file()

    out = tmp_path / "export"
    with pytest.raises(ValueError, match="max_shard_size"):
        ExportConfig(checkpoint=run, out=out, max_shard_size="lots")
    result = _export(run, out, max_shard_size="200KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    held = {p.name: sum(1 for f in index["weight_map"].values() if f == p.name) for p in shards}
    # every file keeps under the limit (plus its header), unless it is one tensor bigger than the limit
    assert all(p.stat().st_size < 200_000 + 4_096 or held[p.name] == 1 for p in shards), held
    assert result.files == len(list(out.iterdir()))
    _no_pickles(out)
    exported = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True).state_dict()
    assert exported.keys() == trained.keys()
    assert all(torch.equal(w, exported[k]) for k, w in trained.items())


def test_pickled_weights_are_refused_naming_the_file(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import torch

    from metachunk.cli import main

    state = {k: v.clone() for k, v in _tensors(tiny_model_dir).items()}
    full = tmp_path / "bin_only"
    full.mkdir()
    shutil.copy(tiny_model_dir / "config.json", full)
    torch.save(state, full / "pytorch_model.bin")
    adapter = tmp_path / "adapter_bin"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    torch.save({}, adapter / "adapter_model.bin")

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    assert main(["export", "--checkpoint", str(full), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{full / 'pytorch_model.bin'}: pickled weights" in err and "safetensors only" in err
    with pytest.raises(InputError, match=r"adapter_model\.bin: pickled weights"):
        _export(adapter, tmp_path / "out", merge_lora=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no weights"):
        _export(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),  # weights cut short or overwritten
        lambda d: (d / "config.json").write_text('{"model_type": "qwen2", '),  # not JSON
        lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "hidden_size": "wide"})
        ),  # a field of the wrong type
    ],
    ids=["weights", "config-not-json", "config-field-type"],
)
def test_a_checkpoint_that_does_not_load_is_named(tiny_model_dir, tmp_path, capsys, damage):
    from metachunk.cli import main

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, checkpoint)
    damage(checkpoint)
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{checkpoint}" in err and "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")  # huggingface_hub's LFS PUT
def test_push_uploads_the_exported_folder(fake_hub, tiny_model_dir, tmp_path, monkeypatch, caplog, capsys):
    import logging

    from huggingface_hub import constants

    from metachunk.cli import main

    model_dir = tmp_path / "model"  # a bare model folder, plus eval results from `metachunk eval`
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "eval_results.json").write_text(json.dumps({"qa": {"f1": 0.5, "n": 20}, "eval_loss": 1.25}))
    out = tmp_path / "export"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert main(["export", "--checkpoint", str(model_dir), "--out", str(out), "--push", REPO]) == 2
    assert "HF_TOKEN" in capsys.readouterr().err
    assert fake_hub.requests == [] and not out.exists()  # refused before any work, nothing sent

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # LFS batch + storage PUT, as emulated
    fake_hub.lfs_suffixes = (".safetensors",)
    caplog.set_level(logging.DEBUG)
    argv = ["export", "--checkpoint", str(model_dir), "--out", str(out), "--push", REPO, "--private",
            "--base-model-id", "Qwen/Qwen2.5-0.5B-Instruct", "--tag", "v1"]  # fmt: skip
    assert main(argv) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.strip() == f"https://huggingface.co/{REPO}"
    assert f"; pushed to https://huggingface.co/{REPO}" in stderr
    assert [t[1] for t in fake_hub.tags] == ["v1"] and len(fake_hub.commits) == 1

    sent = fake_hub.committed_files()
    assert sent == {p.name: p.read_bytes() for p in out.iterdir()}  # the whole export, byte for byte
    assert {"model.safetensors", "README.md", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= set(sent)  # fmt: skip
    assert fake_hub.repos == [("model", REPO)]
    create = next(json.loads(b) for m, url, _, b in fake_hub.requests if url.endswith("/api/repos/create"))
    assert create["type"] == "model" and create["visibility"] == "private"
    assert [
        url for m, url, _, b in fake_hub.requests if url.startswith("https://storage.invalid/")
    ]  # LFS PUT
    # no run facts next to a bare model folder: the card says so instead of guessing
    card = sent["README.md"].decode()
    assert _front_matter(card)["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert "# metachunk-rewriter-tiny" in card and "Command: not recorded." in card
    # pushed: the usage lines name the repo, and no line names a folder of this machine
    assert f'AutoModelForCausalLM.from_pretrained("{REPO}")' in card and "path/to/" not in card
    assert str(tmp_path) not in card and f"- Exported from: `…/{model_dir.name}`" in card
    assert "Hyperparameters: not recorded." in card and "| final training loss | not recorded |" in card
    assert "| qa.f1 | 0.5000 |" in card and "| qa.n | 20 |" in card and "| eval_loss | 1.2500 |" in card
    assert json.loads(sent["eval_results.json"]) == {"qa": {"f1": 0.5, "n": 20}, "eval_loss": 1.25}

    assert fake_hub.unexpected == []
    for method, url, headers, _ in fake_hub.requests:
        if url.startswith("https://huggingface.co/") and not url.endswith("/api/agent-harnesses"):
            assert headers.get("authorization") == f"Bearer {TOKEN}", (method, url)
        else:
            assert "authorization" not in headers, (method, url)
    assert TOKEN not in caplog.text and TOKEN not in stdout and TOKEN not in stderr
    assert TOKEN.encode() not in b"".join(sent.values())


def test_a_failed_push_is_retried_without_exporting_again(
    fake_hub, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """`export --out DIR --push REPO` without --checkpoint publishes the export already at DIR: no model
    is loaded or written (the folder's files keep their mtimes); a folder that is no export is refused."""
    from huggingface_hub import constants

    import metachunk.hub
    from metachunk.cli import main

    out = tmp_path / "export"
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    fake_hub.lfs_suffixes = (".safetensors",)

    def unreachable(*args, **kwargs):
        raise OSError("the network went away")

    with monkeypatch.context() as m:  # the export is written, then its push fails
        m.setattr(metachunk.hub, "push_folder", unreachable)
        with pytest.raises(OSError):
            _export(tiny_model_dir, out, push=REPO)
    assert fake_hub.commits == []
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["export", "--out", str(out), "--push", REPO, "--tag", "v1"]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.strip() == f"https://huggingface.co/{REPO}" and "parameters" in stderr
    assert fake_hub.committed_files() == {p.name: p.read_bytes() for p in out.iterdir()}
    assert [t[1] for t in fake_hub.tags] == ["v1"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing exported again

    # upload_folder ignores only .git and .cache/huggingface: a file left in the folder would be published
    (out / ".env").write_text("HF_TOKEN=hf_private\n")
    (out / "notes").mkdir()
    (out / "notes" / "todo.md").write_text("private\n")
    (out / "training_args.bin").write_bytes(b"a pickle")  # export writes none: it may hold paths, a token
    commits = len(fake_hub.commits)
    assert main(["export", "--out", str(out), "--push", REPO]) == 2
    assert (
        "holds 3 files no export writes (.env, notes/todo.md, training_args.bin)" in capsys.readouterr().err
    )
    assert len(fake_hub.commits) == commits
    (out / ".env").unlink()
    (out / "training_args.bin").unlink()
    shutil.rmtree(out / "notes")
    (out / ".git").mkdir()  # what upload_folder never sends is no reason to refuse
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / "additional_chat_templates").mkdir()  # a tokenizer's named templates (transformers writes them so)
    (out / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    assert main(["export", "--out", str(out), "--push", REPO]) == 0
    assert "additional_chat_templates/tool_use.jinja" in fake_hub.committed_files()
    shutil.rmtree(out / ".git")
    shutil.rmtree(out / "additional_chat_templates")

    _export(tiny_model_dir, tmp_path / "local")  # a card for no repo: its usage lines name a local path
    assert main(["export", "--out", str(tmp_path / "local"), "--push", REPO]) == 2
    assert "its model card was written for another repo, or none" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", "--out", str(tmp_path / "empty"), "--push", REPO]) == 2
    assert "holds no metachunk export to push" in capsys.readouterr().err
    assert main(["export", "--out", str(out), "--push", REPO, "--base-model-id", "Qwen/Qwen2.5-0.5B"]) == 2
    assert "--base-model-id shapes an export" in capsys.readouterr().err  # the card is written already
    assert main(["export", "--out", str(out)]) == 2  # neither a checkpoint nor a push
    assert "field 'checkpoint' is required" in capsys.readouterr().err


@pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)
def test_zero3_checkpoint_exports_gathered_weights_or_consolidates_shards(
    sft_dataset,
    tiny_model_dir,
    tmp_path,
    monkeypatch,
):
    """A 2-process ZeRO-3 run saves checkpoint-2 with the gathered model.safetensors next to the
    shards: the export takes it and unpickles nothing. Without it, --trust-zero-shards consolidates
    the shards with DeepSpeed into the fp32 masters, which round to exactly the gathered weights."""
    import torch
    from transformers import AutoModelForCausalLM

    run = tmp_path / "zero3"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           "--module", "metachunk.train", "--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name",
           str(sft_dataset), "--max_steps", "2", "--max_length", "4096", "--output_dir", str(run),
           "--per_device_train_batch_size", "1", "--deepspeed", str(ROOT / "recipes" / "deepspeed" / "zero3.json"),
           "--ddp_backend", "gloo", "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "no"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checkpoint = run / "checkpoint-2"
    assert (
        list(checkpoint.glob("global_step2/*_optim_states.pt"))
        and (checkpoint / "model.safetensors").exists()
    )
    gathered = _tensors(run)  # the run's final (step 2) gathered weights

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called")

    with monkeypatch.context() as m:
        m.setattr(torch, "load", no_unpickling)
        _export(checkpoint, tmp_path / "from_gathered")
    exported = _tensors(tmp_path / "from_gathered")
    assert exported.keys() == gathered.keys()
    assert all(torch.equal(exported[k], w) for k, w in gathered.items())

    (checkpoint / "model.safetensors").unlink()  # as with gathering off: the shards are all there is
    with pytest.raises(InputError, match="--trust-zero-shards"):
        _export(checkpoint, tmp_path / "from_shards")
    result = _export(checkpoint, tmp_path / "from_shards", trust_zero_shards=True)
    assert (result.kind, result.dtype) == ("zero", "float32")
    _no_pickles(tmp_path / "from_shards")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "from_shards", use_safetensors=True)
    masters = model.state_dict()
    assert all(torch.equal(masters[k].to(w.dtype), w) for k, w in gathered.items())
    card = (tmp_path / "from_shards" / "README.md").read_text()
    facts = json.loads((run / "metachunk_run.json").read_text())
    assert "the checkpoint at step 2" in card and "| world_size (processes) | 2 |" in card
    assert f"| final training loss | {facts['final_train_loss']:.4f} |" in card


def test_the_models_license_is_its_base_models_not_its_datasets(tmp_path):
    """A fine-tune's weights are under its base model's terms: the card took the training data's license."""
    from metachunk.train.card import base_license

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "README.md").write_text("---\nlicense: other\nlicense_name: qwen-research\nlicense_link: "
                                    "https://huggingface.co/Qwen/Qwen2.5-3B-Instruct/blob/main/LICENSE\n---\n# Qwen\n")  # fmt: skip
    assert base_license(qwen) == {"license": "other", "license_name": "qwen-research",
                                  "license_link": "https://huggingface.co/Qwen/Qwen2.5-3B-Instruct/blob/main/LICENSE"}  # fmt: skip
    smol = tmp_path / "smol"
    smol.mkdir()
    (smol / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    assert base_license(smol) == {"license": "apache-2.0"}
    assert base_license(tmp_path / "gone") == base_license(None) == {"license": "other"}


def test_the_cards_license_is_the_flags_else_the_bases_else_the_presets(tmp_path):
    """``--license`` wins; a base folder without a card (a converted preset) falls back to what the
    preset's own Hub card declares; anything else is ``other``, which export says has no name."""
    from metachunk.train.card import Run, card_license

    no_flags = {"license": None, "license_name": None, "license_link": None}
    assert card_license(Run(facts={"base_model": "smollm2", "base_model_dir": str(tmp_path)}), no_flags) == {
        "license": "apache-2.0"
    }
    assert card_license(Run(facts={"base_model": "gemma3-270m"}), no_flags) == {"license": "gemma"}
    assert card_license(Run(facts={"base_model": str(tmp_path)}), no_flags) == {"license": "other"}
    named = {"license": "other", "license_name": "acme-1.0", "license_link": "LICENSE"}
    assert card_license(Run(facts={"base_model": "smollm2"}), named) == named
    with pytest.raises(ValueError, match="go with license 'other'"):
        ExportConfig(checkpoint=tmp_path, out=tmp_path / "o", license="mit", license_name="acme")
