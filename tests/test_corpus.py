"""prepare-crud: QA-to-article matching, the leakage-free training pool, and NearDuplicateIndex."""

import json
from pathlib import Path

import pytest
from metachunk.distill.corpus import (
    NearDuplicateIndex,
    PrepareCrudConfig,
    QAEntry,
    match_qa,
    normalize,
    prepare_crud,
    print_report,
    read_qa,
)
from support.data import data_file

from metachunk.artifacts import Document, InputError

OUTPUTS = ("test_documents.jsonl", "train_pool.jsonl", "qa_matches.jsonl", "report.json")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------- the real CRUD data


@pytest.fixture(scope="module")
def crud(tmp_path_factory: pytest.TempPathFactory):
    news, qa = data_file("crud-news/news.jsonl"), data_file("crud-news/questanswer_1doc.json")
    first, again = tmp_path_factory.mktemp("crud_a"), tmp_path_factory.mktemp("crud_b")
    return news, prepare_crud(news, qa, first), first, prepare_crud(news, qa, again), again


def test_crud_counts_are_stable_and_reruns_identical(crud):
    _, report, first, report_again, again = crud
    # The numbers this matcher produces on the shared data; a change here is a change of method.
    assert (report["qa_entries"], report["matched"], report["ambiguous"], report["unmatched"]) == (
        800,
        43,
        15,
        742,
    )
    assert (report["documents"], report["test_documents"], report["train_pool"]) == (1200, 72, 1128)
    assert report["near_duplicates_removed"] == 0 and report["exact_duplicate_groups"] == []
    assert sum(report["confidence_histogram"].values()) == 800
    assert report["thresholds"]["match_threshold"] == 0.7 and report["thresholds"]["margin"] == 0.1
    assert report_again == report
    for name in OUTPUTS:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name


def test_crud_test_set_and_pool_do_not_overlap(crud):
    news, report, out, _, _ = crud
    test, pool = read_jsonl(out / "test_documents.jsonl"), read_jsonl(out / "train_pool.jsonl")
    assert len(test) == report["test_documents"] and len(pool) == report["train_pool"]
    assert not {d["id"] for d in test} & {d["id"] for d in pool}
    assert not {normalize(d["text"]) for d in test} & {normalize(d["text"]) for d in pool}
    corpus = [d["id"] for d in read_jsonl(news)]
    assert [d["id"] for d in test] == [i for i in corpus if i in {d["id"] for d in test}]  # corpus order
    assert len(test) + len(pool) + report["near_duplicates_removed"] == len(corpus)
    assert all(d["source"].startswith("data/80000_docs/") for d in test + pool)


def test_crud_matches_point_at_test_documents_that_hold_their_keys(crud):
    news, _, out, _, _ = crud
    texts = {d["id"]: normalize(d["text"]) for d in read_jsonl(news)}
    test_ids = {d["id"] for d in read_jsonl(out / "test_documents.jsonl")}
    matches = read_jsonl(out / "qa_matches.jsonl")
    assert len(matches) == 800
    assert test_ids == {i for m in matches for i in m["doc_ids"]}
    shares = []
    for m in matches:
        assert 0 <= m["confidence"] <= 1
        if m["status"] == "unmatched":
            assert m["doc_ids"] == [] and m["confidence"] < 0.7
            continue
        assert m["confidence"] >= 0.7 and (len(m["doc_ids"]) == 1) == (m["status"] == "matched")
        if m["status"] == "matched":
            keys = [normalize(k) for k in m["key_info"]]
            share = sum(k in texts[m["doc_ids"][0]] for k in keys) / len(keys)
            assert share >= 0.5, m["qa_id"]  # the rest are paraphrased in the article
            shares.append(share)
    assert sum(shares) / len(shares) >= 0.85


# -------------------------------------------------------------------------- a planted leak


SOURCE = (
    "2031年3月5日，青禾市交通运输局宣布，全长48.6公里的青禾地铁9号线将于2032年6月底建成通车。"
    "这条线路自北向南穿过老城区，共设车站二十一座，其中换乘站七座。"
    "据介绍，线路采用全自动驾驶系统，最高运行速度为每小时一百公里，高峰时段发车间隔不超过两分钟。"
    "建设单位表示，目前主体结构已经基本完成，轨道铺设和设备安装正在同步推进，"
    "沿线居民出行将因此更加便捷。交通专家认为，新线路能够有效缓解城市中心的拥堵状况，"
    "并带动沿线商业和住宅的发展。市政府还计划在车站周边建设公共自行车停放点和公交接驳站，"
    "方便乘客完成最后一公里的出行。有关部门提醒市民，施工期间部分道路仍将实行交通管制，"
    "请大家提前规划出行路线，注意安全。"
)
# A few characters edited, among them the key facts: no longer the QA's source, still a near copy.
EDITED = SOURCE.replace("9号线", "7号线").replace("48.6公里", "46.8公里").replace("2032年", "2033年")
OTHER = (
    "本周末，南湖公园将举办第五届荷花文化节，活动持续三天。主办方准备了摄影比赛、书画展览和民俗表演，"
    "游客可以在湖边欣赏盛开的荷花，也可以参加亲子手工活动。公园管理处表示，节日期间将延长开放时间，"
    "并增加临时停车位，建议游客尽量乘坐公共交通前往。"
)
PLANTED_QA = {
    "q-metro": {
        "key_info": ["青禾地铁9号线", "全长48.6公里", "2032年6月底", "青禾市交通运输局"],
        "question": ["青禾地铁9号线全长多少公里？", "青禾地铁9号线何时通车？"],
        "answers": ["48.6公里", "2032年6月底", "无法推断"],
    },
    "q-elsewhere": {
        "key_info": ["火星探测器", "着陆成功"],
        "question": ["火星探测器是否着陆成功？"],
        "answers": ["是"],
    },
}


