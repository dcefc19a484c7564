"""``make wheelhouse``: a folder of wheels from which an offline GPU node installs ``metachunk[train]``.

A GPU node in a cluster often reaches no package index and no Hub. This script collects, on a
machine that does, what ``pip install --no-index --find-links DIR 'metachunk[train]'`` needs there,
for the node's Python version and platform:

- metachunk's own wheel, built from this checkout;
- the wheels of the core dependencies and of the extras asked for (``train`` by default), and of
  everything they need, at exactly the versions the suite runs on: ``constraints.txt``'s pins, and
  for the packages it does not pin, the versions installed in this venv (installed under those pins);
- DeepSpeed as its sdist, which the node builds against its own torch (``--no-build-isolation``).

Never torch, nor what comes with a torch build (triton, the ``nvidia-*`` CUDA runtime wheels,
torchvision): the node keeps its own CUDA build, and the core only asks for ``torch>=2.6``.

Given the node's ``pip list --format=freeze`` or ``pip freeze`` (``--node-freeze``), a package the
node already has at a version that meets every requirement on it is left out, so the folder holds
only what the node lacks. A package the list names without a version (``NAME @ URL``, or a bare
name from a package list) is fetched, unless ``--unversioned keep`` leaves it to the node.

What the node keeps, it keeps at a version this venv has not run: a version the list does not give,
or one other than the closure's. Its own requirements at that version are unknown here, and may
clash with what the folder brings (a node's tokenizers 0.23.2 asks for huggingface-hub below 2,
where the core needs 2.4). So the folder also carries the closure's version of each such
package as a *spare*, where its file is small (``--spare-max-mb``; 0 carries none): pip's resolver
keeps the node's version where it fits, and backtracks to the spare where the node's version does
not meet a requirement or its own requirements conflict
(https://pip.pypa.io/en/stable/topics/dependency-resolution/; seen in
``bench/wheelhouse_install.sh`` with ``NODE_LIST``). A spare over the size, or one that does not
download, is left out and named at the end: those are what the install still trusts the node for.

The dependency closure is computed offline, from ``pyproject.toml``,
``constraints.txt`` and the requirements of the packages installed in this venv, with markers
evaluated for the node's Python and platform; ``--dry-run`` prints it (what is fetched and why,
what is left out and why) and touches no network.

Exit status: 0 done, 1 a download or build failed (nothing is written), 2 bad input (a missing or
malformed freeze file, a bad option), named in one line.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "metachunk"

# Built on the node from the sdist: its setup.py reads the installed torch (its version and CUDA go
# into the package, and DS_BUILD_OPS=1 pre-compiles the ops with the node's nvcc), and torch must be
# installed before it, which pip's isolated build environment would not see
# (https://www.deepspeed.ai/tutorials/advanced-install/: "PyTorch must be installed before
# pre-compiling any DeepSpeed C++/CUDA ops"). Hence --no-build-isolation on the node.
FROM_SDIST = {"deepspeed"}
# What those builds add that this venv's metadata cannot show. DeepSpeed's setup.py appends
# nvidia-ml-py to its requirements when the torch it builds against is a CUDA build (not so on a
# machine whose torch is a CPU build). Building it without isolation and without the `wheel` package needs
# setuptools' own bdist_wheel, which setuptools has had since 70.1; that requirement lapses where
# the node already has DeepSpeed and nothing is built.
ADDED_ON_NODE = {"deepspeed": [("nvidia-ml-py", "deepspeed built against a CUDA torch")]}
BUILD_REQUIRES = {"deepspeed": [("setuptools>=70.1", "building deepspeed's sdist")]}
# Packages that declare no requirements of their own, though this venv does not have them
# installed to read it from (checked against the wheel's METADATA).
NO_REQUIREMENTS = {"nvidia-ml-py"}
# The node's torch build brings these, matched to it; a wheel from here would replace them.
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "triton", "pytorch-triton"}


def comes_with_torch(name: str) -> bool:
    # nvidia-ml-py is NVML's Python binding, no CUDA runtime library: DeepSpeed asks for it.
    return (
        name in TORCH_FAMILY
        or name.startswith("cuda-")
        or (name.startswith("nvidia-") and name != "nvidia-ml-py")
    )


class BadInput(Exception):
    """Input the user can fix: printed as one line, exit status 2."""


class FetchFailed(Exception):
    """A download or build that failed: printed as one line, exit status 1."""


# ---------------------------------------------------------------------------------------- input


@dataclass(frozen=True)
class Target:
    python_version: str  # "3.12"
    platform: str  # "manylinux_2_28_x86_64"

    @property
    def tag(self) -> str:
        return "cp" + self.python_version.replace(".", "")

    @property
    def machine(self) -> str:
        return re.sub(r"^(manylinux(_\d+_\d+|\d+)|linux)_", "", self.platform)

    @property
    def platforms(self) -> list[str]:
        """The ``--platform`` tags pip may take for this node: the manylinux tag given and every
        older one (pip does not widen a ``manylinux_2_X`` tag by itself), with the legacy aliases."""
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", self.platform)
        if not m:
            return [self.platform]
        newest, arch = int(m.group(1)), m.group(2)
        aliases = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        tags = []
        for minor in range(newest, 4, -1):
            tags.append(f"manylinux_2_{minor}_{arch}")
            if minor in aliases:
                tags.append(f"{aliases[minor]}_{arch}")
        return tags

    def environment(self) -> dict[str, str]:
        """PEP 508 marker values on the node."""
        return {
            "python_version": self.python_version,
            "python_full_version": f"{self.python_version}.0",
            "implementation_name": "cpython",
            "implementation_version": f"{self.python_version}.0",
            "platform_python_implementation": "CPython",
            "os_name": "posix",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "platform_machine": self.machine,
            "platform_release": "",
            "platform_version": "",
        }


def parse_target(python_version: str, platform: str) -> Target:
    if not re.fullmatch(r"3\.\d+", python_version):
        raise BadInput(f"--python-version {python_version!r}: give MAJOR.MINOR, e.g. 3.12")
    if not re.fullmatch(
        r"(manylinux_2_\d+|manylinux2014|manylinux2010|manylinux1|linux)_(x86_64|aarch64)", platform
    ):
        raise BadInput(f"--platform {platform!r}: give a Linux wheel tag, e.g. manylinux_2_28_x86_64")
    return Target(python_version, platform)


NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
FREEZE_PINNED = re.compile(rf"({NAME})(?:\[[^\]]*\])?\s*===?\s*(\S+)")
FREEZE_URL = re.compile(rf"({NAME})(?:\[[^\]]*\])?\s*@\s*\S+")
LIST_COLUMNS = re.compile(rf"({NAME})\s+(\S+)(?:\s+\S.*)?")  # `pip list`: NAME VERSION [LOCATION]


def read_freeze(path: Path) -> dict[str, Version | None]:
    """The node's packages from ``pip freeze`` or ``pip list`` output: name -> version, or None where
    the line gives none (``NAME @ URL``, a bare name)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file (the node's `pip freeze` output)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot be read: {e}") from None
    found: dict[str, Version | None] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#") or re.fullmatch(r"Package\s+Version(\s+.*)?|-+(\s+-+)*", line):
            continue
        if line.startswith(("-e ", "--editable")):  # a checkout installed in place: not a wheel pip can use
            continue
        if m := FREEZE_PINNED.fullmatch(line):
            name, version = m.group(1), m.group(2)
        elif m := FREEZE_URL.fullmatch(line):
            name, version = m.group(1), None
        elif m := LIST_COLUMNS.fullmatch(line):
            name, version = m.group(1), m.group(2)
        elif re.fullmatch(NAME, line):
            name, version = line, None
        else:
            raise BadInput(
                f"{path}:{lineno}: not a `pip freeze` line (NAME==VERSION, NAME @ URL or NAME VERSION): {raw.strip()!r}"
            )
        try:
            found[canonicalize_name(name)] = None if version is None else Version(version)
        except InvalidVersion:
            raise BadInput(f"{path}:{lineno}: {version!r} is not a version: {raw.strip()!r}") from None
    return found


def read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def read_constraints(path: Path) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for lineno, raw in enumerate(read_text(path, "--constraints").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
            (spec,) = req.specifier
            if spec.operator != "==" or "*" in spec.version:
                raise ValueError
        except (InvalidRequirement, ValueError):
            raise BadInput(f"{path}:{lineno}: not an exact pin NAME==VERSION: {raw.strip()!r}") from None
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def read_roots(pyproject: Path, extras: list[str]) -> list[tuple[Requirement, str]]:
    """The project's core requirements and those of ``extras`` (an extra naming the project's own
    other extras, ``metachunk[semantic]``, is followed)."""
    try:
        project = tomllib.loads(read_text(pyproject, "--pyproject"))["project"]
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"--pyproject {pyproject}: not TOML ({e})") from None
    except KeyError:
        raise BadInput(f"--pyproject {pyproject}: no [project] table") from None
    optional = project.get("optional-dependencies", {})

    def requirement(text: str, where: str) -> Requirement:
        try:
            return Requirement(text)
        except InvalidRequirement as e:
            reason = str(e).splitlines()[0]  # packaging draws a caret under the text on the next lines
            raise BadInput(
                f"--pyproject {pyproject}: {where}: {text!r} is not a requirement ({reason})"
            ) from None

    roots = [(requirement(r, "dependencies"), PROJECT) for r in project.get("dependencies", [])]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise BadInput(
                f"--extras {extra!r}: {pyproject.name} has no such extra (it has {', '.join(optional)})"
            )
        for text in optional[extra]:
            req = requirement(text, f"optional-dependencies.{extra}")
            if canonicalize_name(req.name) == PROJECT:
                todo.extend(req.extras)
            else:
                roots.append((req, f"{PROJECT}[{extra}]"))
    return roots


# -------------------------------------------------------------------------------------- closure


@dataclass
class Package:
    name: str  # canonical
    version: Version | None = None  # the pin fetched; None for the torch family
    pinned_by: str = ""  # "constraints.txt" or "the venv"
    needs: list[tuple[SpecifierSet, str]] = field(default_factory=list)  # (specifier, who asks)
    extras: set[str] = field(default_factory=set)
    unknown_requirements: bool = False

    @property
    def with_torch(self) -> bool:
        return comes_with_torch(self.name)

    def needs_text(self) -> str:
        asked = [f"{spec or 'any'} ({who})" for spec, who in self.needs]
        return ", ".join(dict.fromkeys(asked))


def installed() -> dict[str, metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist)  # sys.path order: the one imported
    return found


def closure(
    roots: list[tuple[Requirement, str]],
    target: Target,
    pins: dict[str, Version],
    venv: dict[str, metadata.Distribution],
) -> dict[str, Package]:
    """Every package the roots need on the node, with its pin and every requirement on it."""
    env = target.environment()

    def active(req: Requirement, extras: set[str]) -> bool:
        return req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in {"", *extras})

    packages: dict[str, Package] = {}
    queue = list(roots)
    while queue:
        req, who = queue.pop(0)
        name = canonicalize_name(req.name)
        if name == PROJECT:
            continue
        pkg = packages.get(name)
        new = pkg is None
        if new:
            pkg = packages[name] = Package(name)
        pkg.needs.append((req.specifier, who))
        new_extras = set(req.extras) - pkg.extras
        pkg.extras |= new_extras
        if pkg.with_torch or not (new or new_extras):
            continue
        if new:
            dist = venv.get(name)
            if name in pins:
                pkg.version, pkg.pinned_by = pins[name], "constraints.txt"
                if dist is not None and Version(dist.version) != pkg.version:
                    raise BadInput(
                        f"constraints.txt pins {name}=={pkg.version} but this venv has {dist.version}: "
                        "`make install` brings the venv to the pins"
                    )
            elif dist is not None:
                pkg.version, pkg.pinned_by = Version(dist.version), "the venv"
            else:
                raise BadInput(
                    f"{name} (needed by {who} on Python {target.python_version}) is neither pinned in "
                    "constraints.txt nor installed in this venv: pin it in constraints.txt"
                )
        dist = venv.get(name)
        requires = [Requirement(r) for r in dist.requires or []] if dist else []
        pkg.unknown_requirements = dist is None and name not in NO_REQUIREMENTS
        if new:
            chosen = [r for r in requires if active(r, pkg.extras)]
            added = ADDED_ON_NODE.get(name, []) + BUILD_REQUIRES.get(name, [])
            queue.extend((Requirement(text), why) for text, why in added)
        else:  # only what the extras asked for now add
            chosen = [r for r in requires if active(r, new_extras) and not active(r, set())]
        queue.extend((r, f"{dist.metadata['Name']} {pkg.version}") for r in chosen)
    for pkg in packages.values():
        if pkg.version is None:
            continue
        for spec, who in pkg.needs:
            if not spec.contains(pkg.version, prereleases=True):
                raise BadInput(f"{pkg.name}=={pkg.version} ({pkg.pinned_by}) does not meet {spec} ({who})")
    return packages


