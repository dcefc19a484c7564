"""The corpora metachunk's recipes, tests and benches read, by name: ``data:NAME/FILE``.

A recipe, a flag, a test or a bench names a file as ``data:gutenqa-emma/paragraphs.jsonl``, and
`resolve` finds it, in this order:

1. ``$METACHUNK_DATA/NAME/FILE``: a folder of named datasets in their converted layout (an offline
   node's copy, a shared volume);
2. the cache, ``$METACHUNK_CACHE/data/NAME/FILE`` (default ``~/.cache/metachunk/data``), where
   ``metachunk data fetch NAME`` writes;
3. the copy shipped in the wheel, for a dataset whose licence allows it (``gutenqa-emma``).

Otherwise it raises one line that names the ``metachunk data fetch NAME`` to run.

``metachunk data fetch NAME`` downloads a dataset's public source files, converts them into the
layout above, checks the sha256 of every converted file against the sums shipped here, and only
then moves the dataset into the cache in one rename: a wrong sum leaves nothing behind, and a
second fetch finds the files and downloads nothing. ``metachunk data list`` says which datasets are
present, where, whether their sums match, and where they come from. Each dataset's card
(``data_cards/NAME.md``) gives its source, licence, conversion and sums.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from metachunk.artifacts import InputError, cache_dir, file_sha256, replace_dir
from metachunk.command import Result

PREFIX = "data:"
SHIPPED = Path(__file__).resolve().parent / "data"
ENV = "METACHUNK_DATA"


@dataclass(frozen=True)
class DataFile:
    name: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Dataset:
    """A named dataset: its converted files (with their sums), where it comes from, its licence,
    and how ``fetch`` builds it (``build(download, folder)``, None when it ships in the wheel)."""

    name: str
    files: tuple[DataFile, ...]
    source: str
    licence: str
    shipped: bool = False
    base_url: str = ""  # where build's relative source paths are downloaded from
    build: Callable[[Callable[[str], Path], Path], None] | None = None

    def file(self, name: str) -> DataFile | None:
        return next((f for f in self.files if f.name == name), None)


class MissingDataset(InputError):
    """A ``data:`` name whose dataset is in none of the places `resolve` looks."""

    def __init__(self, path, problem: str, dataset: str):
        super().__init__(path, problem)
        self.dataset = dataset

    def __reduce__(self):
        return type(self), (self.path, self.reason, self.dataset)


class FetchError(OSError):
    """A download that failed or did not convert to the shipped sums; nothing was installed (the
    CLI prints it as one line and exits 1, as for any other I/O error)."""


# ---- crud-news: 1,200 CRUD-RAG articles and the single-document QA, rebuilt from the repository ----

CRUD_RAG = "https://raw.githubusercontent.com/IAAR-Shanghai/CRUD_RAG/1aace383994e1f68efa12cf2a8e2dadfb4102ceb"
CRUD_SOURCES = SHIPPED / "crud-news.sources.txt"  # the hand-picked sample: one `FILE#LINE` per article
CRUD_QA = "src/quest_eval/QuestAnswer1Doc_quest_gt_save.json"


def crud_article(text: str, source: str) -> str:
    """One ``news.jsonl`` line: the corpus line as it is, with its id (the first 16 hex digits of
    the text's sha1) and its ``FILE#LINE`` source."""
    row = {"id": hashlib.sha1(text.encode("utf-8")).hexdigest()[:16], "source": source, "text": text}
    return json.dumps(row, ensure_ascii=False) + "\n"


def build_crud_news(download: Callable[[str], Path], folder: Path) -> None:
    sources = CRUD_SOURCES.read_text(encoding="utf-8").split()
    lines: dict[str, list[str]] = {}
    with open(folder / "news.jsonl", "w", encoding="utf-8", newline="") as out:
        for source in sources:
            path, _, number = source.partition("#L")
            if path not in lines:  # each corpus file holds one article per line, "\n"-separated
                lines[path] = download(path).read_text(encoding="utf-8").split("\n")
            out.write(crud_article(lines[path][int(number) - 1], source))
    # The QA file as CRUD-RAG's evaluator saved it, less each line's indentation (same JSON value).
    qa = download(CRUD_QA).read_text(encoding="utf-8")
    (folder / "questanswer_1doc.json").write_text(
        "\n".join(line.lstrip() for line in qa.splitlines()), encoding="utf-8", newline=""
    )


DATASETS = {
    d.name: d
    for d in (
        Dataset(
            "gutenqa-emma",
            (
                DataFile(
                    "paragraphs.jsonl",
                    "e9f1cb6130873a195d7e35c8709b3a0b0cfe1ed9d70241dc3282e337e2a8b9f1",
                    1074702,
                ),
                DataFile(
                    "questions.jsonl",
                    "a71969e0bfab95b74e29e09b8f18071d79574f7fea63717290c1234d57a862b2",
                    13707,
                ),
            ),
            source="Jane Austen's Emma (Project Gutenberg #158) in GutenQA's paragraph split, and GutenQA's "
            "30 questions for it (huggingface.co/datasets/LumberChunker/GutenQA)",
            licence="text: public domain; paragraph split and questions: GutenQA, MIT; ships in the wheel",
            shipped=True,
        ),
        Dataset(
            "crud-news",
            (
                DataFile(
                    "news.jsonl", "d7bdbdba6ec766fee291b0d23ec6219db504b3742201b76339a8b7620f52e337", 2477333
                ),
                DataFile(
                    "questanswer_1doc.json",
                    "84ba34f2a610f598f41fbcb94950c53a7f8a1f68ab953d697d6c4e4573523974",
                    388601,
                ),
            ),
            source="1,200 articles of CRUD-RAG's 80,000-document news corpus and its single-document QA "
            "(github.com/IAAR-Shanghai/CRUD_RAG at 1aace38)",
            licence="the repository's README shows an Apache-2.0 badge but it has no licence file, and "
            "the articles' copyright stays with their publishers: not redistributed, fetched",
            base_url=CRUD_RAG,
            build=build_crud_news,
        ),
    )
}


# ---- where a dataset lives --------------------------------------------------------------------------


def cache_root() -> Path:
    return cache_dir() / "data"


def roots(dataset: Dataset) -> list[tuple[str, Path]]:
    """Where `resolve` looks for ``dataset``, in order, as ``(label, folder)``."""
    out = []
    if os.environ.get(ENV):
        out.append((f"${ENV}", Path(os.environ[ENV]) / dataset.name))
    out.append(("cache", cache_root() / dataset.name))
    if dataset.shipped:
        out.append(("shipped", SHIPPED / dataset.name))
    return out


def dataset(name: str) -> Dataset:
    try:
        return DATASETS[name]
    except KeyError:
        raise InputError(f"{PREFIX}{name}", f"no such dataset; known: {', '.join(DATASETS)}") from None


def is_ref(value) -> bool:
    return isinstance(value, (str, Path)) and str(value).startswith(PREFIX)


def resolve(ref: str | Path) -> Path:
    """The file ``data:NAME/FILE`` names (see the module's docstring for the order); any other
    path is returned as it is."""
    if not is_ref(ref):
        return Path(ref)
    name, _, file = str(ref)[len(PREFIX) :].partition("/")
    found = dataset(name)
    if found.file(file) is None:
        raise InputError(ref, f"{name} has no file {file!r}; it has {', '.join(f.name for f in found.files)}")
    for _, folder in roots(found):
        if (folder / file).is_file():
            return folder / file
    where = f"${ENV}/{name} nor " if os.environ.get(ENV) else ""
    raise MissingDataset(ref, f"not in {where}{cache_root() / name}; run `metachunk data fetch {name}`", name)


def name_of(path: str | Path) -> str | None:
    """The ``data:NAME/FILE`` that ``path`` is where `resolve` looks, or None: fingerprints
    record the name, so moving a dataset (from ``$METACHUNK_DATA`` to the cache) reruns nothing."""
    path = Path(path)
    for d in DATASETS.values():
        if d.file(path.name) is not None and any(path == folder / path.name for _, folder in roots(d)):
            return f"{PREFIX}{d.name}/{path.name}"
    return None


def resolve_all(value):
    """``value`` with every ``data:`` string in it (in lists and mappings too) resolved; a config
    loader calls this on the values a run will read."""
    if is_ref(value):
        return resolve(value)
    if isinstance(value, list):
        return [resolve_all(v) for v in value]
    if isinstance(value, dict):
        return {k: resolve_all(v) for k, v in value.items()}
    return value


def mismatches(dataset: Dataset, folder: Path) -> list[str]:
    """The files of ``dataset`` in ``folder`` that are missing or whose sum is not the shipped one."""
    bad = []
    for f in dataset.files:
        path = folder / f.name
        if not path.is_file():
            bad.append(f"{f.name} (missing)")
        elif (got := file_sha256(path)) != f.sha256:
            bad.append(f"{f.name} (sha256 {got[:12]}..., expected {f.sha256[:12]}...)")
    return bad


def present(dataset: Dataset) -> tuple[str, Path] | None:
    """The first place that holds every file of ``dataset`` with its shipped sum, or None."""
    for label, folder in roots(dataset):
        if folder.is_dir() and not mismatches(dataset, folder):
            return label, folder
    return None


# ---- fetch ------------------------------------------------------------------------------------------


def _download(url: str, dest: Path) -> None:
    """``url`` into ``dest`` (a partial file is never left under that name), with a progress bar."""
    from metachunk.progress import bar as progress_bar

    part = dest.with_name(dest.name + ".part")
    request = urllib.request.Request(url, headers={"User-Agent": "metachunk"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response, open(part, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with progress_bar(
                total=total, unit="B", unit_scale=True, desc=Path(url).name, leave=False
            ) as bar:
                for block in iter(lambda: response.read(1 << 16), b""):
                    out.write(block)
                    bar.update(len(block))
    except OSError as e:  # URLError and HTTPError are OSErrors
        part.unlink(missing_ok=True)
        raise FetchError(f"{url}: {getattr(e, 'reason', None) or e}") from None
    os.replace(part, dest)


def fetch(name: str, base_url: str | None = None) -> tuple[str, Path]:
    """Make ``name`` present: ``(label, folder)`` where it already is, else download, convert,
    check every sum and move it into the cache in one rename. Raises `FetchError` (and
    leaves the cache as it was) when a download fails or a converted file has the wrong sum."""
    import filelock

    found = dataset(name)
    if (where := present(found)) is not None:
        return where
    if found.build is None:
        raise FetchError(f"{name} ships with metachunk, but its shipped copy is missing or changed")
    target = cache_root() / name
    target.parent.mkdir(parents=True, exist_ok=True)
    # One fetch at a time per dataset, across processes: a second waits, then finds it present.
    with filelock.FileLock(str(target.parent / f".{name}.lock")):
        if (where := present(found)) is not None:
            return where
        base = (base_url or found.base_url).rstrip("/")
        with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=target.parent) as staging:
            downloads, folder = Path(staging) / "sources", Path(staging) / name
            downloads.mkdir()
            folder.mkdir()

            def download(path: str) -> Path:
                dest = downloads / path.replace("/", "__")
                if not dest.exists():
                    _download(f"{base}/{urllib.parse.quote(path)}", dest)
                return dest

            try:
                found.build(download, folder)
            except FetchError as e:  # a machine without access to the source: say how else to get it
                raise FetchError(f"{e}; where the source cannot be reached, set {ENV} to a folder holding a "
                                 f"copy of {name}/, or --base-url to a mirror") from None  # fmt: skip
            bad = mismatches(found, folder)
            if bad:
                raise FetchError(f"{name}: converted files do not match the shipped sums: {', '.join(bad)}; "
                                 "nothing was installed")  # fmt: skip
            replace_dir(folder, target)  # an old, changed or partial copy is replaced whole
    return "cache", target


# ---- `metachunk data list | fetch` ------------------------------------------------------------------


@dataclass
class ListConfig:
    """``metachunk data list``: no settings."""


@dataclass
class FetchConfig:
    # Plain field metadata (metachunk.config's format): metachunk.config resolves names through this module.
    names: list[str] = field(default=None, metadata={"help": f"datasets to fetch ({', '.join(DATASETS)})",
                                                     "positional": True})  # fmt: skip
    base_url: str | None = field(default=None, metadata={
        "help": "download from this mirror of the dataset's source instead (the same relative paths)",
        "runtime": True})  # fmt: skip


def run_list(cfg: ListConfig) -> Result:
    for d in DATASETS.values():
        where = present(d)
        if where is not None:
            state = f"present ({where[0]}): {where[1]}"
        else:
            changed = [(label, folder) for label, folder in roots(d) if folder.is_dir()]
            state = (f"changed ({changed[0][0]}: {', '.join(mismatches(d, changed[0][1]))}): {changed[0][1]}"
                     if changed else f"absent: metachunk data fetch {d.name}")  # fmt: skip
        print(f"{d.name:<13} {state}\n{'':<13} source: {d.source}\n{'':<13} licence: {d.licence}")
    return Result()


def run_fetch(cfg: FetchConfig) -> Result:
    if not cfg.names:
        raise InputError("command line", f"name a dataset to fetch: {', '.join(DATASETS)}")
    fetched = 0
    for name in cfg.names:
        dataset(name)  # an unknown name is refused before anything is downloaded
    for name in cfg.names:
        before = present(DATASETS[name])
        label, folder = fetch(name, cfg.base_url)
        fetched += before is None
        print(f"{name}: {'fetched into' if before is None else 'present,'} {label}: {folder}")
    return Result(summary={"fetched": fetched})
