"""Bad input met across the verbs, each once a traceback or a silent wrong run: now one line naming the
file or the field, exit status 2, before any model loads or any file is written, and nothing sent."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from support.distill_jobs import make_job

from metachunk.artifacts import InputError
from metachunk.cli import main

DOC = {"id": "a", "text": "Emma was clever. She was rich. Her home was Hartfield."}
LINES = "".join(json.dumps({"id": f"d{k}", "text": f"Line {k} of Emma."}) + "\n" for k in range(500)).encode()


def refused(capsys, argv: list, *expected: str) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert all(e in err for e in expected), err
    return err


def test_a_recipe_key_yaml_reads_as_a_bool_is_named(tmp_path, capsys):
    """``on:``, ``yes:``, ``no:`` and ``null:`` unquoted are not names in YAML (https://yaml.org/type/bool.html)."""
    (tmp_path / "docs.jsonl").write_text(json.dumps(DOC) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: fixed\ntarget_len: 5\non: 3\n")
    refused(capsys, ["chunk", tmp_path / "docs.jsonl", "-o", tmp_path / "o.jsonl", "--config", recipe],
            f"{recipe}: key True is YAML's bool", "quote it")  # fmt: skip
    run = tmp_path / "run.yaml"
    run.write_text("name: x\nstages:\n  - {name: a, run: chunk, config: {yes: 1}}\n")
    refused(capsys, ["run", run, "--plan"], "key stages[0].config.True is YAML's bool")
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("bad.parquet", b"garbage", "not a readable parquet file"),
        ("empty.parquet", b"", "not a readable parquet file"),
        ("fake.jsonl.gz", b"no", "not a whole gzip file"),
        (
            "cut.jsonl.gz",
            gzip.compress(LINES)[: len(gzip.compress(LINES)) // 2],
            "not a whole gzip file",
        ),
    ],
)
def test_a_damaged_input_file_is_named(tmp_path, capsys, name, content, expected):
    (tmp_path / name).write_bytes(content)
    out = tmp_path / "o.jsonl"
    refused(capsys, ["chunk", tmp_path / name, "-o", out, "--method", "fixed", "--target-len", 5],
            f"{tmp_path / name}: {expected}")  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--target-len", "0"], "'target_len' must be >= 1, got 0"),
        (["--batch-size", "0"], "'batch_size' must be >= 1, got 0"),
        (["--bucket-edges", "-1"], "'bucket_edges' must be distinct lengths >= 1"),
        (["--threshold", "nan"], "'threshold' must be a number, got nan"),  # was a traceback after the read
    ],
)
def test_data_sample_checks_its_chunking_settings_before_writing(tmp_path, capsys, flags, expected):
    (tmp_path / "pool.jsonl").write_text(json.dumps(DOC) + "\n")
    out = tmp_path / "sample"
    refused(capsys, ["data", "sample", "--model", "smollm2", "--pool", tmp_path / "pool.jsonl", "--out", out, *flags],
            expected)  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--shard-rows", "0"], "'shard_rows' must be >= 1, got 0"),  # it waited forever for a shard to fill
        (["--near-dup-threshold", "-1"], "'near_dup_threshold' must be in (0, 1]"),
    ],
)
def test_build_sft_checks_its_numbers(tmp_path, capsys, flags, expected):
    (tmp_path / "rewrite.jsonl").write_text("")
    refused(capsys, ["data", "build-sft", "rewrite", "--distilled", tmp_path / "rewrite.jsonl", "--out",
                     tmp_path / "o", *flags], expected)  # fmt: skip


@pytest.mark.parametrize(
    "flags, expected",
    [(["--port", "99999"], "'port' must be in 1..65535"), (["--threads", "0"], "'threads' must be")],
)
def test_teacher_serve_checks_its_port_and_threads_before_starting(capsys, flags, expected):
    refused(capsys, ["teacher", "serve", *flags], expected)


