"""Publish a built SFT dataset directory as a Hugging Face Hub dataset repo.

Only what the card describes is sent: ``README.md`` (the card, whose ``configs`` tell the Hub and
``load_dataset`` where the splits are), ``data/*.parquet``, the PNG plots and any
``dataset_info*.json``. Everything is checked locally before the first request: the directory
holds a card and parquet files and a token is set. The upload itself, the token and the offline
switch are :func:`metachunk.hub.push_folder`'s, shared with ``metachunk export --push``: the token
comes from the argument or ``HF_TOKEN`` and is never logged or printed, and a push lifts
metachunk's own ``HF_HUB_OFFLINE=1`` default for its duration, but never one the user set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from metachunk.artifacts import InputError
from metachunk.config import option

ALLOW_PATTERNS = ["README.md", "data/*.parquet", "*.png", "dataset_info*.json"]


@dataclass
class PushConfig:
    dataset_dir: Path = option(
        None, "dataset directory with README.md and data/*.parquet (from the SFT builder)", positional=True
    )
    repo_id: str = option(None, "Hub dataset repo, 'namespace/name'; created if it does not exist")
    private: bool = option(False, "create the repo as private (an existing repo keeps its visibility)")
    commit_message: str | None = option(None, "commit message; default: 'Upload <dir name> with metachunk'")

    def __post_init__(self):
        if self.repo_id is not None and self.repo_id.count("/") != 1:
            raise ValueError(f"repo_id must be 'namespace/name', got {self.repo_id!r}")


def _check_dataset_dir(dataset_dir: Path) -> list[str]:
    """The files that will be sent, relative to ``dataset_dir``; raises if the card or the data is missing."""
    if not dataset_dir.is_dir():
        raise InputError(dataset_dir, "no such dataset directory")
    if not (dataset_dir / "README.md").is_file():
        raise InputError(
            dataset_dir, "no README.md: write the dataset card first (distill.card.write_dataset_card)"
        )
    if not list(dataset_dir.glob("data/*.parquet")):
        raise InputError(dataset_dir, "no data/*.parquet files: nothing to publish")
    files = {p.relative_to(dataset_dir).as_posix() for p in dataset_dir.rglob("*") if p.is_file()}
    from huggingface_hub.utils import filter_repo_objects

    return sorted(filter_repo_objects(files, allow_patterns=ALLOW_PATTERNS))


def push_dataset(
    dataset_dir: str | Path,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Create the dataset repo if needed, upload the card, data and plots in one call, and return
    the repo URL. ``token`` defaults to the ``HF_TOKEN`` environment variable."""
    from metachunk.hub import check_repo_id, push_folder

    dataset_dir = Path(dataset_dir)
    check_repo_id(repo_id)
    _check_dataset_dir(dataset_dir)
    return push_folder(
        dataset_dir,
        repo_id,
        repo_type="dataset",
        allow_patterns=ALLOW_PATTERNS,
        private=private,
        token=token,
        commit_message=commit_message,
    )


def push(cfg: PushConfig) -> str:
    """:func:`push_dataset` from a config (flags or a recipe)."""
    if cfg.dataset_dir is None or cfg.repo_id is None:
        raise InputError("command line", "push needs a dataset directory and --repo-id")
    return push_dataset(cfg.dataset_dir, cfg.repo_id, private=cfg.private, commit_message=cfg.commit_message)
