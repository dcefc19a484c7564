"""The config loader: lists of scalars from flags, positionals and YAML; flat blocks."""

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from metachunk.artifacts import InputError
from metachunk.config import add_arguments, block, check_choices, from_namespace, option, to_dict


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


# ------------------------------------------------------------------------ flat blocks


@dataclass
class Moc:
    router: str | None = option(None, "router dir", flat="router")
    window_chars: int = option(1024, "window")
    placeholder: str = option("[MASK]", "placeholder", choices=["[MASK]", "<omitted>"])


@dataclass
class Chunky:
    method: str = option("ppl", "method")
    moc: Moc = block(Moc, "moc options", prefix="moc_")

    def __post_init__(self):
        check_choices(self)


def _chunky(argv: list[str]) -> Chunky:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Chunky)
    return from_namespace(Chunky, parser.parse_args(argv))


def test_a_flat_block_takes_nested_yaml_flat_yaml_and_flat_flags(tmp_path):
    nested, flat = tmp_path / "nested.yaml", tmp_path / "flat.yaml"
    nested.write_text("method: moc\nmoc:\n  router: r\n  window_chars: 300\n")
    flat.write_text("method: moc\nrouter: r\nmoc_window_chars: 300\n")
    want = Chunky("moc", Moc(router="r", window_chars=300))
    assert _chunky(["--config", str(nested)]) == _chunky(["--config", str(flat)]) == want
    assert _chunky(["--method", "moc", "--router", "r", "--moc-window-chars", "300"]) == want
    # flags override the recipe, field by field
    assert _chunky(["--config", str(nested), "--moc-placeholder", "<omitted>"]).moc == Moc(
        "r", 300, "<omitted>"
    )
    assert _chunky([]) == Chunky() and Chunky().moc == Moc()
    (tmp_path / "empty.yaml").write_text("moc:\n")
    assert _chunky(["--config", str(tmp_path / "empty.yaml")]) == Chunky()
    # the manifest form: flat, in place, under the flags' names (and it reads back)
    assert to_dict(want) == {
        "method": "moc",
        "router": "r",
        "moc_window_chars": 300,
        "moc_placeholder": "[MASK]",
    }


@pytest.mark.parametrize(
    ("yaml_text", "match"),
    [
        ("moc_window_chars: big\n", "field 'moc_window_chars' must be int"),
        ("moc_window_chars: yes\n", "field 'moc_window_chars' must be int, got bool"),  # yes: True
        ("moc:\n  window_chars: big\n", "field 'moc.window_chars' must be int"),
        ("moc_placeholder: '<x>'\n", "field 'moc_placeholder' must be one of"),
        ("moc_window_chars: 3\nmoc:\n  window_chars: 4\n", "'moc_window_chars' and moc.window_chars"),
        ("moc:\n  window: 3\n", "unknown field.*'moc.window'"),
        ("moc_window: 3\n", "unknown field.*'moc_window'; did you mean 'moc_window_chars'"),
        ("zzz: 3\n", "unknown field.*'zzz'; known: method, moc, router, moc_window_chars"),  # nothing near
    ],
)
def test_flat_block_errors_name_the_key_as_written(tmp_path, yaml_text, match):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml_text)
    with pytest.raises(InputError, match=match):
        _chunky(["--config", str(recipe)])


def test_a_boolean_where_any_value_goes_stays_a_boolean(tmp_path):
    """extra_body holds provider fields of any type: DashScope's enable_thinking is a bool (docs/teachers.md)."""
    from metachunk.distill.run import DistillConfig

    from metachunk.config import load_yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "teachers:\n  reflection:\n    model: m\n    extra_body: {enable_thinking: false, top_k: 5}\n"
    )
    fields = load_yaml(DistillConfig, recipe)
    assert fields["teachers"]["reflection"].extra_body == {"enable_thinking": False, "top_k": 5}


def test_a_key_written_twice_is_refused_and_a_merged_key_may_be_overridden(tmp_path):
    """PyYAML keeps the last of two equal keys: a recipe's second ``input:`` silently won."""
    from metachunk.config import yaml_mapping

    with pytest.raises(
        InputError, match=r"r\.yaml:3: invalid YAML: key 'input' is written twice \(first at line 1\)"
    ):
        yaml_mapping("input: a.jsonl\nmethod: fixed\ninput: b.jsonl\n", tmp_path / "r.yaml")
    with pytest.raises(InputError, match="key 'k' is written twice"):
        yaml_mapping("outer:\n  k: 1\n  k: 2\n", tmp_path / "r.yaml")
    with pytest.raises(InputError, match="key 'input' is written twice"):  # on one line too
        yaml_mapping("run: {input: a.jsonl, input: b.jsonl}\n", tmp_path / "r.yaml")
    merged = "base: &b {input: a.jsonl, method: fixed}\nrun: {<<: *b, input: b.jsonl}\n"
    assert yaml_mapping(merged, tmp_path / "r.yaml")["run"] == {"input": "b.jsonl", "method": "fixed"}
    # a merge of a mapping that itself merges: PyYAML flattens it before building it, which is no repeat
    chained = "a: &a {x: 1, y: 0}\nb: &b {<<: *a, y: 2}\nc: {<<: *b}\n"
    assert yaml_mapping(chained, tmp_path / "r.yaml")["b"] == {"x": 1, "y": 2}
