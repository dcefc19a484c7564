"""The teacher Batch API: the requests a round could not answer, sent as batch files at the
provider's discount, polled, and stored in the same answer store as online answers.

A teacher with ``mode: batch`` does not send a request it has no stored answer for: it puts the
request in its spool (`metachunk.teacher.Teacher.spool`) and the item stays pending. After
the round, `submit` writes the spooled requests as OpenAI Batch JSONL lines
(``custom_id`` = the request's cache key, ``method``, ``url`` = the teacher's ``batch_endpoint``,
``body``), at most
``batch_max_requests`` lines and ``batch_max_bytes`` per file, uploads each with the openai client
(``files.create(purpose="batch")``, ``batches.create``) and `wait` polls every live batch
with backoff, downloads its output and error files, and stores every answer. The next round finds
those answers and asks the next stage: chained stages (reflection -> refinement -> completion)
take one round each.

**Nothing is paid twice, across kills.** Before a file is uploaded its requests are claimed in the
store by the batch itself (not by this process), with their discounted worst-case cost reserved
against ``--max-cost``, and the batch's own row records each step: claimed, uploaded (the file id),
submitted (the batch id). A rerun polls the live batches it finds there and never resubmits their
requests; a batch killed between upload and ``batches.create`` is found again by its file id
(``batches.list``); one killed before its upload is dropped, its claims released.

Expired and failed lines are counted; the next round sends them again in a new batch, or online
with ``retry_mode: online``, up to ``max_retries`` times. ``--export-batch`` / ``--import-batch``
(distill) write the same lines for ``vllm run-batch`` and read its results back.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from metachunk.redaction import redact, safe_url
from metachunk.store import AnswerStore, StoredAnswer
from metachunk.teacher import (
    EndpointUnreachable,
    FatalTeacherError,
    Teacher,
    TeacherConfig,
    api_key,
    endpoint_name,
    provider_message,
    read_usage,
    retry_delay,
)

HOLD_SLACK_SECONDS = 3600.0  # claims outlive the completion window by this much
TERMINAL = ("completed", "failed", "expired", "cancelled")


def window_seconds(window: str) -> float:
    """``"24h"`` -> 86400.0 (the Batch API's ``completion_window``)."""
    unit = {"h": 3600, "m": 60, "d": 86400}.get(window[-1:], None)
    if unit is None or not window[:-1].isdigit():
        raise ValueError(f"completion_window must look like '24h', got {window!r}")
    return int(window[:-1]) * unit


def batch_line(key: str, payload: dict, url: str) -> str:
    """One request of a batch file; ``url`` is the teacher's ``batch_endpoint`` (its provider's:
    OpenAI's /v1/chat/completions, Qianfan's /v2/chat/completions)."""
    line = {"custom_id": key, "method": "POST", "url": url, "body": payload}
    return json.dumps(line, ensure_ascii=False) + "\n"


@dataclass
class BatchCounts:
    rounds: int = 0
    batches: int = 0
    requests: int = 0
    answered: int = 0
    failed: int = 0
    expired: int = 0
    refused_by_budget: int = 0
    cost: float = 0.0  # billed for this run's batch answers (at the discount)
    online_sent: int = 0  # requests sent online in the rounds (retry_mode: online)
    online_paid: float = 0.0
    seconds_waiting: float = 0.0
    by_batch: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _client(cfg: TeacherConfig):
    import openai

    return openai.OpenAI(base_url=cfg.endpoint_urls()[0], api_key=api_key(cfg), max_retries=cfg.max_retries,
                         timeout=cfg.timeout)  # fmt: skip


@contextlib.contextmanager
def provider_errors(cfg: TeacherConfig):
    """A Batch API call the provider refused, or could not be reached for, after the client's own retries:
    the run stops with one line (exit 2, or 4 for a connection that failed), the provider's words redacted
    (a gateway may quote the request's path). The store keeps what each batch had reached: a later run
    drops a batch whose upload never happened and takes over one uploaded but not created."""
    import openai

    try:
        yield
    except openai.APIStatusError as e:
        raise FatalTeacherError(redact(f"teacher {cfg.model!r} at {safe_url(cfg.endpoint_urls()[0])}: Batch API: "
                                       f"HTTP {e.status_code}: {redact(provider_message(e))[:500]}")) from None  # fmt: skip
    except openai.APIConnectionError as e:
        raise EndpointUnreachable(redact(f"teacher {cfg.model!r} at {safe_url(cfg.endpoint_urls()[0])}: Batch "
                                         f"API: {e}; the batches in the store are picked up by a rerun")) from None  # fmt: skip


def create_once(
    client, cfg: TeacherConfig, file_id: str, batch: str, since: float, made_before: bool = False
):
    """``batches.create`` for one uploaded file, run once at the provider whatever fails on the way.
    openai's client sends no idempotency key and retries a create whose answer was lost (a 502, a
    connection reset): the provider would run, and bill, a second batch of the same requests. So each
    try here is sent once, and after a failed one the provider's list says whether it was made. A try
    that timed out may be made after the list was read: once a later try is made, any other batch of
    the file is looked for again, and all but the first are cancelled (while they validate, unbilled).
    ``made_before``: a killed run may have made one that the provider's list did not show yet, so the
    list is read again after this create too."""
    import openai

    once = client.with_options(max_retries=0)
    attempt = 0
    while True:
        try:
            made = once.batches.create(input_file_id=file_id, endpoint=cfg.batch_endpoint,
                                       completion_window=cfg.completion_window,
                                       metadata={"metachunk_batch": batch})  # fmt: skip
            break
        except (openai.APIConnectionError, openai.APIStatusError) as e:
            status = getattr(e, "status_code", None)  # None: the connection failed or timed out
            if attempt == cfg.max_retries or not (
                status is None or status in (408, 409, 429) or status >= 500
            ):
                raise
        time.sleep(retry_delay(attempt))
        attempt += 1
        if found := batches_of_file(client, file_id, since):
            return keep_first(client, found)
    if attempt == 0 and not made_before:
        return made
    every = {b.id: b for b in [made, *batches_of_file(client, file_id, since)]}
    return keep_first(client, list(every.values()))


def batches_of_file(client, file_id: str, since: float) -> list:
    """The provider's batches made from ``file_id``. Providers list newest first (e.g.
    https://docs.perplexity.ai/api-reference/batches-list-get): such a list is read back to ten
    minutes before ``since`` (when the file was uploaded), not through the account's history; one in
    another order is read whole."""
    found, newest_first, last = [], True, math.inf
    for batch in client.batches.list(limit=100):
        if batch.input_file_id == file_id:
            found.append(batch)
        newest_first, last = newest_first and batch.created_at <= last, batch.created_at
        if newest_first and batch.created_at < since - 600:
            break
    return found


ENDED_WITHOUT_ANSWERS = ("failed", "expired", "cancelled", "cancelling")


def first_made(batches: list):
    """The batch made first, of those running or completed if any is (one cancelled before, say by a
    run that kept another, is not taken back)."""
    alive = [b for b in batches if b.status not in ENDED_WITHOUT_ANSWERS] or batches
    return min(alive, key=lambda b: (b.created_at, b.id))


def keep_first(client, batches: list):
    """The batch kept of a file made into more than one (`first_made`); the others still running are
    cancelled, while they validate unbilled (one already in progress is billed for what it did)."""
    first = first_made(batches)
    for extra in batches:
        if extra.id != first.id and extra.status not in (*TERMINAL, "cancelling"):
            client.batches.cancel(extra.id)
    return first


def spooled(teachers: dict[str, Teacher]) -> dict[str, tuple[Teacher, dict[str, tuple[dict, float]]]]:
    """The round's spooled requests by endpoint: stages on one endpoint share its batches."""
    out: dict[str, tuple[Teacher, dict]] = {}
    for teacher in teachers.values():
        if teacher.cfg.mode == "batch" and teacher.spool:
            name = endpoint_name(teacher.cfg)
            out.setdefault(name, (teacher, {}))[1].update(teacher.spool)
    return out


def awaited(teachers: dict[str, Teacher]) -> int:
    """How many of the round's requests wait on a live batch (this run's or another's)."""
    return sum(len(t.in_live_batch) for t in teachers.values() if t.cfg.mode == "batch")


def submit(store: AnswerStore, teachers: dict[str, Teacher], limit: float | None, counts: BatchCounts
           ) -> tuple[int, int]:  # fmt: skip
    """Claim, upload and create batches for every spooled request: ``(submitted, refused by the
    budget)``. A request another run on the store is sending (online or in its batch) is neither."""
    submitted = refused = 0
    for name, (teacher, entries) in spooled(teachers).items():
        cfg = teacher.cfg
        client = _client(cfg)
        hold = window_seconds(cfg.completion_window) + HOLD_SLACK_SECONDS
        files, current, size = [], [], 0
        for key, (payload, reserve) in entries.items():
            line = batch_line(key, payload, cfg.batch_endpoint)
            n = len(line.encode("utf-8"))
            if current and (len(current) >= cfg.batch_max_requests or size + n > cfg.batch_max_bytes):
                files.append(current)
                current, size = [], 0
            current.append((key, line, reserve))
            size += n
        if current:
            files.append(current)
        with provider_errors(cfg):
            for lines in files:
                batch, claimed, over = store.claim_batch(name, [(k, r) for k, _, r in lines], limit, hold)
                counts.refused_by_budget += over
                refused += over
                if not claimed:
                    continue
                keep = set(claimed)
                body = "".join(line for k, line, _ in lines if k in keep).encode("utf-8")
                uploaded = client.files.create(file=(f"metachunk-{batch}.jsonl", body), purpose="batch")
                store.update_batch(batch, input_file_id=uploaded.id, status="uploaded")
                created = create_once(client, cfg, uploaded.id, batch, since=time.time())
                store.update_batch(batch, batch_id=created.id, status="submitted")
                counts.batches += 1
                counts.requests += len(claimed)
                submitted += len(claimed)
                print(f"batch: {created.id} submitted to {name}: {len(claimed)} requests ({len(body):,} bytes)",
                      file=sys.stderr, flush=True)  # fmt: skip
    return submitted, refused


def wait(
    store: AnswerStore, teachers: dict[str, Teacher], counts: BatchCounts, progress: bool = True
) -> None:
    """Poll every live batch in the store until it is done, and store its results."""
    by_endpoint = {endpoint_name(t.cfg): t for t in teachers.values()}
    started = time.perf_counter()
    delays: dict[str, float] = {}
    clients: dict[str, object] = {}  # one openai client per endpoint for the whole wait
    while live := store.live_batches():
        next_poll = None
        for row in live:
            teacher = by_endpoint.get(row["endpoint"])
            if teacher is None:  # another recipe's batch on this store: not ours to collect
                continue
            cfg = teacher.cfg
            with provider_errors(cfg):  # the provider's refusal or absence: one line, not a traceback
                client = clients.get(row["endpoint"]) or clients.setdefault(row["endpoint"], _client(cfg))
                # uploaded, and its run killed before batches.create: a run that takes it over creates it
                recovering = row["batch_id"] is None and row["status"] == "uploaded"
                if row["being_submitted"] or (recovering and not store.take_batch(row["id"])):
                    # another live run is uploading it, creating the batch, or recovering it: not yet ours
                    delay = cfg.batch_poll_seconds
                    next_poll = delay if next_poll is None else min(next_poll, delay)
                    continue
                if row["status"] == "claimed":  # killed before the upload: nothing was sent
                    store.drop_batch(row["id"])
                    continue
                if recovering:
                    existing = batches_of_file(client, row["input_file_id"], since=row["created"])
                    # the killed run's creates may have made one the list does not show yet, or more than one
                    found = (
                        keep_first(client, existing)
                        if existing
                        else create_once(
                            client, cfg, row["input_file_id"], row["id"], row["created"], made_before=True
                        )
                    )
                    store.update_batch(row["id"], batch_id=found.id, status="submitted")
                    row["batch_id"] = found.id
                batch = client.batches.retrieve(row["batch_id"])
                if batch.status in TERMINAL:
                    collect(store, teacher, row, batch, client, counts)
                    continue
                delay = delays.get(row["id"], cfg.batch_poll_seconds)
                delays[row["id"]] = min(600.0, delay * 1.5)
                next_poll = delay if next_poll is None else min(next_poll, delay)
                if progress:
                    rc = batch.request_counts
                    print(f"batch: {batch.id} {batch.status}" + (f" ({rc.completed + rc.failed}/{rc.total})" if rc else "")
                          + f"; next poll in {delay:.1f}s", file=sys.stderr, flush=True)  # fmt: skip
        if next_poll is None:
            if all(by_endpoint.get(r["endpoint"]) is None for r in store.live_batches()):
                break
            continue
        time.sleep(next_poll)
    counts.seconds_waiting += time.perf_counter() - started


def collect(store: AnswerStore, teacher: Teacher, row: dict, batch, client, counts: BatchCounts) -> None:
    """Store a finished batch's output and error lines; what is in neither expired (or failed with it)."""
    cfg, price = teacher.cfg, teacher.price
    answers, states = [], {}
    reserved = {key: store.batch_item(key)[2] for key in row["keys"]}
    for file_id, ok in ((batch.output_file_id, True), (batch.error_file_id, False)):
        if not file_id:
            continue
        for line in client.files.content(file_id).text.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key = item.get("custom_id")
            if key not in reserved:
                continue
            response = item.get("response") or {}
            status_code = response.get("status_code", 0)
            body = response.get("body")
            if ok and status_code == 200 and isinstance(body, dict):
                raw = redact(json.dumps(body, ensure_ascii=False), headers=False)
                prompt_tokens, completion_tokens, _, well_formed = read_usage(raw)
                if well_formed:
                    estimated = prompt_tokens is None
                    if estimated:  # never free: the reservation was the worst case
                        cost, prompt_tokens, completion_tokens = reserved[key], 0, 0
                    else:
                        cost = price.cost(prompt_tokens, completion_tokens) * price.batch_discount
                    answers.append(StoredAnswer(key, cfg.model, "ok", "", raw, prompt_tokens, completion_tokens, cost,
                                                usage_estimated=estimated))  # fmt: skip
                    states[key] = "answered"
                    continue
            # A 200 whose body is no chat completion was generated, and billed: its worst case, as online.
            billed = reserved[key] if ok and status_code == 200 else 0.0
            message = redact(json.dumps(item.get("error") or body or {}, ensure_ascii=False))
            answers.append(StoredAnswer(key, cfg.model, "error", f"batch_http_{status_code}",
                                        message[:500], 0, 0, billed))  # fmt: skip
            states[key] = "failed"
    for key in reserved:  # no line: expired with the batch (or the whole batch failed)
        states.setdefault(key, "failed" if batch.status == "failed" else "expired")
    tally = {s: sum(1 for v in states.values() if v == s) for s in ("answered", "failed", "expired")}
    if not store.finish_batch(row["id"], answers, states, {"status": batch.status, **tally}):
        return  # another run on this store collected it: its answers are stored once, and counted there
    counts.cost += sum(a.cost for a in answers)
    counts.answered += tally["answered"]
    counts.failed += tally["failed"]
    counts.expired += tally["expired"]
    counts.by_batch.append({"batch": batch.id, "status": batch.status, **tally})
    print(f"batch: {batch.id} {batch.status}: {tally['answered']} answered, {tally['failed']} failed, "
          f"{tally['expired']} expired", file=sys.stderr, flush=True)  # fmt: skip


def export(teachers: dict[str, Teacher], path, room: float | None = None) -> tuple[int, int]:
    """The spooled requests as Batch JSONL for ``vllm run-batch`` or a provider; returns how many
    were written, and how many were left out. ``room``: the dollars left under ``--max-cost``
    (the cap less the store's spend): the requests are taken in order while their worst cases
    (each one's reservation) fit, as `submit` takes them, since an exported file is paid wherever it
    runs; the rest wait for a later export."""
    from metachunk.artifacts import AtomicWriter

    n = left = 0
    worst = 0.0
    with AtomicWriter(path) as f:
        for teacher, entries in spooled(teachers).values():
            for key, (payload, reserve) in entries.items():
                if room is not None and worst + reserve > room:
                    left += 1
                    continue
                f.write(batch_line(key, payload, teacher.cfg.batch_endpoint))
                n, worst = n + 1, worst + reserve
    return n, left


FAILURES_SHOWN = 5


def failure_reason(item: dict, response: dict, body) -> str:
    """Why a results line holds no answer, in one phrase. The message is where the format puts it:
    OpenAI's error file has ``"response": null`` and ``"error": {"code", "message"}``
    (https://platform.openai.com/docs/guides/batch), ``vllm run-batch`` a top-level ``"error"``
    string, and a failed request's body an ``"error"`` object."""
    status = response.get("status_code")
    why = ("no response" if not response else f"status {status!r}") if status != 200 else (
        "status 200, but not a chat completion")  # fmt: skip
    for error in (item.get("error"), body.get("error") if isinstance(body, dict) else None):
        message = error.get("message") or error.get("code") if isinstance(error, dict) else error
        if message:
            return f"{why}: {redact(str(message))[:200]}"
    return why


def import_results(store: AnswerStore, teachers: dict[str, Teacher], path) -> dict:
    """Store the answers of a results file (``vllm run-batch`` or a provider's output file). A result
    that is not an answer (an error status, a body that is not a chat completion) is counted as
    failed and sent again by the next run; ``counts["failures"]`` says where and why, for the first
    `FAILURES_SHOWN`."""
    from metachunk.artifacts import InputError

    by_model = {t.cfg.model: t for t in teachers.values()}
    answers, counts = [], {"answered": 0, "failed": 0, "skipped": 0, "failures": []}
    if not Path(path).exists() or Path(path).is_dir():  # a pipe (`<(...)`) is read as a file
        raise InputError(
            path, "a folder, not a results file" if Path(path).is_dir() else "no such results file"
        )
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(path, f"invalid UTF-8 at byte {e.start} of the line", number) from None
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                key, response = item["custom_id"], item.get("response") or {}
                if not isinstance(key, str) or not isinstance(response, dict):
                    raise TypeError
            except (ValueError, KeyError, TypeError, AttributeError):
                raise InputError(
                    path, "expected a Batch API result line with 'custom_id' and 'response'", number
                ) from None
            body = response.get("body")
            model = body.get("model") if isinstance(body, dict) else None
            teacher = by_model.get(model)
            if teacher is None and len(by_model) > 1 and response.get("status_code") == 200:
                raise InputError(path, f"response.body.model: {model!r} is none of the recipe's teachers "
                                 f"({', '.join(sorted(by_model))}), so its price is not known", number)  # fmt: skip
            teacher = teacher or next(iter(teachers.values()))
            if store.has_answer(key):
                counts["skipped"] += 1
                continue
            if response.get("status_code") == 200 and isinstance(body, dict):
                raw = redact(json.dumps(body, ensure_ascii=False), headers=False)
                prompt_tokens, completion_tokens, _, ok = read_usage(raw)
                if ok and prompt_tokens is None and teacher.price.cost(1, 1) > 0:
                    # Online and Batch API answers without usage are counted at the request's upper
                    # estimate; here the request is not known, so a priced answer is refused rather than
                    # stored at $0. vLLM's and OpenAI's result bodies are chat completions, which carry
                    # usage (https://docs.vllm.ai/en/latest/cli/run-batch/).
                    raise InputError(path, f"response.body.usage: missing, and teacher {teacher.cfg.model!r} has a "
                                     "price: its cost cannot be counted against --max-cost", number)  # fmt: skip
                if ok:
                    pt, ct = prompt_tokens or 0, completion_tokens or 0
                    cost = teacher.price.cost(pt, ct) * teacher.price.batch_discount
                    answers.append(StoredAnswer(key, teacher.cfg.model, "ok", "", raw, pt, ct, cost,
                                                usage_estimated=prompt_tokens is None))  # fmt: skip
                    counts["answered"] += 1
                    continue
            counts["failed"] += 1
            if len(counts["failures"]) < FAILURES_SHOWN:
                counts["failures"].append(f"line {number}: {failure_reason(item, response, body)}")
    for answer in answers:
        store.put(answer)
    return counts
