"""``make wheelhouse`` (``tools/wheelhouse.py``): the offline GPU node's install, checked on CPU and
without network. The dry run computes the closure from ``pyproject.toml``, ``constraints.txt`` and
this venv's installed metadata, and leaves out what a node's freeze already has; the fetch is checked
with pip replaced by a fake that writes the files pip would."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "wheelhouse.py"
PINS = {
    line.split("==")[0].lower(): line.split("==")[1].strip()
    for line in (ROOT / "constraints.txt").read_text().splitlines()
    if "==" in line and not line.startswith("#")
}


def load():
    spec = importlib.util.spec_from_file_location("tools_wheelhouse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


wheelhouse = load()


def h200_freeze(tmp_path: Path, *extra: str) -> Path:
    """What the H200 image had: its own CUDA torch, numpy, pyarrow and accelerate at good versions,
    transformers and huggingface_hub too old for the core, no trl and no deepspeed."""
    lines = [
        "torch==2.11.0+cu130",
        f"numpy=={PINS['numpy']}",
        f"pyarrow=={metadata.version('pyarrow')}",
        f"accelerate=={PINS['accelerate']}",
        "transformers==5.17.0",
        "huggingface_hub==1.33.0",
        *extra,
    ]
    path = tmp_path / "node-freeze.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def no_network(monkeypatch):
    """Any process started or socket opened fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"the dry run reached for a process or the network: {args[:1]}")

    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")


def listing(out: str) -> dict[str, tuple[str, str]]:
    """``name -> (action, rest of the line)`` from the dry run's table."""
    rows = {}
    for line in out.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[0] in ("fetch", "spare", "skip", "never"):
            rows[parts[1].split("==")[0]] = (parts[0], parts[2])
    return rows


def test_dry_run_lists_what_the_h200_lacks_and_fetches_nothing(tmp_path, no_network, capsys):
    dest = tmp_path / "wheelhouse"
    freeze = h200_freeze(tmp_path)
    argv = ["--dry-run", "--dest", str(dest), "--python-version", "3.12", "--node-freeze", str(freeze)]
    assert wheelhouse.main(argv) == 0
    out = capsys.readouterr().out
    rows = listing(out)

    assert rows["metachunk"][0] == "fetch" and "built from this checkout" in rows["metachunk"][1]
    for name in ("transformers", "huggingface-hub", "trl", "peft", "deepspeed", "pysbd", "rapidfuzz"):
        assert rows[name][0] == "fetch", (name, rows.get(name))
    assert f"transformers=={PINS['transformers']}" in out
    assert "the node has 5.17.0" in rows["transformers"][1]
    assert "the node has 1.33.0" in rows["huggingface-hub"][1]
    assert "[sdist]" in rows["deepspeed"][1]
    assert rows["nvidia-ml-py"][0] == "fetch"  # deepspeed built against the node's CUDA torch wants it
    for name in ("numpy", "pyarrow", "accelerate"):
        assert rows[name][0] == "skip", (name, rows[name])
    assert rows["torch"][0] == "never" and "2.11.0+cu130" in rows["torch"][1]
    fetched = [name for name, (action, _) in rows.items() if action == "fetch"]
    assert not [name for name in fetched if wheelhouse.comes_with_torch(name)]
    assert "torch" not in fetched and "triton" not in fetched
    assert f"pip install --no-index --find-links {dest} --no-build-isolation 'metachunk[train]'" in out
    assert not dest.exists()


def test_without_a_freeze_everything_but_torch_is_fetched(tmp_path, no_network, capsys):
    assert wheelhouse.main(["--dry-run", "--dest", str(tmp_path / "w")]) == 0
    rows = listing(capsys.readouterr().out)
    assert {action for name, (action, _) in rows.items() if name != "torch"} == {"fetch"}
    assert rows["torch"][0] == "never"


