"""LumberChunker (Duarte et al. 2024), the LLM-prompted chunking baseline: ``chunk --method lumber``.

The paper's loop (``joaodsmarques/LumberChunker``, ``Code/LumberChunker-Segmentation.py``): number
the document's units ``ID n: <text>``, show the teacher a window of consecutive units starting at
the current one and holding up to ``--lumber-tokens`` tokens (the paper's 550, counted there as
1.2 tokens per word), ask for the first unit where the content clearly shifts, cut before it and
start the next window at that unit. Here:

* **Units** are the document's paragraphs (text between blank lines) when it has at least two, else
  its sentences (`metachunk.chunking.sentences.split_sentences`). A paragraph over the token budget on
  its own is replaced by its sentences, so a window always has room for a choice. Units are groups
  of the tiled sentences, so every cut is a sentence boundary and the chunks tile the document:
  ``chunk.text == doc[chunk.start:chunk.end]``, whitespace included. In the prompt each unit is
  one line, its whitespace collapsed; IDs count units from 0 over the whole document.
* **Tokens** are estimated, not counted with a tokenizer (`lumber_token_estimate`): 1.2 per
  whitespace-separated word (the paper's rule) plus 1 per CJK character. A window holds at least two units, even when that
  passes the budget (a single unit over it, e.g. a very long Chinese sentence).
* **The answer** is read as the number after ``Answer:`` / ``答案：`` (with or without ``ID``), else
  after the first ``ID``, else a bare number. It must name a unit after the window's first and
  inside the window. Anything else (no ID, an ID at or before the first, an ID past the window,
  a failed request) is asked again ``--lumber-retries`` times (default 0) as a fresh request, then
  cut by the fallback: the whole window becomes a chunk (it ends at a unit boundary, so at a
  sentence end, and holds about the token budget) and the next window starts after it. Each
  fallback is counted by reason in the run's line of its run log (``OUTPUT.runs.jsonl``).
* **Structured answers.** With the teacher's ``structured_output`` other than ``none``, each
  window asks for ``{"id": n}`` (``chunking/prompts/lumber.schema.json``) with ``id`` narrowed to an
  enum of the window's later IDs (`window_schema`), so a server that decodes under the schema
  (llama.cpp, vLLM, OpenAI) can only name a usable cut. Each answer's outcome (valid, repaired: an
  ID read from text, unparseable) is counted in the run log, and its range is judged as above.
* **The teacher** is the block named ``--lumber-teacher`` (default ``lumber``) of a ``teachers:``
  mapping, written as in a distill recipe (`metachunk.teacher.TeacherConfig`: any
  OpenAI-compatible endpoint, or the local ``metachunk teacher serve`` with ``serve_preset``),
  either inline in the chunk recipe or read from ``--teacher-config`` (a distill recipe works; its
  other keys are ignored; inline blocks win). ``prices:`` gives the cost per model. Requests go
  through the teacher client with its retries, rate limits and budget (``--lumber-max-cost``), and
  every answer is kept in the answer store (``--lumber-cache``, default ``answers.sqlite`` next to
  the output), keyed by the request and the prompt file's sha256: a rerun sends nothing.
* **The prompt** is ``chunking/prompts/lumber.{en,zh}.txt`` (`metachunk.prompts`), the paper's
  instruction with the window after ``Document:``; its sha256 goes into the run's ``.meta.json``.

It runs behind [`metachunk.chunking.pipeline.Chunker`][metachunk.chunking.pipeline.Chunker] like every method, which splits the sentences
and builds the chunks from the boundaries found here. With ``--target-len`` (or
``--mean-chunk-chars``) the teacher's chunks are merged up to that length, as every method's
meta-chunks are (dynamic merging): the papers compare chunkers at one average length, and a small
teacher cuts too often. Documents are chunked concurrently (each
one's windows in order) by the teacher pool's workers (`metachunk.teacher.TeacherPool.map`);
the progress bar counts characters, with the request rate, answers from the store, fallbacks and
cost.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from metachunk.chunking.sentences import CJK_RE
from metachunk.chunking.types import Sentence

from metachunk import config, stopping
from metachunk.artifacts import InputError
from metachunk.config import option
from metachunk.prompts import Prompt, Schema, load_prompt_file, load_schema_file
from metachunk.store import AnswerStore
from metachunk.structured import OUTCOMES, read_answer
from metachunk.teacher import BudgetExceeded, Price, TeacherConfig, TeacherPool

PROMPT_NAME = "lumber"
STAGE = "lumber"  # the stage name inside this run's TeacherPool


@dataclass
class LumberOptions:
    """``lumber:`` (flat: ``teachers:``, ``prices:``, ``--teacher-config``, ``--lumber-*``):
    LumberChunker's teacher, window budget and answer store (`metachunk.chunking.lumber`)."""

    teachers: dict[str, dict] | None = option(
        None,
        "lumber: teacher blocks by name, as in a distill recipe (the fields of metachunk.teacher.TeacherConfig); "
        "the block named by --lumber-teacher finds the content shifts. Recipe only",
        flat="teachers",
    )
    prices: dict[str, dict] | None = option(
        None,
        "lumber: USD per 1M tokens by model name, {input, output}, as in a distill recipe. Recipe only",
        flat="prices",
    )
    teacher_config: Path | None = option(
        None,
        "lumber: take 'teachers:' and 'prices:' from this YAML too (e.g. a distill recipe; its other keys "
        "are ignored); blocks in this recipe win",
        flat="teacher_config",
    )
    teacher: str = option("lumber", "lumber: name of the teacher block that finds the content shifts")
    tokens: int = option(
        550,
        "lumber: token budget of one window of numbered paragraphs (or sentences) shown to the teacher; "
        "the paper's 550, estimated as 1.2 tokens per word and 1 per CJK character",
    )
    retries: int = option(
        0, "lumber: ask again this many times when an answer names no usable ID, then cut by fallback"
    )
    cache: Path | None = option(
        None,
        "lumber: answer store (SQLite, append-only; safe to share with distill runs), so a rerun pays "
        "nothing; default answers.sqlite next to the output",
    )
    max_cost: float | None = option(
        None, "lumber: stop before the total spend recorded in the answer store passes USD"
    )

    def check(self) -> None:
        """The options a ``--method lumber`` run can use, or a ValueError naming the flag: the one
        check, called by [`metachunk.chunking.pipeline.ChunkConfig`][metachunk.chunking.pipeline.ChunkConfig] for ``--method lumber`` and
        by `LumberChunker`, the teacher block too (`resolve_teacher`): before anything runs, so that
        `metachunk run` refuses a bad block (a base_url with a password in it) before it writes the
        stage's config into its state folder, and before the stages ahead of it run."""
        if self.tokens < 1:
            raise ValueError(f"--lumber-tokens must be >= 1, got {self.tokens}")
        if not (self.teachers or self.teacher_config):
            raise ValueError(
                "--method lumber needs a teacher: a 'teachers:' block in the recipe or --teacher-config YAML"
            )
        if self.retries < 0:
            raise ValueError(f"--lumber-retries must be >= 0, got {self.retries}")
        resolve_teacher(self)