def test_planted_near_duplicate_and_exact_copy_leave_the_pool(tmp_path):
    news = tmp_path / "news.jsonl"
    docs = [("src", SOURCE), ("other", OTHER), ("edited", EDITED), ("copy", SOURCE)]
    news.write_text(
        "".join(json.dumps({"id": i, "text": t, "source": f"planted#{i}"}) + "\n" for i, t in docs),
        encoding="utf-8",
    )
    qa = tmp_path / "qa.json"
    qa.write_text(json.dumps(PLANTED_QA, ensure_ascii=False), encoding="utf-8")

    report = prepare_crud(news, qa, tmp_path / "out")
    assert (report["matched"], report["ambiguous"], report["unmatched"]) == (1, 0, 1)
    assert [d["id"] for d in read_jsonl(tmp_path / "out" / "test_documents.jsonl")] == ["src"]
    assert [d["id"] for d in read_jsonl(tmp_path / "out" / "train_pool.jsonl")] == ["other"]
    assert report["exact_duplicate_groups"] == [["src", "copy"]]
    assert report["near_duplicates_removed"] == 2
    edited, copy = report["near_duplicate_pairs"]
    assert copy == {"pool_id": "copy", "test_id": "src", "jaccard": 1.0, "kind": "exact"}
    assert (edited["pool_id"], edited["test_id"], edited["kind"]) == ("edited", "src", "near")
    assert 0.8 <= edited["jaccard"] < 1.0
    metro = {m["qa_id"]: m for m in read_jsonl(tmp_path / "out" / "qa_matches.jsonl")}["q-metro"]
    assert metro["status"] == "matched" and metro["doc_ids"] == ["src"] and metro["confidence"] == 1.0
    assert metro["candidates"][1][0] == "edited" and metro["candidates"][1][1] < 0.5  # edits hit the keys
    assert metro["evidence"]["answers_ignored"] == ["无法推断"]


def test_a_failure_while_writing_leaves_the_last_test_set_and_pool_together(tmp_path, monkeypatch):
    """The four outputs were replaced one by one: a full disk while the pool was written left a new test
    set beside the old pool, which held the new test documents (a leak)."""
    import errno
    import os

    news = tmp_path / "news.jsonl"
    docs = [("src", SOURCE), ("other", OTHER), ("edited", EDITED), ("copy", SOURCE)]
    news.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs), encoding="utf-8")
    qa = tmp_path / "qa.json"
    qa.write_text(json.dumps(PLANTED_QA, ensure_ascii=False), encoding="utf-8")
    out = tmp_path / "out"
    prepare_crud(news, qa, out)
    before = {name: (out / name).read_bytes() for name in OUTPUTS}
    fsync = os.fsync
    calls = []

    def disk_full_at_the_second_file(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", disk_full_at_the_second_file)
    with pytest.raises(OSError, match="No space left"):
        prepare_crud(news, qa, out, match_threshold=0.99)  # a different run
    assert {name: (out / name).read_bytes() for name in OUTPUTS} == before
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS)  # and no temp file is left


def test_two_sources_within_the_margin_are_ambiguous_and_a_clear_winner_is_matched():
    other_report = "据报道，" + SOURCE[:60] + "此外，当地还公布了新的公交线路调整方案，涉及十二条线路。"
    docs = [Document("a", SOURCE), Document("b", other_report), Document("c", OTHER)]
    entry = QAEntry("q", ("青禾地铁9号线", "全长48.6公里"), ("?",), ("48.6公里",))
    (match,) = match_qa(docs, {"q": entry})
    assert match.status == "ambiguous" and match.doc_ids == ("a", "b")  # both hold every key
    entry = QAEntry("q", ("青禾地铁9号线", "全自动驾驶系统", "公共自行车停放点"), ("?",), ())
    (match,) = match_qa(docs, {"q": entry})
    assert match.status == "matched" and match.doc_ids == ("a",)
    assert match.candidates[:2] == (("a", 1.0), ("b", round(7 / 22, 4)))  # 1 key of 3, length-weighted
    (match,) = match_qa(docs, {"q": entry}, match_threshold=1.0, margin=0.7)
    assert match.status == "ambiguous" and match.doc_ids == ("a", "b")