def test_deepspeeds_build_requirement_lapses_where_the_node_has_deepspeed(tmp_path, no_network, capsys):
    old_setuptools = h200_freeze(tmp_path, "setuptools==65.5.0")
    assert wheelhouse.main(["--dry-run", "--node-freeze", str(old_setuptools), "--dest", "W"]) == 0
    out = capsys.readouterr().out
    assert listing(out)["setuptools"][0] == "fetch"  # too old to build deepspeed's sdist
    assert "pip install --no-index --find-links W 'setuptools>=70.1'" in out

    (tmp_path / "sub").mkdir()
    has_deepspeed = h200_freeze(tmp_path / "sub", "setuptools==65.5.0", "deepspeed==0.19.8")
    assert wheelhouse.main(["--dry-run", "--node-freeze", str(has_deepspeed), "--dest", "W"]) == 0
    out = capsys.readouterr().out
    # nothing is built, and tensorboard asks only >=41: the node keeps its setuptools (a spare beside it, as
    # for any version other than the closure's), and nothing is installed before metachunk[train]
    assert listing(out)["setuptools"][0] == "spare"
    assert listing(out)["deepspeed"][0] == "skip"
    assert "'setuptools>=70.1'" not in out


def test_a_name_without_a_version_is_fetched_unless_kept(tmp_path, no_network, capsys):
    """A bare package list (names, no versions) says the node has a package but not which version: by
    default it is fetched anyway; --unversioned keep leaves it to the node's pip, which refuses the install
    there if the version is too old."""
    freeze = h200_freeze(tmp_path, "pandas", "matplotlib @ file:///wheels/matplotlib.whl")
    assert wheelhouse.main(["--dry-run", "--node-freeze", str(freeze), "--dest", "W"]) == 0
    rows = listing(capsys.readouterr().out)
    assert rows["pandas"][0] == rows["matplotlib"][0] == "fetch"
    assert "gives no version" in rows["pandas"][1]

    keep = ["--unversioned", "keep", "--spare-max-mb", "0"]  # no spares: see the next test
    assert wheelhouse.main(["--dry-run", "--node-freeze", str(freeze), "--dest", "W", *keep]) == 0
    rows = listing(capsys.readouterr().out)
    assert rows["pandas"][0] == rows["matplotlib"][0] == "skip"
    assert "version not given" in rows["pandas"][1] and "its pip checks at install" in rows["pandas"][1]
    assert rows["transformers"][0] == "fetch"  # a version that is given still counts
    assert rows["pysbd"][0] == "fetch"  # and what the node lacks is still fetched


def test_what_the_node_keeps_at_another_version_gets_a_small_spare(tmp_path, no_network, capsys):
    """The node keeps a package at a version this venv never ran (one the list does not give, or another
    than the closure's), whose own requirements are unknown here: the H200 image's tokenizers 0.23.2 asks
    for huggingface-hub<2, and the core needs 2.4. The closure's version rides along as a spare, which pip
    takes only where the node's does not do (seen in bench/wheelhouse_install.sh with NODE_LIST)."""
    freeze = h200_freeze(tmp_path, "typing-extensions", "tokenizers==0.23.2", "setuptools")
    argv = ["--dry-run", "--node-freeze", str(freeze), "--dest", "W", "--unversioned", "keep"]
    assert wheelhouse.main(argv) == 0
    out = capsys.readouterr().out
    rows = listing(out)
    assert rows["typing-extensions"][0] == "spare" and "version not given" in rows["typing-extensions"][1]
    assert f"typing-extensions=={metadata.version('typing-extensions')}" in out
    assert rows["tokenizers"][0] == "spare" and "its own requirements at 0.23.2" in rows["tokenizers"][1]
    assert f"tokenizers=={metadata.version('tokenizers')}" in out
    assert rows["numpy"][0] == "skip"  # the closure's own version: nothing unknown about it
    assert rows["transformers"][0] == "fetch" and rows["pysbd"][0] == "fetch"
    # DeepSpeed's sdist builds with the node's setuptools: the spare goes in first, for a node whose is too old
    assert "pip install --no-index --find-links W 'setuptools>=70.1'" in out
    assert "spares (where small)" in out

    assert wheelhouse.main([*argv, "--spare-max-mb", "0"]) == 0
    rows = listing(capsys.readouterr().out)
    assert rows["typing-extensions"][0] == rows["tokenizers"][0] == rows["setuptools"][0] == "skip"