def load_lumber_prompt(lang: str) -> Prompt:
    return load_prompt_file("metachunk.chunking", PROMPT_NAME, lang)


def load_lumber_schema() -> Schema:
    """``chunking/prompts/lumber.schema.json``: the answer as JSON, ``{"id": n}``."""
    return load_schema_file("metachunk.chunking", PROMPT_NAME)


def window_schema(first: int, last: int) -> Schema:
    """The schema a window of units ``first .. last`` is asked under: the file's, with ``id`` one
    of the IDs after the window's first, so that a server decoding under it can only name a usable
    cut. Its sha256 (part of the request's cache key) covers the file and the window's IDs."""
    base = load_lumber_schema()
    data = copy.deepcopy(base.data)
    data["properties"]["id"]["enum"] = list(range(first + 1, last + 1))
    digest = hashlib.sha256(f"{base.sha256}:{first + 1}-{last}".encode()).hexdigest()
    return Schema(base.name, data, digest)


# ---------------------------------------------------------------------------------- units & windows

_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def lumber_token_estimate(text: str) -> int:
    """LumberChunker's token count, which ``--lumber-tokens`` budgets: 1.2 tokens per
    whitespace-separated word (the paper's ``count_words``), plus 1 per CJK character (each counted
    apart from the words around it). Not the teacher client's `metachunk.teacher.estimate_tokens`
    (bytes / 3, for budget tables)."""
    cjk = len(CJK_RE.findall(text))
    return cjk + round(1.2 * len(CJK_RE.sub(" ", text).split()))


@dataclass(frozen=True, slots=True)
class Unit:
    """Sentences ``first .. stop-1`` of the document, i.e. characters ``start .. end``."""

    first: int
    stop: int
    start: int
    end: int


def _ends_paragraph(gap: str) -> bool:
    """Whether the whitespace after a sentence holds a blank line (two line breaks, or U+2029)."""
    if "\u2029" in gap:
        return True
    lines = gap.splitlines(keepends=True)
    return sum(1 for line in lines if line and line[-1] in _LINE_BREAKS) >= 2


