"""``metachunk run RECIPE``: a regeneration job. Stages are skipped while their fingerprint holds,
a change reruns only what is downstream of it, ``--plan`` runs and sends nothing, a kill -9 mid-run
then a rerun pays no answered request twice and ends byte-identical, and ``data push`` with the
run's manifest is idempotent and tags a version (``metachunk/regen.py``, ``distill/hub.py``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from metachunk.distill.hub import push_dataset
from support.fixtures import EMMA_SENTENCES
from support.loopback_server import serve_in_subprocess

from metachunk.artifacts import read_run_log
from metachunk.cli import main
from metachunk.markdown import shown_paths_in

ITEMS = '[{"missing": "who she is", "supplement": "Emma Woodhouse, the heroine", "score": 9}]'
SENTENCES = EMMA_SENTENCES
# The completion of each one-sentence document keeps it whole and adds the supplement (so its SFT
# row survives the lost-content filter); the refinement prompt (the only one with '"score"') gets items.
REPLIES = {
    **{
        rf"(?s)Text chunk:\n{re.escape(s)}\n.*Items to integrate": f"{s} Emma Woodhouse, the heroine, knew it."
        for s in SENTENCES
    },
    '"score"': ITEMS,
}


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Path:
    """Six one-sentence documents from Emma, as a training pool."""
    path = tmp_path_factory.mktemp("pool") / "pool.jsonl"
    path.write_text("".join(json.dumps({"id": f"emma-{k}", "text": t}) + "\n" for k, t in enumerate(SENTENCES)),
                    encoding="utf-8")  # fmt: skip
    return path


def write_recipe(root: Path, pool: Path, tiny: Path, base_url: str, *, validation: float = 0.0,
                 latency_docs: int = 6) -> Path:  # fmt: skip
    teacher = {"model": "loopback", "base_url": base_url, "max_tokens": 64, "concurrency": 2, "timeout": 10.0,
               "max_retries": 1}  # fmt: skip
    recipe = {
        "name": "test-regen",
        "state": str(root / "state"),
        "stages": [
            {"name": "sample", "run": "data sample",
             "config": {"pool": str(pool), "out": str(root / "sample"), "n_docs": latency_docs, "min_doc_chars": 50,
                        "model": str(tiny), "lang": "en", "device": "cpu", "progress": False}},
            {"name": "rewrite", "run": "distill rewrite",
             "config": {"chunks": str(root / "sample" / "chunks.jsonl"),
                        "documents": str(root / "sample" / "documents.jsonl"), "out": str(root / "distill"),
                        "lang": "en", "progress": False,
                        "teachers": {s: dict(teacher) for s in ("reflection", "refinement", "completion")}}},
            {"name": "sft", "run": "data build-sft rewrite",
             "config": {"distilled": str(root / "distill" / "rewrite.jsonl"), "out": str(root / "sft"),
                        "documents": str(root / "sample" / "documents.jsonl"), "tokenizer": str(tiny),
                        "cards_dir": str(root / "cards"), "max_length": 100_000,
                        "validation_fraction": validation}},
        ],
    }  # fmt: skip
    path = root / "regen.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["run", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def paragraphs(tmp_path: Path, n: int = 3) -> Path:
    """``paragraphs.jsonl``: the first ``n`` Emma sentences, one row each (``data passages``' input)."""
    rows = tmp_path / "paragraphs.jsonl"
    rows.write_text(
        "".join(json.dumps({"id": str(k), "text": t}) + "\n" for k, t in enumerate(SENTENCES[:n]))
    )
    return rows


def write_regen(tmp_path: Path, recipe: dict) -> Path:
    """``regen.yaml`` in ``tmp_path``, holding ``recipe``."""
    path = tmp_path / "regen.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def docs_then_fixed(tmp_path: Path) -> dict:
    """A two-stage recipe: ``docs`` (data passages of the Emma paragraphs), then ``fixed`` chunking of them."""
    rows, docs = paragraphs(tmp_path), tmp_path / "docs.jsonl"
    return {"name": "two", "state": str(tmp_path / "state"), "stages": [
        {"name": "docs", "run": "data passages", "config": {"input": str(rows), "out": str(docs)}},
        {"name": "fixed", "run": "chunk", "config": {"input": str(docs), "output": str(tmp_path / "fixed"),
                                                     "method": "fixed", "target_len": 80, "lang": "en"}},
    ]}  # fmt: skip


def sft_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "sft" / "data").glob("*.parquet"))}


