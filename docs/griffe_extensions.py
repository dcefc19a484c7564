"""griffe extensions for the API pages (mkdocs.yml names both).

**StageFolders: the stage folders as ``metachunk``'s subpackages.** pyproject.toml installs the
folders ``chunking/``, ``distill/``, ``train/`` and ``eval/`` at the repository's top as
``metachunk.chunking``, ``metachunk.distill``, ... (``package-dir``). griffe's static finder looks for
subpackages inside ``metachunk/`` only, so this extension visits each folder and attaches it to
``metachunk`` as the installed package has it, in ``metachunk``'s collection of modules (so that a
base class or an import across the stages resolves: a subclass shows what it inherits).

**OptionFields: a config field shows its default and its help.** The config dataclasses declare
each field as ``name: T = option(default, "help", ...)`` (or ``block(Cls, "help", prefix=...)``,
`metachunk.config`), which griffe reads statically as the call's source: a signature full of
``option(...)`` calls and fields without text. This extension gives such a field the default alone
as its value (``= 0.5``, ``= BadRows()``), which the dataclass signature then shows, and the help
string as its docstring. A default written as a constant's name (``option(DEFAULT_WINDOW_CHARS,
...)``, or ``module.NAME``) shows the constant's value (``= 1024``), found in the loaded modules
(the module's own constant, or the one it imports); a name that cannot be found, or whose value is
not a literal, shows as written.

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
                # In metachunk's collection of modules, where a name such as a base class's
                # (metachunk.chunking.api.TrainedStudent) is looked up once the tree is built
                collection = mod.modules_collection
                stage = griffe.load(name, search_paths=[str(ROOT)], docstring_parser="sphinx",
                                    extensions=griffe.load_extensions(OptionFields),
                                    modules_collection=collection, lines_collection=mod.lines_collection)  # fmt: skip
                mod.set_member(name, stage)
                if collection.members.get(name) is stage:  # only as metachunk's: no top-level `chunking`
                    collection.del_member(name)


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
        if maker == "option" and isinstance(default, (ast.Name, ast.Attribute)):
            NAMED_DEFAULTS.append((attr, attr.value))
        try:
            text = ast.literal_eval(help_node)
        except ValueError:  # a help built at import time: left without text
            return
        if isinstance(text, str) and attr.docstring is None:
            attr.docstring = griffe.Docstring(text, parent=attr)

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        """Each default written as a name that the loaded tree can now resolve gets its value. A stage
        folder is loaded on its own before it joins ``metachunk``, so its imports from other modules
        resolve only when ``metachunk`` is loaded; what is unresolved then keeps its name."""
        waiting = []
        for attr, name in NAMED_DEFAULTS:
            value = constant_value(attr.module, name)
            if value is None:
                waiting.append((attr, name))
                continue
            attr.value = value
            # The dataclass's __init__, made from the fields when their package was loaded
            init = attr.parent.members.get("__init__") if attr.parent is not None else None
            for param in getattr(init, "parameters", ()):
                if param.name == attr.name and str(param.default) == name:
                    param.default = value
        NAMED_DEFAULTS[:] = [] if pkg.parent is None and pkg.path not in STAGES else waiting


# (field, the name its default is written as), waiting for the tree that holds the name's constant
NAMED_DEFAULTS: list[tuple[griffe.Attribute, str]] = []
LITERAL_NODES = (ast.Expression, ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp,
                 ast.unaryop, ast.operator, ast.Load)  # fmt: skip


def follow(obj: griffe.Object | griffe.Alias | None, depth: int = 0) -> griffe.Object | None:
    """``obj``, or what the alias ``obj`` points at, found from the root of ``obj``'s own tree (a
    stage loaded on its own has no ``metachunk`` above it yet: then None)."""
    while isinstance(obj, griffe.Alias) and depth < 8:
        root = obj.parent
        while root is not None and root.parent is not None:
            root = root.parent
        path = obj.target_path
        if root is None or not path.startswith(root.path + "."):
            return None
        target = root
        for part in path[len(root.path) + 1 :].split("."):
            target = follow(target.members.get(part), depth + 1) if target is not None else None
        obj, depth = target, depth + 1
    return None if isinstance(obj, griffe.Alias) else obj


def constant_value(module: griffe.Module, name: str, depth: int = 0) -> str | None:
    """The value of the constant ``name`` (``NAME`` or ``module.NAME``) as ``module`` sees it, as
    source (``'[MASK]'``, ``1024``, ``64 << 20``), when it is a literal; else None."""
    obj = module
    for part in name.split("."):
        obj = follow(obj.members.get(part)) if obj is not None else None
    if not isinstance(obj, griffe.Attribute) or obj.value is None or depth > 8:
        return None
    source = str(obj.value)
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        return None
    if isinstance(tree.body, (ast.Name, ast.Attribute)):  # a constant named after another
        return constant_value(obj.module, source, depth + 1)
    return source if all(isinstance(node, LITERAL_NODES) for node in ast.walk(tree)) else None
