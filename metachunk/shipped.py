"""The recipes metachunk ships (``metachunk/recipes/``, package data), found by name.

``--config NAME`` and ``metachunk run NAME`` take a file when one exists at that path, else the
shipped recipe of that name: its path under ``recipes/`` with or without ``.yaml``
(``train/cpu_smoke``, ``recipes/regen/demo.yaml``) or its file name alone when only one recipe
has it (``demo``, ``cpu_smoke``). In a shipped recipe, a path to another config it ships
(``deepspeed: recipes/deepspeed/zero3.json``) reads the shipped copy when no such file is where
the user runs it; every other path, outputs included, stays relative to where the user runs it.
``metachunk recipes list`` and ``metachunk recipes cp NAME [DEST]`` are torchtune's ``tune ls`` and
``tune cp``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from metachunk.artifacts import InputError, write_bytes
from metachunk.command import Result

RECIPES = Path(__file__).resolve().parent / "recipes"
SUFFIXES = (".yaml", ".yml", ".json")
PREFIX = "recipes/"


def names() -> list[str]:
    """Every shipped config, as ``folder/file`` under ``recipes/``."""
    return sorted(
        p.relative_to(RECIPES).as_posix() for p in RECIPES.rglob("*") if p.is_file() and p.suffix in SUFFIXES
    )


def find(name: str) -> Path | None:
    """The shipped file ``name`` stands for, or None."""
    rel = name[len(PREFIX) :] if name.startswith(PREFIX) else name
    for candidate in (rel, *(rel + s for s in SUFFIXES)):
        path = RECIPES / candidate
        if path.is_file() and path.resolve().is_relative_to(RECIPES):
            return path
    if "/" in rel:
        return None
    matches = [
        RECIPES / n for n in names() if Path(n).stem == Path(rel).stem and Path(n).name.startswith(rel)
    ]
    return matches[0] if len(matches) == 1 else None


def resolve(path: str | Path) -> Path:
    """``path`` when it exists, else the shipped recipe it names, else ``path`` (the caller's
    error then names it)."""
    path = Path(path)
    if path.exists():
        return path
    return find(str(path)) or path


def is_shipped(path: Path) -> bool:
    return path.resolve().is_relative_to(RECIPES)


def localize(value, shipped: bool):
    """A shipped recipe's values, with each ``recipes/...`` path that does not exist where the
    user runs it pointed at the shipped copy."""
    if not shipped:
        return value
    if isinstance(value, dict):
        return {k: localize(v, shipped) for k, v in value.items()}
    if isinstance(value, list):
        return [localize(v, shipped) for v in value]
    if isinstance(value, str) and value.startswith(PREFIX) and not Path(value).exists():
        copy = RECIPES / value[len(PREFIX) :]
        return str(copy) if copy.exists() else value
    return value


def copy(name: str, dest: str | None) -> Path:
    """``metachunk recipes cp``: the shipped recipe ``name`` written to ``dest`` (default: its file
    name, here); an existing file is never overwritten."""
    source = find(name)
    if source is None:
        raise InputError(name, "no shipped recipe of that name; `metachunk recipes list` lists them")
    target = Path(dest) if dest else Path(source.name)
    if target.is_dir() or (
        dest and dest.endswith(("/", os.sep))
    ):  # `cp demo runs/recipes/`: into that folder
        target = target / source.name
    if target.exists():
        raise InputError(target, "exists; name another destination")
    write_bytes(target, source.read_bytes())  # atomic: a copy cut short would be refused by the next `cp`
    return target


# ---- `metachunk recipes list | cp` ---------------------------------------------------------------


@dataclass
class ListConfig:
    """``metachunk recipes list``: no settings."""


@dataclass
class CopyConfig:
    # Plain field metadata (metachunk.config's format): metachunk.config reads shipped recipes through this module.
    name: str = field(default=None, metadata={"help": "a name from `metachunk recipes list` (train/cpu_smoke, demo, ...)",
                                              "positional": True})  # fmt: skip
    dest: str | None = field(default=None, metadata={"help": "file or folder (default: the recipe's file name, here)",
                                                     "positional": True})  # fmt: skip


def run_list(cfg: ListConfig) -> Result:
    for name in names():
        print(name)
    return Result()


def run_copy(cfg: CopyConfig) -> Result:
    if not cfg.name:
        raise InputError("recipes cp", "which recipe? give a NAME from `metachunk recipes list`")
    print(copy(cfg.name, cfg.dest))
    return Result()