# ----------------------------------------------------------------------------------------- plan


@dataclass
class Entry:
    name: str
    action: str  # "fetch", "spare", "skip" or "never"
    what: str  # "wheel", "sdist", "wheel built from this checkout", ""
    version: str
    why: str

    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def plan(
    packages: dict[str, Package],
    node: dict[str, Version | None] | None,
    keep_unversioned: bool = False,
    spares: bool = False,
) -> list[Entry]:
    """What to do with each package: fetch it, skip it (the node has it; with ``spares``, carry the
    closure's version beside it where the node's is another or not given), or never fetch it (the node's
    torch)."""
    entries = [Entry(PROJECT, "fetch", "wheel built from this checkout", "", "the package itself")]

    def met(pkg: Package, version: Version) -> bool:
        return all(spec.contains(version, prereleases=True) for spec, _ in pkg.needs)

    # A build requirement lapses where the node already has the package it would build.
    for name, build in BUILD_REQUIRES.items():
        has = None if node is None or name not in packages else node.get(name)
        if has is not None and met(packages[name], has):
            for text, why in build:
                needed = packages[canonicalize_name(Requirement(text).name)]
                needed.needs = [(spec, who) for spec, who in needed.needs if who != why]
    for name in sorted(packages):
        pkg = packages[name]
        if not pkg.needs:
            continue
        has = None if node is None else node.get(name, "absent")
        if pkg.with_torch:
            if node is None:
                why = "the node's torch build brings it"
            elif has == "absent":
                why = "the node's torch build brings it; the node's freeze lacks it" + (
                    f": install it there first (needs {pkg.needs_text()})" if name == "torch" else ""
                )
            elif has is not None and not met(pkg, has):
                why = f"the node has {has}, which does not meet {pkg.needs_text()}: upgrade it there"
            else:
                why = f"the node has {has or 'it'} (needs {pkg.needs_text()})"
            entries.append(Entry(name, "never", "", "", why))
            continue
        what = "sdist" if name in FROM_SDIST else "wheel"
        version = str(pkg.version)
        if node is None:
            entries.append(Entry(name, "fetch", what, version, "no node freeze given"))
        elif has == "absent":
            entries.append(Entry(name, "fetch", what, version, "not on the node"))
        elif has is None and keep_unversioned and spares:
            why = f"the node has it, version not given (needs {pkg.needs_text()}): a spare for its pip"
            entries.append(Entry(name, "spare", what, version, why))
        elif has is None and keep_unversioned:
            why = f"the node has it, version not given (needs {pkg.needs_text()}; its pip checks at install)"
            entries.append(Entry(name, "skip", "", "", why))
        elif has is None:
            entries.append(Entry(name, "fetch", what, version, "the node's freeze gives no version"))
        elif met(pkg, has) and spares and has != pkg.version:
            why = f"the node has {has}; needs {pkg.needs_text()}; its own requirements at {has}: a spare for its pip"
            entries.append(Entry(name, "spare", what, version, why))
        elif met(pkg, has):
            entries.append(Entry(name, "skip", "", str(has), f"the node has {has}; needs {pkg.needs_text()}"))
        else:
            bad = [f"{s} ({who})" for s, who in pkg.needs if not s.contains(has, prereleases=True)]
            entries.append(Entry(name, "fetch", what, version, f"the node has {has}; needs {', '.join(bad)}"))
    return entries


