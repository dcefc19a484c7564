"""Trained students applied to chunks: ``metachunk chunk --rewrite MODEL --summarize MODEL``.

A *rewriter* rewrites a chunk so that it stands on its own; a *summarizer* writes one sentence that
states the chunk's content from the whole document's perspective (Meta-Chunking §3.2). Both are
small causal LMs fine-tuned on the rows of ``metachunk data build-sft``, and a student only does
its job on the prompt it was trained on. This module is the one home of that prompt; the training
rows and the chunker build it with the same functions:

* the instruction: ``chunking/prompts/student_{task}.{lang}.txt`` (its sha256 is its version,
  recorded on every SFT row, and in the ``.meta.json`` (``prompt_sha256``) and the run log of every
  chunk run that uses it);
* the context, as spans of the document (what distill records store as ``context_spans``): the
  document around the chunk (`window_span`: all of it when it fits in ``max_context_chars``,
  else a window centred on the chunk), or the chunk's ``top_k`` most similar chunks of the same
  document (`related_chunks`), turned into text by `context_from_spans`;
* `student_messages`: the [system, user] chat messages from the two.

``distill`` builds its contexts with these functions and ``build-sft`` its prompts with
`student_messages`; the chunker calls the same ones with the same settings (the defaults
are distill's), so the prompt at inference is the training prompt, byte for byte.

Generation (`Student`, with `metachunk.engine.generation.generate_batched`): the model's
chat template with the generation prompt, prompts of similar length batched and padded on the
left, the model's own ``generation_config`` with ``do_sample=False`` on top (greedy,
reproducible) unless sampling is asked for; only the new tokens are decoded. Weights load from
safetensors only.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from metachunk.chunking.ppl import CPU_ROWS

from metachunk.engine.generation import chat_prompt_ids, generate_batched, prepare_tokenizer, stop_token_ids
from metachunk.prompts import Prompt, load_prompt_file

FIELDS = {"rewrite": "rewritten", "summary": "summary"}  # task -> the field it adds to each chunk
CONTEXT_MODES = ("document", "related")
CONTEXT_SEPARATOR = "\n…\n"  # between the related chunks of a context
DEFAULT_CONTEXT_CHARS = 8000  # distill's and build-sft's default max_context_chars
DEFAULT_TOP_K = 4  # distill's default context_top_k
SUMMARY_MAX_NEW_TOKENS = 256
# Prompts a student generates for at once on a GPU when not told (8 on CPU): decoding reads the
# weights once per step for every row, so a GPU needs many rows to be busy; 64 rewrites of a
# 3,000-token prompt plus 1,024 new tokens hold ~10 GB of KV cache for a Qwen2.5-3B.
GPU_STUDENT_ROWS = 64
REWRITE_MAX_NEW_TOKENS = 1024  # the cap of the default rewrite budget
REWRITE_BUDGET = "1.5 x chunk tokens + 32, at most 1024"

# ------------------------------------------------------------------------------------- prompts


def load_student_prompt(task: str, lang: str) -> Prompt:
    if task not in FIELDS:
        raise ValueError(f"unknown student task {task!r}; have {', '.join(FIELDS)}")
    return load_prompt_file("metachunk.chunking", f"student_{task}", lang)


# ------------------------------------------------------------------------------------- context


def window_span(length: int, start: int, end: int, limit: int) -> tuple[int, int]:
    """``(left, right)``: the whole text if it fits, else ``limit`` characters centred on the span."""
    if length <= limit:
        return 0, length
    left = max(0, min(start - (limit - (end - start)) // 2, length - limit))
    return left, left + limit


def context_from_spans(text: str, spans, limit: int) -> str:
    """The context text of ``spans`` of the document (joined, cut to ``limit`` characters)."""
    return CONTEXT_SEPARATOR.join(text[a:b] for a, b in spans)[:limit]


def related_chunks(vectors, index: int, top_k: int) -> list[int]:
    """Indices of the ``top_k`` chunks most similar to chunk ``index`` (not itself), in document
    order. ``vectors``: unit-normalised embeddings of the document's chunks (numpy, one row each)."""
    similarity = vectors @ vectors[index]
    similarity[index] = -2.0
    return sorted(int(i) for i in similarity.argsort()[::-1][:top_k] if similarity[i] > -2.0)


