"""MoC dataset distillation (distill/moc.py): windows, chunk buffer, cleaning, labels, samples,
resume, and the router / expert SFT sets.

The end-to-end test drives ``metachunk distill moc`` against the loopback server as a scripted
teacher: the planted document is a sequence of known chunks, and the script answers each window
(recognised by the text it starts with) with the true chunks it holds, the last one cut at the
window edge, as a teacher that sees only the window would. One answer has a typo, one a
hallucinated chunk; a second document only ever gets answers that are not in it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from metachunk.chunking.moc import expert_messages, granularity_label, router_messages
from metachunk.chunking.moc_answers import expert_element as element
from metachunk.chunking.moc_answers import recover_chunks
from metachunk.chunking.sentences import split_sentences
from metachunk.distill.moc import (
    SEPARATOR,
    DocPlan,
    TokenCounter,
    answer_chunks,
    clean_window,
    expert_target,
    finish_record,
    gaps_of,
    pack_samples,
    split_answer,
    window_end,
)
from support.loopback_server import serve_in_subprocess

from metachunk.artifacts import read_run_log
from metachunk.cli import main as cli_main

WINDOW_TOKENS = 200
SAMPLE_CHARS = 500
PARSE_RETRIES = 2

TREES = ("Alder", "Birch", "Cedar", "Damson", "Elm", "Fir", "Ginkgo", "Hazel")
WORDS = (
    "river meadow lantern harvest village market orchard bridge chapel letter carriage garden winter "
    "candle parcel ribbon sermon basket ladder kettle window blanket journey cottage bonnet fiddle"
).split()


def sentence(k: int, first: str | None = None) -> str:
    import random

    rng = random.Random(k)
    words = [first or rng.choice(WORDS).capitalize()] + [rng.choice(WORDS) for _ in range(9)]
    return " ".join(words) + "."


def planted() -> tuple[str, list[tuple[int, int]]]:
    """Eight chunks of three sentences (~200 characters); one paragraph break, after chunk 4."""
    text, truth = "", []
    for k, tree in enumerate(TREES):
        chunk = " ".join(sentence(10 * k + j, tree if j == 0 else None) for j in range(3))
        if text:
            text += "\n" if k == 4 else " "
        truth.append((len(text), len(text) + len(chunk)))
        text += chunk
    return text, truth


JUNK = "Quartz wolves hum in a lilac fog. Nine grey kites drift past the mill. The last ferry leaves at dusk."
HALLUCINATED = "Nobody ever wrote this sentence about purple elephants dancing on the moon tonight."


def script(text: str, truth) -> dict[str, str]:
    """The scripted teacher's replies (regex -> answer) for every window that starts at a true chunk
    and ends at a sentence end (recognised by its first and last characters): the true chunks it
    holds, the last one cut at the window's end. Windows from the first chunk get a typo (one
    substituted character), windows from the second a hallucinated chunk after their first."""
    replies = {}
    for i, (pos, _) in enumerate(truth):
        for sentence_ in split_sentences(text, "en"):
            end = sentence_.end
            if not pos < end <= pos + 800:
                continue
            pieces = [text[max(s, pos) : min(e, end)].strip() for s, e in truth if s < end and e > pos]
            if i == 0:
                pieces[0] = pieces[0][:30] + ("a" if pieces[0][30] != "a" else "e") + pieces[0][31:]
            if i == 1:
                pieces.insert(1, HALLUCINATED)
            first, last = text[pos : pos + 30], text[end - 30 : end] + "\nThe segmented text chunks are:"
            pattern = re.escape("Document content: " + first) + r"[\s\S]*" + re.escape(last)
            replies[pattern] = SEPARATOR.join(pieces)
    return replies


@pytest.fixture(scope="module")
def counter(tiny_model_dir) -> TokenCounter:
    return TokenCounter(str(tiny_model_dir))


# ------------------------------------------------------------------------------------- units


def test_split_answer_tolerates_dashes_literal_separators_and_echo():
    answer = "The segmented text chunks are:\nOne. Two.\n—\nThree — four.\n - \nFive.\\n—\\nSix.\n---\n"
    assert split_answer(answer) == ["One. Two.", "Three — four.", "Five.", "Six."]
    assert split_answer("甲。乙。\n—\n丙——丁。") == ["甲。乙。", "丙——丁。"]  # an inline dash is text


def test_a_json_list_inside_a_chunk_is_text_not_the_answer():
    """Only a whole JSON answer is read as JSON: a chunk of the separator format holding a list of
    strings was taken for the chunk list."""
    answer = 'Set tags = ["red", "blue"] in the config.\n—\nThen restart the service.'
    assert answer_chunks(answer) == ['Set tags = ["red", "blue"] in the config.', "Then restart the service."]
    assert answer_chunks('```json\n{"chunks": ["A.", "B."]}\n```') == ["A.", "B."]


@pytest.mark.parametrize(
    "answer",
    [
        "Results are in Table [2] below.\n—\nThe committee met on Monday.",
        "The list {a, b} was read first.\n—\nThe committee met on Monday.",
        "结果见[2]。\n—\nThe committee met on Monday.",
        "Results are in [Table 3] below.\n—\nThe committee met on Monday.",
    ],
)
def test_brackets_in_a_separator_answer_are_not_repaired_into_its_only_chunk(answer):
    """With ``structured_output: none`` an answer goes through json-repair before the stage's reader,
    and json-repair makes ``[2]`` of "see [2]": that fragment had become the window's only chunk (42 of
    the 1,200 CRUD articles hold a bracket). A repair counts only with the schema's shape."""
    from metachunk.distill.prompts import load_schema

    from metachunk.structured import read_answer

    schema = load_schema("moc_chunk")
    chunks, outcome = read_answer(answer, schema, answer_chunks, repair=True)
    assert chunks == answer.split("\n—\n") and outcome == "repaired"
    assert read_answer('{"chunks": ["A.", "B."', schema, answer_chunks, repair=True) == (
        ["A.", "B."],
        "repaired",
    )
    # a bare list answer, slightly broken (a trailing comma), is still the chunk list, as before
    assert read_answer('["A.", "B.",]', schema, answer_chunks, repair=True) == (["A.", "B."], "repaired")


