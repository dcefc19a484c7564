"""Publish a built SFT dataset directory as a Hugging Face Hub dataset repo.

Only what the card describes is sent: ``README.md`` (the card, whose ``configs`` tell the Hub and
``load_dataset`` where the splits are), ``data/*.parquet``, the PNG plots and any
``dataset_info*.json``. Everything is checked locally before the first request: the directory
holds a card and parquet files and a token is set. The upload itself, the token and the offline
switch are `metachunk.hub.push_folder`'s, shared with ``metachunk export --push``: the token
comes from the argument or ``HF_TOKEN`` and is never logged or printed, and a push refuses
``HF_HUB_OFFLINE=1``. A push replaces what the last one sent (`DELETE_PATTERNS`: a rebuild in
fewer shards leaves no stale shard behind), and ``--tag`` names one publication (a tag on another
commit is refused before anything is sent). A pushed dataset is read back by its id:
``dataset_name: ORG/NAME`` in a training recipe.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from metachunk.artifacts import InputError
from metachunk.command import Reads, Result
from metachunk.config import option

MANIFEST_NAME = "regen_manifest.json"
ALLOW_PATTERNS = ["README.md", "data/*.parquet", "*.png", "dataset_info*.json", "regen_manifest.json"]
# What a push replaces: after it, the repo's files of these kinds are the folder's (a rebuild in fewer
# shards leaves no stale shard for load_dataset to read). Named narrowly: a file someone added by hand stays.
DELETE_PATTERNS = ["data/*.parquet", "token_lengths.png", "dataset_info*.json", MANIFEST_NAME]


@dataclass
class PushConfig:
    dataset_dir: Path = option(
        None, "dataset directory with README.md and data/*.parquet (from the SFT builder)", positional=True
    )
    repo_id: str = option(None, "Hub dataset repo, 'namespace/name'; created if it does not exist")
    private: bool = option(False, "create the repo as private (an existing repo keeps its visibility)")
    commit_message: str | None = option(None, "commit message; default: 'Upload <dir name> with metachunk'")
    regen_manifest: Path | None = option(
        None,
        "a `metachunk run` regen_manifest.json: uploaded beside the data and summarised in the card; when "
        "the repo (at --revision) already holds a manifest with the same manifest_sha256, nothing is uploaded",
        runtime=True,
    )
    revision: str | None = option(None, "branch to publish to (created from main if new); default main")
    tag: str | None = option(
        None,
        "tag the published commit (one per regeneration): load_dataset(repo, revision=TAG) gets this run",
    )

    def __post_init__(self):
        if self.repo_id is not None and self.repo_id.count("/") != 1:
            raise ValueError(f"repo_id must be 'namespace/name', got {self.repo_id!r}")


def _check_dataset_dir(dataset_dir: Path) -> list[str]:
    """The files that will be sent, relative to ``dataset_dir``; raises if the card or the data is missing."""
    if not dataset_dir.is_dir():
        raise InputError(dataset_dir, "no such dataset directory")
    if not (dataset_dir / "README.md").is_file():
        raise InputError(
            dataset_dir,
            "no README.md: write the dataset card first (metachunk.distill.card.write_dataset_card)",
        )
    if not list(dataset_dir.glob("data/*.parquet")):
        raise InputError(dataset_dir, "no data/*.parquet files: nothing to publish")
    from metachunk.hub import folder_files

    return folder_files(dataset_dir, ALLOW_PATTERNS)


def unnamed_license(card: str) -> bool:
    """Whether a card's front matter says ``license: other`` without the ``license_name`` the Hub's
    card spec asks for with it (https://huggingface.co/docs/hub/datasets-cards): readers then see a
    license nobody named."""
    from huggingface_hub import DatasetCard

    meta = DatasetCard(card).data.to_dict()  # the front matter, as the Hub reads it
    return meta.get("license") == "other" and not meta.get("license_name")


def push_dataset(
    dataset_dir: str | Path,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    regen_manifest: str | Path | None = None,
    revision: str | None = None,
    tag: str | None = None,
) -> str:
    """Create the dataset repo if needed, upload the card, data and plots in one call, and return
    the repo URL. ``token`` defaults to the ``HF_TOKEN`` environment variable.

    With ``regen_manifest`` (a ``metachunk run`` manifest) the manifest goes up too, and the card
    gains a provenance section built from it. If the repo at ``revision`` already holds a manifest
    with the same ``manifest_sha256``, this exact run is published already: nothing is uploaded
    (a ``tag`` is still added if missing)."""
    from metachunk.hub import check_repo_id, push_folder, read_remote_file

    dataset_dir = Path(dataset_dir)
    check_repo_id(repo_id)
    _check_dataset_dir(dataset_dir)
    if unnamed_license((dataset_dir / "README.md").read_text(encoding="utf-8")):
        print(f"data push: {dataset_dir}/README.md says license: other with no license_name; rebuild it with "
              "--license ID, or --license other --license-name ID --license-link URL (the source corpus's "
              "terms apply)", file=sys.stderr)  # fmt: skip
    if regen_manifest is None:
        return push_folder(dataset_dir, repo_id, repo_type="dataset", allow_patterns=ALLOW_PATTERNS,
                           delete_patterns=DELETE_PATTERNS, private=private, token=token,
                           commit_message=commit_message, revision=revision, tag=tag)  # fmt: skip
    manifest = _read_manifest(Path(regen_manifest))
    remote = read_remote_file(repo_id, MANIFEST_NAME, repo_type="dataset", revision=revision, token=token)
    if remote is not None and json.loads(remote).get("manifest_sha256") == manifest["manifest_sha256"]:
        print(f"data push: {repo_id} ({revision or 'main'}) already holds this run (manifest_sha256 "
              f"{manifest['manifest_sha256'][:12]}); nothing uploaded", file=sys.stderr)  # fmt: skip
        url = f"https://huggingface.co/datasets/{repo_id}"
        if tag:
            _ensure_tag(repo_id, tag, revision, token)
        return url
    with tempfile.TemporaryDirectory(prefix=".push-", dir=dataset_dir.parent) as tmp:
        staging = Path(tmp) / dataset_dir.name
        shutil.copytree(dataset_dir, staging)  # the dataset folder itself is left as build-sft wrote it
        shutil.copyfile(regen_manifest, staging / MANIFEST_NAME)
        card = staging / "README.md"
        card.write_text(card.read_text(encoding="utf-8").rstrip("\n") + "\n\n" + provenance_section(manifest),
                        encoding="utf-8")  # fmt: skip
        return push_folder(staging, repo_id, repo_type="dataset", allow_patterns=ALLOW_PATTERNS,
                           delete_patterns=DELETE_PATTERNS, private=private, token=token, commit_message=commit_message or f"metachunk run {manifest['name']} "
                           f"({manifest['manifest_sha256'][:12]})", revision=revision, tag=tag)  # fmt: skip


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(path, f"not a readable regen manifest ({e})") from None
    for key in ("manifest_sha256", "name", "recipe", "stages", "metachunk"):
        if key not in manifest:
            raise InputError(path, f"missing field {key!r}: not a `metachunk run` regen_manifest.json")
    return manifest


def _ensure_tag(repo_id: str, tag: str, revision: str | None, token: str | None) -> None:
    """``tag`` on the head of ``revision``, which holds this run already: made if missing, kept if it
    is there, refused if it marks another commit (`metachunk.hub.tag_target`)."""
    from huggingface_hub import HfApi

    from metachunk.hub import hub_requests, hub_token, tag_target

    api = HfApi(token=hub_token(token))
    with hub_requests(repo_id):
        if tag_target(api, repo_id, "dataset", tag, revision or "main") is None:
            api.create_tag(repo_id, tag=tag, repo_type="dataset", revision=revision)


def provenance_section(manifest: dict) -> str:
    """The card's account of how the rows were made, from the regen manifest alone."""
    from metachunk.markdown import table

    version = manifest["metachunk"]
    rows = []
    for s in manifest["stages"]:
        teachers = ", ".join(sorted(set(s.get("teachers", {}).values()))) or "-"
        summary = "; ".join(
            f"{k} {v}" for k, v in s.get("summary", {}).items() if not isinstance(v, (dict, list))
        )
        rows.append([s["name"], f"`{s['run']}`", teachers, summary or "-"])
    lines = [
        "## How these rows were made",
        "",
        f"`metachunk run` of the recipe **{manifest['name']}** (sha256 `{manifest['recipe']['sha256'][:16]}`), "
        f"metachunk {version['version']}"
        + (f" at commit `{version['git_commit'][:12]}`" if version.get("git_commit") else "")
        + f". Manifest sha256 `{manifest['manifest_sha256']}`; the full record, with every input, model and "
        "prompt hash, is `regen_manifest.json` in this repo.",
        "",
        table(["stage", "command", "teachers", "what it made"], rows),
        "",
        f"{len(manifest.get('prompts', {}))} prompt and schema files, hashed in the manifest. To rerun: save the "
        "recipe below as `recipe.yaml` and `metachunk run recipe.yaml` (stages whose inputs are unchanged are "
        "skipped; teacher answers already stored are not paid again). Absolute paths in it are shown by their "
        "last part (the recipe's sha256 is of the file as written): point them at your copies.",
        "",
        "<details><summary>recipe</summary>",
        "",
        "```yaml",
        manifest["recipe"]["text"].rstrip("\n"),
        "```",
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)


def push(cfg: PushConfig) -> str:
    """`push_dataset` from a config (flags or a recipe)."""
    if cfg.dataset_dir is None or cfg.repo_id is None:
        raise InputError("command line", "push needs a dataset directory and --repo-id")
    return push_dataset(cfg.dataset_dir, cfg.repo_id, private=cfg.private, commit_message=cfg.commit_message,
                        regen_manifest=cfg.regen_manifest, revision=cfg.revision, tag=cfg.tag)  # fmt: skip


CONFIG = PushConfig


def run(cfg: PushConfig) -> Result:
    """``metachunk data push``: prints the dataset's URL."""
    try:
        print(push(cfg))
    except InputError:
        raise
    except ValueError as e:  # no token, a bad repo id: before any request
        raise InputError("data push", str(e)) from None
    return Result()


def inputs(cfg: PushConfig) -> Reads:
    return Reads.of(paths=[cfg.dataset_dir])


def with_run_manifest(config: dict, path: str) -> dict:
    """The recipe taking a regeneration run's manifest along (its card section and file), unless it names one."""
    return {"regen_manifest": path, **config}


def outputs(cfg: PushConfig) -> list:
    return []
