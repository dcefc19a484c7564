"""Every recipe in recipes/ parses through the one config loader and builds a valid config."""

from pathlib import Path

import pytest

from chunking.pipeline import ChunkConfig
from metachunk.config import load_yaml

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes" / "chunk").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_chunk_recipe_is_valid(recipe):
    cfg = ChunkConfig(**load_yaml(ChunkConfig, recipe))
    assert cfg.input is not None and cfg.output is not None


def test_there_are_recipes():
    assert len(RECIPES) >= 3


DISTILL_RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes" / "distill").glob("*.yaml"))


@pytest.mark.parametrize("recipe", DISTILL_RECIPES, ids=lambda p: p.name)
def test_distill_recipe_is_valid(recipe):
    from distill.run import DistillConfig

    values = load_yaml(DistillConfig, recipe)
    # A recipe without `task:` (local.yaml) serves both `distill rewrite` and `distill summary`.
    for task in [values["task"]] if "task" in values else ["rewrite", "summary"]:
        cfg = DistillConfig(**{**values, "task": task})
        for teacher in cfg.teachers.values():
            assert teacher.api_key_env is None or teacher.api_key_env.isupper()  # a variable name, not a key


def test_there_are_distill_recipes():
    assert {p.name for p in DISTILL_RECIPES} >= {"rewrite.yaml", "summary.yaml", "local.yaml"}


DATA_RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes" / "data").glob("*.yaml"))


@pytest.mark.parametrize("recipe", DATA_RECIPES, ids=lambda p: p.name)
def test_data_recipe_is_valid(recipe):
    from distill.corpus import PrepareCrudConfig
    from distill.sample import SampleConfig
    from distill.sft import BuildSftConfig

    cls = {"prepare": PrepareCrudConfig, "sample": SampleConfig, "build": BuildSftConfig}[
        recipe.stem.split("_")[0]
    ]
    cls(**load_yaml(cls, recipe))


def test_there_are_data_recipes():
    assert {p.stem.split("_")[0] for p in DATA_RECIPES} == {"prepare", "sample", "build"}
