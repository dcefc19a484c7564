"""The one config loader: dataclasses with help text -> CLI flags and YAML recipes.

Each field's ``metadata`` carries its ``help`` (and optionally ``choices``, a ``flag`` spelling, a
``short`` alias, or ``positional=True``). A recipe YAML gives values by field name; flags given on
the command line override the recipe; everything else keeps the dataclass default. Unknown YAML
keys and wrong types are errors that name the file and the key, raised before any model loads.

Fields may also be nested: a dataclass-typed field takes a YAML mapping, and a ``dict[str, D]``
field takes a mapping of names to ``D`` mappings (e.g. one teacher block per distillation stage).
A ``list[T]`` field takes a YAML list; a list of scalars also gets a flag taking one or more
values (``--models a b``), or is positional with ``positional=True``. Nested fields and lists of
mappings have no CLI flag; errors name the dotted key (``teachers.reflection.model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path

import yaml

from metachunk.artifacts import InputError


def option(default, help: str, **extra):
    """A dataclass field with CLI/YAML metadata: ``option(0.5, "what it does", choices=[...])``."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})


def _base_type(tp):
    """``int | None`` -> int; plain types unchanged."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: _base_type(hints[f.name]) for f in dataclasses.fields(cls)}


def _scalar_list(kind):
    """``list[str]``, ``list[Path]``, ... -> the item type; None for anything else."""
    if typing.get_origin(kind) is not list:
        return None
    (item,) = typing.get_args(kind)
    item = _base_type(item)
    return item if item in (str, int, float, Path) else None


def _is_nested(kind) -> bool:
    if _scalar_list(kind):
        return False
    return dataclasses.is_dataclass(kind) or typing.get_origin(kind) in (dict, list)


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """Add one flag per field. Defaults are suppressed so that only explicit flags override YAML."""
    parser.add_argument(
        "--config", type=Path, default=argparse.SUPPRESS, help="YAML recipe with field values"
    )
    kinds = _field_types(cls)
    for f in dataclasses.fields(cls):
        meta, kind = f.metadata, kinds[f.name]
        if _is_nested(kind):
            continue  # set in the recipe YAML only
        helptext = meta.get("help", "")
        if f.default is not dataclasses.MISSING and f.default is not None:
            helptext += f" (default: {f.default})"
        item = _scalar_list(kind)
        nargs = {"nargs": "+"} if item else {}
        kind = item or kind
        if meta.get("positional"):
            # default=None, not SUPPRESS: argparse runs a string default of an absent optional
            # positional through ``type`` (Path("==SUPPRESS==")), which would override the recipe.
            # from_namespace drops None values instead.
            parser.add_argument(
                f.name,
                type=kind,
                help=helptext,
                nargs=("*" if item else "?") if f.default is not dataclasses.MISSING else nargs.get("nargs"),
                default=None,
            )
            continue
        names = [meta.get("flag", "--" + f.name.replace("_", "-"))]
        if "short" in meta:
            names.insert(0, meta["short"])
        kwargs = {"dest": f.name, "help": helptext, "default": argparse.SUPPRESS, **nargs}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
        parser.add_argument(*names, **kwargs)


def _coerce(value, kind, where: Path, key: str):
    if value is None:
        return None
    if typing.get_origin(kind) is dict:
        if not isinstance(value, dict):
            raise InputError(where, f"field {key!r} must be a mapping, got {type(value).__name__}")
        _, item_kind = typing.get_args(kind)
        return {str(k): _coerce(v, _base_type(item_kind), where, f"{key}.{k}") for k, v in value.items()}
    if typing.get_origin(kind) is list:
        if not isinstance(value, list):
            raise InputError(where, f"field {key!r} must be a list, got {type(value).__name__}")
        (item_kind,) = typing.get_args(kind)
        return [_coerce(v, _base_type(item_kind), where, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise InputError(where, f"field {key!r} must be a mapping of {kind.__name__} fields")
        fields = _fields_from_mapping(kind, value, where, prefix=f"{key}.")  # raises InputError itself
        try:
            return kind(**fields)
        except (TypeError, ValueError) as e:
            raise InputError(where, f"field {key!r}: {e}") from None
    if isinstance(value, kind):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is Path and isinstance(value, str):
        return Path(value)
    raise InputError(where, f"field {key!r} must be {kind.__name__}, got {type(value).__name__} ({value!r})")


def load_yaml(cls, path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise InputError(path, "config file not found") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = " ".join(str(getattr(e, "problem", None) or e).split())  # one line, no snippet
        raise InputError(path, f"invalid YAML: {problem}", None if mark is None else mark.line + 1) from None
    if not isinstance(data, dict):
        raise InputError(path, "a recipe must be a mapping of field names to values")
    return _fields_from_mapping(cls, data, path)


def _fields_from_mapping(cls, data: dict, path: Path, prefix: str = "") -> dict:
    kinds = _field_types(cls)
    unknown = sorted(set(data) - set(kinds))
    if unknown:
        names = ", ".join(repr(prefix + k) for k in unknown)
        raise InputError(path, f"unknown field(s) {names}; known: {', '.join(kinds)}")
    return {k: _coerce(v, kinds[k], path, prefix + k) for k, v in data.items()}


def check_choices(cfg) -> None:
    """Call from ``__post_init__``: every field with ``choices`` holds one of them, however the
    config was built (flags, YAML or Python)."""
    for f in dataclasses.fields(cfg):
        value, allowed = getattr(cfg, f.name), f.metadata.get("choices")
        if allowed and value is not None and value not in allowed:
            raise ValueError(f"field {f.name!r} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def from_namespace(cls, ns: argparse.Namespace):
    """Build ``cls`` from parsed args: dataclass defaults <- YAML (``--config``) <- explicit flags."""
    values = dict(vars(ns))
    config_path = values.pop("config", None)
    merged = load_yaml(cls, config_path) if config_path else {}
    # None / [] = not given (an absent optional positional): the recipe's value stands
    merged.update({k: v for k, v in values.items() if k in _field_types(cls) and v is not None and v != []})
    try:
        return cls(**merged)
    except (TypeError, ValueError) as e:  # a required field is missing, or __post_init__ rejected a value
        raise InputError(config_path or "command line", str(e)) from None


def to_dict(cfg) -> dict:
    def plain(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return {k: plain(v) for k, v in dataclasses.asdict(cfg).items()}