def make_units(text: str, sentences: Sequence[Sentence], budget: int) -> tuple[list[Unit], str]:
    """``(units, kind)``: paragraphs (``kind`` "paragraph") when the text has two or more, a
    paragraph over ``budget`` tokens split into its sentences; else one unit per sentence."""

    def unit(a: int, b: int) -> Unit:
        return Unit(a, b, sentences[a].start, sentences[b - 1].end)

    paragraphs, begin = [], 0
    for i in range(1, len(sentences)):
        prev = text[sentences[i - 1].start : sentences[i - 1].end]
        if _ends_paragraph(prev[len(prev.rstrip()) :]):
            paragraphs.append((begin, i))
            begin = i
    if sentences:
        paragraphs.append((begin, len(sentences)))
    if len(paragraphs) < 2:
        return [unit(i, i + 1) for i in range(len(sentences))], "sentence"
    units = []
    for a, b in paragraphs:
        if b - a > 1 and lumber_token_estimate(text[sentences[a].start : sentences[b - 1].end]) > budget:
            units.extend(unit(i, i + 1) for i in range(a, b))
        else:
            units.append(unit(a, b))
    return units, "paragraph"


def unit_line(text: str, unit: Unit, number: int) -> str:
    return f"ID {number}: {' '.join(text[unit.start : unit.end].split())}"


def last_unit_in_window(costs: Sequence[int], first: int, budget: int) -> int:
    """Index of the window's last unit: as many units from ``first`` as fit in ``budget`` tokens
    (``costs``: each unit's), and at least two (when the document has them)."""
    last, total = first, costs[first]
    while last + 1 < len(costs) and total + costs[last + 1] <= budget:
        last += 1
        total += costs[last]
    return max(last, min(first + 1, len(costs) - 1))


_ANSWER_RE = re.compile(r"(?:answer|答案)\s*[:：]?\s*\**\s*(?:ID\b\s*[:：#]?\s*)?(\d+)", re.IGNORECASE)
_ID_RE = re.compile(r"\bID\s*[:：#]?\s*(\d+)", re.IGNORECASE)


def parse_answer(text: str) -> int | None:
    """The unit ID an answer names: after ``Answer:``/``答案：``, else after the first ``ID``, else a
    bare number; None when there is none."""
    match = _ANSWER_RE.search(text) or _ID_RE.search(text)
    if match:
        return int(match.group(1))
    stripped = text.strip().rstrip(".。")
    return int(stripped) if stripped.isdecimal() else None


def parse_structured_answer(text: str) -> int | None:
    """The unit ID of an answer asked for as JSON: ``{"id": n}``, else what `parse_answer`
    reads in the text (an endpoint that ignored the schema)."""
    try:
        data = json.loads(text)
    except ValueError:
        return parse_answer(text)
    if isinstance(data, dict) and type(data.get("id")) is int:
        return data["id"]
    return parse_answer(text)


def judge(found: int | None, first: int, last: int) -> str:
    """``ok`` for a usable cut, else the fallback reason."""
    if found is None:
        return "no_id"
    if found <= first:
        return "not_after_first"
    if found > last:
        return "out_of_window"
    return "ok"


# ---------------------------------------------------------------------------------------- teacher


@dataclass
class TeacherBlocks:
    """What lumber reads of a recipe: the ``teachers:`` and ``prices:`` mappings of a distill recipe."""

    teachers: dict[str, TeacherConfig] | None = option(None, "teacher blocks by name")
    prices: dict[str, Price] | None = option(None, "USD per 1M prompt/completion tokens, by model name")


def resolve_teacher(opts: LumberOptions) -> tuple[str, TeacherConfig, dict[str, Price]]:
    """``(where, teacher, prices)``: the block ``opts.teacher`` (``--lumber-teacher``) of
    ``--teacher-config`` and of the recipe's own ``teachers:`` (which win), checked with the one
    config loader."""
    teachers: dict[str, TeacherConfig] = {}
    prices: dict[str, Price] = {}
    sources = []
    if opts.teacher_config is not None:
        path = Path(opts.teacher_config)
        data = config.read_yaml_mapping(path, "teacher config")
        sources.append((path, {k: data[k] for k in ("teachers", "prices") if data.get(k) is not None}))
    inline = {k: v for k, v in (("teachers", opts.teachers), ("prices", opts.prices)) if v}
    if inline:
        sources.append(("chunk recipe", inline))
    for where, data in sources:
        loaded = config.fields_from_mapping(TeacherBlocks, data, where)
        teachers.update(loaded.get("teachers") or {})
        prices.update(loaded.get("prices") or {})
    where = " + ".join(str(w) for w, _ in sources) or "chunk recipe"
    if opts.teacher not in teachers:
        have = ", ".join(sorted(teachers)) or "none"
        raise InputError(
            where,
            f"no teacher block {opts.teacher!r} under 'teachers:' (have: {have}); "
            "add one or pick one with --lumber-teacher",
        )
    return where, teachers[opts.teacher], prices