def build_requires(entries: list[Entry]) -> list[str]:
    """What the fetched sdists build with, where the folder carries it (fetched, or a spare): without
    build isolation they build with the node's own setuptools, which must be there before pip starts.
    A node whose setuptools is new enough keeps it."""
    carried = {e.name for e in entries if e.action in ("fetch", "spare")}
    sdists = [e.name for e in entries if e.action == "fetch" and e.what == "sdist"]
    build = [text for name in sdists for text, _ in BUILD_REQUIRES.get(name, [])]
    return build if any(canonicalize_name(Requirement(t).name) in carried for t in build) else []


def install_commands(entries: list[Entry], dest: str, extras: list[str]) -> list[str]:
    commands = []
    build = build_requires(entries)
    if build:
        commands.append(f"pip install --no-index --find-links {dest} " + " ".join(f"'{t}'" for t in build))
    target = f"{PROJECT}[{','.join(extras)}]" if extras else PROJECT
    commands.append(f"pip install --no-index --find-links {dest} --no-build-isolation '{target}'")
    return commands


def report(entries: list[Entry], target: Target, extras: list[str], freeze: Path | None) -> str:
    width = max(len(e.name) + len(e.version) + 2 for e in entries)
    lines = [
        f"wheelhouse for CPython {target.python_version} on {target.platform}, "
        f"{PROJECT}[{','.join(extras)}]; node freeze: {freeze or 'none'}"
    ]
    for action in ("fetch", "spare", "skip", "never"):
        for e in (e for e in entries if e.action == action):
            pin = f"{e.name}=={e.version}" if e.version and action in ("fetch", "spare") else e.name
            kind = f" [{e.what}]" if e.what and e.what != "wheel" else ""
            lines.append(f"  {action:<5}  {pin:<{width}}  {e.why}{kind}")
    count = {a: sum(e.action == a for e in entries) for a in ("fetch", "spare", "skip", "never")}
    spares = f", {count['spare']} spares (where small)" if count["spare"] else ""
    lines.append(
        f"{count['fetch']} to fetch{spares}, {count['skip']} left out (the node has them), "
        f"{count['never']} never fetched (the node's torch)"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- fetch


def pip(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1]


def fetch_one(entry: Entry, target: Target, staging: Path, scratch: Path) -> str:
    """Put ``entry``'s file in ``staging``; returns a note for the manifest."""
    if entry.name == PROJECT:
        proc = pip(["wheel", "--no-deps", "--no-build-isolation", "-w", str(staging), str(ROOT)])
        if proc.returncode:
            raise FetchFailed(f"{PROJECT}: the wheel did not build: {last_line(proc)}")
        return "built from this checkout"
    req = entry.requirement()
    if entry.what == "sdist":
        # The venv has setuptools and torch, which DeepSpeed's setup.py reads to prepare its metadata.
        proc = pip(
            ["download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation", "-d", str(staging), req]
        )
        if proc.returncode:
            raise FetchFailed(f"{req}: the sdist did not download: {last_line(proc)}")
        return "sdist, built on the node"
    platforms = [flag for tag in target.platforms for flag in ("--platform", tag)]
    proc = pip(
        ["download", "--no-deps", "--only-binary=:all:", "--python-version", target.python_version,
         "--implementation", "cp", *platforms, "-d", str(staging), req]
    )  # fmt: skip
    if proc.returncode == 0:
        return "wheel"
    # No wheel for the node: an sdist-only release. A pure-Python one is built here into a wheel
    # that runs anywhere; a compiled one has to be built on a machine like the node.
    built = scratch / entry.name
    proc = pip(["wheel", "--no-deps", "--no-binary", ":all:", "-w", str(built), req])
    wheels = list(built.glob("*.whl")) if proc.returncode == 0 else []
    if not wheels:
        raise FetchFailed(
            f"{req}: no wheel for {target.tag} on {target.platform}, and its sdist did not build here"
        )
    _, _, _, tags = parse_wheel_filename(wheels[0].name)
    if not all(t.abi == "none" and t.platform == "any" for t in tags):
        raise FetchFailed(
            f"{req}: no wheel for {target.tag} on {target.platform}, and it is not pure Python "
            f"({wheels[0].name}): build it on a machine like the node (`pip wheel --no-deps {req}`) and add it"
        )
    shutil.move(str(wheels[0]), staging / wheels[0].name)
    return "wheel built here from its sdist (pure Python)"


def file_of(name: str, staging: Path) -> Path | None:
    for path in staging.iterdir():
        try:
            if path.name.endswith(".whl"):
                found = parse_wheel_filename(path.name)[0]
            else:
                found = parse_sdist_filename(path.name)[0]
        except (InvalidWheelFilename, InvalidSdistFilename):
            continue
        if found == name:
            return path
    return None


def fetch(
    entries: list[Entry], target: Target, dest: Path, manifest: dict, spare_max_bytes: int
) -> tuple[list[Path], dict[str, str]]:
    """Writes the folder whole; returns its files and the spares left out, with why."""
    from metachunk.artifacts import replace_dir
    from metachunk.progress import bar as progress_bar

    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent)
    )  # replace_dir opens its mode
    try:
        scratch = staging / ".build"
        todo = [e for e in entries if e.action in ("fetch", "spare")]
        notes, dropped = {}, {}
        for entry in progress_bar(todo, desc="wheelhouse", unit="pkg"):
            try:
                notes[entry.name] = fetch_one(entry, target, staging, scratch)
            except FetchFailed as e:
                if entry.action == "fetch":
                    raise
                dropped[entry.name] = f"did not download ({e})"
                continue
            path = file_of(entry.name, staging)
            if path is None:
                raise FetchFailed(f"{entry.name}: pip reported success but left no file for it")
            if entry.action == "spare" and path.stat().st_size > spare_max_bytes:
                dropped[entry.name] = f"{path.stat().st_size / 1e6:.1f} MB, over the spares' limit"
                path.unlink()
                del notes[entry.name]
        shutil.rmtree(scratch, ignore_errors=True)
        for item in manifest["packages"]:
            if item["name"] in notes:
                item |= {"file": file_of(item["name"], staging).name, "how": notes[item["name"]]}
            elif item["name"] in dropped:
                item |= {"how": f"spare left out: {dropped[item['name']]}"}
        (staging / "wheelhouse.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        replace_dir(staging, dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return sorted(p for p in dest.iterdir() if p.suffix in (".whl", ".gz")), dropped


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="wheelhouse", description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", default="dist/wheelhouse", help="the folder to write (replaced whole)")
    p.add_argument("--python-version", default="3.12", help="the node's Python, MAJOR.MINOR")
    p.add_argument("--platform", default="manylinux_2_28_x86_64", help="the node's newest wheel platform tag")
    p.add_argument("--extras", default="train", help="comma-separated extras of metachunk to install")
    p.add_argument(
        "--node-freeze", type=Path, help="the node's `pip list --format=freeze` (or `pip freeze`) output"
    )
    p.add_argument(
        "--unversioned",
        choices=["fetch", "keep"],
        default="fetch",
        help="a package the node's list names without a version: fetch it (safe), or keep the node's "
        "(a smaller folder; a spare, where small, covers a version that does not do)",
    )
    p.add_argument(
        "--spare-max-mb",
        type=float,
        default=5.0,
        help="the largest spare carried, in MB: the closure's version of a package the node keeps at "
        "another version or an unknown one, which pip takes only where the node's does not do; 0: none",
    )
    p.add_argument("--constraints", type=Path, default=ROOT / "constraints.txt")
    p.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    p.add_argument("--dry-run", action="store_true", help="list what would be fetched; fetch nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        target = parse_target(args.python_version, args.platform)
        extras = [e.strip() for e in args.extras.split(",") if e.strip()]
        node = read_freeze(args.node_freeze) if args.node_freeze else None
        packages = closure(
            read_roots(args.pyproject, extras), target, read_constraints(args.constraints), installed()
        )
    except BadInput as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 2
    entries = plan(packages, node, args.unversioned == "keep", spares=args.spare_max_mb > 0)
    print(report(entries, target, extras, args.node_freeze))
    unknown = sorted(p.name for p in packages.values() if p.unknown_requirements)
    if unknown:
        print(
            f"note: not installed in this venv, so their own requirements are not followed: {', '.join(unknown)}"
        )
    commands = install_commands(entries, args.dest, extras)
    if args.dry_run:
        print("dry run: nothing fetched. On the node, after the real run:")
        print("\n".join(f"  {c}" for c in commands))
        return 0
    manifest = {
        "python_version": target.python_version,
        "platform": target.platform,
        "extras": extras,
        "node_freeze": str(args.node_freeze) if args.node_freeze else None,
        "unversioned": args.unversioned,
        "build_requires": build_requires(entries),
        "install": commands,
        "packages": [vars(e) | {"file": None} for e in entries],
    }
    try:
        files, dropped = fetch(entries, target, Path(args.dest), manifest, int(args.spare_max_mb * 1e6))
    except FetchFailed as e:
        print(f"wheelhouse: {e} (nothing written)", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in files)
    own = next(p.name for p in files if canonicalize_name(p.name.split("-")[0]) == PROJECT)
    if re.search(r"\.d\d{8}", own):  # setuptools-scm marks a build from a tree with uncommitted changes
        print(f"note: {own} was built from uncommitted changes; build from a clean checkout to ship it")
    spares = [e.name for e in entries if e.action == "spare" and e.name not in dropped]
    if spares:
        print(f"spares carried ({len(spares)}): {', '.join(spares)}")
    if dropped:
        print("spares left out (the node's own version must do):")
        print("\n".join(f"  {name}: {why}" for name, why in sorted(dropped.items())))
    print(f"{args.dest}: {len(files)} files, {size / 1e6:.1f} MB. On the node (its own torch installed):")
    print("\n".join(f"  {c}" for c in commands))
    return 0


if __name__ == "__main__":
    sys.exit(main())
