"""MoC recovery throughput: head[MASK]tail rules recovered against CRUD news, ours vs a naive scan.

What is compared, on the same documents and the same synthetic expert answers:

* **ours**: :func:`metachunk.chunking.moc_answers.recover_spans`: per element, ``re.escape(head).*?re.escape(tail)``
  after the previous match; on failure :func:`metachunk.chunking.align.locate` for head and tail (exact
  ``str.find``, a rapidfuzz ``partial_ratio`` reject, Myers bit-parallel semi-global edit distance
  in a window near the cursor, doubling until found).
* **naive**: what §3.2.4 describes without an index: for every element, head and tail are each
  placed at the position of the whole document where ``Levenshtein.distance(fragment,
  doc[p:p + n])`` is least, scanning every ``p`` and the lengths ``n`` within the edit budget of
  ``len(fragment)`` (the distance itself is rapidfuzz's C++ one, so this baseline is already far
  faster than a Python DP). The chunk is accepted when both distances are within the same budget
  as ours (10% of the fragment, at least one edit from 8 characters) and the tail does not end
  before the head; no ordering, no cursor.

Synthetic answers: each document (the first ``--docs`` CRUD articles of ``data:crud-news/news.jsonl``,
``metachunk data fetch crud-news`` once; ~700 characters, i.e. one expert window each) is split
into sentences and cut into chunks of 1-4 sentences; each chunk gives
``head[MASK]tail`` with heads and tails of ``--min-anchor``..``--max-anchor`` characters. A share
``--noise`` of heads and of tails (drawn independently) gets one random edit (substitution,
deletion or insertion: a light typo, within the 10% budget for anchors of >= 10 characters), and
a share ``--junk`` of extra elements copied from another document is mixed in (hallucinations,
which should be skipped). Accuracy: recovered chunk starts equal to the true starts, over the real
elements.

Timing: ``--reps`` rounds; in each, every document is recovered by both methods back to back in
alternating order, so machine load hits both alike; the headline is each method's best round.
Throughput is document characters per second. Results: ``bench_out/moc_recovery.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from metachunk.chunking.moc_answers import recover_spans, split_element  # noqa: E402
from metachunk.chunking.sentences import split_sentences  # noqa: E402
from rapidfuzz.distance import Levenshtein  # noqa: E402

from metachunk.artifacts import InputError, write_json  # noqa: E402
from metachunk.named_data import resolve  # noqa: E402


def typo(s: str, rng: random.Random, alphabet: str) -> str:
    if not s:
        return s
    i = rng.randrange(len(s))
    op = rng.choice("sdi")
    if op == "s":
        return s[:i] + rng.choice([c for c in alphabet if c != s[i]]) + s[i + 1 :]
    if op == "d" and len(s) > 1:
        return s[:i] + s[i + 1 :]
    return s[:i] + rng.choice(alphabet) + s[i:]


def make_case(text: str, other: str, rng: random.Random, args) -> tuple[list[str], list[int]]:
    """(elements, true chunk starts) for one document."""
    sents = split_sentences(text, "zh")
    alphabet = "".join(sorted(set(text)))
    elements, starts, i = [], [], 0
    while i < len(sents):
        k = rng.randint(1, 4)
        group = sents[i : i + k]
        i += k
        s, e = group[0].start, group[-1].end
        piece = text[s:e]
        lead = len(piece) - len(piece.lstrip())
        piece = piece.strip()
        n = rng.randint(args.min_anchor, args.max_anchor)
        head, tail = piece[:n], piece[-n:] if len(piece) > n else ""
        if rng.random() < args.noise:
            head = typo(head, rng, alphabet)
        if tail and rng.random() < args.noise:
            tail = typo(tail, rng, alphabet)
        elements.append(head + "[MASK]" + tail)
        starts.append(s + lead)
    for _ in range(len(elements)):
        if rng.random() < args.junk:
            a = rng.randrange(max(1, len(other) - 40))
            junk = other[a : a + 12] + "[MASK]" + other[a + 20 : a + 32]
            elements.insert(rng.randrange(len(elements) + 1), junk)
    return elements, starts


def naive_best(fragment: str, doc: str, budget: int) -> tuple[int, int, int]:
    """(start, end, distance) of the least-distance substring of length len(fragment) +- budget,
    scanning every start in doc (the earliest wins ties; stops at an exact hit)."""
    m = len(fragment)
    best = (0, 0, m + 1)
    for p in range(len(doc)):
        for n in sorted(range(max(1, m - budget), m + budget + 1), key=lambda n: abs(n - m)):
            if p + n > len(doc):
                continue
            d = Levenshtein.distance(fragment, doc[p : p + n], score_cutoff=max(0, best[2] - 1))
            if d < best[2]:
                best = (p, p + n, d)
        if best[2] == 0:
            break
    return best


def budget(fragment: str, max_ratio: float) -> int:
    """The same edit budget as ours: 10% of the length, at least one edit from 8 characters."""
    return int(max(max_ratio, 1.0 / len(fragment) if len(fragment) >= 8 else 0.0) * len(fragment) + 1e-9)


def naive_recover(doc: str, elements: list[str], max_ratio: float = 0.1) -> list[tuple[int, int]]:
    spans = []
    for el in elements:
        head, tail = split_element(el)
        if not head:
            continue
        hp, he, hd = naive_best(head, doc, budget(head, max_ratio))
        if hd > budget(head, max_ratio):
            continue
        end = he
        if tail:
            _, te, td = naive_best(tail, doc, budget(tail, max_ratio))
            if td > budget(tail, max_ratio) or te < end:
                continue
            end = te
        spans.append((hp, end))
    return spans


def accuracy(spans: list[tuple[int, int]], starts: list[int]) -> int:
    got = {s for s, _ in spans}
    return sum(1 for s in starts if s in got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--noise", type=float, default=0.5, help="share of heads/tails with one typo")
    ap.add_argument("--junk", type=float, default=0.05, help="hallucinated elements per real element")
    ap.add_argument("--min-anchor", type=int, default=10)
    ap.add_argument("--max-anchor", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out" / "moc_recovery.json")
    args = ap.parse_args()

    with open(resolve("data:crud-news/news.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line, _ in zip(f, range(args.docs))]
    rng = random.Random(args.seed)
    cases = [make_case(d, docs[(k + 1) % len(docs)], rng, args) for k, d in enumerate(docs)]
    chars = sum(len(d) for d in docs)
    n_elements = sum(len(e) for e, _ in cases)
    n_real = sum(len(s) for _, s in cases)

    rounds = {"ours": [], "naive": []}
    results = {}
    for rep in range(args.reps):
        spent = {"ours": 0.0, "naive": 0.0}
        for k, (doc, (elements, _)) in enumerate(zip(docs, cases)):
            order = ("ours", "naive") if (k + rep) % 2 == 0 else ("naive", "ours")
            for name in order:
                t = time.perf_counter()
                if name == "ours":
                    out = recover_spans(doc, elements)[0]
                else:
                    out = naive_recover(doc, elements)
                spent[name] += time.perf_counter() - t
                results.setdefault(name, {})[k] = out
        for name in spent:
            rounds[name].append(spent[name])

    stats = {"exact": 0, "fuzzy": 0, "skipped": 0}
    for doc, (elements, _) in zip(docs, cases):
        s = recover_spans(doc, elements)[1]
        stats["exact"] += s.exact
        stats["fuzzy"] += s.fuzzy
        stats["skipped"] += s.skipped
    report = {
        "docs": len(docs),
        "chars": chars,
        "elements": n_elements,
        "real_elements": n_real,
        "noise": args.noise,
        "junk": args.junk,
        "anchor_chars": [args.min_anchor, args.max_anchor],
        "reps": args.reps,
        "ours_recovery": stats,
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        },
    }
    print(
        f"MoC recovery on {len(docs)} CRUD articles ({chars} chars), {n_elements} elements "
        f"({n_real} real, noise {args.noise:.0%} of anchors, junk {args.junk:.0%}); best of {args.reps} rounds"
    )
    header = f"{'method':<8} {'best s':>9} {'median s':>9} {'chars/s':>12} {'elements/s':>11}"
    print(f"{header} {'starts right':>13}")
    for name in ("ours", "naive"):
        best, med = min(rounds[name]), statistics.median(rounds[name])
        right = sum(accuracy(results[name][k], starts) for k, (_, starts) in enumerate(cases))
        report[name] = {
            "best_s": round(best, 4),
            "median_s": round(med, 4),
            "chars_per_s": round(chars / best),
            "elements_per_s": round(n_elements / best),
            "starts_right": right,
            "starts_right_share": round(right / n_real, 4),
        }
        print(
            f"{name:<8} {best:>9.3f} {med:>9.3f} {chars / best:>12,.0f} {n_elements / best:>11,.0f} "
            f"{right:>6}/{n_real} ({right / n_real:.1%})"
        )
    ratio = report["naive"]["best_s"] / report["ours"]["best_s"]
    report["speedup_ours_vs_naive"] = round(ratio, 1)
    print(f"ours / naive throughput: {ratio:.1f}x   (ours: exact {stats['exact']}, fuzzy {stats['fuzzy']}, "
          f"skipped {stats['skipped']})")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:  # a named dataset that is not here: the fetch command to run
        print(f"moc_recovery: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