def test_a_fence_with_a_language_tag_is_not_part_of_the_first_chunk():
    assert split_answer("```text\nThe committee met.\n—\nThen it left.\n```") == [
        "The committee met.",
        "Then it left.",
    ]
    assert split_answer("```\nA.\n—\nB.\n```") == ["A.", "B."]


def test_windows_stay_in_budget_and_end_at_sentence_ends(counter):
    text, _ = planted()
    plan = DocPlan.build("d", text, "en", counter)
    ends = {s.end for s in split_sentences(text, "en")}
    pos = after = 0
    while pos < len(text):
        end, tokens, over = window_end(plan, pos, after, WINDOW_TOKENS)
        assert end in ends and end > after and not over
        # Sentences are counted one by one: a few tokens over a count of the whole window, never under.
        assert counter.count(text[pos:end]) <= tokens <= WINDOW_TOKENS
        assert window_end(plan, pos, after, WINDOW_TOKENS * 10)[0] == len(text)  # a big budget: the rest
        pos = after = end
    # A paragraph end in the second half of the budget wins over a later sentence end.
    para = text.index("\n") + 1
    start = truth_start = planted()[1][3][0]
    assert truth_start < para
    end, tokens, _ = window_end(plan, start, start, counter.count(text[start:para]) + 60)
    assert end == para
    # A single sentence over the budget is sent alone, and said so.
    assert window_end(plan, 0, 0, 5)[0] == split_sentences(text, "en")[0].end
    assert window_end(plan, 0, 0, 5)[2] is True


