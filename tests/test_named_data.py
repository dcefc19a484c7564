"""Named datasets (``data:NAME/FILE``): the resolver's order, ``metachunk data list | fetch``, and a
fetch against a loopback HTTP server that serves CRUD-RAG's files as the repository lays them out.

Upstream cannot be reached here, so the served files are derived from our copy of the converted
dataset: each corpus file holds the articles of the sample at their recorded lines (and filler
lines between them, as the real files hold other articles), and the QA file is the JSON indented
as CRUD-RAG's evaluator saves it. The fetch must rebuild our copy byte for byte, which the shipped
sums check.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading
from pathlib import Path

import pytest
from support.data import data_file

from metachunk import named_data
from metachunk.artifacts import InputError
from metachunk.cli import main


@pytest.fixture
def no_data(monkeypatch, tmp_path):
    """No $METACHUNK_DATA and an empty cache: only what ships in the package."""
    monkeypatch.delenv(named_data.ENV, raising=False)
    monkeypatch.setenv("METACHUNK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "data"


def crud_sources(news: Path, qa: Path, root: Path) -> None:
    """CRUD-RAG's layout under ``root``, derived from the converted files."""
    files: dict[str, dict[int, str]] = {}
    for line in news.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        path, _, number = row["source"].partition("#L")
        files.setdefault(path, {})[int(number)] = row["text"]
    for path, lines in files.items():
        text = "\n".join(lines.get(n, f"filler article {n}") for n in range(1, max(lines) + 2))
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text, encoding="utf-8")
    upstream = root / named_data.CRUD_QA
    upstream.parent.mkdir(parents=True, exist_ok=True)
    upstream.write_text(
        json.dumps(json.loads(qa.read_text(encoding="utf-8")), ensure_ascii=False, indent=4), encoding="utf-8"
    )


class Server:
    """A loopback HTTP server over a folder, counting the GETs it answered."""

    def __init__(self, root: Path):
        self.gets: list[str] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):
                server.gets.append(self.path)
                super().do_GET()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Handler, directory=str(root))
        )
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    news, qa = data_file("crud-news/news.jsonl"), data_file("crud-news/questanswer_1doc.json")
    root = tmp_path_factory.mktemp("crud_rag")
    crud_sources(news, qa, root)
    server = Server(root)
    yield server, root, news, qa
    server.close()


# ---- the resolver -----------------------------------------------------------------------------------


def test_emma_ships_in_the_package_and_is_found_with_no_data_at_all(no_data):
    path = named_data.resolve("data:gutenqa-emma/paragraphs.jsonl")
    assert path == named_data.SHIPPED / "gutenqa-emma" / "paragraphs.jsonl"
    assert named_data.present(named_data.DATASETS["gutenqa-emma"])[0] == "shipped"  # sums match


def test_metachunk_data_comes_first_then_the_cache(no_data, monkeypatch, tmp_path):
    for root in (tmp_path / "mine", no_data):
        (root / "gutenqa-emma").mkdir(parents=True)
        (root / "gutenqa-emma" / "questions.jsonl").write_text("{}\n", encoding="utf-8")
    assert (
        named_data.resolve("data:gutenqa-emma/questions.jsonl")
        == no_data / "gutenqa-emma" / "questions.jsonl"
    )
    monkeypatch.setenv(named_data.ENV, str(tmp_path / "mine"))
    assert (
        named_data.resolve("data:gutenqa-emma/questions.jsonl")
        == tmp_path / "mine" / "gutenqa-emma" / "questions.jsonl"
    )
    assert named_data.resolve("plain/path.jsonl") == Path("plain/path.jsonl")


def test_an_absent_dataset_is_one_line_naming_the_fetch_command(no_data):
    with pytest.raises(InputError) as e:
        named_data.resolve("data:crud-news/news.jsonl")
    message = str(e.value)
    assert "\n" not in message and "metachunk data fetch crud-news" in message
    with pytest.raises(InputError, match="no such dataset; known: gutenqa-emma, crud-news"):
        named_data.resolve("data:nope/x.jsonl")
    with pytest.raises(InputError, match="has no file 'x.jsonl'"):
        named_data.resolve("data:crud-news/x.jsonl")


