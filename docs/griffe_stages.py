"""A griffe extension for the API pages: the stage folders as ``metachunk``'s subpackages.

pyproject.toml installs the folders ``chunking/``, ``distill/``, ``train/`` and ``eval/`` at the
repository's top as ``metachunk.chunking``, ``metachunk.distill``, ... (``package-dir``). griffe's
static finder looks for subpackages inside ``metachunk/`` only, so this extension visits each
folder and attaches it to ``metachunk`` as the installed package has it. Nothing is imported.
"""

from __future__ import annotations

from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("chunking", "distill", "train", "eval")


class StageFolders(griffe.Extension):
    def on_module_members(self, *, mod: griffe.Module, **kwargs) -> None:
        if mod.path != "metachunk":
            return
        for name in STAGES:
            if name not in mod.members and (ROOT / name / "__init__.py").is_file():
                stage = griffe.load(name, search_paths=[str(ROOT)], docstring_parser="sphinx")
                mod.set_member(name, stage)