def test_cleaning_accepts_a_light_typo_rejects_a_hallucination_and_stores_offsets():
    window = "The quick brown fox jumps over the lazy dog. " + "A" * 60 + " x " + "b" * 99 + "."
    chunk_b = "b" * 99 + "."  # 100 characters: 10 edits accepted, 11 flagged
    cleaned = clean_window(
        window,
        ["The quick brwn fox jumps over the lazy dog.", HALLUCINATED, "c" * 10 + chunk_b[10:]],
        max_ratio=0.1,
    )
    (s0, e0, d0), flagged, (s2, e2, d2) = cleaned.spans
    assert flagged is None and (d0, d2) == (1, 10)
    assert window[s0:e0] == "The quick brown fox jumps over the lazy dog." and window[s2:e2] == chunk_b
    assert clean_window(window, ["c" * 11 + chunk_b[11:]], 0.1).spans == [None]


@pytest.mark.parametrize(
    "lengths, label", [([120], 0), ([120, 121], 1), ([180], 2), ([181], 3), ([60, 60], 0)]
)
def test_label_from_the_mean_chunk_length_at_the_interval_edges(lengths, label):
    text, chunks = "", []
    for n in lengths:
        chunks.append({"start": len(text), "end": len(text) + n, "distance": 0})
        text += "w" * (n - 1) + ". "
    cfg = SimpleNamespace(sample_chars=1024, head_chars=10, tail_chars=10, placeholder="[MASK]")
    record = finish_record({"status": "ok", "windows": [], "chunks": chunks, "samples": []}, text, cfg)
    assert record["mean_chunk_chars"] == sum(lengths) / len(lengths)
    assert record["label"] == label == granularity_label(record["mean_chunk_chars"])


def test_expert_targets():
    assert (
        element("The quick brown fox jumps over the lazy dog again.", 10, 10, "[MASK]")
        == "The quick[MASK]dog again."
    )
    assert (
        element("Thequickbrownfox jumps over the lazy dog.", 6, 6, "<omitted>")
        == "Thequickbrownfox<omitted>lazy dog."
    )
    assert element("西安市发放了体育消费券，共计五百万元。", 4, 3, "[MASK]") == "西安市发[MASK]万元。"
    assert element("  Short one.  ", 10, 10, "[MASK]") == "Short one."  # quoted whole
    # The targets recover the chunk starts with the inference algorithm, whatever the placeholder.
    text = "Alpha one two. Beta three four.\n\nGamma five six. Delta seven."
    chunks = [(0, 31), (33, 48), (49, 61)]
    for placeholder in ("[MASK]", "<omitted>", ".*?", "<pad>"):
        elements, ok = expert_target(text, chunks, 5, 5, placeholder)
        assert ok and all(placeholder in e for e in elements)
        assert [a for a, _ in recover_chunks(text, elements, placeholder)[0]] == [0, 33, 49]
    # A head that also occurs earlier is lengthened until the chunk is found where it starts.
    # ("The cat sat." ends chunk 1's shortest match early; " The dog" inside chunk 1 looks like chunk 2.)
    text = "The cat sat. The dog ran. Then the cat sat. The dog ran home quickly tonight."
    elements, ok = expert_target(text, [(0, 43), (44, len(text))], 4, 4, "[MASK]")
    assert ok and elements == ["The cat[MASK]cat sat.", "The dog[MASK]tonight."]  # anchors doubled once
    assert [a for a, _ in recover_chunks(text, elements)[0]] == [0, 44]
    assert [a for a, _ in recover_chunks(text, ["The[MASK]sat.", "The[MASK]tonight."])[0]] != [0, 44]
    # Samples are whole consecutive chunks of about the target length, never across a gap.
    chunks = [(0, 300), (301, 600), (601, 900), (901, 1000), (1200, 1500)]
    chars = [" "] * 1500
    for s, e in chunks:
        chars[s:e] = "x" * (e - s)
    chars[1100:1103] = "GAP"
    text = "".join(chars)
    assert gaps_of(text, chunks) == [[1000, 1200]]
    assert pack_samples(text, chunks, 500) == [
        [(0, 300)],
        [(301, 600)],
        [(601, 900), (901, 1000)],
        [(1200, 1500)],
    ]


