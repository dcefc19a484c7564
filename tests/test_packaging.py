"""metachunk as users install it: one import namespace in the wheel, a version, and a core that
chunks without the training or teacher stacks.

The wheel is built from this checkout (``python -m build --no-isolation``: the build backend is
the one installed here), checked with ``twine check`` and installed without its dependencies into
a fresh virtualenv that borrows this environment's packages (torch is never downloaded twice).
Its commands then run from an empty directory that holds a ``train.py`` and an ``eval/`` folder,
names that shadowed the old top-level packages.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("trl", "peft", "deepspeed", "openai", "xgrammar")


def test_core_chunking_imports_no_training_or_teacher_stack(tiny_model_dir, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        json.dumps({"id": "a", "text": "Emma was clever. She was rich. It was late. They met."}) + "\n"
    )
    probe = (
        "import sys\n"
        "import metachunk.chunking\n"
        "from metachunk.cli import main\n"
        f"for method in ('sentence', 'ppl'):\n"
        f"    assert main(['chunk', {str(docs)!r}, '-o', {str(tmp_path)!r} + '/' + method + '.jsonl', '--method',"
        f" method, '--target-len', '20', '--model', {str(tiny_model_dir)!r}]) == 0\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir",
                            str(out), str(REPO)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    # every importable folder is in pyproject's package list: setuptools prints a screen of warning for each
    # one left out, in every user's first `make install`
    assert "would be ignored" not in build.stdout + build.stderr
    check = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, out.iterdir())],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    (whl,) = out.glob("*.whl")
    return whl


def test_the_wheel_holds_one_namespace_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"metachunk"}
    (toplevel,) = [n for n in names if n.endswith("top_level.txt")] or [None]
    if toplevel:
        assert zipfile.ZipFile(wheel).read(toplevel).decode().split() == ["metachunk"]
    for expected in ("metachunk/chunking/ppl.py", "metachunk/distill/run.py", "metachunk/train/__main__.py",
                     "metachunk/eval/qa.py", "metachunk/py.typed", "metachunk/distill/prompts/refinement.schema.json",
                     "metachunk/eval/metrics/crud_bleu/crud_bleu.py", "metachunk/engine/kernels/lse_rows_bf16.c", "metachunk/engine/scoring.py",
                     "metachunk/data/gutenqa-emma/paragraphs.jsonl", "metachunk/data/gutenqa-emma/questions.jsonl",
                     "metachunk/data/gutenqa-emma/LICENSE", "metachunk/data/crud-news.sources.txt"):  # fmt: skip
        assert expected in names, expected
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text and any(n.endswith("licenses/LICENSE") for n in names)


def test_the_installed_wheel_runs_where_train_py_and_eval_would_shadow_it(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    # this environment's packages, for the dependencies (not its editable metachunk: a .pth line
    # adds a folder to the path without running the .pth files inside it)
    Path(site, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert install.returncode == 0, install.stderr

    user = tmp_path / "project"
    (user / "eval").mkdir(parents=True)
    (user / "train.py").write_text("raise SystemExit('the user train.py ran')\n")
    (user / "eval" / "__init__.py").write_text("raise SystemExit('the user eval/ ran')\n")
    (user / "doc.txt").write_text("Emma was clever. She was rich. It was late. They met at noon.\n")
    # no named dataset but the one the wheel ships (an empty cache, no $METACHUNK_DATA)
    env = {**{k: v for k, v in os.environ.items() if k != "METACHUNK_DATA"}, "OMP_NUM_THREADS": "1",
           "METACHUNK_CACHE": str(tmp_path / "cache"), "PATH": f"{env_dir / 'bin'}:{os.environ['PATH']}"}  # fmt: skip

    def run(*argv: str) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, cwd=user, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{argv}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        return done

    version = run("metachunk", "--version").stdout.strip()
    assert version.startswith("metachunk ") and version != "metachunk 0+unknown"
    where = run(str(py), "-c", "import metachunk.train, metachunk; print(metachunk.__file__)").stdout
    assert str(env_dir) in where  # the wheel's copy, not the checkout's
    assert "--model_name_or_path" in run(str(py), "-m", "metachunk.train", "--help").stdout
    assert "regen/demo.yaml" in run("metachunk", "recipes", "list").stdout.split()
    listed = run("metachunk", "data", "list").stdout
    assert f"gutenqa-emma  present (shipped): {env_dir}" in listed  # the wheel's copy, sums checked
    assert "crud-news     absent: metachunk data fetch crud-news" in listed
    plan = run("metachunk", "run", "demo", "--plan").stdout
    assert re.search(r"emma_eval +data passages +runs\n", plan)  # Emma is read from the wheel
    assert re.search(r"crud_news +data passages +needs `metachunk data fetch crud-news`\n", plan)
    assert "chunk" in run(str(py), "-m", "metachunk", "--help").stdout
    run("metachunk", "chunk", "doc.txt", "-o", "chunks.jsonl", "--method", "sentence", "--target-len", "30")

    # From the clone's root, where a user runs the recipes (`deepspeed --module metachunk.train --config
    # recipes/...` runs `python -m metachunk.train`), `-m` puts the checkout first on sys.path: its metachunk/
    # holds only the core, and finds the stages in the checkout's top-level folders.
    clone = subprocess.run([str(py), "-m", "metachunk.train", "--help"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert clone.returncode == 0 and "--model_name_or_path" in clone.stdout, clone.stderr[-2000:]
    (record,) = [json.loads(line) for line in (user / "chunks.jsonl").read_text().splitlines()]
    text = (user / "doc.txt").read_text()
    assert all(text[c["start"] : c["end"]] == c["text"] for c in record["chunks"])


def test_shipped_recipes_are_found_by_name_and_copied(tmp_path, monkeypatch, capsys):
    """From a folder without the checkout's recipes/, a name finds the shipped recipe; its paths to
    configs it ships read the shipped copies, and `recipes cp` never overwrites."""
    from metachunk.distill.run import DistillConfig

    from metachunk import config, shipped
    from metachunk.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["recipes", "list"]) == 0
    listed = capsys.readouterr().out.split()
    assert {"regen/demo.yaml", "train/cpu_smoke.yaml", "distill/providers/dashscope_qwq.yaml",
            "deepspeed/zero3.json"} <= set(listed)  # fmt: skip
    assert shipped.find("demo") == shipped.RECIPES / "regen" / "demo.yaml"
    assert shipped.find("recipes/distill/rewrite.yaml") == shipped.find("distill/rewrite")
    assert shipped.find("zero3") is None  # accelerate/zero3.yaml and deepspeed/zero3.json: not guessed
    values = config.load_yaml(DistillConfig, Path("distill/rewrite"))
    assert values["teachers"]["reflection"].provider == "dashscope"
    zero3 = shipped.localize({"deepspeed": "recipes/deepspeed/zero3.json", "out": "runs/x"}, True)
    assert zero3 == {"deepspeed": str(shipped.RECIPES / "deepspeed" / "zero3.json"), "out": "runs/x"}

    assert main(["recipes", "cp", "train/cpu_smoke", "mine.yaml"]) == 0
    assert (tmp_path / "mine.yaml").read_bytes() == (
        shipped.RECIPES / "train" / "cpu_smoke.yaml"
    ).read_bytes()
    assert main(["recipes", "cp", "train/cpu_smoke", "mine.yaml"]) == 2  # exists: never overwritten
    assert main(["recipes", "cp", "no/such", "other.yaml"]) == 2
    # the name is what is wrong, not the destination (the error used to blame other.yaml)
    assert "metachunk: error: no/such: no shipped recipe of that name" in capsys.readouterr().err
    assert main(["recipes", "cp"]) == 2  # no name: which recipe, not a traceback


def test_a_command_that_needs_a_missing_extra_names_it(tmp_path):
    """Without the distill extra (openai blocked here), a distill run says which extra to install,
    in one line, exit status 2."""
    from support.distill_jobs import make_job

    job = make_job(tmp_path, "http://127.0.0.1:9/v1", {"d": ["Emma was clever."]})
    probe = (
        "import sys\n"
        "sys.modules['openai'] = None  # as if the extra were not installed\n"
        "from metachunk.cli import main\n"
        f"sys.exit(main(['distill', 'rewrite', '--config', {str(job.recipe)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "pip install 'metachunk[distill]'" in done.stderr and "Traceback" not in done.stderr
