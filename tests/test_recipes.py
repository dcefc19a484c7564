"""Every recipe in recipes/ parses through the one config loader and builds a valid config."""

from pathlib import Path

import pytest
import yaml
from metachunk.chunking.pipeline import ChunkConfig

from metachunk.config import load_yaml

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes" / "chunk").glob("*.yaml"))


BLOCK_KEYS = {  # the flat keys of ChunkConfig's blocks that have no block prefix
    "lumber": ("teachers", "prices", "teacher_config"),
    "moc": ("router", "experts"),
    "students": ("rewrite", "summarize", "rewrite_max_new_tokens", "summary_max_new_tokens"),
}
PREFIXES = {"lumber": "lumber_", "moc": "moc_", "students": "student_"}


def nested_form(recipe: dict) -> dict:
    """A chunk recipe with the flat keys of the per-method blocks written as nested blocks."""
    out = {}
    for key, value in recipe.items():
        block = next((b for b, p in PREFIXES.items() if key.startswith(p) or key in BLOCK_KEYS[b]), None)
        if block is None:
            out[key] = value
        else:
            out.setdefault(block, {})[
                key if key in BLOCK_KEYS[block] else key.removeprefix(PREFIXES[block])
            ] = value
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_chunk_recipe_is_valid(recipe, tmp_path):
    cfg = ChunkConfig(**load_yaml(ChunkConfig, recipe))
    assert cfg.input is not None and cfg.output is not None
    # The recipes use the flat keys (lumber_tokens, teachers, ...); the nested blocks say the same.
    path = tmp_path / "nested.yaml"
    path.write_text(yaml.safe_dump(nested_form(yaml.safe_load(recipe.read_text(encoding="utf-8")))))
    assert ChunkConfig(**load_yaml(ChunkConfig, path)) == cfg


def test_there_are_recipes():
    assert len(RECIPES) >= 3


DISTILL_RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes" / "distill").rglob("*.yaml"))


@pytest.mark.parametrize("recipe", DISTILL_RECIPES, ids=lambda p: p.name)
def test_distill_recipe_is_valid(recipe):
    from metachunk.distill.run import DistillConfig

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
    from metachunk.distill.corpus import PrepareCrudConfig
    from metachunk.distill.sample import SampleConfig
    from metachunk.distill.sft import BuildSftConfig

    cls = {"prepare": PrepareCrudConfig, "sample": SampleConfig, "build": BuildSftConfig}[
        recipe.stem.split("_")[0]
    ]
    cls(**load_yaml(cls, recipe))


def test_there_are_data_recipes():
    assert {p.stem.split("_")[0] for p in DATA_RECIPES} == {"prepare", "sample", "build"}


ROOT = Path(__file__).resolve().parents[1]
TRAIN_RECIPES = sorted((ROOT / "recipes" / "train").glob("*.yaml"))


@pytest.mark.parametrize("recipe", TRAIN_RECIPES, ids=lambda p: p.name)
def test_train_recipe_parses_with_trls_parser(recipe):
    """Every field exists in SFTConfig or ModelDataArguments. bf16 is switched off here only
    because TrainingArguments refuses bf16 on a machine without a GPU."""
    from metachunk.train.distributed import validate_deepspeed_config
    from metachunk.train.sft import ModelDataArguments
    from trl import SFTConfig, TrlParser

    parser = TrlParser((ModelDataArguments, SFTConfig))
    model_args, sft_args = parser.parse_args_and_config(["--config", str(recipe), "--bf16", "false"])
    assert sft_args.completion_only_loss is not False and model_args.model_name_or_path
    if sft_args.deepspeed:
        validate_deepspeed_config(sft_args.deepspeed)
    if "qwen2.5" in recipe.name:  # the paper's hyperparameters (MoC Appendix A.6)
        assert (sft_args.per_device_train_batch_size, sft_args.gradient_accumulation_steps) == (3, 16)
        assert (sft_args.learning_rate, sft_args.num_train_epochs, sft_args.warmup_steps) == (1e-5, 3, 0.1)
        assert sft_args.lr_scheduler_type == "cosine"