def test_distill_refuses_a_negative_retry_count_and_batch_files_for_online_teachers(tmp_path, capsys):
    """``--import-batch`` with every teacher online was ignored, and the run paid for the answers online."""
    job = make_job(tmp_path, "http://127.0.0.1:9/v1", {"d": ["Emma was clever.", "She was rich."]})
    recipe = str(job.recipe)
    refused(capsys, ["distill", "rewrite", "--config", recipe, "--parse-retries", "-1", "--dry-run"],
            "'parse_retries' must be >= 0")  # fmt: skip
    results = tmp_path / "results.jsonl"
    results.write_text("")
    refused(capsys, ["distill", "rewrite", "--config", recipe, "--import-batch", results], "mode: batch")
    refused(
        capsys,
        ["distill", "rewrite", "--config", recipe, "--export-batch", tmp_path / "x.jsonl"],
        "mode: batch",
    )


def test_an_answer_store_that_is_not_one_is_named(tmp_path):
    from metachunk.store import AnswerStore

    text = tmp_path / "notes.txt"
    text.write_text("not a database, " * 20)
    with pytest.raises(InputError, match="not an answer store"):
        AnswerStore(text)
    with pytest.raises(InputError, match="a folder: the answer store is a file"):
        AnswerStore(tmp_path)
    assert text.read_text() == "not a database, " * 20


@pytest.mark.integration
def test_an_embedders_folder_is_no_causal_lm_to_score_with(tmp_path, capsys):
    """An encoder loads as ``*ForCausalLM`` with a head at random: PPL from it is noise, so it is refused."""
    pytest.importorskip("sentence_transformers")
    (tmp_path / "docs.jsonl").write_text(json.dumps(DOC) + "\n")
    out = tmp_path / "o.jsonl"
    refused(capsys, ["chunk", tmp_path / "docs.jsonl", "-o", out, "--method", "ppl", "--model", "minilm", "--lang",
                     "en"], "minilm: not a causal language model with its weights")  # fmt: skip
    assert not out.exists()


def _an_encoders_folder(tmp_path: Path, tokenizer_from: Path, architectures: bool) -> Path:
    """A tiny random BERT encoder (an embedder's kind of folder) with the tiny Qwen2's tokenizer."""
    import shutil

    from transformers import BertConfig, BertModel

    folder = tmp_path / "encoder"
    config = BertConfig(vocab_size=1536, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    if not architectures:  # only the weights then say what it is
        saved = json.loads((folder / "config.json").read_text())
        saved.pop("architectures")
        (folder / "config.json").write_text(json.dumps(saved))
    return folder


def test_an_encoder_is_refused_from_its_config_before_the_folder_is_started(tmp_path, capsys, tiny_model_dir):
    (tmp_path / "docs.jsonl").write_text(json.dumps(DOC) + "\n")
    encoder = _an_encoders_folder(tmp_path, tiny_model_dir, architectures=True)
    out = tmp_path / "out"
    refused(capsys, ["chunk", tmp_path / "docs.jsonl", "-o", out, "--model", encoder, "--shards", 2, "--workers", 2],
            f"{encoder}: not a causal language model ({encoder / 'config.json'} names BertModel")  # fmt: skip
    assert not out.exists()


def test_a_workers_refusal_reaches_the_run_as_itself_and_a_fixed_rerun_needs_no_overwrite(
    tmp_path, capsys, tiny_model_dir
):
    """A config naming no class leaves the refusal to the load, in a worker: it was a BrokenProcessPool
    traceback, and its manifest (no shard done) made the rerun with the right model ask for --overwrite."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({**DOC, "id": f"d{k}"}) + "\n" for k in range(4)))
    encoder = _an_encoders_folder(tmp_path, tiny_model_dir, architectures=False)
    out = tmp_path / "out"
    argv = ["chunk", docs, "-o", out, "--shards", 2, "--workers", 2, "--threads-per-worker", 1]
    refused(capsys, [*argv, "--model", encoder],
            f"{encoder}: not a causal language model with its weights (BertLMHeadModel lacks")  # fmt: skip
    assert main([str(a) for a in [*argv, "--model", tiny_model_dir]]) == 0, capsys.readouterr().err
    assert len(json.loads((out / "manifest.json").read_text())["shards"]["done"]) == 2


def test_our_errors_cross_a_process_boundary_whole():
    """A spawned worker's exception reaches the run pickled: rebuilt from its own arguments, not its message."""
    import pickle

    from metachunk.named_data import MissingDataset
    from metachunk.sources import BadRow

    for error in (
        InputError("a.jsonl", "bad", 3),
        BadRow("a.jsonl", "no text", 4),
        MissingDataset("x", "absent", "crud-news"),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error) and vars(again) == vars(error)


def test_eval_model_dtype_is_one_of_the_choices(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["eval", "diagnostics", "--retrieval", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "d"),
              "--dtype", "bogus"])  # fmt: skip
    assert e.value.code == 2 and not Path(tmp_path / "d").exists()