def student_messages(
    task: str, lang: str, text: str, chunk: str, spans, max_context_chars: int
) -> list[dict]:
    """The student's prompt for one chunk of ``text``: [system, user] messages.

    ``spans`` is where the context comes from (a distill record's ``context_spans``); None means
    the whole document, as for records written before context spans existed. An empty list is no
    context: a one-chunk document's in ``related`` mode, as its teacher saw it (it had been given the
    whole document in the SFT rows and at inference).
    """
    context = context_from_spans(text, [(0, len(text))] if spans is None else spans, max_context_chars)
    return load_student_prompt(task, lang).messages(context=context, chunk=chunk)


@dataclass(frozen=True)
class ContextSpec:
    """How the students' context is chosen; must match the distill run the students learnt from."""

    mode: str = "document"
    max_chars: int = DEFAULT_CONTEXT_CHARS
    top_k: int = DEFAULT_TOP_K

    def __post_init__(self):
        if self.mode not in CONTEXT_MODES:
            raise ValueError(f"student context must be one of {', '.join(CONTEXT_MODES)}, got {self.mode!r}")


def chunk_context_spans(
    text: str,
    chunks: Sequence[tuple[int, int]],
    spec: ContextSpec,
    embed: Callable[[list[str]], object] | None = None,
) -> list[tuple[tuple[int, int], ...]]:
    """The context spans of every chunk ``(start, end)`` of ``text`` (``embed`` for ``related``:
    texts -> unit-normalised vectors)."""
    if spec.mode == "document":
        return [(window_span(len(text), s, e, spec.max_chars),) for s, e in chunks]
    if not chunks:
        return []
    vectors = embed([text[s:e] for s, e in chunks])
    return [
        tuple((chunks[j][0], chunks[j][1]) for j in related_chunks(vectors, i, spec.top_k))
        for i in range(len(chunks))
    ]


def chunk_prompts(
    task: str,
    lang: str,
    text: str,
    chunks: Sequence[tuple[int, int]],
    spec: ContextSpec,
    embed: Callable[[list[str]], object] | None = None,
    spans: Sequence | None = None,
) -> list[list[dict]]:
    """The prompt of every chunk ``(start, end)`` of ``text``, exactly as the chunker sends it
    (``spans``: the chunks' context spans when already known, else found here)."""
    if spans is None:
        spans = chunk_context_spans(text, chunks, spec, embed)
    return [
        student_messages(task, lang, text, text[s:e], sp, spec.max_chars) for (s, e), sp in zip(chunks, spans)
    ]


# ------------------------------------------------------------------------------------- loading


def student_dir(name_or_dir: str) -> Path:
    """A student's model folder: a preset or a local HF dir holding safetensors weights.

    Raises `ModelNotFoundError` (a clear one-line error) otherwise.
    """
    from metachunk.models import ModelNotFoundError, resolve

    path = resolve(name_or_dir)
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{name_or_dir!r} holds no *.safetensors weights; students load from safetensors only "
            "(`metachunk export` writes them)"
        )
    return path


def decoding_config(generation_config, sample: bool = False):
    """A copy of the model's ``generation_config``; greedy (``do_sample=False``, sampling knobs
    cleared) unless ``sample``."""
    config = copy.deepcopy(generation_config)
    if not sample:
        config.do_sample = False
        for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
            if hasattr(config, name):
                setattr(config, name, None)
    return config