# ------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, tiny_model_dir, counter):
    """One `distill moc` run (after a dry run), its status, and a rerun, against the scripted teacher."""
    root = tmp_path_factory.mktemp("moc")
    text, truth = planted()
    replies = script(text, truth)
    documents = root / "documents.jsonl"
    documents.write_text(
        json.dumps({"id": "planted", "text": text}) + "\n" + json.dumps({"id": "junk", "text": JUNK}) + "\n"
    )
    runs = {}
    with serve_in_subprocess(replies=replies) as server:
        recipe = root / "moc.yaml"
        recipe.write_text(
            yaml.safe_dump(
                {
                    "task": "moc",
                    "documents": str(documents),
                    "out": str(root / "run"),
                    "lang": "en",
                    "moc_tokenizer": str(tiny_model_dir),
                    "moc_window_tokens": WINDOW_TOKENS,
                    "moc_sample_chars": SAMPLE_CHARS,
                    "parse_retries": PARSE_RETRIES,
                    "progress": False,
                    "teachers": {
                        "moc_chunk": {
                            "model": "loopback",
                            "base_url": server.base_url,
                            "max_tokens": 512,
                            "concurrency": 4,
                            "timeout": 5.0,
                            "max_retries": 1,
                        }  # fmt: skip
                    },
                    "prices": {"loopback": {"input": 1.0, "output": 2.0}},
                }
            )
        )
        for name, flags in (("dry", ["--dry-run"]), ("first", []), ("status", None), ("again", [])):
            action = "status" if flags is None else "moc"
            code = cli_main(["distill", action, "--config", str(recipe), *(flags or [])])
            meta = json.loads((root / "run" / "moc.meta.json").read_text()) if name != "dry" else None
            attempt = read_run_log(root / "run")[-1] if name in ("first", "again") else None
            runs[name] = (code, server.stats()["requests"], meta, attempt)
            if name == "first":
                records = (root / "run" / "moc.jsonl").read_text()
        rerun_records = (root / "run" / "moc.jsonl").read_text()
    return SimpleNamespace(
        root=root, text=text, truth=truth, runs=runs, documents=documents,
        records={r["doc_id"]: r for r in map(json.loads, records.splitlines())},
        rerun={r["doc_id"]: r for r in map(json.loads, rerun_records.splitlines())},
    )  # fmt: skip


def test_sliding_window_and_chunk_buffer_lose_no_text_and_force_no_boundary(distilled):
    record, text, truth = distilled.records["planted"], distilled.text, distilled.truth
    windows = record["windows"]
    assert (record["status"], record["reason"]) == ("ok", "")
    assert len(windows) >= 4 and windows[0]["start"] == 0 and windows[-1]["end"] == len(text)
    # The test means something: window edges fall inside true chunks...
    inside = [w["end"] for w in windows if any(s < w["end"] < e for s, e in truth)]
    assert len(inside) >= 2
    # ...yet the accepted chunks are exactly the planted ones: no boundary at a window edge, no text lost.
    assert [(c["start"], c["end"]) for c in record["chunks"]] == truth
    assert record["gaps"] == [] and gaps_of(text, truth) == []
    for w, nxt in zip(windows, windows[1:]):
        assert nxt["end"] > w["end"]  # every request brings new text
        if w["widened"]:  # one chunk in a window cut short at a paragraph end: asked again, whole budget
            assert (nxt["start"], w["accepted"], text[w["end"] - 1]) == (w["start"], [], "\n")
        else:  # the buffer: the last chunk starts the next window
            assert w["carried"] is not None and nxt["start"] == w["carried"][0]
            assert w["carried"][0] in {s for s, _ in truth}
    assert sum(w["widened"] for w in windows) == 1
    assert windows[-1]["carried"] is None  # the last window keeps all its chunks
    for w in windows:
        assert w["tokens"] <= WINDOW_TOKENS and not w["over_budget"] and not w["forced_edge"]
        assert w["answer"]["prompt_sha256"] and w["answer"]["raw"]
    # Cleaning: the typo is accepted at the source's offsets, the hallucination flagged with its text.
    assert [c["distance"] for c in record["chunks"]] == [1] + [0] * (len(truth) - 1)
    flagged = [f for w in record["windows"] for f in w["flagged"]]
    assert [f["text"] for f in flagged] == [HALLUCINATED]
    counts = record["counts"]
    assert (counts["flagged"], counts["fuzzy"], counts["fallbacks"], counts["accepted"]) == (
        1,
        1,
        0,
        len(truth),
    )
    # Label and samples.
    mean = sum(e - s for s, e in truth) / len(truth)
    assert record["mean_chunk_chars"] == round(mean, 2) and record["label"] == granularity_label(mean)
    covered = [tuple(c) for s in record["samples"] for c in s["chunks"]]
    assert covered == truth  # every accepted chunk in exactly one sample, in order
    for sample in record["samples"]:
        assert sample["end"] - sample["start"] <= 1.5 * SAMPLE_CHARS and sample["recoverable"]
        body = text[sample["start"] : sample["end"]]
        starts = [a for a, _ in recover_chunks(body, sample["elements"], "[MASK]")[0]]
        assert starts == [s - sample["start"] for s, _ in sample["chunks"]]


