"""Dataset card and Hub push: the card loads back with ``datasets``, the push sends the right files.

A small SFT dataset directory (the builder's layout, two train shards) is built in each test. The
Hub is ``hub_mock.FakeHub`` (the ``fake_hub`` fixture of ``conftest.py``, shared with the model
export tests): an ``httpx2.MockTransport`` installed with ``huggingface_hub.set_client_factory``
that answers the endpoints ``create_repo`` + ``upload_folder`` call (repo create, README YAML
validation, preupload, LFS batch + the storage PUT + verify, commit) and records every request,
so the tests see exactly which bytes and headers would have left the machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re

import pytest
import yaml
from metachunk.distill.card import plot_token_lengths, render_dataset_card, size_category, write_dataset_card
from metachunk.distill.hub import PushConfig, push_dataset

from metachunk.artifacts import InputError

TOKEN = "not-a-real-hub-token-metachunk-tests"  # distinctive, so the leak scan cannot miss it
REPO = "someone/metachunk-rewrite-demo"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPT_TEXT = "<<<system>>>\nYou rewrite text chunks.\n<<<user>>>\nDocument context:\n{context}\n\n```x```"


def _row(i: int, split: str) -> dict:
    return {
        "prompt": [
            {"role": "system", "content": "You rewrite text chunks."},
            {"role": "user", "content": f"Document context: doc {i}\n\nText chunk:\nHe said {i}."},
        ],
        "completion": [{"role": "assistant", "content": f"Mr Knightley said {i}."}],
        "doc_id": f"{split}-doc-{i // 2}",
        "chunk_index": i % 2,
        "start": 10 * i,
        "end": 10 * i + 9,
        "teachers": json.dumps({"completion": "SmolLM2-135M-Instruct"}),
        "prompt_sha256": "ab" * 32,
        "source_record": f"rewrite.jsonl:{i + 1}",
    }


@pytest.fixture
def dataset_dir(tmp_path):
    """The builder's layout: train in two shards (3 + 2 rows), validation in one (2 rows), a histogram."""
    from datasets import Dataset

    root = tmp_path / "sft"
    shards = {
        "train-00000-of-00002": [_row(i, "train") for i in range(3)],
        "train-00001-of-00002": [_row(i, "train") for i in range(3, 5)],
        "validation-00000-of-00001": [_row(i, "validation") for i in range(2)],
    }
    (root / "data").mkdir(parents=True)
    for name, rows in shards.items():
        Dataset.from_list(rows).to_parquet(str(root / "data" / f"{name}.parquet"))
    plot_token_lengths(root / "token_lengths.png", [40, 52, 61, 75, 80], [9, 12, 14, 20, 33], "smollm2", 96)
    return root


def full_stats() -> dict:
    return {
        "name": "metachunk-rewrite-demo",
        "task": "rewrite",
        "pretty_name": "Meta-Chunking rewrite SFT (demo)",
        "license": "apache-2.0",
        "language": ["zh", "en"],
        "demo": True,
        "rows": {"train": 5, "validation": 2},
        "documents": {"train": 3, "validation": 1},
        "input_records": 131,
        "source": {
            "corpus": "gutenqa-emma",
            "path": "corpora/emma.jsonl",
            "provenance": "Project Gutenberg",
        },
        "teachers": [
            {"stage": "reflection", "model": "SmolLM2-135M-Instruct"},
            {"stage": "completion", "model": "SmolLM2-135M-Instruct"},
        ],
        "prompts": [
            {"name": "student_rewrite.en", "sha256": "ab" * 32, "text": PROMPT_TEXT, "role": "student"},
            {"name": "reflection.en", "sha256": "cd" * 32, "text": "Reflect.", "role": "teacher"},
        ],
        "filters": {
            "failed_or_empty": 41,
            "refusal_or_off_format": 17,
            "too_long": 13,
            "exact_duplicate": 11,
            "near_duplicate": 7,
            "lost_content": 29,
            "contaminated": 6,
        },
        "token_lengths": {
            "tokenizer": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "max_length": 96,
            "prompt": {"min": 40, "mean": 61.6, "p50": 61, "p95": 79.0, "max": 80},
            "completion": {"min": 9, "mean": 17.6, "p50": 14, "p95": 30.4, "max": 33},
            "histogram": "token_lengths.png",
        },
        "leakage": {
            "method": "MinHash LSH over 5-gram shingles",
            "threshold": 0.8,
            "test_documents": 23,
            "rows_checked": 137,
            "contaminated": 6,
        },
        "teacher_usage": {"prompt_tokens": 81234, "completion_tokens": 20456, "cost_usd": 0.0},
        "build": {
            "command": "metachunk distill sft --task rewrite",
            "seed": 1234,
        },
        "limitations": ["Only one novel (Emma) is represented."],
    }


