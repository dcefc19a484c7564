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

A *flat block* ([`block`][metachunk.config.block]) is a nested dataclass whose fields also work flat: each field
``name`` of the block is a top-level key and a flag spelled ``prefix + name`` (or the field's
own ``flat`` name in its metadata). ``moc: MocOptions = block(MocOptions, "...", prefix="moc_")``
takes ``moc: {window_chars: 512}`` or ``moc_window_chars: 512`` in YAML (a key given both ways
is an error) and ``--moc-window-chars 512`` on the command line; a field declared with
``flat="router"`` is ``router:`` / ``--router``. Errors, ``choices`` checks and [`to_dict`][metachunk.config.to_dict]
name a flat key by its flat spelling, so a run's manifest lists every setting as its flag does.

A field marked ``runtime=True`` says how a run goes (workers, device, endpoints, timeouts), not what
it makes: [`computed`][metachunk.config.computed] leaves it out, and so do the fingerprints built on it. A config class may
list old spellings of its keys in a ``RENAMED`` class attribute (``{"placeholder": "moc_placeholder"}``):
the old key in a recipe, or its old flag, is refused with one line naming the new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
import types
import typing
from pathlib import Path

import yaml

from metachunk.artifacts import InputError


def option(default, help: str, **extra):
    """A dataclass field with CLI/YAML metadata: ``option(0.5, "what it does", choices=[...])``."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})


def block(cls, help: str, prefix: str):
    """A nested dataclass field whose fields are also top-level keys and flags, ``prefix + name``
    (see the module docstring); its default is ``cls()``."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "prefix": prefix})


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


