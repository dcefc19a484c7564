"""griffe extensions for the API pages (mkdocs.yml names both).

**StageFolders: the stage folders as ``metachunk``'s subpackages.** pyproject.toml installs the
folders ``chunking/``, ``distill/``, ``train/`` and ``eval/`` at the repository's top as
``metachunk.chunking``, ``metachunk.distill``, ... (``package-dir``). griffe's static finder looks for
subpackages inside ``metachunk/`` only, so this extension visits each folder and attaches it to
``metachunk`` as the installed package has it.

**OptionFields: a config field shows its default and its help.** The config dataclasses declare
each field as ``name: T = option(default, "help", ...)`` (or ``block(Cls, "help", prefix=...)``,
`metachunk.config`), which griffe reads statically as the call's source: a signature full of
``option(...)`` calls and fields without text. This extension gives such a field the default alone
as its value (``= 0.5``, ``= BadRows()``), which the dataclass signature then shows, and the help
string as its docstring.

Nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("chunking", "distill", "train", "eval")
FIELD_MAKERS = ("option", "block")


class StageFolders(griffe.Extension):
    def on_module_members(self, *, mod: griffe.Module, **kwargs) -> None:
        if mod.path != "metachunk":
            return
        for name in STAGES:
            if name not in mod.members and (ROOT / name / "__init__.py").is_file():
                stage = griffe.load(name, search_paths=[str(ROOT)], docstring_parser="sphinx",
                                    extensions=griffe.load_extensions(OptionFields))  # fmt: skip
                mod.set_member(name, stage)


class OptionFields(griffe.Extension):
    def on_attribute_instance(
        self, *, node: ast.AST | griffe.ObjectNode, attr: griffe.Attribute, **kwargs
    ) -> None:
        call = getattr(node, "value", None)
        if not isinstance(call, ast.Call):
            return
        # option(...) or config.option(...), as the module imports it
        maker = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
        if maker not in FIELD_MAKERS or len(call.args) < 2:
            return
        default, help_node = call.args[0], call.args[1]
        attr.value = ast.unparse(default) + ("()" if maker == "block" else "")
        try:
            text = ast.literal_eval(help_node)
        except ValueError:  # a help built at import time: left without text
            return
        if isinstance(text, str) and attr.docstring is None:
            attr.docstring = griffe.Docstring(text, parent=attr)
