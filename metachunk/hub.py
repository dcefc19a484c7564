"""The one place where metachunk talks to the Hugging Face Hub: uploads, and Hub ids read back.

``metachunk data push`` (a dataset repo) and ``metachunk export --push`` (a model repo) both end
here. Everything that can be checked locally is checked before the first request: the repo id, a
token, and the offline switch: a push refuses ``HF_HUB_OFFLINE=1``.

Wherever a model, a student or a dataset is named, a Hub id is taken too, as transformers and TRL
take one: ``ORG/NAME``, ``ORG/NAME@REVISION`` (a branch, a tag or a commit), or for a dataset repo
``hf://datasets/ORG/NAME[@REVISION]``. `snapshot` downloads the repo at that revision into
the Hub cache (``huggingface_hub.snapshot_download``; with ``HF_HUB_OFFLINE=1`` only the cache is
read) and returns the local folder, named by the commit it resolved to, which is what a
regeneration fingerprint records. metachunk never switches the Hub off itself: the Makefile, the
tests and CI set ``HF_HUB_OFFLINE=1``.

The token comes from the argument or the ``HF_TOKEN`` environment variable, never from a file we
write, and it is never logged or printed: it only travels in the Authorization header that
``huggingface_hub`` sets.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from metachunk.redaction import register_secret

logger = logging.getLogger(__name__)


def check_repo_id(repo_id: str | None) -> None:
    if not repo_id or repo_id.count("/") != 1:
        raise ValueError(f"repo_id must be 'namespace/name', got {repo_id!r}")


def hub_token(token: str | None = None) -> str:
    """``token`` or ``$HF_TOKEN``; ``ValueError`` (before any request) when there is none."""
    token = token or os.environ.get("HF_TOKEN", "").strip()
    if not token:
        raise ValueError("no Hub token: set the HF_TOKEN environment variable (a write token) to push")
    register_secret(token)  # from here on, redact() masks it in everything written or printed
    return token


def env_token() -> str | None:
    """``$HF_TOKEN`` for a read (None without one: public repos need none), registered for redaction."""
    token = os.environ.get("HF_TOKEN", "").strip() or None
    if token:
        register_secret(token)
    return token


def check_online_allowed() -> None:
    """``ValueError`` when ``HF_HUB_OFFLINE=1`` is set: a push needs the Hub."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ValueError("HF_HUB_OFFLINE=1 is set in your environment: unset it (or set 0) to push")


# ORG/NAME[@REV], or hf://datasets/ORG/NAME[@REV] (hf://models/... too)
HUB_ID = re.compile(
    r"^(?:hf://(?P<kind>datasets|models)/)?(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$"
)


def parse_hub_id(text: str, repo_type: str = "model") -> tuple[str, str, str | None] | None:
    """``(repo_type, repo_id, revision)`` when ``text`` reads as a Hub id, else None. A path that
    exists on disk is never a Hub id (the caller checks that first)."""
    match = HUB_ID.match(str(text))
    if match is None:
        return None
    kind = match.group("kind")
    return (kind[:-1] if kind else repo_type), match.group("repo"), match.group("rev")


class HubNotFound(ValueError):
    """A Hub id that cannot be read: no such repo or revision, or offline and not in the cache."""


def snapshot(text: str, repo_type: str = "model", token: str | None = None) -> Path:
    """The local folder of the Hub repo ``text`` names (`parse_hub_id`), downloaded into the
    Hub cache at its revision; its name is the commit it resolved to."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    parsed = parse_hub_id(text, repo_type)
    if parsed is None:
        raise HubNotFound(f"{text!r} is not a Hub id (ORG/NAME[@REVISION])")
    kind, repo_id, revision = parsed
    name = f"{kind} {repo_id}{'@' + revision if revision else ''}"
    try:
        return Path(snapshot_download(repo_id, repo_type=kind, revision=revision, token=token or env_token()))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        # huggingface_hub raises LocalEntryNotFoundError offline, and also when the Hub cannot be reached
        if constants.HF_HUB_OFFLINE:
            raise HubNotFound(f"{name} is not in the local Hub cache and HF_HUB_OFFLINE=1 is set: unset it to "
                              "download it") from None  # fmt: skip
        raise HubNotFound(
            f"{name}: not in the local Hub cache, and the Hub could not be reached ({e})"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise HubNotFound(f"{name}: the Hub answered {status}") from None


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
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    token = hub_token(token)
    check_online_allowed()
    folder = Path(folder)
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
    return str(url)


def read_remote_file(repo_id: str, filename: str, *, repo_type: str, revision: str | None = None,
                     token: str | None = None) -> bytes | None:  # fmt: skip
    """The bytes of ``filename`` in the repo at ``revision`` (default main), or None when the repo,
    the revision or the file does not exist."""
    import tempfile

    from huggingface_hub import HfApi
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    token = hub_token(token)
    check_online_allowed()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = HfApi(token=token).hf_hub_download(repo_id, filename, repo_type=repo_type,
                                                      revision=revision, local_dir=tmp)  # fmt: skip
        except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
            return None
        return Path(path).read_bytes()