def test_a_spare_over_the_size_limit_is_left_out_and_named(tmp_path, monkeypatch, capsys):
    class BigSpares(FakePip):
        def __call__(self, args):
            done = super().__call__(args)
            if args[-1].startswith("fsspec=="):
                folder = Path(args[args.index("-d") + 1])
                next(folder.glob("fsspec-*")).write_bytes(b"x" * 3_000_000)
            return done

    monkeypatch.setattr(wheelhouse, "pip", BigSpares())
    dest = tmp_path / "wheelhouse"
    freeze = h200_freeze(tmp_path, "fsspec", "typing-extensions")
    argv = ["--dest", str(dest), "--node-freeze", str(freeze), "--unversioned", "keep", "--spare-max-mb", "2"]
    assert wheelhouse.main(argv) == 0
    out = capsys.readouterr().out
    files = {p.name.split("-")[0] for p in dest.iterdir()}
    assert "typing_extensions" in files and "fsspec" not in files
    assert "fsspec: 3.0 MB, over the spares' limit" in out
    manifest = json.loads((dest / "wheelhouse.json").read_text())
    fsspec = next(p for p in manifest["packages"] if p["name"] == "fsspec")
    assert fsspec["file"] is None and fsspec["how"].startswith("spare left out")
    assert manifest["build_requires"] == ["setuptools>=70.1"]  # this freeze lacks setuptools: fetched


def test_a_spare_that_does_not_download_is_left_out_not_fatal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wheelhouse, "pip", FakePip(fail="typing-extensions"))
    dest = tmp_path / "wheelhouse"
    freeze = h200_freeze(tmp_path, "typing-extensions")
    assert wheelhouse.main(["--dest", str(dest), "--node-freeze", str(freeze), "--unversioned", "keep"]) == 0
    out = capsys.readouterr().out
    assert "typing-extensions: did not download" in out
    assert not list(dest.glob("typing_extensions-*"))


def test_freeze_reads_pip_freeze_and_pip_list_output(tmp_path):
    path = tmp_path / "freeze.txt"
    path.write_text(
        "# a comment\n"
        "Package    Version\n"
        "---------- -------\n"
        "Torch==2.11.0a0+git1234  # NGC's build\n"
        "numpy @ file:///tmp/numpy-2.3.5-cp312-cp312-linux_x86_64.whl\n"
        "-e git+https://example.invalid/x.git#egg=x\n"
        "pyarrow    24.0.0\n"
        "typing_extensions\n"
    )
    found = wheelhouse.read_freeze(path)
    assert {k: (str(v) if v else None) for k, v in found.items()} == {
        "torch": "2.11.0a0+git1234",
        "numpy": None,
        "pyarrow": "24.0.0",
        "typing-extensions": None,
    }


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("numpy==2.3.5\ntorch>=2.6\n", "node-freeze.txt:2: not a `pip freeze` line"),
        ("numpy==two\n", "node-freeze.txt:1: 'two' is not a version"),
        (None, "node-freeze.txt: no such file"),
    ],
)
def test_a_bad_freeze_stops_with_one_line_and_exit_2(tmp_path, content, expected):
    path = tmp_path / "node-freeze.txt"
    if content is not None:
        path.write_text(content)
    env = {**os.environ, "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--node-freeze", str(path)],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "argv",
    [["--extras", "gpu"], ["--python-version", "312"], ["--platform", "win_amd64"]],
)
def test_bad_options_exit_2(argv, no_network, capsys):
    assert wheelhouse.main(["--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wheelhouse: ") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "flag, content, expected",
    [
        ("--constraints", None, "cannot read it"),
        ("--pyproject", None, "cannot read it"),
        ("--pyproject", "[project\n", "not TOML"),
        ("--pyproject", "[tool.x]\n", "no [project] table"),
        (
            "--pyproject",
            '[project]\ndependencies = ["torch>="]\n',
            "dependencies: 'torch>=' is not a requirement",
        ),
    ],
)
def test_bad_constraints_or_pyproject_exit_2_naming_the_file(
    flag, content, expected, tmp_path, no_network, capsys
):
    path = tmp_path / "input"
    if content is not None:
        path.write_text(content)
    assert wheelhouse.main(["--dry-run", flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"wheelhouse: {flag} {path}: ")
        and expected in err
        and len(err.strip().splitlines()) == 1
    )