def test_unusable_answers_fall_back_and_are_counted(distilled):
    junk = distilled.records["junk"]
    assert (junk["status"], junk["reason"]) == ("failed", "no_chunks")
    (window,) = junk["windows"]
    assert window["fallback"] and window["reason"] == "unparseable"
    assert window["answer"]["attempts"] == PARSE_RETRIES + 1 and junk["samples"] == []
    assert junk["gaps"] == [[0, len(JUNK)]] and junk["counts"]["flagged"] == 1


def test_counts_dry_run_status_and_a_rerun_that_sends_nothing(distilled, capsys):
    runs = distilled.runs
    n_requests = sum(w["answer"]["attempts"] for r in distilled.records.values() for w in r["windows"])
    assert n_requests == len(distilled.records["planted"]["windows"]) + PARSE_RETRIES + 1
    assert runs["dry"][:2] == (0, 0)  # the dry run sent nothing
    code, sent, meta, attempt = runs["first"]
    assert code == 4 and sent == n_requests  # 1 of 2 documents failed: over --max-failure-rate 0.25
    assert attempt["requests_sent"] == n_requests and attempt["answers_from_store"] == 0
    summary = meta["summary"]
    assert summary["outcome"] == {"ok": 1, "failed": 1} and summary["fallbacks"] == 1
    assert summary["chunks"]["accepted"] == len(distilled.truth) and summary["chunks"]["flagged"] == 2
    assert summary["prompt_tokens"] > 0 and summary["cost"] > 0
    assert meta["prompt_sha256"].keys() == {"moc_chunk.en"} and meta["config"]["task"] == "moc"
    assert runs["status"][:2] == (0, n_requests)
    code, sent, again_meta, attempt = runs["again"]
    assert code == 4 and sent == n_requests  # the rerun sent zero requests
    assert attempt["requests_sent"] == 0 and attempt["answers_from_store"] == n_requests
    assert again_meta == meta  # from the store: the same meta file
    for doc_id, record in distilled.records.items():
        again = distilled.rerun[doc_id]
        assert again == record  # from the store: the same record