def test_a_command_reads_a_name_and_fails_in_one_line_without_the_data(no_data, tmp_path, capsys):
    out = tmp_path / "ch.jsonl"
    argv = ["data", "passages", "--input", "data:gutenqa-emma/paragraphs.jsonl", "--out", str(out),
            "--group-field", "chapter", "--groups", "0:1"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["id"] == "VOLUME I. CHAPTER I"
    capsys.readouterr()
    argv[3] = "data:crud-news/news.jsonl"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "field 'input'" in err and "metachunk data fetch crud-news" in err


def test_data_list_says_what_is_where(no_data, capsys):
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "gutenqa-emma  present (shipped)" in out
    assert "crud-news     absent: metachunk data fetch crud-news" in out
    assert "licence: text: public domain" in out and "not redistributed" in out


# ---- the fetch --------------------------------------------------------------------------------------


def test_fetch_rebuilds_our_copy_and_a_second_fetch_downloads_nothing(no_data, upstream, capsys):
    server, _, news, qa = upstream
    server.gets.clear()
    assert main(["data", "fetch", "crud-news", "--base-url", server.url]) == 0
    assert "crud-news: fetched into cache" in capsys.readouterr().out
    fetched = no_data / "crud-news"
    assert (fetched / "news.jsonl").read_bytes() == news.read_bytes()
    assert (fetched / "questanswer_1doc.json").read_bytes() == qa.read_bytes()
    sources = set(named_data.CRUD_SOURCES.read_text(encoding="utf-8").split())
    assert len(server.gets) == len({s.partition("#L")[0] for s in sources}) + 1  # each file once, and the QA
    assert named_data.resolve("data:crud-news/news.jsonl") == fetched / "news.jsonl"

    server.gets.clear()
    assert main(["data", "fetch", "crud-news", "--base-url", server.url]) == 0
    assert server.gets == [] and "crud-news: present, cache" in capsys.readouterr().out
    assert sorted(p.name for p in no_data.iterdir()) == [".crud-news.lock", "crud-news"]  # no staging left


def test_a_wrong_sum_is_refused_and_nothing_is_written(no_data, upstream, tmp_path, capsys):
    server, root, news, qa = upstream
    changed = tmp_path / "changed"
    crud_sources(news, qa, changed)
    first = changed / "data" / "80000_docs" / "documents_dup_part_1_part_1"
    lines = first.read_text(encoding="utf-8").split("\n")
    lines[17] = lines[17].replace("抖音", "快手", 1)  # line 18: the sample's first article
    first.write_text("\n".join(lines), encoding="utf-8")
    bad = Server(changed)
    try:
        assert main(["data", "fetch", "crud-news", "--base-url", bad.url]) == 1
    finally:
        bad.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "news.jsonl (sha256" in err and "nothing was installed" in err
    assert sorted(p.name for p in no_data.iterdir()) == [".crud-news.lock"]  # no dataset, no staging

    # A good copy already there is never replaced by a bad download.
    assert main(["data", "fetch", "crud-news", "--base-url", server.url]) == 0
    good = (no_data / "crud-news" / "news.jsonl").read_bytes()
    (no_data / "crud-news" / "questanswer_1doc.json").write_text("{}", encoding="utf-8")  # changed by hand
    bad = Server(changed)
    try:
        assert main(["data", "fetch", "crud-news", "--base-url", bad.url]) == 1
    finally:
        bad.close()
    assert (no_data / "crud-news" / "news.jsonl").read_bytes() == good
    capsys.readouterr()
    assert main(["data", "list"]) == 0
    assert "crud-news     changed (cache: questanswer_1doc.json (sha256" in capsys.readouterr().out


def test_an_unreachable_source_is_one_line_and_writes_nothing(no_data, capsys):
    assert main(["data", "fetch", "crud-news", "--base-url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "http://127.0.0.1:9/data/80000_docs/" in err
    assert "set METACHUNK_DATA to a folder holding a copy of crud-news/, or --base-url to a mirror" in err
    assert sorted(p.name for p in no_data.iterdir()) == [".crud-news.lock"]


def test_the_shipped_sample_is_the_one_our_copy_holds():
    """The (file, line) list that the fetch rebuilds is our 1,200 articles, in order."""
    rows = [
        json.loads(line)
        for line in data_file("crud-news/news.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert named_data.CRUD_SOURCES.read_text(encoding="utf-8").split() == [r["source"] for r in rows]
    assert len(rows) == 1200
    assert all(
        named_data.crud_article(r["text"], r["source"]) == json.dumps(r, ensure_ascii=False) + "\n"
        for r in rows
    )


# ---- without CRUD: the fetch's guarantees on a toy dataset, and fingerprints by name -------------------


def toy_dataset(text: str) -> named_data.Dataset:
    """A dataset of one file, ``toy.txt``, converted from the source ``src/toy.txt`` by upper-casing it."""

    def build(download, folder):
        (folder / "toy.txt").write_text(download("src/toy.txt").read_text(encoding="utf-8").upper())

    data = text.upper().encode()
    checked = named_data.DataFile("toy.txt", hashlib.sha256(data).hexdigest(), len(data))
    return named_data.Dataset("toy", (checked,), source="a test", licence="none", build=build)


def test_a_fetch_is_checked_whole_and_atomic_without_any_real_data(no_data, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(named_data.DATASETS, "toy", toy_dataset("hello"))
    (tmp_path / "up" / "src").mkdir(parents=True)
    (tmp_path / "up" / "src" / "toy.txt").write_text("hellO", encoding="utf-8")  # converts to the right sum
    server = Server(tmp_path / "up")
    try:
        assert main(["data", "fetch", "toy", "--base-url", server.url]) == 0
        assert (no_data / "toy" / "toy.txt").read_text() == "HELLO" and server.gets == ["/src/toy.txt"]
        assert main(["data", "fetch", "toy", "--base-url", server.url]) == 0
        assert server.gets == ["/src/toy.txt"]  # present: nothing downloaded
        (no_data / "toy" / "toy.txt").write_text("changed")
        (tmp_path / "up" / "src" / "toy.txt").write_text("bye", encoding="utf-8")  # a different source
        capsys.readouterr()
        assert main(["data", "fetch", "toy", "--base-url", server.url]) == 1
    finally:
        server.close()
    assert "toy.txt (sha256" in capsys.readouterr().err
    assert (no_data / "toy" / "toy.txt").read_text() == "changed"  # the old copy stays as it was
    assert sorted(p.name for p in no_data.iterdir()) == [".toy.lock", "toy"]  # and no staging is left


def test_a_stage_stays_cached_when_its_dataset_moves(no_data, monkeypatch, tmp_path, capsys):
    """Fingerprints name the dataset's file, not the folder it was found in."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"state: {tmp_path / 'state'}\nstages:\n  - name: ch1\n    run: data passages\n"
        f"    config: {{input: 'data:gutenqa-emma/paragraphs.jsonl', out: {tmp_path / 'ch1.jsonl'}, "
        "group_field: chapter, groups: '0:1'}\n",
        encoding="utf-8",
    )
    assert main(["run", str(recipe)]) == 0  # the shipped copy
    copy = tmp_path / "mine" / "gutenqa-emma"
    copy.mkdir(parents=True)
    for f in ("paragraphs.jsonl", "questions.jsonl"):
        (copy / f).write_bytes((named_data.SHIPPED / "gutenqa-emma" / f).read_bytes())
    monkeypatch.setenv(named_data.ENV, str(tmp_path / "mine"))
    assert named_data.resolve("data:gutenqa-emma/paragraphs.jsonl").parent == copy
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 0
    assert "ch1 (data passages): cached, skipped" in capsys.readouterr().err