class FakePip:
    """Writes the file each pip command would, and records the commands."""

    def __init__(self, fail: str | None = None):
        self.calls: list[list[str]] = []
        self.fail = fail

    def __call__(self, args):
        self.calls.append(args)
        folder = Path(args[args.index("-d" if "-d" in args else "-w") + 1])
        req = args[-1]
        if self.fail and req.startswith(f"{self.fail}=="):
            return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found")
        folder.mkdir(parents=True, exist_ok=True)
        if req == str(ROOT):
            name = "metachunk-0.1.0-py3-none-any.whl"
        else:
            project, version = req.split("==")
            norm = project.replace("-", "_")
            sdist = "--no-binary" in args
            name = f"{norm}-{version}.tar.gz" if sdist else f"{norm}-{version}-py3-none-any.whl"
        (folder / name).write_bytes(b"fake")
        return subprocess.CompletedProcess(args, 0, "", "")


def test_fetch_asks_pip_for_each_pin_and_writes_the_folder_whole(tmp_path, monkeypatch, capsys):
    fake = FakePip()
    monkeypatch.setattr(wheelhouse, "pip", fake)
    dest = tmp_path / "wheelhouse"
    dest.mkdir()
    (dest / "stale.whl").write_bytes(b"old")
    argv = ["--dest", str(dest), "--python-version", "3.12", "--node-freeze", str(h200_freeze(tmp_path))]
    assert wheelhouse.main(argv) == 0
    out = capsys.readouterr().out

    requested = {args[-1].split("==")[0]: args for args in fake.calls}
    assert "torch" not in requested and "numpy" not in requested
    wheel = requested["transformers"]
    assert wheel[:2] == ["download", "--no-deps"] and "--only-binary=:all:" in wheel
    assert wheel[wheel.index("--python-version") + 1] == "3.12"
    platforms = [wheel[i + 1] for i, a in enumerate(wheel) if a == "--platform"]
    assert platforms[0] == "manylinux_2_28_x86_64" and "manylinux2014_x86_64" in platforms
    sdist = requested["deepspeed"]
    assert "--no-binary" in sdist and "--platform" not in sdist
    assert requested[str(ROOT)][0] == "wheel"

    files = sorted(p.name for p in dest.iterdir())
    assert "stale.whl" not in files  # replaced whole
    assert f"transformers-{PINS['transformers']}-py3-none-any.whl" in files
    assert f"deepspeed-{PINS['deepspeed']}.tar.gz" in files
    manifest = json.loads((dest / "wheelhouse.json").read_text())
    assert manifest["install"][-1].endswith("--no-build-isolation 'metachunk[train]'")
    file_of = {p["name"]: p["file"] for p in manifest["packages"]}
    assert file_of["deepspeed"] == f"deepspeed-{PINS['deepspeed']}.tar.gz"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left
    assert f"{dest}: {len(files) - 1} files" in out


def test_a_failed_download_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wheelhouse, "pip", FakePip(fail="trl"))
    dest = tmp_path / "wheelhouse"
    assert wheelhouse.main(["--dest", str(dest), "--node-freeze", str(h200_freeze(tmp_path))]) == 1
    err = capsys.readouterr().err
    assert f"trl=={PINS['trl']}: no wheel for cp312" in err and "nothing written" in err
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_wheelhouse_passes_its_variables():
    def recipe(*variables):
        proc = subprocess.run(["make", "-n", "-o", ".venv/.installed", "wheelhouse", *variables],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return " ".join(proc.stdout.replace("\\\n", " ").split())

    dry = recipe("DRY_RUN=1", "NODE_FREEZE=node.txt", "PYTHON_VERSION=3.11", "WHEELHOUSE=out/w")
    assert "tools/wheelhouse.py --dest out/w --python-version 3.11" in dry
    assert "--node-freeze node.txt --unversioned fetch --spare-max-mb 5 --dry-run" in dry
    assert "--unversioned keep" in recipe("UNVERSIONED=keep")
    assert "--spare-max-mb 0" in recipe("SPARE_MAX_MB=0")
    real = recipe()
    assert "--dest dist/wheelhouse --python-version 3.12 --platform manylinux_2_28_x86_64" in real
    assert "--dry-run" not in real and "--node-freeze" not in real
    for no in ("DRY_RUN=0", "DRY_RUN=no", "DRY_RUN=false"):  # "no" had meant a dry run
        assert "--dry-run" not in recipe(no), no
    for yes in ("DRY_RUN=yes", "DRY_RUN=TRUE", "DRY_RUN=on"):  # anything else is a dry run: it fails closed
        assert "--dry-run" in recipe(yes), yes