# ---------------------------------------------------------------------------------------- chunker


class LumberChunker:
    """The teacher's cuts for [`metachunk.chunking.pipeline.Chunker`][metachunk.chunking.pipeline.Chunker] (``--method lumber``):
    ``opts`` is the run's ``lumber:`` block, ``output`` the run's output (the answer store defaults
    to ``answers.sqlite`` beside it), ``total_chars`` the size of the progress bar.

    One event loop (an `asyncio.Runner`), one teacher pool and one answer store serve every
    batch of the run; `close` releases them. `manifest` is the run's ``lumber`` block.
    """

    def __init__(
        self,
        opts: LumberOptions,
        *,
        output: Path | None = None,
        total_chars: int | None = None,
        progress: bool = True,
    ):
        from metachunk.progress import bar as progress_bar

        opts.check()
        self.opts = opts
        self.where, self.teacher_cfg, self.prices = resolve_teacher(opts)
        for lang in ("en", "zh"):  # a broken prompt file fails before anything is sent
            load_lumber_prompt(lang)
        if opts.cache is not None:
            self.store_path = Path(opts.cache)
        elif output is not None:
            self.store_path = Path(output).parent / "answers.sqlite"
        else:
            raise InputError("command line", "--method lumber needs --output or --lumber-cache")
        self.store = AnswerStore(self.store_path)
        self._runner: asyncio.Runner | None = asyncio.Runner()
        try:
            self.pool = TeacherPool({STAGE: self.teacher_cfg}, self.prices, self.store, opts.max_cost)
        except BaseException:
            self._runner.close()
            self.store.close()
            raise
        self.teacher = self.pool[STAGE]
        # With a structured_output other than none, each window asks for {"id": n} (window_schema);
        # an answer's outcome (valid by the file's schema, repaired, unparseable) is counted.
        self.structured = self.teacher_cfg.structured_output != "none"
        self.outcomes: Counter[str] = Counter()
        self.langs: set[str] = set()
        self.kinds: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.documents = self.units = self.windows = self.requests = self.retries = 0
        self.prompt_tokens = self.completion_tokens = 0
        self.cost = 0.0  # of every answer used, from the store or paid now
        self.seconds = 0.0
        self.bar = progress_bar(
            total=total_chars,
            unit="char",
            unit_scale=True,
            desc="chunk lumber",
            enabled=progress,
        )
        self._shown = 0.0
        self._started = time.perf_counter()

    @property
    def prompt_sha256(self) -> dict[str, str]:
        return {f"{PROMPT_NAME}.{lang}": load_lumber_prompt(lang).sha256 for lang in sorted(self.langs)}

    # -- running

    def chunk_documents(
        self, texts: Sequence[str], langs: Sequence[str], sentences: Sequence[Sequence[Sentence]]
    ) -> list[list[int]]:
        """Per document, the sentence indices where a chunk ends (the teacher's cuts)."""
        if self._runner is None:
            raise RuntimeError("LumberChunker is closed")
        started = time.perf_counter()
        try:
            done = stopping.run(
                self.pool.map(
                    list(zip(texts, langs, sentences)), self._chunk_one, progress=False, close=False
                ),
                self._runner,
            )
        except BudgetExceeded:
            raise InputError(
                self.store_path,
                f"stopped before the spend recorded here passes --lumber-max-cost {self.opts.max_cost} "
                f"(${self.pool.budget.spent:.4f} spent on this store, ${self.pool.budget.paid:.4f} by this run); "
                "every answer is stored: rerun with a higher limit",
            ) from None
        finally:
            self.seconds += time.perf_counter() - started
        if done.error is not None:  # nothing to chunk with: an error, as any other teacher error
            raise done.error
        return done.results

    async def _chunk_one(self, doc: tuple[str, str, Sequence[Sentence]]) -> list[int]:
        text, lang, sentences = doc
        prompt = load_lumber_prompt(lang)
        self.langs.add(lang)
        budget = self.opts.tokens
        units, kind = make_units(text, sentences, budget)
        lines = [unit_line(text, u, k) for k, u in enumerate(units)]
        costs = [lumber_token_estimate(line) for line in lines]
        starts, first, done = [], 0, 0  # units that start a chunk; current window start; chars done
        while len(units) - first > 1:
            last = last_unit_in_window(costs, first, budget)
            cut = await self._ask(prompt, lines, first, last)
            reached = units[cut].start if cut < len(units) else len(text)
            self._advance(reached - done)
            done = reached
            if cut >= len(units):
                break
            starts.append(cut)
            first = cut
        self._advance(len(text) - done)
        self.documents += 1
        self.units += len(units)
        if units:
            self.kinds[kind] += 1
        return [units[k].first - 1 for k in starts]  # sentence indices that end a chunk

    async def _ask(self, prompt: Prompt, lines: Sequence[str], first: int, last: int) -> int:
        """The unit the next chunk starts at: the teacher's answer, else the fallback ``last + 1``."""
        messages = prompt.messages(document="\n".join(lines[first : last + 1]))
        schema = window_schema(first, last) if self.structured else None
        self.windows += 1
        verdict = "no_id"
        for attempt in range(self.opts.retries + 1):
            answer = await self.teacher.complete(messages, prompt.sha256, attempt, schema=schema)
            self.requests += 1
            self.retries += attempt > 0
            self.prompt_tokens += answer.spent[0]
            self.completion_tokens += answer.spent[1]
            self.cost += answer.spent[2]
            if not answer.text and not answer.ok:  # transport error, or cut at max_tokens with no text
                verdict = f"teacher_{answer.reason or answer.status}"
                continue
            if schema is None:
                found = parse_answer(answer.text)
            else:  # the window's range is judged below; the outcome is the answer's shape
                found, outcome = read_answer(
                    answer.text, load_lumber_schema(), parse_structured_answer, repair=False
                )
                self.outcomes[outcome] += 1
            verdict = judge(found, first, last)
            if verdict == "ok":
                return found
        self.fallbacks[verdict] += 1
        return last + 1

    def _advance(self, chars: int, force: bool = False) -> None:
        if chars:
            self.bar.update(chars)
        now = time.perf_counter()
        if force or now - self._shown >= 0.5:
            self._shown = now
            self.bar.set_postfix_str(
                f"{self.pool.sent / max(now - self._started, 1e-9):.1f} req/s, {self.teacher.cached} cached, "
                f"{sum(self.fallbacks.values())} fallbacks, ${self.pool.budget.paid:.4f}",
                refresh=False,
            )

    def close(self) -> None:
        if self._runner is not None:
            self._advance(0, force=True)
            try:
                self._runner.run(self.pool.close())
            finally:
                self._runner.close()
                self._runner = None
                self.bar.close()
                self.store.close()

    # -- reporting

    def manifest(self) -> dict:
        teacher = {k: v for k, v in config.to_dict(self.teacher_cfg).items() if v is not None}
        structured = {}
        if self.structured:
            structured = {"schema_sha256": load_lumber_schema().sha256,
                          "answers": {k: self.outcomes[k] for k in OUTCOMES}}  # fmt: skip
        return {
            "method": "LumberChunker (Duarte et al. 2024)",
            "teacher_block": self.opts.teacher,
            "teacher_from": self.where,
            "teacher": teacher,
            "answer_store": str(self.store_path),
            "token_budget": self.opts.tokens,
            "structured_output": self.teacher_cfg.structured_output,
            **structured,
            "retries_allowed": self.opts.retries,
            "documents": self.documents,
            "documents_by_unit": dict(self.kinds),
            "units": self.units,
            "windows": self.windows,
            "requests": self.requests,
            "retries": self.retries,
            "requests_sent": self.pool.sent,
            "answers_from_store": self.teacher.cached,
            "fallbacks": {"total": sum(self.fallbacks.values()), **dict(sorted(self.fallbacks.items()))},
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost": round(self.cost, 6),
            "tokens_paid": self.teacher.tokens_used,
            "cost_paid": round(self.pool.budget.paid, 6),
            "seconds": round(self.seconds, 2),
        }

    def summary_line(self) -> str:
        m = self.manifest()
        return (
            f"  lumber ({self.teacher_cfg.model}): {m['windows']} windows, {m['requests_sent']} requests sent, "
            f"{m['answers_from_store']} answers from the store, {m['fallbacks']['total']} fallbacks, "
            f"{m['prompt_tokens'] + m['completion_tokens']:,} tokens, ${m['cost']:.4f} "
            f"(paid now: {m['tokens_paid']:,} tokens, ${m['cost_paid']:.4f})"
        )
