"""A fake Hugging Face Hub for push and download tests (the ``fake_hub`` fixture in ``conftest.py``).

The Hub is an ``httpx2.MockTransport`` installed with ``huggingface_hub.set_client_factory``: it
answers the endpoints ``create_repo`` + ``upload_folder`` call (repo create, README YAML
validation, preupload, LFS batch + the storage PUT + verify, commit) and those
``snapshot_download`` calls (repo info at a revision, the recursive tree, each file's resolve URL)
for any repo of any type (model, dataset), and records every request, so a test sees exactly
which bytes and headers would have left the machine. Each commit gets its own oid; a branch or a
tag resolves to its commit, and a commit oid reads the files as they were then.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re

import yaml

# /api/{models|datasets|spaces}/{ns}/{name}/{preupload|commit}/{revision}
_API = re.compile(r"^/api/(models|datasets|spaces)/([^/]+/[^/]+)/(preupload|commit)/[^/]+$")
# /{datasets/|spaces/|}{ns}/{name}.git/info/lfs/objects/{batch|verify}
# /{datasets/|spaces/|}{ns}/{name}/resolve/{revision}/{filename}
_RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
# /api/{models|datasets}/{ns}/{name}[/revision/{revision}]  and  .../tree/{revision}
_INFO = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_TREE = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)/tree/([^/]+)$")
# /api/{models|datasets}/{ns}/{name}/refs  (list_repo_refs)
_REFS = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)/refs$")
# /api/{models|datasets|spaces}/{ns}/{name}/{branch|tag}/{name or revision}
_REF = re.compile(r"^/api/(models|datasets|spaces)/([^/]+/[^/]+)/(branch|tag)/([^/]+)$")
_LFS = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)\.git/info/lfs/objects/(batch|verify)$")


def front_matter(text: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, "no YAML front matter"
    return yaml.safe_load(match.group(1))


GITATTRIBUTES = (
    b"*.parquet filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
)


def remote_oid(content: bytes | None, mode: str) -> str | None:
    """The oid the Hub gives a file in its preupload answer: the sha256 of an LFS file's content, the
    git blob sha1 of a regular one (``huggingface_hub``'s ``CommitOperationAdd._local_oid`` compares them)."""
    if content is None:
        return None
    if mode == "lfs":
        return hashlib.sha256(content).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class FakeHub:
    """The Hub endpoints ``create_repo`` + ``upload_folder`` use, and an LFS storage host.

    ``lfs_suffixes``: files the preupload answer sends through LFS (the real Hub picks binary and large
    files); the rest go base64-encoded inside the commit.
    """

    def __init__(self, lfs_suffixes=()):
        self.lfs_suffixes = tuple(lfs_suffixes)
        self.requests = []  # (method, url, headers, body)
        self.stored = {}  # LFS oid -> bytes PUT to storage
        self.commits = []  # parsed ndjson lines of each commit
        self.repos = []  # (repo type, repo id) of each commit, in order
        self.unexpected = []  # requests to endpoints not emulated here
        self.revisions = {}  # (repo type, repo id, branch or tag) -> {path: bytes}, after each commit
        self.tags = []  # (repo id, tag, revision) of each create_tag
        self.last_revision = {}  # (repo type, repo id) -> the branch of its last commit
        self.heads = {}  # (repo type, repo id, branch or tag) -> commit oid
        self.snapshots = {}  # commit oid -> {path: bytes} as of that commit
        self.tag_names = set()  # (repo type, repo id, tag)
        self.private = {}  # (repo type, repo id) -> its visibility, set when it is created (as the Hub keeps it)
        self.commits_fail = False  # True: every commit is answered 500, after its files were uploaded

    def handler(self, request):
        import httpx2

        body = request.read()
        self.requests.append((request.method, str(request.url), dict(request.headers), body))
        path, host = request.url.path, request.url.host
        if host == "storage.invalid" and request.method == "PUT":
            self.stored[path.rsplit("/", 1)[1]] = body
            return httpx2.Response(200)
        if (request.method, host, path) == ("GET", "huggingface.co", "/api/agent-harnesses"):
            # huggingface_hub fetches this public registry (no auth) once per process to build its
            # user agent; a 404 makes it fall back to an empty one and write no cache file.
            return httpx2.Response(404)
        if host != "huggingface.co":
            self.unexpected.append((request.method, str(request.url)))
            return httpx2.Response(404, json={"error": f"unexpected host {host}"})
        if (request.method, path) == ("POST", "/api/repos/create"):
            payload = json.loads(body)
            prefix = {"dataset": "datasets/", "space": "spaces/"}.get(payload.get("type"), "")
            main = (payload.get("type") or "model", f"{payload['organization']}/{payload['name']}", "main")
            private = bool(payload.get("private")) or payload.get("visibility") == "private"
            self.private.setdefault(main[:2], private)  # an existing repo keeps its own
            if main not in self.revisions:  # the Hub's first commit of a new repo: its .gitattributes alone
                oid = hashlib.sha1(f"{main}@initial".encode()).hexdigest()
                self.revisions[main] = {".gitattributes": GITATTRIBUTES}
                self.heads[main], self.snapshots[oid] = oid, dict(self.revisions[main])
            return httpx2.Response(
                200,
                json={"url": f"https://huggingface.co/{prefix}{payload['organization']}/{payload['name']}"},
            )
        if (request.method, path) == ("POST", "/api/validate-yaml"):
            try:
                front_matter(json.loads(body)["content"])
            except Exception as e:  # noqa: BLE001 - any parse failure is the Hub's 400
                return httpx2.Response(400, json={"errors": [{"message": str(e)}]})
            return httpx2.Response(200, json={"errors": [], "warnings": []})
        api, lfs = _API.match(path), _LFS.match(path)
        if request.method == "POST" and api and api.group(3) == "preupload":
            files = json.loads(body)["files"]
            there = self.revisions.get((api.group(1)[:-1], api.group(2), path.rsplit("/", 1)[1]), {})

            def mode(name):
                return "lfs" if name.endswith(self.lfs_suffixes) else "regular"

            # the remote file's oid, as the Hub answers it: the client leaves out a file that has not changed
            return httpx2.Response(
                200,
                json={
                    "files": [
                        {
                            "path": f["path"],
                            "uploadMode": mode(f["path"]),
                            "shouldIgnore": False,
                            "oid": remote_oid(there.get(f["path"]), mode(f["path"])),
                        }
                        for f in files
                    ]
                },
            )
        refs = _REFS.match(path)
        if request.method == "GET" and refs:  # list_repo_refs
            kind, repo = refs.group(1)[:-1], refs.group(2)
            named = [(k[2], oid) for k, oid in self.heads.items() if k[:2] == (kind, repo)]
            if not named:
                return httpx2.Response(
                    404, headers={"X-Error-Code": "RepoNotFound"}, json={"error": "RepoNotFound"}
                )
            tags = [(n, oid) for n, oid in named if (kind, repo, n) in self.tag_names]
            branches = [(n, oid) for n, oid in named if (kind, repo, n) not in self.tag_names]
            return httpx2.Response(200, json={
                "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": oid} for n, oid in branches],
                "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": oid} for n, oid in tags],
                "converts": []})  # fmt: skip
        if request.method == "POST" and lfs and lfs.group(3) == "batch":
            objects = json.loads(body)["objects"]
            verify = f"https://huggingface.co{path.rsplit('/', 1)[0]}/verify"
            return httpx2.Response(
                200,
                json={
                    "transfer": "basic",
                    "objects": [
                        {
                            "oid": o["oid"],
                            "size": o["size"],
                            "authenticated": True,
                            "actions": {
                                "upload": {"href": f"https://storage.invalid/lfs/{o['oid']}"},
                                "verify": {"href": verify},
                            },
                        }
                        for o in objects
                    ],
                },
            )
        if request.method == "POST" and lfs and lfs.group(3) == "verify":
            return httpx2.Response(200, json={"success": True})
        info, tree = _INFO.match(path), _TREE.match(path)
        if request.method == "GET" and (info or tree):  # repo_info, list_repo_tree (snapshot_download)
            match = info or tree
            kind, repo, revision = match.group(1)[:-1], match.group(2), match.group(3) or "main"
            oid, files = self._at(kind, repo, revision)
            if files is None:
                known = any(k[:2] == (kind, repo) for k in self.heads)
                code = "RevisionNotFound" if known else "RepoNotFound"
                return httpx2.Response(404, headers={"X-Error-Code": code}, json={"error": code})
            if info:
                return httpx2.Response(200, json={"id": repo, "sha": oid, "private": self.private.get((kind, repo), False),
                                                  "siblings": [{"rfilename": f} for f in sorted(files)]})  # fmt: skip
            return httpx2.Response(200, json=[self._tree_entry(f, c) for f, c in sorted(files.items())])
        resolve = _RESOLVE.match(path)
        if request.method in ("HEAD", "GET") and resolve:  # hf_hub_download
            kind, repo, revision, filename = (
                resolve.group(1) or "models",
                resolve.group(2),
                resolve.group(3),
                resolve.group(4),
            )
            oid, files = self._at(kind[:-1], repo, revision)
            if files is None or filename not in files:
                code = "RevisionNotFound" if files is None and revision != "main" else "EntryNotFound"
                return httpx2.Response(404, headers={"X-Error-Code": code}, json={"error": code})
            content = files[filename]
            headers = {"ETag": f'"{hashlib.sha1(content).hexdigest()}"', "X-Repo-Commit": oid,
                       "Content-Length": str(len(content))}  # fmt: skip
            return httpx2.Response(200, headers=headers, content=b"" if request.method == "HEAD" else content)
        ref = _REF.match(path)
        if request.method == "POST" and ref:  # create_branch / create_tag
            kind, repo, what, name = ref.group(1), ref.group(2), ref.group(3), ref.group(4)
            if what == "branch":
                key = (kind[:-1], repo, name)
                if key in self.revisions:
                    return httpx2.Response(409, json={"error": "branch exists"})
                self.revisions[key] = dict(self.revisions.get((kind[:-1], repo, "main"), {}))
                if (kind[:-1], repo, "main") in self.heads:
                    self.heads[key] = self.heads[(kind[:-1], repo, "main")]
                return httpx2.Response(200, json={})
            tag = json.loads(body)["tag"]
            if (kind[:-1], repo, tag) in self.revisions:
                return httpx2.Response(409, json={"error": "tag exists"})
            source = self.revisions.get(
                (kind[:-1], repo, self.last_revision.get((kind[:-1], repo), "main")), {}
            )
            self.revisions[(kind[:-1], repo, tag)] = dict(self.snapshots.get(name, source))
            self.heads[(kind[:-1], repo, tag)] = name
            self.tag_names.add((kind[:-1], repo, tag))
            self.tags.append((repo, tag, name))
            return httpx2.Response(200, json={})
        if request.method == "POST" and api and api.group(3) == "commit" and self.commits_fail:
            return httpx2.Response(500, json={"error": "Internal Error"})
        if request.method == "POST" and api and api.group(3) == "commit":
            lines = [json.loads(line) for line in body.splitlines()]
            parent = next((x["value"].get("parentCommit") for x in lines if x["key"] == "header"), None)
            at = (api.group(1)[:-1], api.group(2), path.rsplit("/", 1)[1])
            if parent is not None and parent != self.heads.get(
                at
            ):  # the Hub's check of create_commit's parent_commit
                return httpx2.Response(
                    412, json={"error": "A commit has happened since. Please refresh and try again."}
                )
            self.commits.append(lines)
            kind, repo = api.group(1), api.group(2)
            self.repos.append((kind[:-1], repo))
            revision = path.rsplit("/", 1)[1]
            files = self.revisions.setdefault((kind[:-1], repo, revision), {})
            files.update(self._files_of(self.commits[-1]))
            for line in self.commits[-1]:
                if line["key"] == "deletedFile":
                    files.pop(line["value"]["path"], None)
                elif line["key"] == "deletedFolder":
                    for name in [f for f in files if f.startswith(line["value"]["path"].rstrip("/") + "/")]:
                        del files[name]
            self.last_revision[(kind[:-1], repo)] = revision
            prefix = "" if kind == "models" else f"{kind}/"
            oid = hashlib.sha1(f"{kind}/{repo}@{len(self.commits)}".encode()).hexdigest()
            self.heads[(kind[:-1], repo, revision)] = oid
            self.snapshots[oid] = dict(files)
            return httpx2.Response(
                200,
                json={"commitUrl": f"https://huggingface.co/{prefix}{repo}/commit/{oid}", "commitOid": oid},
            )
        self.unexpected.append((request.method, str(request.url)))
        return httpx2.Response(404, json={"error": f"not emulated: {request.method} {path}"})

    def _tree_entry(self, path: str, content: bytes) -> dict:
        """A file of ``list_repo_tree``: its git blob oid, and an LFS file's sha256 (``RepoFile.lfs``)."""
        entry = {"type": "file", "oid": remote_oid(content, "regular"), "size": len(content), "path": path}
        if path.endswith(self.lfs_suffixes):
            entry["lfs"] = {"oid": remote_oid(content, "lfs"), "size": len(content), "pointerSize": 134}
        return entry

    def _at(self, kind: str, repo: str, revision: str) -> tuple[str | None, dict | None]:
        """``(commit oid, files)`` of a branch, a tag or a commit oid; ``(None, None)`` if unknown."""
        if (kind, repo, revision) in self.revisions:
            return self.heads.get((kind, repo, revision)), self.revisions[(kind, repo, revision)]
        if revision in self.snapshots:
            return revision, self.snapshots[revision]
        return None, None

    def _files_of(self, commit) -> dict[str, bytes]:
        files = {}
        for line in commit:
            if line["key"] == "file":
                files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            elif line["key"] == "lfsFile":
                files[line["value"]["path"]] = self.stored[line["value"]["oid"]]
        return files

    def committed_files(self) -> dict[str, bytes]:
        """path -> content of every file in the commits; LFS pointers resolved from storage."""
        files = {}
        for commit in self.commits:
            files.update(self._files_of(commit))
        return files