@pytest.mark.parametrize("cap", ["-5", "nan"])
def test_a_budget_is_a_number_of_dollars(tmp_path, capsys, cap):
    job = make_job(tmp_path, "http://127.0.0.1:9/v1", {"d": ["Emma was clever.", "She was rich."]})
    refused(capsys, ["distill", "rewrite", "--config", job.recipe, "--max-cost", cap, "--dry-run"],
            "'max_cost' must be a number of dollars >= 0")  # fmt: skip


def test_a_folder_as_the_recipe_and_a_path_as_a_cards_name_are_refused(tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_text(json.dumps(DOC) + "\n")
    refused(capsys, ["chunk", tmp_path / "docs.jsonl", "-o", tmp_path / "o.jsonl", "--config", tmp_path],
            f"{tmp_path}: a folder, not a recipe file")  # fmt: skip
    (tmp_path / "rewrite.jsonl").write_text("")
    refused(capsys, ["data", "build-sft", "rewrite", "--distilled", tmp_path / "rewrite.jsonl", "--out",
                     tmp_path / "sft", "--name", "../../evil"], "'name' must be a plain name")  # fmt: skip


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--on-bad-row", "skip", "--max-bad-rows", "-1"], "'max_bad_rows' must be >= 0"),
        (
            ["--max-row-bytes", "0"],
            "'max_row_bytes' must be >= 1",
        ),  # it blamed the data: "a row over 0 bytes"
        (["--method", "ppl", "--threshold", "nan"], "--threshold must be a number, got nan"),
        (
            ["--shards", "99999999999999999999"],
            "--shards must be at most 99,999",
        ),  # it hung, writing a manifest
    ],
)
def test_chunk_checks_its_bad_row_limits_and_threshold(tmp_path, capsys, flags, expected):
    (tmp_path / "docs.jsonl").write_text(json.dumps(DOC) + "\n")
    argv = [
        "chunk",
        tmp_path / "docs.jsonl",
        "-o",
        tmp_path / "o.jsonl",
        "--method",
        "fixed",
        "--target-len",
        5,
    ]
    refused(capsys, [*argv, *flags], expected)


def test_distill_limit_and_eval_cutoffs_start_at_one(tmp_path, capsys):
    job = make_job(tmp_path, "http://127.0.0.1:9/v1", {"d": ["Emma was clever.", "She was rich."]})
    refused(
        capsys,
        ["distill", "rewrite", "--config", job.recipe, "--limit", "0", "--dry-run"],
        "'limit' must be >= 1",
    )
    refused(capsys, ["eval", "qa", "--chunks", tmp_path / "c.jsonl", "--qa", tmp_path / "q.jsonl", "--out",
                     tmp_path / "qa", "--cutoffs", "0", "-1"], "'cutoffs' must be ks >= 1")  # fmt: skip


def test_models_fetch_without_a_name_lists_the_presets(capsys):
    refused(capsys, ["models", "fetch"], "name a preset to fetch: smollm2")