@pytest.mark.parametrize("recipe", TRAIN_RECIPES, ids=lambda p: p.name)
def test_train_recipe_is_read_by_trl_sft(recipe, monkeypatch):
    """`trl sft --config RECIPE` reads the same file: its own parser (ScriptArguments, SFTConfig, ModelConfig,
    DatasetMixtureConfig) knows every key, and reads the model, the dataset and its split as ours does. A key
    it did not know would go to `accelerate launch`, which refuses it (parse only: nothing trains)."""
    from metachunk.train.sft import ModelDataArguments
    from trl import SFTConfig, TrlParser
    from trl.scripts.sft import make_parser

    monkeypatch.chdir(ROOT)  # the recipes name recipes/deepspeed/*.json relative to the checkout
    argv = ["--config", str(recipe), "--bf16", "false"]  # bf16: as above
    script_args, _, model_config, _, unknown, _ = make_parser().parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    assert unknown == []
    ours, _ = TrlParser((ModelDataArguments, SFTConfig)).parse_args_and_config(argv)
    assert model_config.model_name_or_path == ours.model_name_or_path
    assert script_args.dataset_name == ours.dataset_name
    assert script_args.dataset_test_split == ours.dataset_test_split == "validation"  # build-sft's split
    assert model_config.dtype == ours.dtype


@pytest.mark.parametrize("old", ["model", "dataset"])
def test_the_old_train_field_names_say_the_new_ones(old, tmp_path, capsys):
    from metachunk.train.sft import main

    new = {"model": "model_name_or_path", "dataset": "dataset_name"}[old]
    recipe = tmp_path / "old.yaml"
    recipe.write_text(TRAIN_RECIPES[0].read_text().replace(f"{new}:", f"{old}:"))
    for argv in (["--config", str(recipe)], ["--config", str(TRAIN_RECIPES[0]), f"--{old}", "x"]):
        assert main(argv) == 2
        assert f"field '{old}' is now '{new}'" in capsys.readouterr().err


def test_there_are_train_recipes():
    assert {p.stem for p in TRAIN_RECIPES} >= {
        "cpu_smoke", "rewriter_qwen2.5-3b", "summarizer_qwen2.5-3b", "moc_router_qwen2.5-1.5b", "moc_expert_qwen2.5-1.5b"
    }  # fmt: skip


REGEN_RECIPES = sorted((ROOT / "recipes" / "regen").glob("*.yaml")) + sorted(
    (ROOT / "recipes" / "experiments").glob("*.yaml")
)


@pytest.mark.parametrize("recipe", REGEN_RECIPES, ids=lambda p: p.name)
def test_regen_recipe_stages_are_valid_configs_of_their_commands(recipe, tmp_path):
    import yaml
    from metachunk.distill.corpus import PrepareCrudConfig
    from metachunk.distill.hub import PushConfig
    from metachunk.distill.passages import PassagesConfig
    from metachunk.distill.run import DistillConfig
    from metachunk.distill.sample import SampleConfig
    from metachunk.distill.sft import BuildSftConfig
    from metachunk.eval.chunk_quality import ChunkQualityConfig
    from metachunk.eval.compare import CompareConfig
    from metachunk.eval.diagnostics import DiagnosticsConfig
    from metachunk.eval.qa import QAConfig
    from metachunk.train.export import ExportConfig
    from metachunk.train.sft import ModelDataArguments

    from metachunk.regen import load_recipe

    commands = {("data", "prepare-crud"): PrepareCrudConfig, ("data", "sample"): SampleConfig,
                ("distill",): DistillConfig, ("data", "build-sft"): BuildSftConfig, ("data", "push"): PushConfig,
                ("data", "passages"): PassagesConfig, ("chunk",): ChunkConfig, ("export",): ExportConfig,
                ("eval", "qa"): QAConfig, ("eval", "chunk-quality"): ChunkQualityConfig,
                ("eval", "compare"): CompareConfig, ("eval", "diagnostics"): DiagnosticsConfig}  # fmt: skip
    for stage in load_recipe(recipe).stages:
        words = tuple(stage.argv)
        path = tmp_path / f"{stage.name}.yaml"
        path.write_text(yaml.safe_dump(stage.config))
        if words == ("train",):  # TRL's parser: an unknown or mistyped field raises
            from trl import SFTConfig, TrlParser

            model_args, sft_args = TrlParser((ModelDataArguments, SFTConfig)).parse_args_and_config(
                ["--config", str(path)]
            )
            assert sft_args.bf16 is False and model_args.dtype == "float32", (
                stage.name
            )  # set explicitly, on CPU
            continue
        cls = commands.get(words[:2]) or commands[words[:1]]
        values = load_yaml(cls, path)
        if cls in (DistillConfig, BuildSftConfig):
            values["task"] = words[-1]
        cls(**values)


def test_there_are_regen_recipes():
    assert "crud_rewrite_summary.yaml" in {p.name for p in REGEN_RECIPES}
