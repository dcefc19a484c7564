"""Hub ids wherever a model, a student or a dataset is named, through the fake Hub.

The round trips users make: a rewriter exported and pushed, then chunked with by its id (the same
output as from the local folder); a training run whose base model and dataset are both Hub ids; a
corpus read as ``hf://datasets/ORG/NAME``. A revision (``@BRANCH``, ``@TAG``, ``@COMMIT``) reads the
files as they were then, and a regeneration fingerprint records the commit an id resolved to.
Offline, an id outside the local cache is a clear error, not a download.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from metachunk.cli import main

TOKEN = "hf_test_token_0123456789"
TEXT = (
    "Emma Woodhouse lived with her father at Hartfield. Her governess had just married Mr. Weston. "
    "The wedding left father and daughter alone. Mr. Knightley walked over after dinner."
)


@pytest.fixture
def hub(fake_hub, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # LFS batch + storage PUT, as emulated
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # downloads land here
    return fake_hub


def push_model(folder: Path, repo: str) -> None:
    from metachunk.hub import push_folder

    push_folder(folder, repo, repo_type="model", token=TOKEN)


def test_a_pushed_rewriter_chunks_by_its_id_as_from_its_folder(hub, tiny_model_dir, tmp_path, capsys):
    student = tmp_path / "rewriter"
    shutil.copytree(tiny_model_dir, student)
    push_model(student, "someone/rewriter-tiny")
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "en", "text": TEXT}) + "\n")
    outputs = {}
    for name, model in (("local", str(student)), ("hub", "someone/rewriter-tiny")):
        out = tmp_path / f"{name}.jsonl"
        argv = ["chunk", str(docs), "-o", str(out), "--method", "sentence", "--target-len", "80",
                "--len-unit", "char", "--rewrite", model, "--rewrite-max-new-tokens", "4"]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert outputs["hub"] == outputs["local"]
    assert any("/resolve/" in url for _, url, _, _ in hub.requests)  # it was downloaded, not found on disk


def test_training_takes_a_hub_model_and_a_hub_dataset(hub, tiny_model_dir, sft_dataset, tmp_path):
    from metachunk.distill.hub import push_dataset
    from metachunk.train.sft import main as train

    push_model(tiny_model_dir, "someone/base-tiny")
    push_dataset(sft_dataset, "someone/sft-tiny", token=TOKEN)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "train" / "cpu_smoke.yaml"
    out = tmp_path / "run"
    argv = ["--config", str(recipe), "--model_name_or_path", "someone/base-tiny", "--dataset_name",
            "someone/sft-tiny", "--output_dir", str(out), "--max_steps", "1", "--max_length", "4096"]  # fmt: skip
    assert train(argv) == 0
    assert (out / "metachunk_run.json").is_file()
    # online, TRL pings its own telemetry endpoint (HF_HUB_DISABLE_TELEMETRY=1 stops it): nothing else
    assert all("/api/telemetry/" in url for _, url in hub.unexpected), hub.unexpected


def test_a_revision_reads_the_files_as_they_were_and_the_fingerprint_names_the_commit(
    hub, tiny_model_dir, tmp_path
):
    from metachunk import models
    from metachunk.regen import Digests, Stage, fingerprint

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    push_model(folder, "someone/moving")
    first = hub.heads[("model", "someone/moving", "main")]
    (folder / "extra.json").write_text("{}")
    push_model(folder, "someone/moving")
    second = hub.heads[("model", "someone/moving", "main")]
    assert first != second
    old, new = models.resolve(f"someone/moving@{first}"), models.resolve("someone/moving")
    assert old.name == first and new.name == second
    assert not (old / "extra.json").exists() and (new / "extra.json").is_file()
    assert models.fingerprint("someone/moving")["commit"] == second

    from metachunk.cli import registry

    config = {"method": "ppl", "model": "someone/moving", "output": "o.jsonl"}
    (tmp_path / "stage.yaml").write_text(json.dumps(config))  # JSON is YAML
    fp = fingerprint(Stage("c", "chunk", config), registry(), tmp_path / "stage.yaml", Digests())
    assert fp.models["someone/moving"]["commit"] == second and not fp.missing


def test_a_corpus_reads_from_a_hub_dataset(hub, tmp_path, monkeypatch):
    from metachunk.hub import push_folder
    from metachunk.sources import DocumentSource

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train-00000-of-00001.jsonl").write_text(json.dumps({"id": "a", "text": TEXT}) + "\n")
    push_folder(corpus, "someone/corpus", repo_type="dataset", token=TOKEN)
    source = DocumentSource("hf://datasets/someone/corpus")
    assert [(d.id, d.text) for d in source] == [("a", TEXT)]
    assert main(["chunk", "hf://datasets/someone/corpus", "-o", str(tmp_path / "c.jsonl"), "--method", "sentence",
                 "--target-len", "80", "--len-unit", "char"]) == 0  # fmt: skip


def test_offline_an_id_outside_the_cache_is_a_clear_error(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from metachunk import models

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(models.ModelNotFoundError, match="not in the local Hub cache"):
        models.resolve("someone/nowhere")
    # a relative folder that is not there reads like a Hub id: the error says both were looked for
    with pytest.raises(
        models.ModelNotFoundError, match=r"^no folder models/Qwen2-7B here, and as a Hub id: model "
    ):
        models.resolve("models/Qwen2-7B")


def test_online_an_unreachable_hub_is_said_so_not_blamed_on_offline_mode(monkeypatch):
    """huggingface_hub raises LocalEntryNotFoundError when the Hub cannot be reached too, not only offline."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    from metachunk.hub import HubNotFound, snapshot

    def unreachable(*args, **kwargs):
        raise LocalEntryNotFoundError("cannot reach the Hub (connection refused)")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(HubNotFound) as caught:
        snapshot("someone/nowhere")
    assert "could not be reached (cannot reach the Hub" in str(caught.value)
    assert "HF_HUB_OFFLINE" not in str(caught.value)