def test_stages_are_skipped_while_unchanged_and_a_change_reruns_only_downstream(tmp_path, capsys, pool,
                                                                                tiny_model_dir):  # fmt: skip
    with serve_in_subprocess(latency=0.0, replies=REPLIES) as server:
        base_url = server.base_url  # (a base_url with a password in it is refused by the teacher config)
        recipe = write_recipe(tmp_path, pool, tiny_model_dir, base_url)
        code, out, _ = run(capsys, recipe, "--plan")
        assert code == 0 and "nothing was run or sent" in out
        assert "sample" in out and "runs" in out and server.stats()["requests"] == 0
        assert not (tmp_path / "sample").exists()  # the plan ran nothing

        code, out, err = run(capsys, recipe)
        assert code == 0, err
        paid = server.stats()["requests"]
        assert paid > 0
        manifest = json.loads((tmp_path / "state" / "regen_manifest.json").read_text())
        assert [s["name"] for s in manifest["stages"]] == ["sample", "rewrite", "sft"]
        assert manifest["run"]["stages"]["rewrite"]["status"] == "ran"
        assert manifest["stages"][1]["teachers"] == {"reflection": "loopback", "refinement": "loopback",
                                                     "completion": "loopback"}  # fmt: skip
        # data push uploads the manifest: its paths name no local folder, the recipe's text included (each
        # absolute path in it by its last part)
        assert (
            manifest["recipe"]["text"] == shown_paths_in(recipe.read_text())
            and manifest["metachunk"]["version"]
        )
        assert (
            f"…/{pool.name}" in manifest["recipe"]["text"]
            and f"…/{tiny_model_dir.name}" in manifest["recipe"]["text"]
        )
        assert str(tmp_path) in recipe.read_text()  # so the check below is not vacuous
        recorded = json.dumps(manifest)
        assert str(tmp_path) not in recorded and str(tiny_model_dir) not in recorded
        assert (
            manifest["recipe"]["path"] == "…/regen.yaml" and "…/pool.jsonl" in manifest["stages"][0]["inputs"]
        )
        assert (
            manifest["stages"][0]["models"][f"…/{tiny_model_dir.name}"]["name"] == f"…/{tiny_model_dir.name}"
        )
        first = sft_bytes(tmp_path)
        rows = json.loads((tmp_path / "sft" / "build_report.json").read_text())["rows"]
        assert rows == {"train": 6, "validation": 0}, rows  # every distilled row made it

        started = time.perf_counter()
        code, out, err = run(capsys, recipe)  # nothing changed: every stage cached
        assert code == 0 and err.count("cached, skipped") == 3, err
        assert server.stats()["requests"] == paid and time.perf_counter() - started < 30
        again = json.loads((tmp_path / "state" / "regen_manifest.json").read_text())
        assert again["manifest_sha256"] == manifest["manifest_sha256"]  # what was made, not when

        code, out, _ = run(capsys, recipe, "--plan")
        assert out.count(" cached") == 3

        # Rerun to the same bytes (the answers from the store): what reads them stays cached.
        code, out, err = run(capsys, recipe, "--rerun", "sample", "rewrite")
        assert code == 0, err
        assert "metachunk data sample --config" in err and "metachunk distill rewrite --config" in err
        assert "sft (data build-sft rewrite): cached" in err and server.stats()["requests"] == paid
        rerun = json.loads((tmp_path / "state" / "regen_manifest.json").read_text())
        assert (
            rerun["stages"][1]["summary"] == manifest["stages"][1]["summary"]
        )  # the same records, counted alike
        assert rerun["manifest_sha256"] == manifest["manifest_sha256"]  # the same rows: the Hub has them

        write_recipe(tmp_path, pool, tiny_model_dir, base_url, validation=0.5)  # only sft's config
        code, out, err = run(capsys, recipe)
        assert code == 0, err
        assert "sample (data sample): cached" in err and "rewrite (distill rewrite): cached" in err
        assert "metachunk data build-sft rewrite --config" in err
        assert server.stats()["requests"] == paid  # nothing paid twice
        report = json.loads((tmp_path / "sft" / "build_report.json").read_text())
        assert report["rows"]["validation"] > 0 and sft_bytes(tmp_path) != first