def _flat_fields(cls) -> dict[str, tuple[str, dataclasses.Field, type]]:
    """``{flat name: (block field, the block's field, its type)}`` over the flat blocks of ``cls``."""
    kinds = _field_types(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if "prefix" not in f.metadata:
            continue
        inner_kinds = _field_types(kinds[f.name])
        for inner in dataclasses.fields(kinds[f.name]):
            name = inner.metadata.get("flat", f.metadata["prefix"] + inner.name)
            if name in kinds or name in out:
                raise TypeError(f"{cls.__name__}: flat name {name!r} of {f.name}.{inner.name} is taken")
            out[name] = (f.name, inner, inner_kinds[inner.name])
    return out


class _Renamed(argparse.Action):
    """An old flag: refused, naming the new one (raised while parsing, so it is one line, exit 2)."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        raise InputError("command line", f"{option_string} is now {self.new}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls) -> list[str]:
    """Add one flag per field. Defaults are suppressed so that only explicit flags override YAML. Returns
    the long flags (what a mistyped one is matched against)."""
    for old, new in getattr(cls, "RENAMED", {}).items():
        parser.add_argument(_flag(old), action=_Renamed, new=_flag(new), dest=f"renamed_{old}",
                            default=argparse.SUPPRESS)  # fmt: skip
    flags = []
    if dataclasses.fields(cls):  # a command with nothing to set (`models list`) takes no recipe
        parser.add_argument(
            "--config",
            type=Path,
            default=argparse.SUPPRESS,
            help="YAML recipe with field values: a file, or the name of a shipped one (`metachunk recipes list`)",
        )
        flags.append("--config")
    kinds = _field_types(cls)
    flat = _flat_fields(cls)
    for f in dataclasses.fields(cls):
        if "prefix" in f.metadata:  # a flat block: its fields' flags, in place
            for name, (block_name, inner, kind) in flat.items():
                if block_name == f.name and not _is_nested(kind):
                    flags += _add_flag(parser, name, inner, kind)
        elif not _is_nested(kinds[f.name]):  # nested fields are set in the recipe YAML only
            flags += _add_flag(parser, f.name, f, kinds[f.name])
    return flags


def _add_flag(parser: argparse.ArgumentParser, name: str, f: dataclasses.Field, kind) -> list[str]:
    """The flag (or positional) of field ``f``, stored under ``name``; returns its long flags."""
    meta = f.metadata
    helptext = meta.get("help", "")
    if f.default is not dataclasses.MISSING and f.default is not None:
        plain = not isinstance(f.default, str) or (f.default.isprintable() and f.default.strip() == f.default)
        helptext += f" (default: {f.default if plain else repr(f.default)})"  # "\n\n" shown, not blank lines
    item = _scalar_list(kind)
    nargs = {"nargs": "+"} if item else {}
    kind = item or kind
    if meta.get("positional"):
        if "choices" in meta:  # checked when the config is built (an absent positional is None), listed here
            helptext += f" (one of: {', '.join(map(str, meta['choices']))})"
        # default=None, not SUPPRESS: argparse runs a string default of an absent optional
        # positional through ``type`` (Path("==SUPPRESS==")), which would override the recipe.
        # from_namespace drops None values instead.
        parser.add_argument(
            name,
            type=kind,
            help=helptext,
            nargs=("*" if item else "?") if f.default is not dataclasses.MISSING else nargs.get("nargs"),
            default=None,
        )
        return []
    names = [meta.get("flag", "--" + name.replace("_", "-"))]
    if "short" in meta:
        names.insert(0, meta["short"])
    kwargs = {"dest": name, "help": helptext, "default": argparse.SUPPRESS, **nargs}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = kind
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
    parser.add_argument(*names, **kwargs)
    long = [n for n in names if n.startswith("--")]
    return long + [n.replace("--", "--no-", 1) for n in long] if kind is bool else long


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
        fields = fields_from_mapping(kind, value, where, prefix=f"{key}.")  # raises InputError itself
        try:
            return kind(**fields)
        except (TypeError, ValueError) as e:
            raise InputError(where, f"field {key!r}: {e}") from None
    counted_yes = isinstance(value, bool) and kind in (
        int,
        float,
    )  # YAML's yes is True, a Python int: no count
    if isinstance(value, kind) and not counted_yes:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is Path and isinstance(value, str):
        return Path(value)
    raise InputError(where, f"field {key!r} must be {kind.__name__}, got {type(value).__name__} ({value!r})")


def check_keys(data, path: Path, where: str = "") -> None:
    """No mapping key in a recipe is a bool or null: YAML reads ``on``, ``off``, ``yes``, ``no`` and ``null``
    unquoted as those (https://yaml.org/type/bool.html), which no field or stage is named. A number may be
    a key (``logit_bias: {50256: -100}`` in ``extra_body``); as a field's name it is refused where fields
    are read ([`fields_from_mapping`][metachunk.config.fields_from_mapping])."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key is None or isinstance(key, bool):
                raise InputError(path, f"key {where}{key!r} is YAML's {'null' if key is None else 'bool'}, not a "
                                 "name: YAML reads on/off/yes/no/null unquoted as such; quote it")  # fmt: skip
            check_keys(value, path, f"{where}{key}.")
    elif isinstance(data, list):
        for i, item in enumerate(data):
            check_keys(item, path, f"{where.rstrip('.')}[{i}].")


def read_yaml_mapping(path: Path, what: str = "config file") -> dict:
    """The YAML mapping in ``path`` ([`read_text_file`][metachunk.config.read_text_file],
    [`yaml_mapping`][metachunk.config.yaml_mapping])."""
    return yaml_mapping(read_text_file(path, what), path, what)


def read_text_file(path: Path, what: str = "config file") -> str:
    """The UTF-8 text of ``path``; a file that is missing, a folder, unreadable or not UTF-8 is an
    `InputError` naming it. ``what`` names the file in those errors."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(path, f"{what} not found") from None
    except IsADirectoryError:
        raise InputError(path, f"a folder, not a {what}") from None
    except UnicodeDecodeError as e:
        raise InputError(path, f"not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise InputError(path, f"cannot read it ({e.strerror or e})") from None
    return text


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key written twice in one mapping is an error: PyYAML keeps
    the last, so a recipe's second ``input:`` silently won. Keys a merge (``<<: *anchor``) brings in
    may be overridden, as YAML means them to be. Each mapping is checked as written, once, before
    PyYAML flattens merges into it (an anchored mapping can be flattened before it is built)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node):
        if id(node) not in self._checked:
            self._checked.add(id(node))
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in lines:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} is written twice (first at line {lines[key] + 1})",
                            key_node.start_mark,
                        )  # fmt: skip
                    lines[key] = key_node.start_mark.line
                except TypeError:  # an unhashable key: the constructor says so
                    break
        super().flatten_mapping(node)


def load_yaml_text(text: str):
    """``text``'s YAML value, a key written twice in one mapping refused (`yaml.YAMLError`)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader


def yaml_mapping(text: str, path: Path, what: str = "config file") -> dict:
    """The YAML mapping ``text`` (empty: ``{}``), read from ``path``, its keys checked
    ([`check_keys`][metachunk.config.check_keys]); invalid YAML (with its line) or anything but a
    mapping is an `InputError` naming the file."""
    try:
        data = load_yaml_text(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = " ".join(str(getattr(e, "problem", None) or e).split())  # one line, no snippet
        raise InputError(path, f"invalid YAML: {problem}", None if mark is None else mark.line + 1) from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise InputError(path, f"a {what} must be a mapping of field names to values")
    check_keys(data, path)
    return data


def load_yaml(cls, path: Path) -> dict:
    """The recipe at ``path``, or the shipped recipe ``path`` names (`metachunk.shipped`)."""
    from metachunk import shipped

    path = shipped.resolve(path)
    data = read_yaml_mapping(path, "recipe file")
    return fields_from_mapping(cls, shipped.localize(data, shipped.is_shipped(path)), path)


def fields_from_mapping(cls, data: dict, path: Path, prefix: str = "") -> dict:
    """The fields of ``cls`` in ``data`` (a recipe mapping), checked and typed (``path`` names the
    file in errors); flat keys of a flat block are gathered into the block."""
    kinds = _field_types(cls)
    flat = _flat_fields(cls)
    for key in data:
        if not isinstance(key, str):
            raise InputError(
                path, f"key {prefix}{key!r} is a {type(key).__name__}, not a field name; quote it"
            )
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old in data:
            raise InputError(path, f"field {prefix + old!r} is now {prefix + new!r}")
    unknown = sorted(set(data) - set(kinds) - set(flat))
    if unknown:
        names = ", ".join(repr(prefix + k) for k in unknown)
        known = [n for k in kinds for n in [k, *(f for f, (b, _, _) in flat.items() if b == k)]]
        import difflib

        near = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        meant = {k: prefix + m[0] for k, m in near.items() if m}
        if meant:  # a typo: the field it is nearest to, not the whole list
            said = (repr(*meant.values()) if len(unknown) == 1
                    else ", ".join(f"{prefix + k!r} -> {m!r}" for k, m in meant.items()))  # fmt: skip
            raise InputError(path, f"unknown field(s) {names}; did you mean {said}?")
        raise InputError(path, f"unknown field(s) {names}; known: {', '.join(known)}")
    nested = {k: v for k, v in data.items() if k not in flat}
    for name, (block_name, inner, kind) in flat.items():
        if name not in data:
            continue
        block_data = nested.get(block_name)
        block_data = nested[block_name] = {} if block_data is None else block_data
        if not isinstance(block_data, dict):
            continue  # `moc: 3`: the block's own error below
        if inner.name in block_data:
            raise InputError(
                path, f"{prefix}{name!r} and {prefix}{block_name}.{inner.name} are the same field"
            )
        # typed under its flat name, so that errors name the key as it is written
        nested[block_name] = {**block_data, inner.name: _coerce(data[name], kind, path, prefix + name)}
    out = {k: _coerce(v, kinds[k], path, prefix + k) for k, v in nested.items()}
    for block_name in {b for b, _, _ in flat.values()}:
        if block_name in out and out[block_name] is None:  # an empty `moc:`: the block's defaults
            out[block_name] = kinds[block_name]()
    return out


def check_types(cfg) -> None:
    """Call from ``__post_init__``, before comparing values: a field typed int holds an integer, one typed
    float a number and one typed str a str or a path, however the config was built (from Python, where no
    parser typed it). ``None`` only where the field's type allows it (``int | None``). A bool is no number."""
    hints = typing.get_type_hints(type(cfg))
    kinds = {name: _base_type(hint) for name, hint in hints.items()}
    for f in dataclasses.fields(cfg):
        kind, value = kinds[f.name], getattr(cfg, f.name)
        if value is None:
            if type(None) not in typing.get_args(hints[f.name]) and kind in (int, float, str):
                allowed = f.metadata.get("choices")
                expected = f"one of {', '.join(map(str, allowed))}" if allowed else kind.__name__
                raise TypeError(f"field {f.name!r} must be {expected}, got None")
            continue
        expected = {int: numbers.Integral, float: numbers.Real, str: (str, os.PathLike)}.get(kind)
        if expected and (isinstance(value, bool) or not isinstance(value, expected)):
            raise TypeError(
                f"field {f.name!r} must be {kind.__name__}, got {type(value).__name__} ({value!r})"
            )


def check_choices(cfg) -> None:
    """Call from ``__post_init__``: every field with ``choices`` holds one of them, however the
    config was built (flags, YAML or Python); the fields of flat blocks too, by their flat names."""
    checks = [
        (f, getattr(cfg, f.name), f.name) for f in dataclasses.fields(cfg) if "prefix" not in f.metadata
    ]
    for name, (block_name, inner, _) in _flat_fields(type(cfg)).items():
        checks.append((inner, getattr(getattr(cfg, block_name), inner.name), name))
    for f, value, name in checks:
        allowed = f.metadata.get("choices")
        if allowed and value is not None and value not in allowed:
            raise ValueError(f"field {name!r} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def check_number(
    cfg, name: str, low: float | None = None, high: float | None = None, strict: bool = False
) -> None:
    """Call from ``__post_init__``: ``cfg.name`` is a finite number within ``[low, high]`` (``low``
    itself excluded when ``strict``), else a ValueError naming the field and the range. YAML reads
    ``.nan`` and ``.inf`` as floats, and a NaN passes every ``<`` and ``>`` check."""
    value = getattr(cfg, name)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if (
        number
        and (low is None or value > low or (value == low and not strict))
        and (high is None or value <= high)
    ):
        return
    bounds = ([f"> {low}" if strict else f">= {low}"] if low is not None else []) + (
        [f"<= {high}"] if high is not None else []
    )
    raise ValueError(f"field {name!r} must be a finite number{' ' + ' and '.join(bounds) if bounds else ''}, "
                     f"got {value!r}")  # fmt: skip


def from_namespace(cls, ns: argparse.Namespace, defaults: dict | None = None):
    """Build ``cls`` from parsed args: dataclass defaults <- ``defaults`` <- YAML (``--config``) <-
    explicit flags."""
    from metachunk import named_data

    values = dict(vars(ns))
    config_path = values.pop("config", None)
    merged = {**(defaults or {}), **(load_yaml(cls, config_path) if config_path else {})}
    # None / [] = not given (an absent optional positional): the recipe's value stands; a "_" name is the
    # parser's own (the subcommand chosen), no setting
    given = {k: v for k, v in values.items() if v is not None and v != [] and not k.startswith("_")}
    # Where a bad value came from: the recipe, the flags, or (both given) either.
    where = f"{config_path} or the command line" if config_path and given else config_path or "command line"
    kinds = _field_types(cls)
    merged.update({k: v for k, v in given.items() if k in kinds})
    for name, (block_name, inner, _) in _flat_fields(cls).items():  # a flat block's flags
        if name in given:
            try:
                merged[block_name] = dataclasses.replace(
                    merged.get(block_name) or kinds[block_name](), **{inner.name: given[name]}
                )
            except (TypeError, ValueError) as e:  # the block's __post_init__ rejected the flag's value
                raise InputError(where, str(e)) from None
    # `data:NAME/FILE` names a file of a named dataset (metachunk.named_data): the run reads the
    # file it resolves to, so a missing dataset is one line that names its fetch command.
    for key, value in merged.items():
        try:
            merged[key] = named_data.resolve_all(value)
        except named_data.MissingDataset as e:
            raise named_data.MissingDataset(
                config_path or "command line", f"field {key!r}: {e}", e.dataset
            ) from None
        except InputError as e:
            raise InputError(config_path or "command line", f"field {key!r}: {e}") from None
    try:
        return cls(**merged)
    except (TypeError, ValueError) as e:  # a required field is missing, or __post_init__ rejected a value
        raise InputError(where, str(e)) from None


def to_dict(cfg) -> dict:
    """The config as plain data (paths as strings); a flat block's fields in place, under their
    flat names (a manifest lists each setting as its flag spells it, and reads back as a recipe)."""

    def plain(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    values = dataclasses.asdict(cfg)
    flat = _flat_fields(type(cfg))
    out = {}
    for f in dataclasses.fields(cfg):
        if "prefix" in f.metadata:
            out.update(
                (n, plain(values[f.name][inner.name])) for n, (b, inner, _) in flat.items() if b == f.name
            )
        else:
            out[f.name] = plain(values[f.name])
    return out


def runtime(cfg) -> dict:
    """How a run goes, not what it makes: the settings [`computed`][metachunk.config.computed] leaves
    out, as [`to_dict`][metachunk.config.to_dict] writes them (a run log records them)."""
    decides = computed(cfg)
    return {k: v for k, v in to_dict(cfg).items() if k not in decides}


def block_keys(cls, block_name: str) -> set[str]:
    """The top-level keys (and flags, without ``--``) of block ``block_name``'s fields: ``moc_top_p``,
    and ``router`` where the block names one without its prefix."""
    return {name for name, (owner, _, _) in _flat_fields(cls).items() if owner == block_name}


def computed(cfg) -> dict:
    """The settings that decide what a run makes: [`to_dict`][metachunk.config.to_dict] less every field marked
    ``runtime=True``, in nested blocks (teacher blocks) too. Fingerprints hash this. A file of a
    named dataset is recorded by its ``data:`` name, wherever it was found."""
    from metachunk import named_data

    def plain(v):
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return computed(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Path):
            return named_data.name_of(v) or str(v)
        return v

    flat = _flat_fields(type(cfg))
    out = {}
    for f in dataclasses.fields(cfg):
        if "prefix" in f.metadata:
            block = getattr(cfg, f.name)
            for name, (block_name, inner, _) in flat.items():
                if block_name == f.name and not inner.metadata.get("runtime"):
                    out[name] = plain(getattr(block, inner.name))
        elif not f.metadata.get("runtime"):
            out[f.name] = plain(getattr(cfg, f.name))
    return out