class Student:
    """One trained student (rewriter or summarizer), loaded once, applied to batches of prompts."""

    def __init__(
        self,
        task: str,
        model: str,
        *,
        device: str | None = None,
        dtype: str = "auto",
        batch_size: int | None = None,
        max_new_tokens: int | None = None,
        sample: bool = False,
    ):
        from metachunk.models import ModelNotFoundError, load_causal_lm

        if task not in FIELDS:
            raise ValueError(f"unknown student task {task!r}; have {', '.join(FIELDS)}")
        self.task, self.name, self.batch_size, self.sample = task, model, batch_size, sample
        self.path = student_dir(model)
        started = time.perf_counter()
        self.model, self.tokenizer = load_causal_lm(
            str(self.path), device=device, dtype=dtype, use_safetensors=True
        )
        self.load_seconds = time.perf_counter() - started
        if self.batch_size is None:  # the device's default
            self.batch_size = GPU_STUDENT_ROWS if self.model.device.type == "cuda" else CPU_ROWS
        tok = self.tokenizer
        if not tok.chat_template:
            raise ModelNotFoundError(
                f"{model!r} has no chat template; a student is trained on chat messages "
                "(`metachunk export` keeps the template)"
            )
        prepare_tokenizer(tok)
        self.generation = decoding_config(self.model.generation_config, sample)
        if self.generation.pad_token_id is None:
            self.generation.pad_token_id = tok.pad_token_id
        self.stop_ids = stop_token_ids(self.generation, tok)
        self.fixed_max_new_tokens = max_new_tokens or (SUMMARY_MAX_NEW_TOKENS if task == "summary" else None)
        self.new_tokens = self.prompts_done = self.cut_at_budget = 0
        self.seconds = 0.0

    def max_new_tokens(self, chunk: str) -> int:
        """The generation budget of one chunk: fixed, or for a rewrite 1.5x the chunk's tokens + 32
        (the rewrite keeps the chunk and weaves in context), at most 1024."""
        if self.fixed_max_new_tokens:
            return self.fixed_max_new_tokens
        n = len(self.tokenizer(chunk, add_special_tokens=False)["input_ids"])
        return min(REWRITE_MAX_NEW_TOKENS, math.ceil(1.5 * n) + 32)

    def encode(self, messages: list[dict]) -> list[int]:
        """Token ids of the prompt as the student saw it in training: chat template + generation prompt."""
        return chat_prompt_ids(self.tokenizer, messages)

    def generate(
        self,
        prompts: Sequence[list[dict]],
        budgets: Sequence[int],
        on_batch: Callable[[int], object] | None = None,
    ) -> list[str]:
        """One answer per prompt (new text only, stripped), in the order given
        (`metachunk.engine.generation.generate_batched`: a batch generates up to its largest budget
        and each answer is cut to its own budget, so an answer does not depend on its batch
        neighbours)."""
        started = time.perf_counter()
        ids = [self.encode(p) for p in prompts]
        out = generate_batched(self.model, self.tokenizer, ids, self.generation, self.batch_size,
                               stop_ids=self.stop_ids, budgets=budgets, on_batch=on_batch)  # fmt: skip
        self.new_tokens += sum(g.new_tokens for g in out)
        self.prompts_done += len(out)
        self.cut_at_budget += sum(1 for g in out if not g.stopped and g.text)  # ended by max_new_tokens
        self.seconds += time.perf_counter() - started
        # an answer cut inside a character decodes to U+FFFD at its end: not text the student wrote (an
        # answer of nothing else is kept as it is: the run log counts it among those cut at the budget)
        return [g.text if g.stopped else g.text.rstrip("\ufffd").rstrip() or g.text for g in out]

    def generation_settings(self) -> dict:
        settings = {k: v for k, v in self.generation.to_diff_dict().items() if k != "transformers_version"}
        settings["do_sample"] = bool(self.generation.do_sample)
        settings["num_beams"] = self.generation.num_beams or 1
        settings["max_new_tokens"] = self.fixed_max_new_tokens or REWRITE_BUDGET
        settings["forced_greedy"] = not self.sample
        return settings


# ------------------------------------------------------------------------------------ chunk run


