"""Every recipe in recipes/ parses through the one config loader and builds a valid config."""

import re
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
        rows = sft_args.per_device_train_batch_size * sft_args.gradient_accumulation_steps
        assert sft_args.per_device_train_batch_size == 3 and rows * RECIPE_GPUS[recipe.stem] == 96
        assert (sft_args.learning_rate, sft_args.num_train_epochs, sft_args.warmup_steps) == (1e-5, 3, 0.1)
        assert sft_args.lr_scheduler_type == "cosine"
        # the comments' settings for other GPU counts keep the 96 rows: per-device batch x accumulation x GPUs
        others = re.findall(
            r"^#.*--num_gpus (\d+)\b.*--gradient_accumulation_steps (\d+)", recipe.read_text(), re.M
        )
        assert {int(g) for g, _ in others} >= {1, 2, 8} - {RECIPE_GPUS[recipe.stem]}
        for gpus, steps in others:
            assert sft_args.per_device_train_batch_size * int(steps) * int(gpus) == 96, (gpus, steps)


# The GPU count each shipped Qwen2.5 recipe's defaults are for: the 3B ones one GPU, the MoC ones the paper's 2 x A800.
RECIPE_GPUS = {"rewriter_qwen2.5-3b": 1, "summarizer_qwen2.5-3b": 1, "moc_router_qwen2.5-1.5b": 2,
               "moc_expert_qwen2.5-1.5b": 2}  # fmt: skip
DS = ROOT / "recipes" / "deepspeed"


def _parse(argv: list[str]):
    """Through metachunk.train's own parser (TRL's, plus its checks), as `metachunk train` reads a recipe. bf16 is
    off: TrainingArguments refuses it on a machine without a GPU."""
    from metachunk.train.sft import parse_config

    cfg = parse_config([*argv, "--bf16", "false"])
    return cfg.model_args, cfg.sft_args


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
@pytest.mark.parametrize("recipe", TRAIN_RECIPES, ids=lambda p: p.name)
def test_train_recipe_parses_packed_with_its_attention_under_zero2_and_zero3(recipe, stage, monkeypatch):
    """Every train recipe with packing on (bfd: padding-free sequences of max_length tokens), the attention it names
    (one that names none: flex_attention, or sdpa on CPU, where flex has no backward), under each ZeRO stage: what
    the packing and attention checks accept before any model loads."""
    from metachunk.train.distributed import validate_deepspeed_config
    from metachunk.train.sft import check_attention, check_packing, padding_free

    monkeypatch.chdir(ROOT)
    model_args, sft_args = _parse(["--config", str(recipe)])
    attn = model_args.attn_implementation or ("sdpa" if sft_args.use_cpu else "flex_attention")
    argv = ["--config", str(recipe), "--packing", "true", "--attn_implementation", attn,
            "--deepspeed", str(DS / f"{stage}.json")]  # fmt: skip
    if sft_args.max_length is None:  # packing needs the sequence length
        argv += ["--max_length", "4096"]
    model_args, sft_args = _parse(argv)
    assert sft_args.packing and sft_args.packing_strategy == "bfd" and padding_free(sft_args)
    assert model_args.attn_implementation == attn
    check_packing(sft_args)
    check_attention(attn, sft_args)
    assert validate_deepspeed_config(sft_args.deepspeed)["zero_optimization"]["stage"] == int(stage[-1])


@pytest.mark.parametrize("recipe", [p for p in TRAIN_RECIPES if "3b" in p.stem], ids=lambda p: p.name)
def test_3b_recipes_name_their_batching_and_kernels(recipe, monkeypatch):
    """The 3B recipes say how a batch is laid out and which kernels run (recipes/train/README.md, "Kernels"):
    padding-free rows (96 per step, no padding) under flex attention, TRL's fused LM head (loss_type nll, no
    logits tensor), torch's fused AdamW, no Liger; ZeRO-2 by default, and the recipe parses as it is."""
    from metachunk.train.sft import check_attention, check_packing, padding_free

    monkeypatch.chdir(ROOT)
    model_args, sft_args = _parse(["--config", str(recipe)])
    assert (
        sft_args.padding_free
        and not sft_args.packing
        and sft_args.max_length is None
        and padding_free(sft_args)
    )
    assert model_args.attn_implementation == "flex_attention"
    check_packing(sft_args)
    check_attention(model_args.attn_implementation, sft_args)
    with pytest.raises(ValueError, match="field 'max_length': packing"):  # TRL's refusal came after the load
        check_packing(_parse(["--config", str(recipe), "--packing", "true"])[1])
    assert sft_args.loss_type == "nll" and sft_args.label_smoothing_factor == 0  # the fused LM head's path
    assert sft_args.optim == "adamw_torch_fused" and not sft_args.use_liger_kernel
    assert Path(sft_args.deepspeed).name == "zero2.json" and sft_args.activation_checkpointing
    assert not re.search(r"^#?\s*use_liger_kernel:", recipe.read_text(), re.M)  # not even commented out


ACCELERATE = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("config", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_configs_load_and_name_a_valid_deepspeed_config(config, monkeypatch):
    """accelerate's own loader reads each shipped accelerate config; the DeepSpeed JSON it names validates and is
    the stage its name says (ZeRO-3 partitions the weights while they load: zero3_init_flag)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from metachunk.train.distributed import validate_deepspeed_config

    monkeypatch.chdir(ROOT)  # accelerate reads the JSON path relative to the launch directory
    loaded = load_config_from_file(str(config))
    assert loaded.distributed_type == "DEEPSPEED"
    stage = int(re.fullmatch(r"zero(\d)", config.stem).group(1))
    ds = loaded.deepspeed_config
    assert validate_deepspeed_config(ds["deepspeed_config_file"])["zero_optimization"]["stage"] == stage
    assert ds["zero3_init_flag"] is (stage == 3)


def test_there_are_accelerate_configs_for_zero2_and_zero3():
    assert {p.stem for p in ACCELERATE} >= {"zero2", "zero3"}


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


def test_build_sft_says_trls_name_for_its_token_limit(tmp_path, capsys, monkeypatch):
    from metachunk.cli import main

    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "old.yaml"
    text = (ROOT / "recipes" / "data" / "build_sft_rewrite.yaml").read_text()
    recipe.write_text(text.replace("max_length:", "max_tokens:"))
    for argv, said in (
        (["--config", str(recipe)], "field 'max_tokens' is now 'max_length'"),
        (
            ["rewrite", "--distilled", "d.jsonl", "--out", "o", "--max-tokens", "9"],
            "--max-tokens is now --max-length",
        ),
    ):
        assert main(["data", "build-sft", *argv]) == 2
        assert said in capsys.readouterr().err


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
    from metachunk.train.sft import parse_args

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
        if words == ("train",):  # `metachunk train`'s parser (TRL's): an unknown or mistyped field raises
            model_args, sft_args = parse_args(["--config", str(path)], check_inputs=False)
            # bf16 set explicitly, on CPU
            assert stage.config.get("bf16") is False and not sft_args.bf16, stage.name
            assert model_args.dtype == "float32", stage.name
            continue
        cls = commands.get(words[:2]) or commands[words[:1]]
        values = load_yaml(cls, path)
        if cls in (DistillConfig, BuildSftConfig):
            values["task"] = words[-1]
        cls(**values)


def test_there_are_regen_recipes():
    assert "crud_rewrite_summary.yaml" in {p.name for p in REGEN_RECIPES}
