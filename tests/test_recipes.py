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


TRAIN_RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes" / "train").glob("*.yaml"))


@pytest.mark.parametrize("recipe", TRAIN_RECIPES, ids=lambda p: p.name)
def test_train_recipe_parses_with_trls_parser(recipe):
    """Every field exists in SFTConfig or ModelDataArguments. bf16 is switched off here only
    because TrainingArguments refuses bf16 on a machine without a GPU."""
    from trl import SFTConfig, TrlParser

    from train.distributed import validate_deepspeed_config
    from train.sft import ModelDataArguments

    parser = TrlParser((ModelDataArguments, SFTConfig))
    model_args, sft_args = parser.parse_args_and_config(["--config", str(recipe), "--bf16", "false"])
    assert sft_args.completion_only_loss is not False and model_args.model
    if sft_args.deepspeed:
        validate_deepspeed_config(sft_args.deepspeed)
    if "qwen2.5" in recipe.name:  # the paper's hyperparameters (MoC Appendix A.6)
        assert (sft_args.per_device_train_batch_size, sft_args.gradient_accumulation_steps) == (3, 16)
        assert (sft_args.learning_rate, sft_args.num_train_epochs, sft_args.warmup_steps) == (1e-5, 3, 0.1)
        assert sft_args.lr_scheduler_type == "cosine"


def test_there_are_train_recipes():
    assert {p.stem for p in TRAIN_RECIPES} >= {
        "cpu_smoke", "rewriter_qwen2.5-3b", "summarizer_qwen2.5-3b", "moc_router_qwen2.5-1.5b", "moc_expert_qwen2.5-1.5b"
    }  # fmt: skip
