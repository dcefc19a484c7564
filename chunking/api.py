"""metachunk from Python: every chunker and both students in a few lines.

Each class is a thin front over the objects ``metachunk chunk`` runs
([`ChunkConfig`][metachunk.chunking.pipeline.ChunkConfig] and
[`Chunker`][metachunk.chunking.pipeline.Chunker], and for the students what ``--rewrite`` and
``--summarize`` load), so a chunker here and the CLI with the same settings cut the same text the
same way. Models load once, when the object is made: a preset name (``metachunk models list``), a
local folder or a Hub id (``ORG/NAME[@REV]``).

A chunker takes a text and returns its chunks; every chunk is a slice of the text, and the chunks
tile it:

```pycon
>>> from metachunk import SentenceChunker
>>> doc = "Emma was clever. She was rich. Her home was Hartfield. She had few troubles."
>>> chunker = SentenceChunker(target_len=40, len_unit="char", lang="en")
>>> [c.text for c in chunker(doc)]
['Emma was clever. She was rich. ', 'Her home was Hartfield. ', 'She had few troubles.']
>>> all(c.text == doc[c.start : c.end] for c in chunker(doc))
True
>>> "".join(c.text for c in chunker(doc)) == doc
True

```

As in the CLI, an empty text has no chunks and a whitespace-only text is one chunk of itself; a
lone surrogate (half a UTF-16 pair, not text) is a ``ValueError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

from metachunk.chunking.lumber import LumberOptions
from metachunk.chunking.moc import MocOptions
from metachunk.chunking.pipeline import ChunkConfig, ChunkedDocument, Chunker, StudentOptions
from metachunk.chunking.sentences import detect_lang
from metachunk.chunking.types import Chunk

__all__ = [
    "Chunk", "TextChunker", "PPLChunker", "MSPChunker", "MoCChunker", "LumberChunker", "FixedChunker",
    "SentenceChunker", "SemanticChunker", "Rewriter", "Summarizer",
]  # fmt: skip


def check_text(text: str, where: str = "text") -> str:
    """``text`` if it is a str that UTF-8 can hold, else a ``TypeError`` (not a str) or a ``ValueError``
    (a lone surrogate) that says why."""
    if not isinstance(text, str):
        raise TypeError(f"{where} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where} holds a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start} "
            "(half a UTF-16 pair, not text)"
        ) from None
    return text


@contextlib.contextmanager
def as_arguments(names: Mapping[str, str] | None = None):
    """A plain ``ValueError`` from `ChunkConfig`'s checks, which name the CLI's flags and YAML fields,
    raised again in this API's argument names: ``--target-len`` is ``target_len``, and ``names`` maps a
    config field to the argument that sets it where the two differ (a student's ``context_chars``).
    Its subclasses (``ModelNotFoundError``, ``InputError``) say what they mean and pass unchanged."""
    try:
        yield
    except ValueError as e:
        if type(e) is not ValueError:
            raise
        message = re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m[1].replace("-", "_"), str(e))
        for field, argument in (names or {}).items():
            message = re.sub(rf"\b{field}\b", argument, message)
        raise ValueError(message) from None


class TextChunker:
    """What every chunker does: ``chunker(text) -> list[Chunk]`` and ``chunker.chunk_batch(texts)``.
    ``target_len`` is a target, not a ceiling: every chunker but
    [`FixedChunker`][metachunk.chunking.api.FixedChunker] cuts between
    sentences, so one sentence longer than it is a chunk of its own.

    ``settings`` are [`ChunkConfig`][metachunk.chunking.pipeline.ChunkConfig]'s fields (the ``metachunk
    chunk`` flags without their dashes: ``target_len``, ``len_unit``, ``lang``, ``dtype``,
    ``device``, ``batch_size``, ...), checked as the CLI checks them.
    """

    method: ClassVar[str]
    # A config field's name -> the argument that sets it here, where the two differ (`as_arguments`)
    argument_names: ClassVar[dict[str, str]] = {}

    def __init__(self, **settings):
        if settings.get("device") is not None and not isinstance(settings["device"], str):
            settings["device"] = str(settings["device"])  # a torch.device
        corpus_wide = [k for k in CORPUS_SETTINGS if settings.get(k) is not None]
        if corpus_wide:  # fitted over a whole corpus by `metachunk chunk`; here it would do nothing
            raise ValueError(
                f"{corpus_wide[0]} fits target_len to a whole corpus, which `metachunk chunk` reads; a chunker "
                "takes target_len (the fitted one is in that run's manifest)"
            )
        with as_arguments(self.argument_names):
            self.config = ChunkConfig(method=self.method, **settings)
        self._chunker = Chunker(self.config, progress=False)

    def __reduce__(self):
        """Pickled (multiprocessing, Ray, LlamaIndex's workers) and deep-copied as its config: the copy
        loads its own model, where the original's threads and loader cannot be pickled."""
        return _rebuilt, (type(self), self.config)

    def __call__(self, text: str) -> list[Chunk]:
        """The chunks of ``text``, in order, each ``text[chunk.start:chunk.end]``."""
        if not isinstance(text, str):
            raise TypeError(
                f"text must be a str, got {type(text).__name__} (chunk_batch takes several texts)"
            )
        return self.chunk_batch([text])[0]

    def chunk_batch(self, texts: Iterable[str]) -> list[list[Chunk]]:
        """The chunks of each text, in order; texts are scored together in groups of
        [`ChunkConfig.documents_per_call`][metachunk.chunking.pipeline.ChunkConfig.documents_per_call], as the CLI does."""
        if isinstance(texts, str):  # iterable, but as one-character texts
            raise TypeError("texts must be an iterable of str, not a str (chunker(text) chunks one text)")
        texts = [check_text(t, f"texts[{i}]") for i, t in enumerate(texts)]
        group = self.config.documents_per_call()
        out: list[list[Chunk]] = []
        for k in range(0, len(texts), group):
            part = texts[k : k + group]
            out += [d.chunks for d in self._chunker.chunk([str(k + i) for i in range(len(part))], part)]
        return out

    def close(self) -> None:
        """Releases what outlives a call (LumberChunker: its teacher pool and answer store)."""
        self._chunker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        """``target_len`` and the settings that differ from the defaults (a block's, such as MoC's router
        and experts or LumberChunker's teacher, against its default block)."""

        def default(f: dataclasses.Field):
            return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

        changed = [f"{f.name}={getattr(self.config, f.name)!r}" for f in dataclasses.fields(self.config)
                   if f.name not in ("method", "target_len") and getattr(self.config, f.name) != default(f)]  # fmt: skip
        return f"{type(self).__name__}({', '.join([f'target_len={self.config.target_len!r}', *changed])})"


# ChunkConfig's fields a corpus run fits over all its documents (`chunking/pipeline.fit_target_len`).
CORPUS_SETTINGS = ("mean_chunk_chars", "mean_chunk_chars_of")


def _rebuilt(cls: type[TextChunker], config: ChunkConfig) -> TextChunker:
    """A chunker of class ``cls`` with ``config`` (`TextChunker.__reduce__`)."""
    chunker = cls.__new__(cls)
    chunker.config = config
    chunker._chunker = Chunker(config, progress=False)
    return chunker


def split_options(options: Mapping, block: type) -> tuple[dict, dict]:
    """``(block's fields, ChunkConfig's)`` of a chunker's keyword arguments: MoC's and LumberChunker's own
    settings (``max_new_tokens``, ``tokens``) beside the ones every chunker takes (``len_unit``,
    ``batch_size``)."""
    own = {f.name for f in dataclasses.fields(block)}
    return {k: v for k, v in options.items() if k in own}, {k: v for k, v in options.items() if k not in own}


class PPLChunker(TextChunker):
    """Meta-Chunking's perplexity chunking: a boundary where a sentence's PPL drops by ``threshold``
    (or, with ``target_len``, at the local minima, then merged up to ``target_len``).

    ```pycon
    >>> chunker = PPLChunker(model, target_len=120, len_unit="char", lang="en")  # model: preset, dir or Hub id
    >>> doc = "Emma was clever. She was rich. Her home was Hartfield. She had few troubles."
    >>> chunks = chunker(doc)
    >>> "".join(c.text for c in chunks) == doc and all(c.text == doc[c.start : c.end] for c in chunks)
    True

    ```
    """

    method = "ppl"

    def __init__(self, model: str = "smollm2", *, target_len: int | None = None, threshold: float | None = None,
                 lang: str = "auto", dtype: str = "auto", device: str | None = None, **settings):  # fmt: skip
        super().__init__(model=model, target_len=target_len, threshold=threshold, lang=lang, dtype=dtype,
                         device=device, **settings)  # fmt: skip


class MSPChunker(TextChunker):
    """Meta-Chunking's margin sampling: the model is asked whether two sentences belong together.

    ```pycon
    >>> chunker = MSPChunker(model, target_len=40, len_unit="char", lang="en")  # model: preset, dir or Hub id
    >>> doc = "Emma was clever. She was rich. Her home was Hartfield. She had few troubles."
    >>> chunks = chunker(doc)
    >>> "".join(c.text for c in chunks) == doc and all(c.text == doc[c.start : c.end] for c in chunks)
    True

    ```
    """

    method = "msp"

    def __init__(self, model: str = "smollm2", *, target_len: int | None = None, threshold: float | None = None,
                 lang: str = "auto", dtype: str = "auto", device: str | None = None, **settings):  # fmt: skip
        super().__init__(model=model, target_len=target_len, threshold=threshold, lang=lang, dtype=dtype,
                         device=device, **settings)  # fmt: skip


class FixedChunker(TextChunker):
    """Fixed-length chunks of ``target_len`` characters (or words, ``len_unit="word"``).

    ```pycon
    >>> [c.text for c in FixedChunker(24, len_unit="char")("Emma was clever. She was rich. Her home was Hartfield.")]
    ['Emma was clever. She was', ' rich. Her home was Hart', 'field.']

    ```
    """

    method = "fixed"

    def __init__(self, target_len: int, *, len_unit: str | None = None, lang: str = "auto", **settings):
        super().__init__(target_len=target_len, len_unit=len_unit, lang=lang, **settings)


class SentenceChunker(TextChunker):
    """Whole sentences, merged up to ``target_len``.

    ```pycon
    >>> chunker = SentenceChunker(40, len_unit="char", lang="en")
    >>> [c.text for c in chunker("Emma was clever. She was rich. Her home was Hartfield.")]
    ['Emma was clever. She was rich. ', 'Her home was Hartfield.']

    ```
    """

    method = "sentence"

    def __init__(self, target_len: int, *, len_unit: str | None = None, lang: str = "auto", **settings):
        super().__init__(target_len=target_len, len_unit=len_unit, lang=lang, **settings)


class SemanticChunker(TextChunker):
    """A boundary where consecutive sentences' embeddings are furthest apart (percentile
    ``threshold``, default 95), then merged up to ``target_len``.

    ```pycon
    >>> chunker = SemanticChunker("minilm", target_len=40, len_unit="char", lang="en")  # an embedder preset or dir
    >>> doc = "Emma was clever. She was rich. Her home was Hartfield. She had few troubles."
    >>> "".join(c.text for c in chunker(doc)) == doc
    True

    ```
    """

    method = "semantic"

    def __init__(self, embedder: str = "minilm", *, target_len: int | None = None, threshold: float | None = None,
                 lang: str = "auto", device: str | None = None, **settings):  # fmt: skip
        super().__init__(embedder=embedder, target_len=target_len, threshold=threshold, lang=lang, device=device,
                         **settings)  # fmt: skip


class MoCChunker(TextChunker):
    """Mixture of Chunkers: the router picks a granularity per window, its expert writes the chunks
    (``experts``: four models, labels 0-3; the same one may repeat). ``options``:
    [`MocOptions`][metachunk.chunking.moc.MocOptions] fields (``anchored=True``, ``max_new_tokens``, ...),
    and the settings every chunker takes (``len_unit``, ``batch_size``).

    ```pycon
    >>> chunker = MoCChunker(router=model, experts=[model] * 4, target_len=40, lang="en")  # trained students
    >>> doc = "Emma was clever. She was rich. Her home was Hartfield. She had few troubles."
    >>> "".join(c.text for c in chunker(doc)) == doc  # what an expert wrote, aligned back to the text
    True

    ```
    """

    method = "moc"
    # MoC's own options are arguments without the CLI's prefix: `placeholder`, not `moc_placeholder`
    argument_names = {f"moc_{f.name}": f.name for f in dataclasses.fields(MocOptions)}

    def __init__(self, router: str, experts: Sequence[str] | str, *, lang: str = "auto", target_len: int | None = None,
                 dtype: str = "auto", device: str | None = None, **options):  # fmt: skip
        experts = experts if isinstance(experts, str) else ",".join(experts)
        options, settings = split_options(options, MocOptions)
        super().__init__(moc=MocOptions(router=router, experts=experts, **options), lang=lang,
                         target_len=target_len, dtype=dtype, device=device, **settings)  # fmt: skip


class LumberChunker(TextChunker):
    """LumberChunker (Duarte et al. 2024): a teacher LLM reads numbered paragraphs and names where
    the content shifts. ``teacher``: a teacher block (a mapping of
    [`TeacherConfig`][metachunk.teacher.TeacherConfig] fields), a ``TeacherConfig``, or a
    [`Teacher`][metachunk.teacher.Teacher] (its config, and its answer store unless ``cache`` is given);
    ``options``: [`LumberOptions`][metachunk.chunking.lumber.LumberOptions] fields (``tokens``, ``cache``,
    ``max_cost``). Every answer is kept in the answer store (default: one under metachunk's cache
    folder), so a text chunked again costs nothing.

    ```pycon
    >>> teacher = {"model": teacher_model, "base_url": teacher_url}  # the key comes from the environment
    >>> chunker = LumberChunker(teacher, lang="en", cache=answers)  # answers: an answer store's path
    >>> doc = "Emma was clever.\\n\\nShe was rich.\\n\\nHer home was Hartfield.\\n\\nShe had few troubles."
    >>> "".join(c.text for c in chunker(doc)) == doc
    True
    >>> chunker.close()

    ```
    """

    method = "lumber"

    def __init__(self, teacher, *, lang: str = "auto", prices: Mapping | None = None, **options):
        from metachunk import config

        if hasattr(teacher, "cfg") and hasattr(teacher, "store"):  # a Teacher: its config and its store
            if options.get("cache") is None:
                options["cache"] = teacher.store.path
            teacher = teacher.cfg
        block = teacher if isinstance(teacher, Mapping) else config.to_dict(teacher)
        block = {k: v for k, v in block.items() if v is not None}
        if options.get("cache") is None:  # shared and append-only: every answer is paid once, in any process
            from metachunk.artifacts import cache_dir

            options["cache"] = cache_dir() / "lumber" / "answers.sqlite"
        options, settings = split_options(options, LumberOptions)
        super().__init__(lumber=LumberOptions(teachers={"lumber": dict(block)}, prices=dict(prices or {}) or None,
                                              **options), lang=lang, **settings)  # fmt: skip


class TrainedStudent:
    """A trained student applied to chunks with their context, as ``chunk --rewrite/--summarize``:
    what [`Rewriter`][metachunk.chunking.api.Rewriter] and
    [`Summarizer`][metachunk.chunking.api.Summarizer] share.

    ``model``: a preset, a local folder (``metachunk export``'s) or a Hub id. Give the student the
    context it learnt from, as its distill run did (the fields of
    [`StudentOptions`][metachunk.chunking.pipeline.StudentOptions]): ``context`` ``"document"`` (the
    text around the chunk, up to ``context_chars`` characters) or ``"related"`` (the ``top_k`` most
    similar chunks of the document, by ``embedder``). ``max_new_tokens``: most new tokens per chunk
    (default: the rewriter 1.5 x the chunk's tokens + 32, at most 1024; the summarizer 256). ``sample``: sample instead of greedy decoding. ``batch_size``:
    chunks generated together."""

    task: ClassVar[str]
    field: ClassVar[str]

    def __init__(self, model: str, *, context: str = "document", context_chars: int = 8000, top_k: int = 4,
                 max_new_tokens: int | None = None, sample: bool = False, embedder: str = "minilm",
                 dtype: str = "auto", device: str | None = None, batch_size: int = 8):  # fmt: skip
        from metachunk.chunking.students import ChunkStudents

        name = "rewrite" if self.task == "rewrite" else "summarize"
        tokens = {"rewrite_max_new_tokens": max_new_tokens} if self.task == "rewrite" else (
            {"summary_max_new_tokens": max_new_tokens} if max_new_tokens is not None else {})  # fmt: skip
        with as_arguments({"student_context_chars": "context_chars", "student_context": "context",
                           "student_top_k": "top_k", "rewrite_max_new_tokens": "max_new_tokens",
                           "summary_max_new_tokens": "max_new_tokens"}):  # fmt: skip
            students = StudentOptions(**{name: model}, context=context, context_chars=context_chars, top_k=top_k,
                                      sample=sample, **tokens)  # fmt: skip
            self.config = ChunkConfig(method="fixed", target_len=1, students=students, embedder=embedder,
                                      dtype=dtype, device=device, batch_size=batch_size)  # fmt: skip
        self._students = ChunkStudents.from_config(self.config, progress=False)

    @classmethod
    def from_pretrained(cls, name_or_path: str, **settings):
        """The student at a preset, a local folder (``metachunk export``'s) or a Hub id."""
        return cls(name_or_path, **settings)

    def __call__(self, text: str, chunks: Sequence[Chunk], lang: str = "auto") -> list[str]:
        """One output per chunk of ``text`` (its chunks, from any chunker), each written with the
        chunk's context in ``text``; a blank chunk gets ``""``."""
        text = check_text(text)
        chunks = list(chunks)  # a generator read once, by the check below, had left no chunk to write
        for c in chunks:
            if text[c.start : c.end] != c.text:
                raise ValueError(f"chunk [{c.start}, {c.end}) is not text[{c.start}:{c.end}]")
        doc = ChunkedDocument("0", text, detect_lang(text) if lang == "auto" else lang, list(chunks))
        return [fields[self.field] for fields in self._students.apply([doc])[0]]

    def close(self) -> None:
        """Closes what the student's run holds open (its progress bar); the model is freed with the
        object."""
        self._students.close()


class Rewriter(TrainedStudent):
    """Each chunk rewritten to stand on its own (the student of ``distill rewrite``).

    ```pycon
    >>> doc = "Emma was clever. She was rich. Her home was Hartfield."
    >>> chunks = SentenceChunker(40, len_unit="char", lang="en")(doc)
    >>> rewriter = Rewriter.from_pretrained(model, max_new_tokens=16)  # `metachunk export`'s folder
    >>> len(rewriter(doc, chunks)) == len(chunks)  # one rewritten text per chunk
    True

    ```
    """

    task, field = "rewrite", "rewritten"


class Summarizer(TrainedStudent):
    """One sentence on each chunk from the document's perspective (the student of ``distill summary``).

    ```pycon
    >>> doc = "Emma was clever. She was rich. Her home was Hartfield."
    >>> chunks = SentenceChunker(40, len_unit="char", lang="en")(doc)
    >>> len(Summarizer.from_pretrained(model, max_new_tokens=16)(doc, chunks)) == len(chunks)
    True

    ```
    """

    task, field = "summary", "summary"