def test_build_sft_moc_router_and_expert(distilled, tiny_model_dir, tmp_path):
    from datasets import load_dataset
    from metachunk.distill.sft import BuildSftConfig, build_sft

    record = distilled.records["planted"]
    label = record["label"]
    common = dict(distilled=distilled.root / "run" / "moc.jsonl", cards_dir=tmp_path / "cards",
                  tokenizer=str(tiny_model_dir), validation_fraction=0.0)  # fmt: skip
    router = build_sft(BuildSftConfig(task="moc-router", out=tmp_path / "router", **common), progress=False)
    assert router["rows"]["train"] == len(record["samples"])
    assert router["filters"]["failed_or_empty"] == 1  # the junk document
    expert = build_sft(
        BuildSftConfig(task="moc-expert", out=tmp_path / "expert", granularity=[label], name="ex", **common),
        progress=False,
    )
    assert expert["outputs"] == [(str(tmp_path / f"expert-{label}"), f"ex-{label}")]
    assert (tmp_path / "cards" / f"ex-{label}.md").is_file()

    text = distilled.text
    rows = load_dataset(str(tmp_path / "router"), split="train")
    assert rows.num_rows == len(record["samples"])
    for row, sample in zip(rows, record["samples"]):
        body = text[sample["start"] : sample["end"]]
        assert row["prompt"] == router_messages(body, "en")
        assert row["completion"] == [{"role": "assistant", "content": str(label)}]
    rows = load_dataset(str(tmp_path / f"expert-{label}"), split="train")
    assert rows.num_rows == len(record["samples"])
    for row, sample in zip(rows, record["samples"]):
        body = text[sample["start"] : sample["end"]]
        assert row["prompt"] == expert_messages(body, "en", "[MASK]")
        elements = json.loads(row["completion"][0]["content"])
        assert elements == sample["elements"] and row["label"] == label
        assert [a for a, _ in recover_chunks(body, elements)[0]] == [
            s - sample["start"] for s, _ in sample["chunks"]
        ]
    card = (tmp_path / "router" / "README.md").read_text(encoding="utf-8")
    assert "MoC granularity router" in card and "moc_router.en" in card and "moc_chunk.en" in card
    # What the card says of the run is the run's: its teacher and edit bound, a sample's columns.
    assert (
        "Chunk boundaries are the teacher's (loopback), kept only where every chunk was found in the source within 10% edits"
        in card
    )
    assert "`sample_index`" in card and "`chunk_index`" not in card
    assert f"Candidate rows from the distilled records: {len(record['samples']) + 1}" in card  # + the junk's


def test_build_sft_moc_filters(tmp_path, tiny_model_dir, monkeypatch):
    """Each filter drops its planted sample: unrecoverable, contaminated, exact and near duplicates,
    too long; a failed record counts as failed_or_empty. A rebuild that cannot swap its dataset in
    keeps the previous one whole."""
    from metachunk.distill.sft import BuildSftConfig, build_sft
    from metachunk.distill.sft_rows import MOC_FILTERS

    cfg = SimpleNamespace(sample_chars=10_000, head_chars=10, tail_chars=10, placeholder="[MASK]")

    def record(doc_id, text, status="ok"):
        chunks = [
            {"start": m.start(), "end": m.end(), "distance": 0} for m in re.finditer(r"[^ .][^.]*\.", text)
        ]
        rec = {"schema_version": 1, "task": "moc", "doc_id": doc_id, "lang": "en", "status": status,
               "reason": "", "windows": [], "chunks": chunks, "samples": [], "placeholder": "[MASK]"}  # fmt: skip
        return finish_record(rec, text, cfg)

    docs = {f"d{i}": " ".join(sentence(100 * i + j) for j in range(4)) for i in range(6)}
    docs["dup"] = docs["d0"]
    docs["near"] = docs["d1"] + " Bridge."
    docs["held"] = " ".join(sentence(900 + j) for j in range(4))
    docs["long"] = " ".join(sentence(700 + j) for j in range(60))
    records = [record(k, v) for k, v in docs.items()]
    records[2]["samples"][0]["recoverable"] = False
    records.append(record("failed", docs["d3"], status="failed"))
    (tmp_path / "moc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items())
    )
    (tmp_path / "test.jsonl").write_text(json.dumps({"id": "t", "text": docs["held"]}) + "\n")
    common = dict(distilled=tmp_path / "moc.jsonl", documents=tmp_path / "docs.jsonl", test_documents=tmp_path / "test.jsonl",
                  cards_dir=tmp_path / "cards", tokenizer=str(tiny_model_dir), max_length=1500)  # fmt: skip
    expert = build_sft(BuildSftConfig(task="moc-expert", out=tmp_path / "ex", **common), progress=False)
    filters = Counter()
    for stats in expert["datasets"].values():
        filters.update(stats["filters"])
    assert (
        set(MOC_FILTERS) <= set(filters) and filters["lost_content"] == filters["refusal_or_off_format"] == 0
    )
    assert {k: filters[k] for k in MOC_FILTERS} == {"failed_or_empty": 0, "unrecoverable": 1, "contaminated": 1,
                                                     "exact_duplicate": 1, "near_duplicate": 1, "too_long": 1}  # fmt: skip
    assert {Path(o).name for o, _ in expert["outputs"]} == {f"ex-{k}" for k in range(4)}
    router = build_sft(BuildSftConfig(task="moc-router", out=tmp_path / "ro", **common), progress=False)
    assert {k: router["filters"][k] for k in MOC_FILTERS} == {"failed_or_empty": 1, "unrecoverable": 0, "contaminated": 1,
                                                             "exact_duplicate": 1, "near_duplicate": 1, "too_long": 1}  # fmt: skip
    # The card's filter table adds up: input records - rows removed = rows kept (no "differs" note).
    card = (tmp_path / "ro" / "README.md").read_text(encoding="utf-8")
    assert "`unrecoverable`" in card and "differs from" not in card
    assert sum(router["rows"].values()) == 6 and router["input_records"] == 11

    import errno
    import os

    def files() -> dict:
        return {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "ro").rglob("*") if p.is_file()}

    built = files()
    failed = []

    def failing(real):  # the first move of a new build into place fails, as on a full or broken disk
        def move(src, dst, *args, **kwargs):
            if Path(dst) == tmp_path / "ro" and not failed:
                failed.append(src)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real(src, dst, *args, **kwargs)

        return move

    monkeypatch.setattr(os, "rename", failing(os.rename))
    monkeypatch.setattr(os, "replace", failing(os.replace))
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        build_sft(BuildSftConfig(task="moc-router", out=tmp_path / "ro", **common), progress=False)
    monkeypatch.undo()
    assert failed  # the swap failed, not something before it
    assert files() == built
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".ro.")]  # no staging or trash left


