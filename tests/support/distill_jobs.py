"""A distill run directory for tests: documents and chunks, a recipe with one teacher block for
every stage, and the ways to run it (CLI subprocess, in-process) and read what it wrote."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from metachunk.distill.pipelines import STAGES
from metachunk.distill.run import DistillConfig

from metachunk import config
from metachunk.artifacts import read_run_log
from metachunk.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
KEY_ENV = "METACHUNK_TEST_KEY"


@dataclass
class Job:
    task: str
    recipe: Path
    out: Path

    @property
    def store_path(self) -> Path:
        return self.out / "answers.sqlite"

    @property
    def records_path(self) -> Path:  # OUT/TASK.jsonl, next to OUT/TASK.meta.json
        return self.out / f"{self.task}.jsonl"

    def meta(self) -> dict:
        return json.loads((self.out / f"{self.task}.meta.json").read_text(encoding="utf-8"))

    def last_run(self) -> dict:
        """How the last attempt went: its line in ``OUT/runs.jsonl`` (requests sent, paid, stopped)."""
        return read_run_log(self.out)[-1]

    def cli(self, action: str, *flags: str, env: dict | None = None, timeout: float = 60):
        """``python -m metachunk.cli distill ACTION --config RECIPE FLAGS``; a hang fails the test."""
        return subprocess.run(
            [sys.executable, "-m", "metachunk.cli", "distill", action, "--config", str(self.recipe), *flags],
            cwd=REPO,
            env=cli_env() if env is None else env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def main(self, action: str, *flags: str) -> int:
        """The same command in-process (no interpreter start-up): its exit code."""
        return cli_main(["distill", action, "--config", str(self.recipe), *flags])

    def config(self, **overrides) -> DistillConfig:
        """The recipe as the CLI reads it, for in-process runs."""
        return DistillConfig(**{**config.load_yaml(DistillConfig, self.recipe), **overrides})

    def records(self) -> list[dict]:
        lines = self.records_path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines]

    def records_by_doc(self) -> dict[str, dict]:
        return {r["doc_id"]: r for r in self.records()}

    def query(self, sql: str) -> list[tuple]:
        """Read the answer store read-only (as another process would, also while a run writes it)."""
        db = sqlite3.connect(f"file:{self.store_path}?mode=ro", uri=True)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()


def cli_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def make_job(
    root: Path,
    base_url: str,
    docs: dict[str, list[str]],
    *,
    task: str = "rewrite",
    teacher: dict | None = None,
    **fields,
) -> Job:
    """Documents made of the given chunks (joined by spaces), their chunks file and a recipe with
    the same teacher block for every stage of ``task``."""
    root.mkdir(parents=True, exist_ok=True)
    documents, chunks = root / "documents.jsonl", root / "chunks.jsonl"
    with documents.open("w", encoding="utf-8") as d, chunks.open("w", encoding="utf-8") as c:
        for doc_id, texts in docs.items():
            text, spans = "", []
            for piece in texts:
                text += " " if text else ""
                spans.append({"text": piece, "start": len(text), "end": len(text) + len(piece)})
                text += piece
            d.write(json.dumps({"id": doc_id, "text": text}) + "\n")
            c.write(json.dumps({"id": doc_id, "chunks": spans}) + "\n")
    block = {
        "model": "loopback",
        "base_url": base_url,
        "max_tokens": 64,
        "concurrency": 8,
        "timeout": 5.0,
        "max_retries": 2,
        **(teacher or {}),
    }
    recipe = {
        "task": task,
        "documents": str(documents),
        "chunks": str(chunks),
        "out": str(root / "run"),
        "lang": "en",
        "progress": False,
        "teachers": {stage: dict(block) for stage in STAGES[task]},
        **fields,
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return Job(task, path, root / "run")
