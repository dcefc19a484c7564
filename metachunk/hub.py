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

import contextlib
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
        raise ValueError(
            "no Hub token: set the HF_TOKEN environment variable (a write token) to push; metachunk takes "
            "secrets from the environment only, not from the file `hf auth login` writes"
        )
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


def commit_of(text: str, repo_type: str = "dataset", token: str | None = None) -> str:
    """The commit the Hub repo ``text`` names (`parse_hub_id`) resolves to, without downloading its
    files: the Hub's repo info, or offline (or unreachable) the local cache's snapshot. A plan that
    fingerprints an ``hf://`` corpus must not download it."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    parsed = parse_hub_id(text, repo_type)
    if parsed is None:
        raise HubNotFound(f"{text!r} is not a Hub id (ORG/NAME[@REVISION])")
    kind, repo_id, revision = parsed
    name = f"{kind} {repo_id}{'@' + revision if revision else ''}"
    reached = None
    if not constants.HF_HUB_OFFLINE:
        try:
            return HfApi(token=token or env_token()).repo_info(repo_id, repo_type=kind, revision=revision).sha
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else "?"
            raise HubNotFound(f"{name}: the Hub answered {status}") from None
        except Exception as e:  # noqa: BLE001 - unreachable (the client's own connection errors): the cache
            reached = e
    try:
        folder = snapshot_download(repo_id, repo_type=kind, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE=1 is set" if reached is None else f"the Hub could not be reached ({reached})"
        raise HubNotFound(f"{name} is not in the local Hub cache, and {why}") from None
    return Path(folder).name


class HubRequestError(OSError):
    """The Hub refused a request, or could not be reached: one line naming the repo and what the
    Hub said (the CLI prints it and exits 1)."""


@contextlib.contextmanager
def hub_requests(repo_id: str):
    """``huggingface_hub``'s HTTP errors, whose text spans lines (URL, request id, body), as one
    `HubRequestError` line naming ``repo_id``."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    try:
        yield
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        said = " ".join((e.server_message or str(e)).split())
        raise HubRequestError(f"{repo_id}: the Hub answered {status or 'no status'}: {said}") from None
    except httpx2.TransportError as e:  # no answer at all: no route, DNS, a proxy, a timeout
        raise HubRequestError(f"{repo_id}: the Hub could not be reached ({type(e).__name__}: {e})") from None


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    repo_type: str,
    allow_patterns: Sequence[str] | None = None,
    delete_patterns: Sequence[str] | None = None,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    tag: str | None = None,
) -> str:
    """Create ``repo_id`` if needed, upload the files of ``folder`` that match ``allow_patterns``
    to ``revision`` (a branch, created from main if new; default main), tag that commit ``tag`` if
    given, and return the repo URL.

    ``delete_patterns``: the remote files of these kinds that ``folder`` no longer has are deleted
    in the same commit (``upload_folder``'s own argument), so that a push replaces what the last
    one sent (a dataset rebuilt in fewer shards, a model re-exported in more) instead of leaving
    stale files for ``load_dataset`` or ``from_pretrained`` to read. A new repo is private with
    ``private``, else as its namespace's default says (``create_repo(private=None)``); an existing
    repo keeps its visibility. A tag names one publication: one that marks another commit than
    the branch's head, or the head with other files than this folder's, is refused before anything
    is uploaded, and rerunning the push that made it succeeds without a request that writes
    (https://huggingface.co/docs/huggingface_hub/package_reference/hf_api). A push to the same branch
    by someone else before this one's first commit makes the Hub refuse it (``parent_commit``).

    One push is one commit (``create_commit``, whose files are all uploaded before the commit is made:
    https://huggingface.co/docs/huggingface_hub/package_reference/hf_api): a failure leaves the
    branch as it was, never with a new card over part of the new shards. ``upload_folder`` with
    ``hf_xet`` commits a folder of more than a few hundred files in parts. Rerunning a push cut short
    sends again only what the Hub's storage lacks (preupload answers which files it holds).

    A pattern matches whole path segments, as a glob does: ``*.bin`` is a top-level file, not
    ``gptq-4bit/model.bin`` (``upload_folder``'s ``*`` also crossed ``/`` and deleted a variant someone
    had added in a subfolder). ``private`` on a repo that exists and is public is refused: the Hub
    keeps an existing repo's visibility (``create_repo``: "ignored if the repo already exists")."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    check_repo_id(repo_id)
    token = hub_token(token)
    check_online_allowed()
    folder = Path(folder)
    api = HfApi(token=token)
    branch = revision or "main"
    with hub_requests(repo_id):
        url = api.create_repo(repo_id, repo_type=repo_type, private=True if private else None, exist_ok=True)
        if private and not api.repo_info(repo_id, repo_type=repo_type).private:
            raise ValueError(
                f"{repo_id} exists and is public: --private does not change an existing repo's visibility; make "
                "it private on the Hub first, or push without --private"
            )
        if branch != "main":
            api.create_branch(repo_id, branch=branch, repo_type=repo_type, exist_ok=True)
        refs = api.list_repo_refs(repo_id, repo_type=repo_type)
        head = next((b.target_commit for b in refs.branches if b.name == branch), None)
        tagged = tag_target(api, repo_id, repo_type, tag, branch) if tag else None
        if tagged is not None:  # the tag marks the head: this push may only be the one that made it
            if not holds_folder(api, repo_id, repo_type, tagged, folder, allow_patterns, delete_patterns):
                raise ValueError(
                    f"tag {tag!r} marks the head of {branch} in {repo_id}, whose files differ from this folder's: "
                    "name a new tag (a tag is one publication)"
                )
            return str(url)  # the same push again: the tag already marks exactly this
        logger.info("uploading %s to %s", folder, url)
        local = folder_files(folder, allow_patterns)
        remote = api.list_repo_files(repo_id, repo_type=repo_type, revision=branch) if delete_patterns else []
        sent = set(local)
        stale = [n for n in remote if n not in sent and n != ".gitattributes" and matches(n, delete_patterns)]
        operations = [CommitOperationDelete(path_in_repo=n) for n in stale]
        operations += [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(folder / n)) for n in local]
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or f"Upload {folder.name} with metachunk",
            repo_type=repo_type,
            revision=revision,
            # another push to the branch since `head` was read makes the Hub refuse this one: it would mix the two
            parent_commit=head,
        )
        if tag:
            api.create_tag(repo_id, tag=tag, repo_type=repo_type, revision=commit.oid,
                           tag_message=f"metachunk: {commit_message or folder.name}")  # fmt: skip
    return str(url)


def holds_folder(api, repo_id: str, repo_type: str, revision: str, folder: Path,
                 allow_patterns: Sequence[str] | None, delete_patterns: Sequence[str] | None) -> bool:  # fmt: skip
    """Whether the repo at ``revision`` holds exactly what a push of ``folder`` would leave there:
    each file it would send, byte for byte (the Hub's oid of it: the sha256 of an LFS file, Xet-stored
    ones included, the git blob sha1 of another; a tree entry's ``lfs.oid`` and ``oid``,
    https://huggingface.co/docs/huggingface.js/hub/interfaces/ListFileEntry), and none of the kinds it
    replaces that the folder lacks."""
    import hashlib

    from huggingface_hub.hf_api import RepoFile

    remote = {f.path: f for f in api.list_repo_tree(repo_id, repo_type=repo_type, revision=revision, recursive=True)
              if isinstance(f, RepoFile)}  # fmt: skip
    local = folder_files(folder, allow_patterns)
    for name in local:
        there = remote.get(name)
        if there is None:
            return False
        content = (folder / name).read_bytes()
        if there.lfs is not None:
            same = hashlib.sha256(content).hexdigest() == there.lfs.sha256
        else:
            same = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest() == there.blob_id
        if not same:
            return False
    sent = set(local)
    stale = [n for n in remote if n not in sent and n != ".gitattributes" and matches(n, delete_patterns)]
    return not stale


def matches(name: str, patterns: Sequence[str] | None) -> bool:
    """Whether the repo path ``name`` matches one of the glob ``patterns``, each ``*`` within one
    path segment (``*.bin`` is no ``gptq-4bit/model.bin``; ``data/*.parquet`` is ``data/x.parquet``)."""
    import fnmatch

    return any(name.count("/") == p.count("/") and fnmatch.fnmatchcase(name, p) for p in patterns or ())


def folder_files(folder: Path, allow_patterns: Sequence[str] | None) -> list[str]:
    """The files of ``folder`` a push sends, as repo paths in sorted order: all, or those matching
    ``allow_patterns`` (`matches`); never what ``.git/`` and ``.cache/huggingface/`` hold, as
    ``upload_folder`` never sends them (its ``DEFAULT_IGNORE_PATTERNS``)."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    names = [n for n in names if not n.startswith((".git/", ".cache/huggingface/"))]
    return names if allow_patterns is None else [n for n in names if matches(n, allow_patterns)]


def tag_target(api, repo_id: str, repo_type: str, tag: str, branch: str) -> str | None:
    """The commit ``tag`` marks in the repo (None when there is no such tag); a tag on any other
    commit than ``branch``'s head is a `ValueError`: a tag names one publication, and moving it
    would change what ``revision=TAG`` loads."""
    refs = api.list_repo_refs(repo_id, repo_type=repo_type)
    target = next((t.target_commit for t in refs.tags if t.name == tag), None)
    head = next((b.target_commit for b in refs.branches if b.name == branch), None)
    if target is not None and target != head:
        raise ValueError(
            f"tag {tag!r} already marks commit {target[:12]} of {repo_id}, not the head of {branch}: name a new tag"
        )
    return target


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