def test_a_sample_past_its_document_is_named(tmp_path, tiny_model_dir):
    """A documents file shorter than the one distilled from had cut each sample's body silently."""
    from metachunk.distill.sft import BuildSftConfig, build_sft

    from metachunk.artifacts import InputError

    text = " ".join(sentence(j) for j in range(8))
    chunks = [{"start": m.start(), "end": m.end(), "distance": 0} for m in re.finditer(r"[^ .][^.]*\.", text)]
    rec = {"schema_version": 1, "task": "moc", "doc_id": "d", "lang": "en", "status": "ok", "reason": "",
           "windows": [], "chunks": chunks, "samples": [], "placeholder": "[MASK]"}  # fmt: skip
    cfg = SimpleNamespace(sample_chars=10_000, head_chars=10, tail_chars=10, placeholder="[MASK]")
    (tmp_path / "moc.jsonl").write_text(json.dumps(finish_record(rec, text, cfg)) + "\n")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"id": "d", "text": text[: len(text) // 2]}) + "\n")
    with pytest.raises(
        InputError, match=r"moc\.jsonl:1: .*samples\[0\] 'start':'end' 0:\d+ is outside document 'd'"
    ):
        build_sft(BuildSftConfig(task="moc-router", distilled=tmp_path / "moc.jsonl", out=tmp_path / "ro",
                                 documents=tmp_path / "docs.jsonl", cards_dir=tmp_path / "cards",
                                 tokenizer=str(tiny_model_dir)), progress=False)  # fmt: skip
    assert not (tmp_path / "ro").exists()


def test_router_and_expert_train_on_distilled_rows_then_chunk(distilled, tiny_model_dir, tmp_path):
    """The whole MoC path on distilled rows: build-sft → train (router, expert) → chunk --method moc
    with the trained checkpoints. The tiny model's rules are junk; the chunks must still tile."""
    from metachunk.distill.sft import BuildSftConfig, build_sft
    from metachunk.train.sft import main as train_main

    label = distilled.records["planted"]["label"]
    common = dict(distilled=distilled.root / "run" / "moc.jsonl", cards_dir=tmp_path / "cards",
                  tokenizer=str(tiny_model_dir), validation_fraction=0.0)  # fmt: skip
    build_sft(BuildSftConfig(task="moc-router", out=tmp_path / "router", **common), progress=False)
    build_sft(
        BuildSftConfig(task="moc-expert", out=tmp_path / "expert", granularity=[label], **common),
        progress=False,
    )
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "train" / "cpu_smoke.yaml"
    trained = {}
    for name, dataset in (("router", tmp_path / "router"), ("expert", tmp_path / f"expert-{label}")):
        out = tmp_path / "runs" / name
        argv = ["--config", str(recipe), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(dataset),
                "--output_dir", str(out), "--max_steps", "2", "--eval_strategy", "no", "--max_length", "4096"]  # fmt: skip
        assert train_main(argv) == 0
        facts = json.loads((out / "metachunk_run.json").read_text())
        assert facts["global_steps"] == 2 and facts["final_train_loss"] > 0
        assert facts["dataset_report"]["task"] == ("moc-router" if name == "router" else "moc-expert")
        trained[name] = str(out)

    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"id": "planted", "text": distilled.text}) + "\n")
    chunks = tmp_path / "moc.jsonl"
    argv = ["chunk", str(src), "-o", str(chunks), "--method", "moc", "--lang", "en", "--router", trained["router"],
            "--experts", ",".join([trained["expert"]] * 4), "--moc-max-new-tokens", "8", "--moc-retries", "1"]  # fmt: skip
    assert cli_main(argv) == 0
    record = json.loads(chunks.read_text())
    assert "".join(c["text"] for c in record["chunks"]) == distilled.text
    assert all(c["text"] == distilled.text[c["start"] : c["end"]] for c in record["chunks"])
    moc = read_run_log(chunks)[-1]["workers_report"][0]["moc"]
    assert sum(moc["routes"].values()) == moc["windows"] >= 1


