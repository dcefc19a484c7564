"""Upload a local folder to a Hugging Face Hub repo: the one place where metachunk talks to the Hub.

``metachunk data push`` (a dataset repo) and ``metachunk export --push`` (a model repo) both end
here. Everything that can be checked locally is checked before the first request: the repo id, a
token, and the offline switch. metachunk keeps the Hub switched off at run time
(``HF_HUB_OFFLINE=1`` unless the user set it, see :mod:`metachunk.models`); a push is the user
asking for the Hub, so it lifts that default for its own duration, but never an
``HF_HUB_OFFLINE=1`` the user set.

The token comes from the argument or the ``HF_TOKEN`` environment variable, never from a file we
write, and it is never logged or printed: it only travels in the Authorization header that
``huggingface_hub`` sets.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def check_repo_id(repo_id: str | None) -> None:
    if not repo_id or repo_id.count("/") != 1:
        raise ValueError(f"repo_id must be 'namespace/name', got {repo_id!r}")


def hub_token(token: str | None = None) -> str:
    """``token`` or ``$HF_TOKEN``; ``ValueError`` (before any request) when there is none."""
    token = token or os.environ.get("HF_TOKEN", "").strip()
    if not token:
        raise ValueError("no Hub token: set the HF_TOKEN environment variable (a write token) to push")
    return token


def check_online_allowed() -> None:
    """``ValueError`` when the user themselves set ``HF_HUB_OFFLINE=1`` (metachunk's own default is lifted)."""
    from huggingface_hub import constants

    from metachunk import models  # read at call time: tests flip OFFLINE_BY_DEFAULT

    if constants.HF_HUB_OFFLINE and not models.OFFLINE_BY_DEFAULT:
        raise ValueError("HF_HUB_OFFLINE=1 is set in your environment: unset it (or set 0) to push")


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    repo_type: str,
    allow_patterns: Sequence[str] | None = None,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    tag: str | None = None,
) -> str:
    """Create ``repo_id`` if needed (an existing repo keeps its visibility), upload the files of
    ``folder`` that match ``allow_patterns`` in one commit to ``revision`` (a branch, created from
    main if new; default main), tag that commit ``tag`` if given, and return the repo URL."""
    from huggingface_hub import HfApi, constants

    check_repo_id(repo_id)
    token = hub_token(token)
    check_online_allowed()
    folder = Path(folder)
    offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False
    try:
        api = HfApi(token=token)
        url = api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, repo_type=repo_type, exist_ok=True)
        logger.info("uploading %s to %s", folder, url)
        commit = api.upload_folder(
            repo_id=repo_id,
            repo_type=repo_type,
            folder_path=folder,
            allow_patterns=list(allow_patterns) if allow_patterns is not None else None,
            commit_message=commit_message or f"Upload {folder.name} with metachunk",
            revision=revision,
        )
        if tag:
            api.create_tag(repo_id, tag=tag, repo_type=repo_type, revision=commit.oid,
                           tag_message=f"metachunk: {commit_message or folder.name}")  # fmt: skip
    finally:
        constants.HF_HUB_OFFLINE = offline
    return str(url)


def read_remote_file(repo_id: str, filename: str, *, repo_type: str, revision: str | None = None,
                     token: str | None = None) -> bytes | None:  # fmt: skip
    """The bytes of ``filename`` in the repo at ``revision`` (default main), or None when the repo,
    the revision or the file does not exist."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    token = hub_token(token)
    check_online_allowed()
    offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False
    try:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = HfApi(token=token).hf_hub_download(repo_id, filename, repo_type=repo_type,
                                                          revision=revision, local_dir=tmp)  # fmt: skip
            except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
                return None
            return Path(path).read_bytes()
    finally:
        constants.HF_HUB_OFFLINE = offline
