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