@pytest.mark.parametrize("start", ["x", 1e30, True, -1])
def test_a_distilled_records_offsets_are_checked_where_its_line_is_known(
    tmp_path, capsys, tiny_model_dir, start
):
    """A bad ``start`` reached parquet's int64 column as pyarrow's or Python's traceback."""
    doc = "Emma was clever and rich. She had lived nearly twenty-one years in the world."
    stage = {"status": "ok", "teacher": "t", "prompt_sha256": "ab" * 32, "usage": {}, "cost": 0.0}
    record = {"schema_version": 1, "task": "rewrite", "doc_id": "d", "chunk_index": 0, "start": start, "end": 25,
              "text": doc[:25], "lang": "en", "context_spans": [[0, len(doc)]], "status": "ok", "reason": "",
              "output": doc[:25], "stages": {"reflection": stage, "refinement": stage, "completion": stage}}  # fmt: skip
    (tmp_path / "docs.jsonl").write_text(json.dumps({"id": "d", "text": doc}) + "\n")
    (tmp_path / "rewrite.jsonl").write_text(json.dumps(record) + "\n")
    refused(capsys, ["data", "build-sft", "rewrite", "--distilled", tmp_path / "rewrite.jsonl", "--documents",
                     tmp_path / "docs.jsonl", "--out", tmp_path / "o", "--cards-dir", tmp_path / "cards",
                     "--tokenizer", tiny_model_dir], f"{tmp_path / 'rewrite.jsonl'}:1:", "'start'")  # fmt: skip
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("doc_id", [["x"], {"a": 1}, True])
def test_an_id_that_is_no_string_or_number_is_a_bad_row(tmp_path, capsys, doc_id):
    """It was written as its Python repr (``"['x']"``). A float stays an id (pandas writes a nullable int
    column with nulls as float64)."""
    (tmp_path / "docs.jsonl").write_text(json.dumps({"id": doc_id, "text": "Emma."}) + "\n")
    refused(capsys, ["chunk", tmp_path / "docs.jsonl", "-o", tmp_path / "o.jsonl", "--method", "fixed", "--target-len",
                     5], f"{tmp_path / 'docs.jsonl'}:1: field 'id' must be a string or a number")  # fmt: skip


def test_a_number_as_a_key_inside_a_mapping_value_still_loads(tmp_path):
    """``logit_bias`` maps token ids to biases: an int key is a value there, not a field's name."""
    from metachunk.distill.config import DistillConfig

    from metachunk import config

    job = make_job(tmp_path, "http://127.0.0.1:9/v1", {"d": ["Emma was clever."]},
                   teacher={"extra_body": {"logit_bias": {50256: -100}}})  # fmt: skip
    fields = config.load_yaml(DistillConfig, job.recipe)
    assert fields["teachers"]["reflection"].extra_body == {"logit_bias": {50256: -100}}
    bad = tmp_path / "bad.yaml"
    bad.write_text(job.recipe.read_text() + "1: 2\n")
    with pytest.raises(InputError, match="key 1 is a int, not a field name"):
        config.load_yaml(DistillConfig, bad)


def test_no_cap_is_an_infinite_budget(tmp_path, capsys):
    job = make_job(tmp_path, "http://127.0.0.1:9/v1", {"d": ["Emma was clever."]},
                   prices={"loopback": {"input": 1.0, "output": 1.0}})  # fmt: skip
    assert main(["distill", "rewrite", "--config", str(job.recipe), "--max-cost", "inf", "--dry-run"]) == 0


def test_a_dry_run_and_a_status_make_no_answer_store(tmp_path, capsys):
    """Both replay against the store: one that is not there yet is an empty one, and stays not there."""
    job = make_job(tmp_path, "http://127.0.0.1:9/v1", {"d": ["Emma was clever."]})
    before = sorted(p.name for p in job.out.rglob("*")) if job.out.exists() else None
    assert main(["distill", "rewrite", "--config", str(job.recipe), "--dry-run"]) == 0
    assert main(["distill", "status", "--config", str(job.recipe)]) == 0
    assert (sorted(p.name for p in job.out.rglob("*")) if job.out.exists() else None) == before
    assert not job.store_path.exists() and not Path(f"{job.store_path}.lock").exists()


def test_a_task_flag_that_contradicts_the_verb_is_named_first(tmp_path, capsys):
    """`distill rewrite --task moc` had been judged as a MoC run ("lacks a block for stage(s) moc_chunk")."""
    from metachunk.cli import main

    docs = tmp_path / "d.jsonl"
    docs.write_text('{"id": "a", "text": "Hello."}\n')
    capsys.readouterr()
    assert (
        main(["distill", "rewrite", "--task", "moc", "--documents", str(docs), "--out", str(tmp_path / "o")])
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "--task moc contradicts 'distill rewrite': run `metachunk distill moc`" in err
        and "Traceback" not in err
    )