def test_the_hub_token_is_masked_once_read(monkeypatch):
    from metachunk.hub import hub_token
    from metachunk.redaction import redact

    monkeypatch.setenv("HF_TOKEN", "hf_never_in_a_log_0123456789")
    hub_token()
    assert redact("pushing with hf_never_in_a_log_0123456789") == "pushing with [REDACTED]"


def test_the_python_api_takes_hub_ids(hub, tiny_model_dir):
    """The README's three lines with Hub ids: the same chunks and rewrites as from the local folder."""
    import metachunk

    push_model(tiny_model_dir, "someone/lm-tiny")
    local = metachunk.PPLChunker(str(tiny_model_dir), target_len=80, len_unit="char", lang="en")
    remote = metachunk.PPLChunker("someone/lm-tiny", target_len=80, len_unit="char", lang="en")
    chunks = remote(TEXT)
    assert chunks == local(TEXT) and "".join(c.text for c in chunks) == TEXT
    assert remote.chunk_batch([TEXT, TEXT[:40]]) == local.chunk_batch([TEXT, TEXT[:40]])
    rewriter = metachunk.Rewriter.from_pretrained("someone/lm-tiny", max_new_tokens=4)
    same = metachunk.Rewriter.from_pretrained(str(tiny_model_dir), max_new_tokens=4)
    assert rewriter(TEXT, chunks) == same(TEXT, chunks)
    assert any("/resolve/" in url for _, url, _, _ in hub.requests)  # downloaded through the Hub


def test_a_regeneration_stage_reads_a_hub_dataset_by_its_commit(hub, tmp_path, capsys):
    """`metachunk run` had taken ``hf://datasets/...`` (folded to ``hf:/`` by its Path field) for a local
    file nobody writes, and refused the stage: it is fingerprinted by the commit it resolves to."""
    import yaml

    from metachunk.hub import push_folder

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train-00000-of-00001.jsonl").write_text(json.dumps({"id": "a", "text": TEXT}) + "\n")
    push_folder(corpus, "someone/corpus", repo_type="dataset", token=TOKEN)
    recipe = {"name": "hub", "state": str(tmp_path / "state"), "stages": [
        {"name": "c", "run": "chunk", "config": {"input": "hf://datasets/someone/corpus", "output": str(tmp_path / "c.jsonl"),
                                                 "method": "sentence", "target_len": 80, "len_unit": "char"}},
    ]}  # fmt: skip
    path = tmp_path / "regen.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))

    def run(*extra) -> str:
        capsys.readouterr()
        assert main(["run", str(path), *extra]) == 0, capsys.readouterr().err
        return capsys.readouterr().err

    capsys.readouterr()
    before = len(hub.requests)
    assert main(["run", str(path), "--plan"]) == 0  # the plan asks for the commit, and downloads no file
    assert not [url for _, url, *_ in hub.requests[before:] if "/resolve/" in url]
    assert "== run: c: metachunk chunk" in run()
    assert "c (chunk): cached, skipped" in run()
    (corpus / "train-00000-of-00001.jsonl").write_text(
        json.dumps({"id": "a", "text": TEXT + " More."}) + "\n"
    )
    push_folder(corpus, "someone/corpus", repo_type="dataset", token=TOKEN)  # a new commit on main
    assert "== run: c: metachunk chunk" in run()