def _front_matter(text: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, "no YAML front matter"
    return yaml.safe_load(match.group(1))


def test_card_round_trip_loads_with_datasets(dataset_dir, tmp_path):
    from datasets import load_dataset
    from huggingface_hub import DatasetCard

    stats = full_stats()
    card_path = write_dataset_card(dataset_dir, stats, cards_dir=tmp_path / "data_cards")
    assert card_path == tmp_path / "data_cards" / "metachunk-rewrite-demo.md"
    text = card_path.read_text(encoding="utf-8")
    assert (dataset_dir / "README.md").read_text(encoding="utf-8") == text

    meta = _front_matter(text)
    assert meta["license"] == "apache-2.0"
    assert meta["language"] == ["zh", "en"]
    assert meta["task_categories"] == ["text-generation"]
    assert meta["size_categories"] == ["n<1K"]
    assert meta["tags"] == ["rag", "text-chunking", "meta-chunking", "distillation", "rewrite"]
    assert meta["pretty_name"] == stats["pretty_name"]
    card = DatasetCard.load(dataset_dir / "README.md")
    assert card.data.size_categories == ["n<1K"]

    # configs point at every parquet file, split by split
    (config,) = meta["configs"]
    assert config["config_name"] == "default"
    matched = {}
    for entry in config["data_files"]:
        files = sorted(dataset_dir.glob(entry["path"]))
        assert files, entry
        matched[entry["split"]] = [f.name for f in files]
    assert matched == {
        "train": ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"],
        "validation": ["validation-00000-of-00001.parquet"],
    }
    # dataset_info: features read from the parquet, split sizes from stats, bytes measured
    info = meta["dataset_info"]
    assert [f["name"] for f in info["features"]][:2] == ["prompt", "completion"]
    assert {s["name"]: s["num_examples"] for s in info["splits"]} == {"train": 5, "validation": 2}
    assert all(s["num_bytes"] > 0 for s in info["splits"])
    assert info["download_size"] == sum(f.stat().st_size for f in dataset_dir.glob("data/*.parquet"))

    # load_dataset reads the README's configs (and checks the row counts in dataset_info)
    ds = load_dataset(str(dataset_dir), cache_dir=str(tmp_path / "hf_cache"))
    assert {split: len(d) for split, d in ds.items()} == {"train": 5, "validation": 2}
    assert [m["role"] for m in ds["train"][0]["prompt"]] == ["system", "user"]
    assert ds["validation"][1]["completion"] == [{"role": "assistant", "content": "Mr Knightley said 1."}]

    # every number from stats is on the card, as given
    for name, removed in stats["filters"].items():
        assert re.search(rf"^\| `{name}` \| [^\n]* \| {removed} \|$", text, re.M), name
    assert "- Candidate rows: 131" in text and "- Rows kept: 7" in text
    for line in (
        "- Method: MinHash LSH over 5-gram shingles",
        "- Threshold: 0.8",
        "- Test documents: 23",
        "- Rows checked: 137",
        "- Contaminated rows: 6",
        "The check found 6 contaminated rows.",
        "- Prompt tokens: 81234",
        "- Completion tokens: 20456",
        "- Cost: 0.0000 USD",
        "- Seed: 1234",
        "| prompt tokens | 40 | 61.6 | 61 | 79.0 | 80 |",
        "| completion tokens | 9 | 17.6 | 14 | 30.4 | 33 |",
        "Token limit (`max_length`): 96.",
        "| reflection | SmolLM2-135M-Instruct |",
        "![Prompt and completion token lengths](token_lengths.png)",
        "- Only one novel (Emma) is represented.",
    ):
        assert line in text, line
    assert "not measured" not in text
    # prompt templates in full, in a fence the template's own backticks cannot close
    assert "sha256: `" + "ab" * 32 + "`" in text
    assert "````text\n" + PROMPT_TEXT + "\n````" in text
    assert "Demo-scale set, not a training-grade dataset" in text and "SmolLM2-135M" in text

    png = dataset_dir / "token_lengths.png"
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert [p.name for p in dataset_dir.iterdir() if p.name.startswith(".")] == []  # no temp files left


@pytest.mark.parametrize(
    "n, label",
    [
        (0, "n<1K"),
        (999, "n<1K"),
        (1000, "1K<n<10K"),
        (9999, "1K<n<10K"),
        (10_000, "10K<n<100K"),
        (100_000, "100K<n<1M"),
        (2_500_000, "1M<n<10M"),
        (10**12, "n>1T"),
    ],
)
def test_size_category_uses_hub_buckets(n, label):
    assert size_category(n) == label


def test_a_license_off_the_hubs_list_is_named_and_linked(tmp_path):
    """The Hub's dataset card spec: with license other, license_name and license_link say which."""
    from huggingface_hub import DatasetCard
    from metachunk.distill.sft import BuildSftConfig

    stats = {**full_stats(), "license": "other", "license_name": "crud-rag", "license_link": "LICENSE"}
    card = DatasetCard(render_dataset_card(stats))
    assert (card.data.license, card.data.license_name, card.data.license_link) == (
        "other",
        "crud-rag",
        "LICENSE",
    )
    assert "license_name" not in render_dataset_card(full_stats())
    with pytest.raises(ValueError, match="go with license 'other'"):
        BuildSftConfig(task="rewrite", distilled="d", out="o", license="mit", license_name="x")


def test_missing_stats_say_not_measured():
    text = render_dataset_card({"name": "bare", "task": "summary", "rows": {"train": 1200, "validation": 0}})
    meta = _front_matter(text)
    assert meta["size_categories"] == ["1K<n<10K"]
    assert meta["license"] == "apache-2.0"
    assert "language" not in meta and "dataset_info" not in meta
    # an empty split has no file, so it gets no data_files pattern (load_dataset would fail on it)
    assert meta["configs"][0]["data_files"] == [{"split": "train", "path": "data/train-*.parquet"}]
    for line in (
        "- Corpus: not measured",
        "- Candidate rows: not measured",
        "Teacher models: not measured.",
        "Prompt templates: not measured.",
        "| `too_long` | over the token limit (`max_length`) | not measured |",
        "| prompt tokens | not measured | not measured | not measured | not measured | not measured |",
        "Histogram: not measured.",
        "- Contaminated rows: not measured",
        "- Cost: not measured",
        "Command: not measured.",
    ):
        assert line in text, line
    assert "Demo-scale" not in text
    with pytest.raises(ValueError, match="'rows'"):
        render_dataset_card({"name": "x", "task": "rewrite"})


def test_a_report_with_the_old_limit_key_still_shows_the_limit():
    """build_report.json files written under build-sft's old field name, ``max_tokens``."""
    lengths = {**full_stats()["token_lengths"]}
    lengths["max_tokens"] = lengths.pop("max_length")
    text = render_dataset_card({**full_stats(), "token_lengths": lengths})
    assert "Token limit (`max_length`): 96." in text


def test_counts_that_do_not_add_up_are_reported_not_fixed(tmp_path):
    stats = full_stats()
    stats["input_records"] = 140  # 140 - 124 removed = 16, but 7 rows were kept
    text = render_dataset_card(stats)
    assert "- Candidate rows: 140" in text and "- Rows kept: 7" in text
    assert "candidate rows − rows removed = 16, which differs from the 7 rows kept" in text
    png = plot_token_lengths(tmp_path / "plots" / "empty.png", [], [], "smollm2", None)
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert [p.name for p in png.parent.iterdir()] == ["empty.png"]


def test_write_card_refuses_stats_that_do_not_match_the_files(dataset_dir, tmp_path):
    stats = full_stats()
    stats["rows"]["test"] = 4
    with pytest.raises(InputError, match=r"4 test rows but no file matches data/test-\*\.parquet"):
        write_dataset_card(dataset_dir, stats, cards_dir=tmp_path / "cards")
    stats = full_stats()
    stats["token_lengths"]["histogram"] = "missing.png"
    with pytest.raises(InputError, match="missing.png"):
        write_dataset_card(dataset_dir, stats, cards_dir=tmp_path / "cards")
    assert not (dataset_dir / "README.md").exists()


# ---------------------------------------------------------------------------------------------- Hub


def _debug_everything(caplog):
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            caplog.set_level(logging.DEBUG, logger=name)
    caplog.set_level(logging.DEBUG)


def _push_and_check(hub, dataset_dir, tmp_path, monkeypatch, caplog, capsys):
    write_dataset_card(dataset_dir, full_stats(), cards_dir=tmp_path / "data_cards")
    (dataset_dir / "notes.txt").write_text("not for the Hub")  # outside the allow patterns
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    _debug_everything(caplog)

    url = push_dataset(dataset_dir, REPO, commit_message="Upload demo set")
    assert url == f"https://huggingface.co/datasets/{REPO}"

    # exactly the card, the parquet shards and the PNG were committed, byte for byte
    sent = hub.committed_files()
    expected = {
        p.relative_to(dataset_dir).as_posix(): p.read_bytes()
        for p in [
            dataset_dir / "README.md",
            dataset_dir / "token_lengths.png",
            *dataset_dir.glob("data/*.parquet"),
        ]
    }
    assert sent == expected
    (commit,) = hub.commits
    head = next(oid for oid, files in hub.snapshots.items() if set(files) == {".gitattributes"})
    assert commit[0] == {"key": "header", "value": {"summary": "Upload demo set", "description": "",
                                                    "parentCommit": head}}  # the repo's first commit  # fmt: skip
    create = next(json.loads(body) for m, url, _, body in hub.requests if url.endswith("/api/repos/create"))
    # no visibility asked for: the namespace's default decides (create_repo(private=None))
    assert create == {"name": "metachunk-rewrite-demo", "organization": "someone", "type": "dataset"}

    # the token went to the Hub in the Authorization header, and nowhere else
    assert hub.unexpected == []
    for method, url, headers, _ in hub.requests:
        if url.endswith("/api/agent-harnesses"):
            assert "authorization" not in headers
        elif url.startswith("https://huggingface.co/"):
            assert headers.get("authorization") == f"Bearer {TOKEN}", (method, url)
        else:
            assert "authorization" not in headers, (method, url)
    out, err = capsys.readouterr()
    assert caplog.records, "nothing was logged: the no-token-in-logs check would be vacuous"
    assert any("authenticated: True" in r.getMessage() for r in caplog.records)
    assert TOKEN not in caplog.text and TOKEN not in out and TOKEN not in err
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    return sent


# huggingface_hub's LFS PUT passes a file object as ``data=``, which httpx2 deprecates
@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")
def test_push_sends_card_data_and_plot_through_lfs(
    fake_hub, dataset_dir, tmp_path, monkeypatch, caplog, capsys
):
    """The legacy path (no hf_xet): binary files go through the LFS batch API and a storage PUT."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    fake_hub.lfs_suffixes = (".parquet", ".png")
    _push_and_check(fake_hub, dataset_dir, tmp_path, monkeypatch, caplog, capsys)
    assert len(fake_hub.stored) == 4  # 3 parquet shards + the PNG
    for oid, data in fake_hub.stored.items():
        assert hashlib.sha256(data).hexdigest() == oid
    lines = {line["value"]["path"]: line["key"] for line in fake_hub.commits[0][1:]}
    assert lines["README.md"] == "file" and lines["token_lengths.png"] == "lfsFile"
    verified = [json.loads(b)["oid"] for m, url, _, b in fake_hub.requests if url.endswith("/objects/verify")]
    assert sorted(verified) == sorted(fake_hub.stored)


def test_push_through_the_default_pipeline(fake_hub, dataset_dir, tmp_path, monkeypatch, caplog, capsys):
    """With hf_xet installed (huggingface_hub's default); files the server calls regular travel inside
    the commit, so no Xet storage is contacted."""
    import importlib.util

    if importlib.util.find_spec("hf_xet") is None:
        pytest.skip("hf_xet is not installed: upload_folder uses the path tested above")
    _push_and_check(fake_hub, dataset_dir, tmp_path, monkeypatch, caplog, capsys)
    assert fake_hub.stored == {}


def _main_files(hub) -> set[str]:
    return set(hub.revisions[("dataset", REPO, "main")])


def test_a_second_push_replaces_what_the_first_sent(fake_hub, dataset_dir, tmp_path, monkeypatch):
    """A rebuild in fewer shards: the old shards went, so load_dataset reads the new rows only. The same
    push again sends nothing (each file's oid is the Hub's already), and a file added by hand stays."""
    import shutil

    from datasets import load_dataset

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    write_dataset_card(dataset_dir, full_stats(), cards_dir=tmp_path / "data_cards")
    push_dataset(dataset_dir, REPO)
    fake_hub.revisions[("dataset", REPO, "main")]["notes/by-hand.png"] = b"a maintainer's file"
    assert len(fake_hub.commits) == 1
    push_dataset(dataset_dir, REPO)
    assert len(fake_hub.commits) == 1  # nothing changed: no commit
    data = dataset_dir / "data"
    shutil.copyfile(data / "train-00000-of-00002.parquet", data / "train-00000-of-00001.parquet")
    for old in ("train-00000-of-00002.parquet", "train-00001-of-00002.parquet"):
        (data / old).unlink()
    rebuilt = full_stats()
    rebuilt["rows"]["train"] = 3
    write_dataset_card(dataset_dir, rebuilt, cards_dir=tmp_path / "data_cards")
    push_dataset(dataset_dir, REPO)
    assert len(fake_hub.commits) == 2
    assert _main_files(fake_hub) == {".gitattributes", "README.md", "token_lengths.png", "notes/by-hand.png",
                                     "data/train-00000-of-00001.parquet", "data/validation-00000-of-00001.parquet"}  # fmt: skip
    remote = tmp_path / "remote"
    for name, content in fake_hub.revisions[("dataset", REPO, "main")].items():
        (remote / name).parent.mkdir(parents=True, exist_ok=True)
        (remote / name).write_bytes(content)
    assert (
        len(load_dataset(str(remote), split="train")) == 3
    )  # the card's data_files glob reads the new shard only


def test_a_push_of_many_files_is_one_commit_and_a_failed_one_changes_nothing(fake_hub, tmp_path, monkeypatch):
    """upload_folder with hf_xet committed 300 files in two parts; when the second failed, main held the
    new card over 249 of the 300 shards, which load_dataset refuses. create_commit is one commit."""
    from metachunk.hub import push_folder

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    folder = tmp_path / "many"
    (folder / "data").mkdir(parents=True)
    for i in range(300):
        (folder / "data" / f"train-{i:05d}-of-00300.txt").write_text(f"shard {i}\n")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# many\n")
    push_folder(folder, REPO, repo_type="dataset", delete_patterns=["data/*.txt"])
    assert len(fake_hub.commits) == 1 and len(_main_files(fake_hub)) == 302
    before = dict(fake_hub.revisions[("dataset", REPO, "main")])
    for i in range(300):
        (folder / "data" / f"train-{i:05d}-of-00300.txt").rename(
            folder / "data" / f"train-{i:05d}-of-00301.txt"
        )
    (folder / "data" / "train-00300-of-00301.txt").write_text("one more\n")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# many, 301\n")
    fake_hub.commits_fail = True
    with pytest.raises(Exception, match="500"):
        push_folder(folder, REPO, repo_type="dataset", delete_patterns=["data/*.txt"])
    assert fake_hub.revisions[("dataset", REPO, "main")] == before  # the last publication, whole


def test_what_a_push_replaces_is_top_level_and_private_is_not_a_wish(fake_hub, tmp_path, monkeypatch):
    """``*.bin`` deleted a quantized variant kept in a subfolder (fnmatch's ``*`` crosses ``/``), and
    ``--private`` on an existing public repo pushed to it publicly (the Hub keeps its visibility)."""
    from metachunk.train.export import MODEL_FILE_PATTERNS

    from metachunk.hub import matches, push_folder

    assert matches("model.bin", MODEL_FILE_PATTERNS) and not matches(
        "gptq-4bit/model.bin", MODEL_FILE_PATTERNS
    )
    assert matches("data/x.parquet", ["data/*.parquet"]) and not matches(
        "data/a/x.parquet", ["data/*.parquet"]
    )
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# m\n")
    push_folder(folder, "someone/m", repo_type="model", delete_patterns=MODEL_FILE_PATTERNS)
    files = fake_hub.revisions[("model", "someone/m", "main")]
    files.update({"gptq-4bit/model.bin": b"kept", "pytorch_model.bin": b"stale", "loss.png": b"stale"})
    push_folder(folder, "someone/m", repo_type="model", delete_patterns=MODEL_FILE_PATTERNS)
    assert set(fake_hub.revisions[("model", "someone/m", "main")]) == {
        ".gitattributes", "README.md", "config.json", "gptq-4bit/model.bin"}  # fmt: skip
    commits = len(fake_hub.commits)
    with pytest.raises(ValueError, match="exists and is public: --private does not change"):
        push_folder(folder, "someone/m", repo_type="model", private=True)
    assert len(fake_hub.commits) == commits  # refused before anything was sent
    push_folder(folder, "someone/p", repo_type="model", private=True)  # a new repo is made private
    push_folder(folder, "someone/p", repo_type="model", private=True)  # and stays so


def test_a_tag_names_one_publication(fake_hub, dataset_dir, tmp_path, monkeypatch, capsys):
    """The same tagged push again succeeds without a commit; a tag that marks an older commit is refused
    before anything is sent (it was a 409 after the upload, leaving main published and untagged)."""
    from metachunk.cli import main

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    write_dataset_card(dataset_dir, full_stats(), cards_dir=tmp_path / "data_cards")
    argv = ["data", "push", str(dataset_dir), "--repo-id", REPO]
    assert main([*argv, "--tag", "v1"]) == 0
    assert main([*argv, "--tag", "v1"]) == 0  # the same push again: no commit, no second tag
    assert len(fake_hub.commits) == 1 and [t[1] for t in fake_hub.tags] == ["v1"]
    (dataset_dir / "data" / "validation-00000-of-00001.parquet").unlink()
    capsys.readouterr()
    # v1 marks the head, whose files this folder no longer matches: refused before anything is sent
    assert main([*argv, "--tag", "v1"]) == 2 and len(fake_hub.commits) == 1
    assert "tag 'v1' marks the head of main" in capsys.readouterr().err
    assert main([*argv, "--tag", "v2"]) == 0 and len(fake_hub.commits) == 2
    capsys.readouterr()
    assert main([*argv, "--tag", "v1"]) == 2 and len(fake_hub.commits) == 2
    err = capsys.readouterr().err
    assert f"tag 'v1' already marks commit {fake_hub.heads[('dataset', REPO, 'v1')][:12]}" in err, err
    assert [t[1] for t in fake_hub.tags] == ["v1", "v2"]


def test_a_hub_refusal_is_one_line(fake_hub, dataset_dir, tmp_path, monkeypatch, capsys):
    import httpx2

    from metachunk.cli import main

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    write_dataset_card(dataset_dir, full_stats(), cards_dir=tmp_path / "data_cards")
    answer = fake_hub.handler

    def forbidden(request):
        if request.url.path == "/api/repos/create":
            return httpx2.Response(
                403, json={"error": "You don't have the rights to create a dataset under\nthe namespace"}
            )
        return answer(request)

    monkeypatch.setattr(fake_hub, "handler", forbidden)
    assert main(["data", "push", str(dataset_dir), "--repo-id", REPO]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and TOKEN not in err, err
    assert f"metachunk: error: {REPO}: the Hub answered 403: You don't have the rights" in err


def test_a_push_that_another_overtook_is_refused(fake_hub, dataset_dir, tmp_path, monkeypatch, capsys):
    """Someone else's commit lands on the branch while this push uploads: the Hub refuses this one
    (upload_folder's parent_commit) instead of committing a mix of the two."""
    from metachunk.cli import main

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    write_dataset_card(dataset_dir, full_stats(), cards_dir=tmp_path / "data_cards")
    answer = fake_hub.handler

    def overtaken(request):
        if request.url.path.endswith("/commit/main"):  # the other push's commit lands first
            fake_hub.heads[("dataset", REPO, "main")] = "f" * 40
        return answer(request)

    monkeypatch.setattr(fake_hub, "handler", overtaken)
    assert main(["data", "push", str(dataset_dir), "--repo-id", REPO]) == 1
    err = capsys.readouterr().err
    assert f"{REPO}: the Hub answered 412: A commit has happened since" in err and err.count("\n") == 1, err
    assert fake_hub.commits == []
    monkeypatch.setattr(fake_hub, "handler", answer)  # pushed again: on top of the other's commit
    assert main(["data", "push", str(dataset_dir), "--repo-id", REPO]) == 0
    assert len(fake_hub.commits) == 1


def test_push_without_token_or_files_sends_nothing(fake_hub, dataset_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(InputError, match=r"sft: no README\.md"):
        push_dataset(dataset_dir, REPO, token=TOKEN)
    write_dataset_card(dataset_dir, full_stats(), cards_dir=tmp_path / "data_cards")
    with pytest.raises(ValueError, match="HF_TOKEN"):
        push_dataset(dataset_dir, REPO)
    for shard in dataset_dir.glob("data/*.parquet"):
        shard.unlink()
    with pytest.raises(InputError, match=r"sft: no data/\*\.parquet"):
        push_dataset(dataset_dir, REPO, token=TOKEN)
    with pytest.raises(ValueError, match="namespace/name"):
        push_dataset(dataset_dir, "no-namespace", token=TOKEN)
    assert fake_hub.requests == []


def test_push_refuses_offline_mode(dataset_dir, tmp_path, monkeypatch, fake_hub):
    """metachunk never switches the Hub off itself; HF_HUB_OFFLINE=1, set by a user or a test
    environment, is obeyed: a push says to unset it, before any request."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # after fake_hub, which turns it off
    write_dataset_card(dataset_dir, full_stats(), cards_dir=tmp_path / "data_cards")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        push_dataset(dataset_dir, REPO, token=TOKEN)
    assert fake_hub.requests == []


def test_importing_metachunk_leaves_the_hub_switch_alone():
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "HF_HUB_OFFLINE"}
    probe = "import os, metachunk.models, metachunk.cli; print(os.environ.get('HF_HUB_OFFLINE'))"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


def test_push_config_from_flags(tmp_path):
    import argparse

    from metachunk import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser, PushConfig)
    ns = parser.parse_args([str(tmp_path), "--repo-id", REPO, "--private"])
    cfg = config.from_namespace(PushConfig, ns)
    assert (cfg.dataset_dir, cfg.repo_id, cfg.private, cfg.commit_message) == (tmp_path, REPO, True, None)
    with pytest.raises(InputError, match="namespace/name"):
        config.from_namespace(PushConfig, parser.parse_args([str(tmp_path), "--repo-id", "x"]))


def test_a_card_whose_license_is_other_and_unnamed_is_said_at_push(fake_hub, dataset_dir, tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    """build-sft's default is license other (the corpus's terms apply); the Hub's card spec wants a
    license_name with it, and no step said so before the set went public."""
    from metachunk.distill.hub import unnamed_license

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    write_dataset_card(dataset_dir, {**full_stats(), "license": "other"}, cards_dir=tmp_path / "data_cards")
    push_dataset(dataset_dir, REPO)
    assert "license: other with no license_name" in capsys.readouterr().err
    named = {**full_stats(), "license": "other", "license_name": "crud-rag", "license_link": "LICENSE"}
    write_dataset_card(dataset_dir, named, cards_dir=tmp_path / "data_cards")
    assert not unnamed_license((dataset_dir / "README.md").read_text(encoding="utf-8"))