class ChunkStudents:
    """The students of one chunk run: loaded once, applied to each batch of chunked documents.

    ``models`` maps a task (``rewrite``, ``summary``) to a preset or model dir. Every model dir is
    checked before any model loads.
    """

    def __init__(
        self,
        models: dict[str, str],
        *,
        context: ContextSpec | None = None,
        embedder: str = "minilm",
        device: str | None = None,
        dtype: str = "auto",
        batch_size: int | None = None,
        max_new_tokens: dict[str, int | None] | None = None,
        sample: bool = False,
        expected_docs: int | None = None,
        progress: bool = True,
    ):
        from metachunk.progress import bar as progress_bar

        self.context = context or ContextSpec()
        self.embedder_name = embedder
        for model in models.values():
            student_dir(model)
        max_new_tokens = max_new_tokens or {}
        self.students = {
            task: Student(task, model, device=device, dtype=dtype, batch_size=batch_size,
                          max_new_tokens=max_new_tokens.get(task), sample=sample)
            for task, model in models.items()
        }  # fmt: skip
        self._embed = None
        if self.context.mode == "related":
            from metachunk.models import load_sentence_embedder

            embedder_model = load_sentence_embedder(embedder, device=device)
            self._embed = lambda texts: embedder_model.encode(
                texts, normalize_embeddings=True, convert_to_numpy=True
            )
        self.expected_docs = expected_docs
        self.docs_seen = self.chunks_seen = 0
        self.prompt_sha256: dict[str, str] = {}
        self.bar = progress_bar(
            total=None,
            unit="chunk",
            desc=" + ".join(self.students),
            enabled=progress,
        )

    @classmethod
    def from_config(
        cls, cfg, expected_docs: int | None = None, progress: bool = True
    ) -> ChunkStudents | None:
        """The students a [`ChunkConfig`][metachunk.chunking.pipeline.ChunkConfig] asks for (its ``students:``
        block), or None."""
        st = cfg.students
        models = {
            task: model for task, model in (("rewrite", st.rewrite), ("summary", st.summarize)) if model
        }
        if not models:
            return None
        return cls(
            models,
            context=ContextSpec(st.context, st.context_chars, st.top_k),
            embedder=cfg.embedder,
            device=cfg.device,
            dtype=cfg.dtype,
            batch_size=cfg.batch_size,  # default: the device's (Student)
            max_new_tokens={"rewrite": st.rewrite_max_new_tokens, "summary": st.summary_max_new_tokens},
            sample=st.sample,
            expected_docs=expected_docs,
            progress=progress,
        )

    def apply(self, docs: Sequence) -> list[list[dict]]:
        """Per document (``ChunkedDocument``), per chunk: ``{"rewritten": ..., "summary": ...}``
        (the fields asked for)."""
        chunks = [c for d in docs for c in d.chunks]
        self.docs_seen += len(docs)
        self.chunks_seen += len(chunks)
        estimate = self.chunks_seen
        if self.expected_docs and self.docs_seen:  # chunks per document so far x documents in all
            estimate = max(estimate, round(self.chunks_seen / self.docs_seen * self.expected_docs))
        self.bar.total = estimate * len(self.students)  # shown at the bar's next timed redraw
        fields = [{} for _ in chunks]
        if not chunks:
            return [[] for _ in docs]
        geometry = [[(c.start, c.end) for c in d.chunks] for d in docs]
        spans = [chunk_context_spans(d.text, g, self.context, self._embed) for d, g in zip(docs, geometry)]
        # A whitespace-only chunk (a blank document's) has nothing to rewrite or summarise: its
        # field is "" and no model is asked, rather than letting a model invent text for it.
        blank = [not c.text.strip() for c in chunks]
        for task, student in self.students.items():
            prompts = []
            for d, g, s in zip(docs, geometry, spans):
                prompts += chunk_prompts(task, d.lang, d.text, g, self.context, spans=s)
                if g:
                    prompt = load_student_prompt(task, d.lang)
                    self.prompt_sha256[f"{prompt.name}.{prompt.lang}"] = prompt.sha256
            asked = [i for i, b in enumerate(blank) if not b]
            budgets = [student.max_new_tokens(chunks[i].text) for i in asked]
            answers = student.generate([prompts[i] for i in asked], budgets, self.bar.update)
            self.bar.update(len(chunks) - len(asked))
            for extra in fields:
                extra[FIELDS[task]] = ""
            for i, answer in zip(asked, answers):
                fields[i][FIELDS[task]] = answer
        out, k = [], 0
        for d in docs:
            out.append(fields[k : k + len(d.chunks)])
            k += len(d.chunks)
        return out

    def close(self) -> None:
        self.bar.close()

    def manifest(self) -> dict:
        """What the run's line in its run log records: which students, from where, decoded how."""
        context = {"mode": self.context.mode, "max_chars": self.context.max_chars}
        if self.context.mode == "related":
            context.update(top_k=self.context.top_k, embedder=self.embedder_name)
        out = {}
        for task, s in self.students.items():
            out[task] = {
                "model": s.name,
                "path": str(Path(s.path).resolve()),
                "field": FIELDS[task],
                "prompt_sha256": {
                    k: v for k, v in self.prompt_sha256.items() if k.startswith(f"student_{task}.")
                },
                "context": context,
                "generation": s.generation_settings(),
                "batch_size": s.batch_size,
                "device": str(s.model.device),
                "dtype": str(s.model.dtype).removeprefix("torch."),
                "chunks": s.prompts_done,
                "new_tokens": s.new_tokens,
                "cut_at_budget": s.cut_at_budget,  # answers max_new_tokens ended, not the model
                "seconds": round(s.seconds, 2),
                "load_seconds": round(s.load_seconds, 2),
            }
        return out