# --------------------------------------------------------------------------- NearDuplicateIndex


def exact_jaccard(index: NearDuplicateIndex, a: str, b: str) -> float:
    sa, sb = index.shingles(a), index.shingles(b)
    return len(sa & sb) / len(sa | sb)


def test_near_duplicate_index_finds_copies_and_small_edits_only():
    index = NearDuplicateIndex()
    index.add("metro", SOURCE)
    index.add("park", OTHER)
    assert len(index) == 2 and "metro" in index and "nope" not in index
    assert index.query(SOURCE) == ["metro"]
    assert index.query_scored(SOURCE) == [("metro", 1.0)]
    assert index.query(" \n".join(SOURCE.split("，"))) == []  # commas gone: not whitespace
    assert index.query(SOURCE.replace("，", "， \n")) == ["metro"]  # whitespace is ignored
    assert index.query(EDITED) == ["metro"]
    assert index.query("Completely unrelated English text about the weather in the mountains.") == []
    english = "The quick brown fox jumps over the lazy dog near the riverbank every single morning. " * 3
    index.add("fox", english)
    assert index.query(english.replace("lazy", "hazy", 1)) == ["fox"]
    with pytest.raises(ValueError):
        index.add("metro", SOURCE)


def test_near_duplicate_index_respects_the_threshold():
    base = "".join(chr(0x4E00 + i) for i in range(200))  # 200 distinct characters: 196 5-gram shingles
    fresh = "".join(chr(0x6000 + i) for i in range(50))
    just_above, just_below = base[:179] + fresh[:21], base[:178] + fresh[:22]
    index = NearDuplicateIndex(threshold=0.8)
    index.add("base", base)
    assert exact_jaccard(index, base, just_above) == pytest.approx(175 / 217)  # 0.806
    assert exact_jaccard(index, base, just_below) == pytest.approx(174 / 218)  # 0.798
    assert index.query(just_above) == ["base"]
    assert index.query(just_below) == []
    looser = NearDuplicateIndex(threshold=174 / 218)
    looser.add("base", base)
    assert looser.query(just_below) == ["base"]


def test_near_duplicate_index_short_and_empty_texts_and_bad_settings():
    index = NearDuplicateIndex(shingle=5)
    index.add("empty", "  ")
    index.add("short", "abc")  # shorter than a shingle: the whole text is one shingle
    assert index.query("") == [] and index.query("abc") == ["short"] and index.query("abd") == []
    assert len(index) == 2 and "empty" in index
    for bad in ({"threshold": 0}, {"threshold": 1.5}, {"num_perm": 1}, {"shingle": 0}):
        with pytest.raises(ValueError):
            NearDuplicateIndex(**bad)


# ------------------------------------------------------------------------- inputs, config, report


def test_read_qa_names_the_file_and_problem(tmp_path):
    bad = tmp_path / "qa.json"
    bad.write_text('{"q": {"key_info": ["a"]', encoding="utf-8")
    with pytest.raises(InputError, match=r"qa\.json:1: invalid JSON"):
        read_qa(bad)
    bad.write_text(json.dumps({"q": {"key_info": ["a"], "question": []}}), encoding="utf-8")
    with pytest.raises(InputError, match="entry 'q': field 'answers' must be a list of strings"):
        read_qa(bad)
    with pytest.raises(InputError, match="no such file"):
        read_qa(tmp_path / "missing.json")


def test_prepare_crud_config_validates():
    cfg = PrepareCrudConfig(news=Path("n.jsonl"), qa=Path("q.json"), out=Path("o"))
    assert (cfg.match_threshold, cfg.margin, cfg.near_dup_threshold, cfg.num_perm) == (0.7, 0.1, 0.8, 128)
    with pytest.raises(ValueError, match="'out' is required"):
        PrepareCrudConfig(news=Path("n.jsonl"), qa=Path("q.json"))
    for bad in ({"match_threshold": 1.5}, {"margin": 0}, {"near_dup_threshold": 0}, {"num_perm": 1}):
        with pytest.raises(ValueError):
            PrepareCrudConfig(news=Path("n.jsonl"), qa=Path("q.json"), out=Path("o"), **bad)


def test_print_report(tmp_path, capsys):
    news = tmp_path / "news.jsonl"
    news.write_text(json.dumps({"id": "src", "text": SOURCE}) + "\n", encoding="utf-8")
    qa = tmp_path / "qa.json"
    qa.write_text(json.dumps(PLANTED_QA), encoding="utf-8")
    print_report(prepare_crud(news, qa, tmp_path / "out"))
    out = capsys.readouterr().out
    assert "matched (>= 0.7, margin 0.1)" in out and "training pool" in out and "near-dups removed" in out
