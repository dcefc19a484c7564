"""The config loader: lists of scalars from flags, positionals and YAML."""

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from metachunk.artifacts import InputError
from metachunk.config import add_arguments, from_namespace, option


@dataclass
class Runs:
    runs: list[Path] | None = option(None, "run dirs", positional=True)
    models: list[str] | None = option(None, "models")
    k: int = option(3, "k")


def _parse(argv: list[str]) -> Runs:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Runs)
    return from_namespace(Runs, parser.parse_args(argv))


def test_scalar_lists_take_several_values_on_the_command_line():
    cfg = _parse(["a", "b", "--models", "x", "y", "--k", "4"])
    assert cfg == Runs(runs=[Path("a"), Path("b")], models=["x", "y"], k=4)


def test_absent_list_flags_leave_the_recipe_values(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("runs: [r1, r2]\nmodels: [m]\n")
    assert _parse(["--config", str(recipe)]) == Runs(runs=[Path("r1"), Path("r2")], models=["m"])
    assert _parse(["--config", str(recipe), "r3"]).runs == [Path("r3")]  # flags override the recipe


def test_a_list_field_given_a_scalar_in_yaml_names_the_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("models: smollm2\n")
    with pytest.raises(InputError, match="field 'models' must be a list"):
        _parse(["--config", str(recipe)])