def test_kill_9_mid_run_then_rerun_pays_nothing_twice_and_ends_byte_identical(tmp_path, pool, tiny_model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with serve_in_subprocess(latency=0.0, replies=REPLIES) as server:
        whole = tmp_path / "whole"
        subprocess.run([sys.executable, "-m", "metachunk.cli", "run",
                        str(write_recipe(whole, pool, tiny_model_dir, server.base_url))],
                       check=True, env=env, capture_output=True)  # fmt: skip
    with serve_in_subprocess(latency=0.3, replies=REPLIES) as server:
        killed = tmp_path / "killed"
        cmd = [sys.executable, "-m", "metachunk.cli", "run", str(write_recipe(killed, pool, tiny_model_dir,
                                                                              server.base_url))]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while server.stats()["requests"] < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # in the middle of the distill stage
        proc.wait()
        before = server.stats()["requests"]
        assert not (killed / "sft").exists(), "the run ended before the kill"
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "sample (data sample): cached, skipped" in done.stderr
        by_key = server.stats()["by_key"]
    # Only requests in flight at the kill (no answer stored) may arrive twice: at most `concurrency`.
    assert sum(n - 1 for n in by_key.values()) <= 2, (before, by_key)
    assert sft_bytes(whole) and sft_bytes(killed) == sft_bytes(whole)  # files found, and the same


STAGE = "stages:\n  - name: a\n    run: data sample\n    config: {}\n"


@pytest.mark.parametrize(
    "text, field",
    [
        ("stages:\n  - name: a\n    run: frobnicate\n", "stages[0].run"),
        (STAGE + "    allow_exit: 4\n", "stages[0].allow_exit"),
        (STAGE + "    allow_exit: '04'\n", "stages[0].allow_exit"),
        (STAGE + "    local_teacher: 'yes'\n", "stages[0].local_teacher"),
        (STAGE + "local_teacher: smollm2\n", "local_teacher: a mapping"),
        (STAGE + "local_teacher: {backend: llamacpp}\n", "local_teacher.backend: one of auto, llama.cpp"),
        (STAGE + "local_teacher: {modle: smollm2}\n", "local_teacher: unknown key(s) modle"),
        (STAGE + "local_teacher: {threads: 0}\n", "local_teacher.threads"),
        (STAGE + "2024: notes\n", "unknown top-level key(s): 2024"),  # a number beside a name
        (STAGE + "    1: x\n    foo: y\n", "stages[0]: unknown key(s) 'foo', 1"),
        # a bad value in a stage's config: named in the recipe, not in the runner's copy of it
        (
            "state: st\nstages:\n  - {name: c1, run: chunk, config: {input: d.jsonl, output: o.jsonl, "
            "method: sentence, target_len: abc}}\n",
            "stage 'c1', config: field 'target_len' must be int",
        ),
        # a train stage's too: TRL's parser named the runner's temp copy
        (
            "state: st\nstages:\n  - {name: t, run: train, config: {model_name_or_path: m, dataset_name: d, "
            "output_dir: o, use_cpu: true, bf16: false, learning_rate: fast}}\n",
            "stage 't', config: field 'learning_rate': invalid float value: 'fast'",
        ),
        (
            "state: st\nstages:\n  - {name: t, run: train, config: {model_name_or_path: m, dataset_name: d, "
            "output_dir: o, use_cpu: true, bf16: false, per_device_train_batch_size: 0}}\n",
            "stage 't', config: field 'per_device_train_batch_size' must be >= 1, got 0",
        ),
        (  # a stage's name names its files in the state folder: this one wrote over ../../notes.yaml
            "stages:\n  - {name: ../../notes, run: chunk, config: {input: a.jsonl, output: b.jsonl}}\n",
            "stages[0].name: letters, digits, '_', '-' and '.', not first, got '../../notes'",
        ),
        (
            "state: bad.yaml\nstages:\n  - {name: a, run: chunk, config: {}}\n",
            "state: bad.yaml is a file, where the run's state folder is to be",
        ),
    ],
)
def test_a_bad_recipe_names_its_file_and_field(tmp_path, capsys, monkeypatch, text, field):
    monkeypatch.chdir(tmp_path)  # a recipe's relative paths (state:) land here
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    code, _, err = run(capsys, path)
    assert code == 2 and f"{path}: {field}" in err and "Traceback" not in err


def test_push_with_the_manifest_is_idempotent_and_tags_each_run(fake_hub, monkeypatch, sft_dataset, tmp_path):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_123456")
    manifest = {"schema_version": 1, "name": "crud", "manifest_sha256": "a" * 64,
                "recipe": {"path": "r.yaml", "sha256": "b" * 64, "text": "name: crud\nstages: []\n"},
                "metachunk": {"version": "0.1.0", "git_commit": "c" * 40}, "prompts": {"p.txt": "d" * 64},
                "stages": [{"name": "rewrite", "run": "distill rewrite", "teachers": {"reflection": "QwQ-32B"},
                            "summary": {"chunks": 12, "requests_sent": 36}}]}  # fmt: skip
    path = tmp_path / "regen_manifest.json"
    path.write_text(json.dumps(manifest))
    push_dataset(sft_dataset, "me/crud-rewrite", regen_manifest=path, tag="regen-1")
    files = fake_hub.committed_files()
    assert json.loads(files["regen_manifest.json"])["manifest_sha256"] == "a" * 64
    card = files["README.md"].decode()
    assert "## How these rows were made" in card and "QwQ-32B" in card and "name: crud" in card
    assert fake_hub.tags == [
        ("me/crud-rewrite", "regen-1", fake_hub.heads[("dataset", "me/crud-rewrite", "main")])
    ]
    assert (
        "How these rows were made" not in (sft_dataset / "README.md").read_text()
    )  # the folder is untouched
    commits = len(fake_hub.commits)

    push_dataset(sft_dataset, "me/crud-rewrite", regen_manifest=path)  # the same run again
    assert len(fake_hub.commits) == commits

    manifest["manifest_sha256"] = "e" * 64  # a new regeneration
    path.write_text(json.dumps(manifest))
    push_dataset(sft_dataset, "me/crud-rewrite", regen_manifest=path, revision="v2", tag="regen-2")
    assert len(fake_hub.commits) == commits + 1
    assert ("dataset", "me/crud-rewrite", "v2") in fake_hub.revisions
    assert fake_hub.tags[-1][:2] == ("me/crud-rewrite", "regen-2")
    assert not fake_hub.unexpected


def test_an_empty_stage_skips_what_needs_its_output_unless_that_stage_copes(sft_dataset, tiny_model_dir, tmp_path,
                                                                             capsys):  # fmt: skip
    """A training set left without rows: `train` exits 5 (nothing to do) and the stage is *empty*;
    the export of its checkpoint is skipped as empty; MoC chunking, told to use stand-ins, still
    runs with the nearest trained model in the empty expert's place. A rerun skips all of it."""
    import shutil

    empty_set = Path(shutil.copytree(sft_dataset, tmp_path / "empty_set"))
    report = empty_set / "build_report.json"
    report.write_text(json.dumps({**json.loads(report.read_text()), "rows": {"train": 0, "validation": 0}}))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(json.dumps({"id": str(k), "text": t}) + "\n" for k, t in enumerate(SENTENCES[:2]))
    )
    recipe_file = Path(__file__).resolve().parents[1] / "recipes" / "train" / "cpu_smoke.yaml"
    train_cfg = {**yaml.safe_load(recipe_file.read_text()), "model_name_or_path": str(tiny_model_dir),
                 "dataset_name": str(empty_set), "output_dir": str(tmp_path / "expert-1"), "eval_strategy": "no",
                 "report_to": "none"}  # fmt: skip
    tiny = str(tiny_model_dir)
    recipe = {"name": "empty", "state": str(tmp_path / "state"), "stages": [
        {"name": "train_expert_1", "run": "train", "allow_exit": [0, 5], "config": train_cfg},
        {"name": "export_expert_1", "run": "export",
         "config": {"checkpoint": str(tmp_path / "expert-1"), "out": str(tmp_path / "export")}},
        {"name": "moc", "run": "chunk", "on_empty_inputs": "run",
         "config": {"input": str(docs), "output": str(tmp_path / "moc.jsonl"), "method": "moc", "lang": "en",
                    "moc": {"router": tiny, "experts": ",".join([tiny, str(tmp_path / "expert-1"), tiny, tiny]),
                            "stand_in": tiny, "max_new_tokens": 8, "retries": 0, "window_chars": 300}}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, out, err = run(capsys, path)
    assert code == 0, err
    assert "nothing to train" in err and "export_expert_1 (export): skipped, nothing to do" in err
    assert not (tmp_path / "export").exists()
    moc = read_run_log(tmp_path / "moc.jsonl")[-1]["workers_report"][0]["moc"]
    assert moc["stand_ins"] == {"expert 1": tiny}  # the nearest trained granularity: expert 0
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["stages"]["train_expert_1"]["exit"] == 5 and "export_expert_1" not in state["stages"]
    code, out, err = run(capsys, path)
    assert code == 0, err
    assert "train_expert_1 (train): empty, skipped" in err and "moc (chunk): cached, skipped" in err
    assert "metachunk run" not in err and "== run: moc: metachunk" not in err


def fingerprint_of(tmp_path, run: str, config: dict):
    """A stage's fingerprint as the runner takes it: through the CLI's table of commands."""
    from metachunk.cli import registry
    from metachunk.regen import Digests, Stage, fingerprint

    path = tmp_path / "stage.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return fingerprint(Stage("s", run, config), registry(), path, Digests())


def test_a_label_is_not_part_of_the_input_path_it_names(tmp_path):
    """`eval diagnostics --retrieval rewritten=RUN`: the fingerprint hashes RUN, not 'rewritten=RUN'."""
    run_dir = tmp_path / "rewritten" / "qa"
    run_dir.mkdir(parents=True)
    (run_dir / "retrieval.jsonl").write_text("{}\n")
    fp = fingerprint_of(
        tmp_path, "eval diagnostics", {"retrieval": [f"rewritten={run_dir}"], "out": str(tmp_path / "o")}
    )
    assert str(run_dir) in fp.inputs and fp.inputs[str(run_dir)] is not None and not fp.missing
    assert not any("=" in p for p in fp.inputs)


def test_a_stage_is_fingerprinted_by_the_prompt_files_its_command_reads(tmp_path, monkeypatch):
    """Each command names the prompt and schema files it reads (its ``inputs``): a changed prompt
    reruns only the stages that read it."""
    teacher = {"model": "m"}
    rewrite = {"chunks": "c.jsonl", "documents": "d.jsonl", "out": "o",
               "teachers": {s: teacher for s in ("reflection", "refinement", "completion")}}  # fmt: skip

    def read(run, **config):
        return set(fingerprint_of(tmp_path, run, config).prompts)

    def chunking(*names):
        return {f"chunking/prompts/{n}" for n in names}

    assert read("chunk", method="ppl") == read("chunk", method="semantic") == set()
    assert read("chunk", method="lumber", teachers={"lumber": teacher}) == chunking(
        "lumber.en.txt", "lumber.zh.txt", "lumber.schema.json")  # fmt: skip
    assert read("chunk", method="msp") == chunking("msp_table6.en.txt", "msp_table6.zh.txt")
    assert read("chunk", method="fixed", target_len=100, rewrite="runs/export/rewrite") == chunking(
        "student_rewrite.en.txt", "student_rewrite.zh.txt")  # fmt: skip
    qa = {"chunks": "c.jsonl", "qa": "q.jsonl", "out": "o"}
    assert read("eval qa", **qa) == set()  # retrieval only: no answer prompt
    assert read("eval qa", **qa, generator_model="smollm2") == {"eval/prompts/rag_answer.en.txt",
                                                               "eval/prompts/rag_answer.zh.txt"}  # fmt: skip
    assert (
        read("eval chunk-quality", chunks="c.jsonl", out="o")
        == read("data passages", input="i", out="o")
        == set()
    )
    assert read("distill rewrite", **rewrite) == {
        f"distill/prompts/{stage}.{lang}.txt" for stage in ("reflection", "refinement", "completion")
        for lang in ("en", "zh")} | {"distill/prompts/refinement.schema.json"}  # fmt: skip
    # build-sft writes the students' prompts into its rows
    assert read("data build-sft rewrite", distilled="r.jsonl", out="o") == chunking(
        "student_rewrite.en.txt", "student_rewrite.zh.txt")  # fmt: skip

    before = {run: fingerprint_of(tmp_path, run, cfg).sha256 for run, cfg in
              (("chunk", {"method": "ppl", "output": "o.jsonl"}), ("distill rewrite", rewrite))}  # fmt: skip
    from metachunk import prompts

    monkeypatch.setattr(prompts, "file_hashes", lambda paths: {str(p): "0" * 64 for p in paths})
    after = {run: fingerprint_of(tmp_path, run, cfg).sha256 for run, cfg in
             (("chunk", {"method": "ppl", "output": "o.jsonl"}), ("distill rewrite", rewrite))}  # fmt: skip
    assert before["chunk"] == after["chunk"] and before["distill rewrite"] != after["distill rewrite"]


def test_rerun_runs_the_named_stages_even_when_cached(tmp_path, capsys):
    """`--rerun STAGE`: after a code change the fingerprint cannot see. The stage after it reads
    its output, which reran to the same bytes, so that one stays cached."""
    path = write_regen(tmp_path, docs_then_fixed(tmp_path))
    code, _, err = run(capsys, path)
    assert code == 0, err
    code, _, err = run(capsys, path, "--rerun", "docs")
    assert code == 0, err
    assert "== run: docs: metachunk data passages" in err and "fixed (chunk): cached, skipped" in err

    def made():  # the digest of the chunk folder, as what reads it sees it
        return json.loads((tmp_path / "state" / "state.json").read_text())["stages"]["fixed"]["outputs"]

    before = made()
    code, _, err = run(capsys, path, "--rerun", "fixed")  # a folder run again: its manifest is unchanged
    assert code == 0 and "== run: fixed: metachunk chunk" in err, err
    assert made() == before and len(read_run_log(tmp_path / "fixed")) == 2
    code, _, err = run(capsys, path, "--rerun", "nope")
    assert code == 2 and "regen.yaml" in err and "no stage named 'nope'" in err and "Traceback" not in err


def test_the_plan_names_a_model_folder_this_machine_lacks(tmp_path, capsys, monkeypatch):
    """A recipe names its models by relative folder (``models/Qwen2-7B``), which reads like a Hub id:
    the plan says which stage needs which model, and goes on to the stages after it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": SENTENCES[0]}) + "\n")
    recipe = {"name": "plan", "state": "state", "stages": [
        {"name": "ppl", "run": "chunk", "config": {"input": "docs.jsonl", "output": "ppl.jsonl", "method": "ppl",
                                                   "model": "models/Qwen2-7B", "lang": "en"}},
        {"name": "fixed", "run": "chunk", "config": {"input": "docs.jsonl", "output": "fixed.jsonl",
                                                     "method": "fixed", "target_len": 80, "lang": "en"}},
    ]}  # fmt: skip
    Path("regen.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    code, out, err = run(capsys, "regen.yaml", "--plan")
    assert code == 0, err
    assert (
        "ppl                  chunk                      needs a model: no folder models/Qwen2-7B here, and as a Hub id"
        in out
    )
    assert "fixed                chunk                      runs" in out


def test_a_cached_stage_sweeps_what_a_killed_run_left_beside_its_outputs(tmp_path, capsys):
    """A forced rerun killed mid-write leaves its temp file, and the next run finds the stage cached, so
    no write of that output would have removed it. A live writer's temp stays."""
    from metachunk.artifacts import process_space

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": SENTENCES[0]}) + "\n")
    recipe = {"name": "swept", "state": str(tmp_path / "state"), "stages": [
        {"name": "file", "run": "chunk", "config": {"input": str(docs), "output": str(tmp_path / "c.jsonl"),
                                                    "method": "fixed", "target_len": 40, "lang": "en"}},
        {"name": "folder", "run": "chunk", "config": {"input": str(docs), "output": str(tmp_path / "sharded"),
                                                      "method": "fixed", "target_len": 40, "lang": "en"}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    assert run(capsys, path)[0] == 0
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        shard = next((tmp_path / "sharded").glob("train-*.jsonl")).name
        temps = {
            "dead file": tmp_path / f".c.jsonl.{dead.pid}@{process_space()}.a1b2.tmp",
            "dead shard": tmp_path / "sharded" / f".{shard}.{dead.pid}@{process_space()}.c3d4.tmp",
            "dead manifest": tmp_path / "sharded" / f".manifest.json.{dead.pid}@{process_space()}.e5f6.tmp",
            "live shard": tmp_path / "sharded" / f".{shard}.{live.pid}@{process_space()}.g7h8.tmp",
        }
        for temp in temps.values():
            temp.write_text("half written")
        code, _, err = run(capsys, path)
        assert code == 0 and "file (chunk): cached" in err and "folder (chunk): cached" in err, err
        assert [w for w, t in temps.items() if t.exists()] == ["live shard"]
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize(
    "last, said",
    [
        ({"method": "fixd"}, "stage 'chunk', config: field 'method' must be one of"),
        ({"target_length": 80}, "stage 'chunk', config: unknown field(s) 'target_length'"),
        (
            {"input": "docs_typo.jsonl"},
            "stage 'chunk' reads docs_typo.jsonl, which is not there and no earlier stage writes it",
        ),  # fmt: skip
    ],
)
def test_every_stage_is_checked_before_the_first_runs(tmp_path, capsys, monkeypatch, last, said):
    """A typo in the last stage stopped the run only after the stages before it had run (in the demo, a
    training among them), and a bad value named the runner's copy of the stage's config, not the recipe."""
    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "paragraphs.jsonl"
    rows.write_text(json.dumps({"id": "0", "text": SENTENCES[0]}) + "\n")
    chunk = {
        "input": "docs.jsonl",
        "output": "fixed.jsonl",
        "method": "fixed",
        "target_len": 80,
        "lang": "en",
    }
    recipe = {"name": "checked", "state": "state", "stages": [
        {"name": "docs", "run": "data passages", "config": {"input": str(rows), "out": "docs.jsonl"}},
        {"name": "chunk", "run": "chunk", "config": {**chunk, **last}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    for plan in ([], ["--plan"]):
        code, _, err = run(capsys, path, *plan)
        assert code == 2 and f"regen.yaml: {said}" in err and "Traceback" not in err, err
        assert not (tmp_path / "docs.jsonl").exists()  # the first stage did not run
        assert "stages/chunk.yaml" not in err


def test_a_file_an_earlier_stage_writes_is_found_however_it_is_spelled(tmp_path, capsys, monkeypatch):
    """Written as docs.jsonl, read by its absolute path and through a symlinked folder: one file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path)
    rows = tmp_path / "paragraphs.jsonl"
    rows.write_text(json.dumps({"id": "0", "text": SENTENCES[0]}) + "\n")
    chunk = {"method": "fixed", "target_len": 80, "lang": "en"}
    recipe = {"name": "spelled", "state": "state", "stages": [
        {"name": "docs", "run": "data passages", "config": {"input": str(rows), "out": "docs.jsonl"}},
        {"name": "a", "run": "chunk", "config": {**chunk, "input": str(tmp_path / "docs.jsonl"), "output": "a.jsonl"}},
        {"name": "b", "run": "chunk", "config": {**chunk, "input": "link/docs.jsonl", "output": "b.jsonl"}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, _, err = run(capsys, path)
    assert code == 0 and (tmp_path / "b.jsonl").exists(), err


def test_a_bad_value_in_a_config_file_names_that_file_alone(tmp_path, capsys):
    """No flag was given, yet the error said 'FILE or the command line': the parser's own entry (the
    subcommand chosen) was taken for a flag."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": SENTENCES[0]}) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump({"input": str(docs), "output": str(tmp_path / "o.jsonl"), "method": "fixd"})
    )
    assert main(["chunk", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: field 'method'" in err and "command line" not in err, err


def test_two_stages_writing_one_output_are_refused(tmp_path, capsys):
    """The second replaced the first's output, and each rerun ran both again."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": SENTENCES[0]}) + "\n")
    chunk = {"input": str(docs), "output": str(tmp_path / "same.jsonl"), "method": "fixed", "lang": "en"}
    recipe = {"name": "twice", "state": str(tmp_path / "state"), "stages": [
        {"name": "a", "run": "chunk", "config": {**chunk, "target_len": 40}},
        {"name": "b", "run": "chunk", "config": {**chunk, "target_len": 80}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, _, err = run(capsys, path)
    assert code == 2 and "stages 'a' and 'b' both write" in err and "Traceback" not in err, err


def test_the_local_teacher_answers_eval_qa_generator_blocks_too(tmp_path):
    """A stage with `local_teacher: true` gets the served teacher in distill's `teachers` blocks and
    in eval qa's `generator_teacher`, under the name the server answers to (the preset's, for llama.cpp)."""
    from metachunk.local_teacher import llama_cpp_available
    from metachunk.regen import Runner, load_recipe

    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed")
    recipe = {"name": "gen", "state": str(tmp_path / "state"), "local_teacher": {"model": "smollm2", "backend": "llama.cpp"},
              "stages": [{"name": "qa", "run": "eval qa", "local_teacher": True,
                          "config": {"chunks": "c.jsonl", "qa": "q.jsonl", "out": "o",
                                     "generator_teacher": {"model": "anything", "base_url": "http://x/v1"}}}]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    loaded = load_recipe(path)
    from metachunk.cli import registry

    runner = Runner(loaded, registry())
    block = runner.fitted(loaded.stages[0]).config["generator_teacher"]
    teacher = runner.local_teacher(start=False)
    assert block == {"model": "smollm2", "base_url": teacher.base_url, "serve_preset": False}


def test_a_stage_is_fingerprinted_by_the_code_its_command_runs(tmp_path):
    """The import closure of the command's entry modules, hashed: an edit to a module the
    command imports changes its digest, an edit elsewhere (another stage's module, a README) does
    not. Checked on a package written here, then on metachunk's own commands."""
    from metachunk import code_digest

    pkg = tmp_path / "mc"
    (pkg / "stage").mkdir(parents=True)
    files = {
        "mc/__init__.py": "",
        "mc/core.py": "X = 1\n",
        "mc/stage/__init__.py": "",
        "mc/stage/entry.py": "from mc import core\n\ndef run():\n    from mc.stage import lazy\n",
        "mc/stage/lazy.py": "from .. import core\n",
        "mc/stage/other.py": "Y = 2\n",
        "README.md": "words\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)

    def find(name: str):
        path = tmp_path / name.replace(".", "/")
        return (
            path / "__init__.py"
            if path.is_dir()
            else path.with_suffix(".py")
            if path.with_suffix(".py").is_file()
            else None
        )

    def digest() -> str:
        return code_digest.digest(code_digest.closure(("mc.stage.entry",), find, root="mc"))

    assert set(code_digest.closure(("mc.stage.entry",), find, root="mc")) == {
        "mc", "mc.core", "mc.stage", "mc.stage.entry", "mc.stage.lazy"}  # fmt: skip
    before = digest()
    (tmp_path / "README.md").write_text("other words\n")
    (tmp_path / "mc/stage/other.py").write_text("Y = 3\n")
    assert digest() == before  # not imported by the command: no rerun
    (tmp_path / "mc/stage/lazy.py").write_text("from .. import core  # edited\n")
    assert digest() != before  # imported inside a function: still its code

    # metachunk's own commands: chunking's code is not training's
    from metachunk.cli import find

    chunk = code_digest.closure((find(("chunk",)).module,))
    train = code_digest.closure((find(("train",)).module,))
    distill = code_digest.closure((find(("distill", "rewrite")).module,))
    assert "metachunk.chunking.ppl" in chunk and "metachunk.chunking.ppl" not in train
    assert "metachunk.distill.run" not in chunk and "metachunk.chunking.sentences" in distill
    assert "metachunk.train.sft" in train and not any(m.startswith("metachunk.train") for m in chunk)
    assert "metachunk.chunking.shards" in chunk and "metachunk.chunking.students" in chunk


def test_a_stage_whose_input_is_left_empty_is_skipped_whatever_an_earlier_run_made(
    sft_dataset, tiny_model_dir, tmp_path, capsys
):
    """Trained and exported once; then the training set loses its rows: `train` is empty this time, and
    the export of its checkpoint has nothing to do. It had been reported cached, and the old export stood
    for this run's."""
    import shutil

    dataset = Path(shutil.copytree(sft_dataset, tmp_path / "set"))
    recipe_file = Path(__file__).resolve().parents[1] / "recipes" / "train" / "cpu_smoke.yaml"
    train_cfg = {**yaml.safe_load(recipe_file.read_text()), "model_name_or_path": str(tiny_model_dir),
                 "dataset_name": str(dataset), "output_dir": str(tmp_path / "ckpt"), "eval_strategy": "no",
                 "report_to": "none", "max_steps": 1, "save_steps": 1}  # fmt: skip
    recipe = {"name": "emptied", "state": str(tmp_path / "state"), "stages": [
        {"name": "train", "run": "train", "allow_exit": [0, 5], "config": train_cfg},
        {"name": "export", "run": "export", "config": {"checkpoint": str(tmp_path / "ckpt"), "out": str(tmp_path / "export")}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, _, err = run(capsys, path)
    assert code == 0 and (tmp_path / "export" / "config.json").is_file(), err
    report = dataset / "build_report.json"
    report.write_text(json.dumps({**json.loads(report.read_text()), "rows": {"train": 0, "validation": 0}}))
    code, _, err = run(capsys, path)
    assert code == 0, err
    assert "nothing to train" in err and "export (export): skipped, nothing to do" in err, err
    manifest = json.loads((tmp_path / "state" / "regen_manifest.json").read_text())
    assert [s["status"] for s in manifest["run"]["stages"].values()] == ["empty", "empty"]


def test_a_teacher_stage_that_left_requests_unanswered_runs_again_on_the_next_run(tmp_path, capsys, pool,
                                                                                   tiny_model_dir):  # fmt: skip
    """A distill stage allowed to exit 4 (its failures recorded) had been recorded as done: the requests that
    failed in transport were never asked again, though the stage's own message says a rerun retries them."""
    with serve_in_subprocess(replies=REPLIES, random_faults={"500": 0.6}, seed=3) as server:
        path = write_recipe(tmp_path, pool, tiny_model_dir, server.base_url)
        recipe = yaml.safe_load(path.read_text())
        recipe["stages"] = recipe["stages"][:2]
        recipe["stages"][1]["allow_exit"] = [0, 4]
        for teacher in recipe["stages"][1]["config"]["teachers"].values():
            teacher["max_retries"] = 0
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        code, _, err = run(capsys, path)
        assert code == 0, err
        state = json.loads((tmp_path / "state" / "state.json").read_text())
        assert state["stages"]["rewrite"]["retry"] is True, state["stages"]["rewrite"]
        assert "runs it again" in err
        code, out, _ = run(capsys, path, "--plan")
        assert re.search(r"rewrite\s+distill rewrite\s+runs", out), out
        code, _, err = run(capsys, path)
        assert (
            code == 0
            and "sample (data sample): cached" in err
            and "== run: rewrite: metachunk distill" in err
        )


def test_the_plan_runs_what_reads_a_rerun_stage_and_keeps_the_rest_cached(tmp_path, capsys):
    """Once one stage ran, the plan had said every later one runs, and priced its teacher calls: a stage
    that reads none of the outputs to be rewritten stays cached, as the run then has it."""
    recipe = docs_then_fixed(tmp_path)
    recipe["stages"].append({"name": "apart", "run": "chunk", "config": {
        "input": str(tmp_path / "paragraphs.jsonl"), "output": str(tmp_path / "apart.jsonl"), "method": "sentence",
        "target_len": 80, "lang": "en"}})  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, _, err = run(capsys, path)
    assert code == 0, err
    code, out, _ = run(capsys, path, "--plan", "--rerun", "docs")
    assert code == 0
    assert re.search(r"docs\s+data passages\s+runs \(--rerun\)", out) and re.search(
        r"fixed\s+chunk\s+runs", out
    ), out
    assert re.search(r"apart\s+chunk\s+cached", out), out


def test_a_second_run_on_one_state_folder_is_refused_and_a_plan_beside_it_saves_nothing(tmp_path, capsys):
    """Two runs of one recipe had both run every stage, and a `--plan` beside a run saved the state it
    had read at its start, erasing a stage the run had finished since."""
    from filelock import FileLock

    rows = paragraphs(tmp_path)
    recipe = {"name": "locked", "state": str(tmp_path / "state"), "stages": [
        {"name": "docs", "run": "data passages", "config": {"input": str(rows), "out": str(tmp_path / "docs.jsonl")}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, _, err = run(capsys, path)
    assert code == 0, err
    state = (tmp_path / "state" / "state.json").read_bytes()
    with FileLock(tmp_path / "state" / "run.lock", timeout=0):  # another run holds it
        code, _, err = run(capsys, path, "--rerun", "docs")
        assert (
            code == 2
            and "another `metachunk run` of this recipe is running" in err
            and "Traceback" not in err
        )
        code, out, _ = run(capsys, path, "--plan")
        assert code == 0 and "cached" in out
        assert (tmp_path / "state" / "state.json").read_bytes() == state
    code, _, err = run(capsys, path, "--rerun", "docs")
    assert code == 0, err


def test_a_local_teacher_its_backend_cannot_serve_is_the_recipes_field(tmp_path, capsys):
    text = SENTENCES[0]
    docs, chunks = tmp_path / "docs.jsonl", tmp_path / "chunks.jsonl"
    docs.write_text(json.dumps({"id": "d", "text": text}) + "\n")
    chunks.write_text(
        json.dumps({"id": "d", "chunks": [{"text": text, "start": 0, "end": len(text)}]}) + "\n"
    )
    teacher = {"model": "m"}
    recipe = {"name": "teacher", "state": str(tmp_path / "state"),
              "local_teacher": {"model": "nonexistent-model", "backend": "llama.cpp"},
              "stages": [{"name": "summary", "run": "distill summary", "local_teacher": True,
                          "config": {"chunks": str(chunks), "documents": str(docs), "out": str(tmp_path / "d"),
                                     "teachers": {s: teacher for s in ("summary_global", "summary_local", "summary_fuse")}}}]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, _, err = run(capsys, path)
    # "serves a preset or a .gguf file", or where llama-cpp-python is not installed, "needs ..."
    assert code == 2 and f"{path}: field 'local_teacher': the llama.cpp backend" in err, err
    assert "Traceback" not in err


def test_a_bad_lumber_teacher_block_is_refused_before_any_stage_runs_or_is_written(tmp_path, capsys):
    """LumberChunker's teacher block had been read only when its stage ran: the stages ahead of it ran
    first, and a base_url with a password in it (which the teacher config refuses) was by then written
    into the state folder's copy of the stage's config."""
    rows = tmp_path / "paragraphs.jsonl"
    rows.write_text(json.dumps({"id": "0", "text": SENTENCES[0]}) + "\n")
    teacher = {"model": "m", "base_url": "http://user:hunter2pass@127.0.0.1:9/v1"}
    recipe = {"name": "lumber", "state": str(tmp_path / "state"), "stages": [
        {"name": "docs", "run": "data passages", "config": {"input": str(rows), "out": str(tmp_path / "docs.jsonl")}},
        {"name": "cut", "run": "chunk", "config": {"input": str(tmp_path / "docs.jsonl"), "output": str(tmp_path / "c.jsonl"),
                                                   "method": "lumber", "lang": "en", "teachers": {"lumber": teacher}}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, _, err = run(capsys, path)
    assert code == 2 and "Traceback" not in err and "hunter2pass" not in err, err
    assert not (tmp_path / "docs.jsonl").exists()  # the stage ahead did not run
    written = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and p != path and "hunter2pass" in p.read_text(errors="replace")
    ]
    assert written == []


def test_a_relative_folder_a_stage_writes_is_not_taken_for_a_hub_id(sft_dataset, tiny_model_dir, tmp_path, capsys,
                                                                   monkeypatch):  # fmt: skip
    """``runs/ckpt`` reads like a Hub id (ORG/NAME): a training left empty never wrote it, and the export
    reading it had stopped the run ("no folder runs/ckpt here, and as a Hub id ...")."""
    import shutil

    monkeypatch.chdir(tmp_path)
    empty_set = Path(shutil.copytree(sft_dataset, tmp_path / "empty_set"))
    report = empty_set / "build_report.json"
    report.write_text(json.dumps({**json.loads(report.read_text()), "rows": {"train": 0, "validation": 0}}))
    recipe_file = Path(__file__).resolve().parents[1] / "recipes" / "train" / "cpu_smoke.yaml"
    train_cfg = {**yaml.safe_load(recipe_file.read_text()), "model_name_or_path": str(tiny_model_dir),
                 "dataset_name": "empty_set", "output_dir": "runs/ckpt", "eval_strategy": "no", "report_to": "none"}  # fmt: skip
    recipe = {"name": "relative", "state": "state", "stages": [
        {"name": "train", "run": "train", "allow_exit": [0, 5], "config": train_cfg},
        {"name": "export", "run": "export", "config": {"checkpoint": "runs/ckpt", "out": "runs/export"}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, _, err = run(capsys, path)
    assert code == 0, err
    assert "export (export): skipped, nothing to do: runs/ckpt was left empty upstream" in err, err


def test_the_plan_runs_a_stage_that_reads_the_folder_a_rerun_stage_writes_into(tmp_path, capsys):
    rows = paragraphs(tmp_path)
    recipe = {"name": "folder", "state": str(tmp_path / "state"), "stages": [
        {"name": "docs", "run": "data passages", "config": {"input": str(rows), "out": str(tmp_path / "data" / "docs.jsonl")}},
        {"name": "cut", "run": "chunk", "config": {"input": str(tmp_path / "data"), "output": str(tmp_path / "cut"),
                                                   "method": "fixed", "target_len": 80, "lang": "en"}},
    ]}  # fmt: skip
    path = write_regen(tmp_path, recipe)
    code, _, err = run(capsys, path)
    assert code == 0, err
    code, out, _ = run(capsys, path, "--plan", "--rerun", "docs")
    assert re.search(r"cut\s+chunk\s+runs", out), out