def test_each_sample_is_labelled_by_its_own_chunks_not_its_document(tmp_path, tiny_model_dir):
    """MoC §3.2.2 labels the ~1,024-character text the router reads at inference: a document whose first
    half the teacher cut into sentences (~60 characters, granularity 0) and whose second half into chunks of
    four sentences (~250, granularity 3) gives router rows of both labels and rows to both expert sets."""
    from metachunk.distill.sft import BuildSftConfig, build_sft

    text, chunks = "", []
    for k in range(24):  # 16 one-sentence chunks, then 8 of four sentences
        piece = sentence(k) if k < 16 else " ".join(sentence(100 * k + j) for j in range(4))
        start = len(text) + (1 if text else 0)
        text = f"{text} {piece}" if text else piece
        chunks.append({"start": start, "end": len(text), "distance": 0})
    cfg = SimpleNamespace(sample_chars=600, head_chars=10, tail_chars=10, placeholder="[MASK]")
    rec = {"schema_version": 1, "task": "moc", "doc_id": "mixed", "lang": "en", "status": "ok", "reason": "",
           "windows": [], "chunks": chunks, "samples": [], "placeholder": "[MASK]"}  # fmt: skip
    rec = finish_record(rec, text, cfg)
    labels = [granularity_label(s["mean_chunk_chars"]) for s in rec["samples"]]
    assert {0, 3} <= set(labels)  # one document, samples of both ends
    (tmp_path / "moc.jsonl").write_text(json.dumps(rec) + "\n")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"id": "mixed", "text": text}) + "\n")
    common = dict(distilled=tmp_path / "moc.jsonl", documents=tmp_path / "docs.jsonl", cards_dir=tmp_path / "cards",
                  tokenizer=str(tiny_model_dir), validation_fraction=0.0)  # fmt: skip
    build_sft(BuildSftConfig(task="moc-router", out=tmp_path / "ro", **common), progress=False)
    from datasets import load_dataset

    rows = load_dataset(str(tmp_path / "ro"), split="train")
    by_start = {s["start"]: label for s, label in zip(rec["samples"], labels)}
    assert sorted(int(r["completion"][0]["content"]) for r in rows) == sorted(labels)
    assert all(int(r["completion"][0]["content"]) == r["label"] == by_start[r["start"]] for r in rows)
    expert = build_sft(BuildSftConfig(task="moc-expert", out=tmp_path / "ex", granularity=[0, 3], **common),
                       progress=False)  # fmt: skip
    assert {int(label): stats["rows"]["train"] for label, stats in expert["datasets"].items()} == {
        label: labels.count(label) for label in (0, 3)
    }
