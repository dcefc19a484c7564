"""Pictures of a chunking decision: the per-sentence score profile with the chosen boundaries."""

from __future__ import annotations

import math
from pathlib import Path

from metachunk.artifacts import write_figure

SCORE_LABELS = {
    "ppl": "PPL (mean token NLL, nats)",
    "msp": "margin P(keep) - P(split)",
    "semantic": "cosine distance to next",
}


def plot_profile(path: Path, doc, method: str, threshold: float | None = None) -> Path:
    """Write ``path`` (PNG): one point per sentence, a triangle at each meta-chunk boundary, and a
    dashed line at every sentence that ends a final chunk (after merging)."""
    from metachunk.artifacts import new_figure

    scores = [math.nan if s.score is None else s.score for s in doc.sentences]
    ends = {i for i, s in enumerate(doc.sentences) if any(c.end == s.end for c in doc.chunks)}
    fig, ax = new_figure(figsize=(max(6.0, min(24.0, len(scores) / 8)), 3.2))
    ax.plot(range(len(scores)), scores, marker=".", lw=0.8, color="tab:blue")
    for i in sorted(ends)[:-1]:
        ax.axvline(i, color="tab:red", ls="--", lw=0.6)
    if doc.boundaries:  # meta-chunk boundaries (PPL minima / MSP splits), before merging
        ax.plot(
            doc.boundaries, [scores[i] for i in doc.boundaries], "v", color="tab:red", ms=5, label="boundary"
        )
        ax.legend(loc="upper right", fontsize=7)
    if doc.thresholds:
        ax.plot(
            range(len(scores)),
            [math.nan if t is None else t for t in doc.thresholds],
            color="tab:orange",
            lw=0.8,
            label="dynamic θ",
        )
        ax.legend(loc="upper right", fontsize=7)
    ax.set_xlabel("sentence")
    ax.set_ylabel(SCORE_LABELS.get(method, "score"))
    title = f"{doc.id}: {len(doc.sentences)} sentences, {len(doc.chunks)} chunks ({method}"
    ax.set_title(title + (f", θ={threshold:g})" if threshold is not None else ")"), fontsize=9)
    fig.tight_layout()
    return write_figure(fig, path)  # atomically: a crash never leaves half a PNG
