"""metachunk.train.sft: no silent precision change, max_length checked against the data, bad input refused before the model loads.

Every refusal is one line on stderr and exit status 2, found before any weights load (``no_model_load``).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from test_train import RECIPE

ROOT = Path(__file__).resolve().parents[1]
TRAIN_RECIPES = sorted((ROOT / "recipes" / "train").glob("*.yaml"))


@pytest.fixture
def no_model_load(monkeypatch):
    """The test fails if metachunk.train.sft gets as far as loading the model's weights."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(refuse))


def _cli(argv, capsys):
    """``metachunk train ARGV``: (exit status, stderr)."""
    from metachunk.cli import main

    status = main(["train", *argv])
    return status, capsys.readouterr().err


def _one_line_error(err: str, text: str) -> None:
    assert "Traceback" not in err and "usage:" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("train: ")]
    assert len(errors) == 1 and text in errors[0], err


def _recipe_without(tmp_path, *keys) -> Path:
    recipe = yaml.safe_load(RECIPE.read_text())
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in recipe.items() if k not in keys}))
    return path


def _facts(out: Path) -> dict:
    return json.loads((out / "metachunk_run.json").read_text())


# ------------------------------------------------------------------------------------------- precision


@pytest.mark.parametrize("recipe", TRAIN_RECIPES, ids=lambda p: p.name)
def test_every_train_recipe_sets_its_precision(recipe):
    config = yaml.safe_load(recipe.read_text())
    assert {"dtype", "bf16", "fp16"} <= config.keys(), "the recipe leaves its precision to a default"
    assert not (config["bf16"] and config["fp16"])
    if config["dtype"] == "float32":
        assert config["bf16"] is False and config["fp16"] is False  # float32 means float32, no autocast


def test_cpu_smoke_trains_and_saves_float32_and_records_it(sft_dataset, tiny_model_dir, tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "run"
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
            "--output_dir", str(out), "--max_steps", "1", "--max_length", "4096", "--eval_strategy", "no"]  # fmt: skip
    status, err = _cli(argv, capsys)
    assert status == 0, err[-2000:]
    assert _facts(out)["precision"] == {"dtype": "float32", "bf16": False, "fp16": False, "autocast": None,
                                        "bf16_given": True, "saved_dtype": "float32"}  # fmt: skip
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F32"}


class _Saver:
    """A trainer's `save_model` as a ZeRO-3 save writes: shards and their index, then the tokenizer; it
    can be cut short after ``cut_after`` files (a kill mid-save)."""

    def __init__(self, shards: int, tag: str, cut_after: int | None = None, zero: bool = True):
        self.shards, self.tag, self.cut_after, self.zero = shards, tag, cut_after, zero
        self.args = SimpleNamespace(push_to_hub=False)

    def is_world_process_zero(self):
        return self.zero

    def save_model(self, folder):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        names = [f"model-{i:05d}-of-{self.shards:05d}.safetensors" for i in range(1, self.shards + 1)]
        files = {n: self.tag for n in names}
        files |= {"model.safetensors.index.json": json.dumps(names), "tokenizer.json": self.tag}
        for k, (name, text) in enumerate(files.items()):
            if k == self.cut_after:
                raise KeyboardInterrupt
            (folder / name).write_text(text)


def test_the_final_model_replaces_an_older_one_whole_or_not_at_all(tmp_path):
    """A rerun into the same output_dir wrote over the old model in place: a kill mid-save left a cut
    file, or new shards beside the old index, which loads a mix without an error."""
    from metachunk.train.sft import FINAL_STAGING, RUN_FACTS, save_final_model

    out = tmp_path / "run"
    save_final_model(_Saver(3, "old"), out)
    (out / RUN_FACTS).write_text("{}")
    (out / "checkpoint-5").mkdir()
    before = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    with pytest.raises(KeyboardInterrupt):  # killed while saving: the old model and its facts are whole
        save_final_model(_Saver(2, "new", cut_after=1), out)
    assert {p.name: p.read_text() for p in out.iterdir() if p.is_file()} == before
    save_final_model(_Saver(2, "new"), out)  # the next save: the new model only, no old shard beside it
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-5", "model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors",
                                                     "model.safetensors.index.json", "tokenizer.json"]  # fmt: skip
    assert {p.read_text() for p in out.glob("*.safetensors")} == {"new"} and not (
        out / FINAL_STAGING
    ).exists()
    save_final_model(_Saver(1, "other rank", zero=False), out)  # a rank other than 0 moves nothing
    assert (out / "model-00001-of-00002.safetensors").read_text() == "new"
    # an old single file would load before an index: it goes before the new index comes
    (out / "model.safetensors").write_text("old single file")
    save_final_model(_Saver(2, "newer"), out)
    assert not (out / "model.safetensors").exists()
    assert (out / "model-00001-of-00002.safetensors").read_text() == "newer"


def test_unset_bf16_follows_the_weights_dtype(tmp_path, tiny_model_dir):
    from metachunk.train.sft import parse_args

    (tmp_path / "ds" / "data").mkdir(parents=True)
    recipe = _recipe_without(tmp_path, "bf16", "fp16")
    base = ["--config", str(recipe), "--dataset_name", str(tmp_path / "ds"), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tiny_model_dir)]  # fmt: skip
    # TRL's SFTConfig alone would make it bf16 autocast over float32 weights
    _, sft_args = parse_args(base + ["--dtype", "float32"])
    assert (sft_args.bf16, sft_args.fp16, sft_args.mixed_precision) == (False, False, "no")
    _, sft_args = parse_args(base + ["--dtype", "auto"])  # the checkpoint's: float32 in config.json
    assert (sft_args.bf16, sft_args.mixed_precision) == (False, "no")
    _, sft_args = parse_args(base + ["--dtype", "bfloat16"])  # bf16 weights: bf16 mixed precision
    assert (sft_args.bf16, sft_args.mixed_precision) == (True, "bf16")
    _, sft_args = parse_args(base + ["--dtype", "bfloat16", "--bf16", "false"])  # given: kept
    assert sft_args.bf16 is False


def test_16_bit_weights_without_deepspeed_are_told_they_have_no_master_copy(
    tmp_path, tiny_model_dir, monkeypatch
):
    from metachunk.train.sft import master_weights_note, parse_args

    (tmp_path / "ds" / "data").mkdir(parents=True)
    base = ["--config", str(RECIPE), "--dataset_name", str(tmp_path / "ds"), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tiny_model_dir), "--dtype", "bfloat16", "--bf16", "true"]  # fmt: skip
    model_args, sft_args = parse_args(base)
    assert "no float32 master copy" in master_weights_note("bfloat16", model_args, sft_args)
    assert master_weights_note("float32", model_args, sft_args) is None
    model_args, sft_args = parse_args(base + ["--use_peft", "true"])  # the adapter is trained in float32
    assert master_weights_note("bfloat16", model_args, sft_args) is None
    model_args, sft_args = parse_args(
        base + ["--deepspeed", "recipes/deepspeed/zero2.json"]
    )  # DeepSpeed keeps one
    assert master_weights_note("bfloat16", model_args, sft_args) is None
    model_args, sft_args = parse_args(base)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # accelerate launch, DeepSpeed's settings inline
    assert master_weights_note("bfloat16", model_args, sft_args) is None


@pytest.mark.parametrize(
    "flags, text",
    [
        (["--bf16", "true"], "field 'dtype' is float32 but bf16: true asks for bf16 mixed precision on CPU"),
        (["--bf16", "false", "--fp16", "true"], "field 'dtype' is float32 but fp16: true asks for fp16"),
        (["--dtype", "float16", "--bf16", "true"], "field 'dtype' is float16 but bf16: true"),
        (
            ["--dtype", "bfloat16", "--bf16", "false", "--fp16", "true"],
            "field 'dtype' is bfloat16 but fp16: true",
        ),
        (["--dtype", "auto", "--bf16", "true"], "field 'dtype' is float32 (auto: the checkpoint's) but bf16"),
    ],
)
def test_contradicting_precision_is_refused_before_the_model_loads(
    tmp_path, tiny_model_dir, capsys, no_model_load, flags, text
):
    (tmp_path / "ds" / "data").mkdir(parents=True)
    base = ["--config", str(RECIPE), "--dataset_name", str(tmp_path / "ds"), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tiny_model_dir)]  # fmt: skip
    status, err = _cli(base + flags, capsys)
    assert status == 2
    _one_line_error(err, text)


def test_accelerates_mixed_precision_counts_too(tmp_path, tiny_model_dir, capsys, no_model_load, monkeypatch):
    (tmp_path / "ds" / "data").mkdir(parents=True)
    # what `accelerate launch --mixed_precision bf16` sets
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    argv = ["--config", str(RECIPE), "--dataset_name", str(tmp_path / "ds"), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tiny_model_dir)]  # fmt: skip
    status, err = _cli(argv, capsys)
    assert status == 2
    _one_line_error(err, "ACCELERATE_MIXED_PRECISION=bf16 asks for bf16 mixed precision on CPU")


# ------------------------------------------------------------------------------------------ max_length


def _lengths(dataset: Path, split: str, model_dir: Path) -> list[tuple[int, int]]:
    """(prompt + completion tokens, completion tokens) of each row, the way TRL tokenizes it."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for row in load_dataset(str(dataset), split=split):
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], return_dict=True)
        n_prompt, n_full = len(prompt["input_ids"]), len(full["input_ids"])
        assert full["input_ids"][:n_prompt] == prompt["input_ids"][:n_prompt]
        out.append((n_full, n_full - n_prompt))
    return out


def test_rows_longer_than_max_length_are_dropped_not_cut(sft_dataset, tiny_model_dir, tmp_path, capsys):
    max_length = 1024
    train = _lengths(sft_dataset, "train", tiny_model_dir)
    validation = _lengths(sft_dataset, "validation", tiny_model_dir)
    over = sum(n > max_length for n, _ in train)
    assert 0 < over < len(train)  # the ~3,000-word row does not fit, the others do
    out = tmp_path / "run"
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
            "--output_dir", str(out), "--max_steps", "1", "--max_length", str(max_length), "--eval_strategy", "no"]  # fmt: skip
    status, err = _cli(argv, capsys)
    assert status == 0, err[-2000:]
    assert f"dropped {over} of {len(train)} training rows" in err
    assert f"{len(train) - over} of {len(train)} rows fit max_length" in err
    facts = _facts(out)
    assert facts["rows"] == len(train) - over
    assert facts["rows_over_max_length"] == {
        "train": over,
        "validation": sum(n > max_length for n, _ in validation),
    }
    # every completion token of the rows kept carries the loss: none was cut
    assert facts["completion_tokens"] == sum(c for n, c in train if n <= max_length)

    from metachunk.train.export import ExportConfig, export  # the model card says both

    export(ExportConfig(checkpoint=out, out=tmp_path / "exported"), progress=lambda msg: None)
    card = (tmp_path / "exported" / "README.md").read_text()
    assert (
        f"- Training rows (that fit max_length): {len(train) - over} ({over} more dropped: longer than max_length);"
        in card
    )
    assert "| precision | float32 weights, no mixed precision |" in card


def test_no_row_within_max_length_is_refused_before_the_model_loads(
    sft_dataset,
    tiny_model_dir,
    tmp_path,
    capsys,
    no_model_load,
):
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
            "--output_dir", str(tmp_path / "o"), "--max_length", "64"]  # fmt: skip
    status, err = _cli(argv, capsys)
    assert status == 2
    _one_line_error(err, "field 'max_length': none of the 11 training rows fits in 64 tokens")


# ------------------------------------------------------------------------------------ one-line errors


def _no_chat_template(tiny_model_dir: Path, tmp_path: Path) -> Path:
    model = tmp_path / "base-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(
    "case",
    ["unknown model", "invalid YAML", "missing config", "no chat template", "report_to", "hub_token",
     "no such test split", "deepspeed not a JSON object", "deepspeed not JSON", "a recipe value's type",
     "a flag's type", "a list for a number", "a number as a key", "not UTF-8", "batch size 0",
     "accumulation 0", "learning rate NaN", "no step"],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(sft_dataset, tiny_model_dir, tmp_path, capsys, no_model_load, case):
    config, model, extra = RECIPE, str(tiny_model_dir), []
    if case == "unknown model":
        model, text = "no-such-model", "unknown model 'no-such-model'"
    elif case == "invalid YAML":
        config = tmp_path / "broken.yaml"
        config.write_text("model: [smollm2\nlearning_rate: 1e-5\n")
        text = f"--config {config}: not valid YAML"
    elif case == "missing config":
        config, text = tmp_path / "nope.yaml", f"--config {tmp_path / 'nope.yaml'}: no such file"
    elif case == "no chat template":
        model = str(_no_chat_template(tiny_model_dir, tmp_path))
        text = f"the tokenizer of {model} has no chat template"
    elif case == "hub_token":  # a secret given here would reach metachunk_run.json and the model card
        extra, text = (
            ["--hub-token", "hf_SECRET"],
            "field 'hub_token': the Hub token is read from HF_TOKEN only",
        )
    elif (
        case == "no such test split"
    ):  # eval_strategy steps (the recipe's) needs it: the Trainer's error is a traceback
        extra, text = ["--dataset_test_split", "dev"], "field 'dataset_test_split': "
        text += f"{sft_dataset} has no split 'dev' (train, validation), and eval_strategy is 'steps'"
    elif case.startswith("deepspeed"):  # the recipe's key: SFTConfig reads the file as it is built
        ds = tmp_path / "ds.json"
        ds.write_text("[1]" if case == "deepspeed not a JSON object" else "{zero: 2}")
        config = tmp_path / "with_ds.yaml"
        config.write_text(RECIPE.read_text() + f"\ndeepspeed: {ds}\n")
        text = f"deepspeed config {ds}: " + (
            "the top level must be a JSON object" if "object" in case else "not JSON"
        )
    elif case == "a recipe value's type":  # argparse printed the usage of every SFTConfig flag first (9 KB)
        config = _recipe_without(tmp_path, "learning_rate")
        config.write_text(config.read_text() + "learning_rate: 1e-5x\n")
        text = f"--config {config}: field 'learning_rate': invalid float value: '1e-5x'"
    elif case in ("a list for a number", "a number as a key", "not UTF-8"):
        # TrlParser hands a recipe's values to argparse as defaults, unchecked unless strings: the
        # list reached the Trainer after the model loaded, the number key was a TypeError
        config = _recipe_without(tmp_path, "max_steps")
        line, text = {"a list for a number": (b"max_steps: [1, 2]\n", "field 'max_steps' must be int, got list [1, 2]"),
                      "a number as a key": (b"5: x\n", "key 5 is not a field name; quote it"),
                      "not UTF-8": (b"run_name: caf\xe9\n", "not UTF-8 text (byte ")}[case]  # fmt: skip
        config.write_bytes(config.read_bytes() + line)
        text = f"--config {config}: {text}"
    elif case in (
        "batch size 0",
        "accumulation 0",
        "learning rate NaN",
        "no step",
    ):  # torch or the Trainer failed
        extra, text = {  # after the load, with a traceback
            "batch size 0": (["--per_device_train_batch_size", "0"], "field 'per_device_train_batch_size' must be >= 1"),
            "accumulation 0": (["--gradient_accumulation_steps", "0"], "field 'gradient_accumulation_steps' must be >= 1"),
            "learning rate NaN": (["--learning_rate", "nan"], "field 'learning_rate' must be a finite number >= 0.0"),
            "no step": (["--max_steps", "0", "--num_train_epochs", "0"], "nothing would be trained"),
        }[case]  # fmt: skip
    elif case == "a flag's type":
        extra, text = (
            ["--learning-rate", "fast"],
            "argument --learning_rate/--learning-rate: invalid float value",
        )
    else:
        extra, text = ["--report_to", "tensorbored"], "field 'report_to': unknown 'tensorbored'"
    argv = ["--config", str(config), "--model_name_or_path", model, "--dataset_name", str(sft_dataset),
            "--output_dir", str(tmp_path / "o"), *extra]  # fmt: skip
    status, err = _cli(argv, capsys)
    assert status == 2
    _one_line_error(err, text)


def test_a_chat_template_path_serves_a_base_model(sft_dataset, tiny_model_dir, tmp_path, no_model_load):
    from metachunk.train.sft import main

    model = _no_chat_template(tiny_model_dir, tmp_path)
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(model), "--dataset_name", str(sft_dataset),
            "--output_dir", str(tmp_path / "o"), "--chat_template_path", str(tiny_model_dir / "chat_template.jinja")]  # fmt: skip
    with pytest.raises(AssertionError, match="the model was loaded"):  # every check before it passed
        main(argv)


def test_python_m_train_bad_input_has_no_traceback(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [smollm2\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for argv in (["--config", str(tmp_path / "nope.yaml")], ["--config", str(broken)]):
        done = subprocess.run([sys.executable, "-m", "metachunk.train", *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        _one_line_error(done.stderr, "train: invalid config: --config ")


def test_unset_activation_checkpointing_is_trls_default_under_its_own_name(tmp_path, tiny_model_dir):
    """TRL's SFTConfig gives its checkpointing default under transformers' deprecated ``gradient_checkpointing``;
    left unset, the same value is said as ``activation_checkpointing``: no FutureWarning, nothing else changed."""
    import warnings

    from metachunk.train.sft import parse_args

    (tmp_path / "ds" / "data").mkdir(parents=True)
    recipe = _recipe_without(tmp_path, "activation_checkpointing")
    base = ["--config", str(recipe), "--dataset_name", str(tmp_path / "ds"), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tiny_model_dir)]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, sft_args = parse_args(base)
        assert sft_args.activation_checkpointing is True and sft_args.gradient_checkpointing is True
        # every spelling argparse takes: the default appended after it had overridden a dashed one
        _, by_equals = parse_args([f"--config={recipe}", *base[2:]])  # one word, as argparse takes it
        assert by_equals.learning_rate == sft_args.learning_rate and by_equals.use_cpu
        for given in (["--activation_checkpointing", "false"], ["--activation_checkpointing=false"],
                      ["--activation-checkpointing", "false"]):  # fmt: skip
            _, sft_args = parse_args(base + given)
            assert sft_args.activation_checkpointing is False and sft_args.gradient_checkpointing is False, (
                given
            )
    # the old name, given: transformers says so
    with pytest.warns(FutureWarning, match="gradient_checkpointing"):
        _, sft_args = parse_args(base + ["--gradient_checkpointing", "false"])
    assert sft_args.activation_checkpointing is False


def test_resume_from_latest_skips_a_checkpoint_whose_save_was_cut_short(tmp_path, capsys):
    """The Trainer writes ``trainer_state.json`` last; a run killed while saving leaves a newer checkpoint without
    it (or with it half-written). ``latest`` is the newest whole one, not the highest number."""
    from types import SimpleNamespace

    from metachunk.train.sft import resume_point

    for step, state in [(2, "{}"), (4, '{"global_step": 4}'), (6, None), (8, ""), (10, '{"global_st')]:
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"")
        if state is not None:
            (folder / "trainer_state.json").write_text(state)
    (tmp_path / "checkpoint-final").mkdir()  # not a step: not a checkpoint
    args = SimpleNamespace(resume_from_checkpoint="latest", output_dir=str(tmp_path))
    assert resume_point(args) == str(tmp_path / "checkpoint-4")
    err = capsys.readouterr().err
    assert all(f"checkpoint-{n} skipped" in err for n in (6, 8, 10)) and "checkpoint-2" not in err
    args = SimpleNamespace(resume_from_checkpoint="latest", output_dir=str(tmp_path / "none_yet"))
    with pytest.raises(ValueError, match="no whole checkpoint"):
        resume_point(args)


def test_a_zero_checkpoint_resumes_only_on_as_many_processes_as_saved_it(tmp_path, monkeypatch):
    """DeepSpeed refuses a ZeRO checkpoint saved by 2 ranks in a run of 1, after the model has loaded:
    a job preempted on 2 GPUs and requeued on 1 is refused before the load."""
    from types import SimpleNamespace

    from metachunk.train.sft import resume_point

    folder = tmp_path / "checkpoint-4"
    (folder / "global_step4").mkdir(parents=True)
    (folder / "latest").write_text("global_step4")
    (folder / "trainer_state.json").write_text('{"global_step": 4}')
    for rank in (0, 1):
        (folder / "global_step4" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    args = SimpleNamespace(resume_from_checkpoint="latest", output_dir=str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"was saved by 2 processes, and this run has 1: .*--num_gpus 2"):
        resume_point(args)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_point(args) == str(folder)


def test_a_deprecated_alias_beside_its_new_name_is_refused(tmp_path, tiny_model_dir, capsys, no_model_load):
    """Every shipped recipe sets ``activation_checkpointing``; transformers reads its old name
    ``gradient_checkpointing`` only when the new one is unset, so ``--gradient_checkpointing false``
    was ignored without a word."""
    (tmp_path / "ds" / "data").mkdir(parents=True)
    argv = ["--config", str(RECIPE), "--dataset_name", str(tmp_path / "ds"), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tiny_model_dir)]  # fmt: skip
    for flags in (["--gradient_checkpointing", "false"], ["--gradient-checkpointing", "false"],
                  ["--no_gradient_checkpointing"], ["--no-gradient-checkpointing"]):  # fmt: skip
        status, err = _cli([*argv, *flags], capsys)
        assert status == 2
        _one_line_error(
            err, "field 'gradient_checkpointing' is transformers' old name for 'activation_checkpointing'"
        )


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--use_peft", "true", "--lora_dropout", "2"], "field 'lora_dropout' must be in [0, 1), got 2.0"),
        (["--max_train_rows", "0"], "field 'max_train_rows' must be >= 1"),
        (["--max_train_rows", "-3"], "field 'max_train_rows' must be >= 1"),
        (
            ["--chat_template_path", "/nonexistent/t.jinja"],
            "field 'chat_template_path': no file /nonexistent/t.jinja",
        ),
        (["--output_dir", "FILE"], "is a file; checkpoints are written in a folder"),
    ],
)
def test_bad_training_values_are_refused_before_the_model_loads(
    tmp_path, tiny_model_dir, capsys, no_model_load, flags, said
):
    """Each had failed after the model loaded, with a traceback (torch's Dropout, a Hub id check on a
    template path, mkdir over a file), or done something else than asked (0 rows meant every row)."""
    (tmp_path / "ds" / "data").mkdir(parents=True)
    (tmp_path / "FILE").write_text("")
    argv = ["--config", str(RECIPE), "--dataset_name", str(tmp_path / "ds"), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tiny_model_dir)]  # fmt: skip
    status, err = _cli([*argv, *[str(tmp_path / f) if f == "FILE" else f for f in flags]], capsys)
    assert status == 2
    _one_line_error(err, said)


def test_a_recipes_lora_target_modules_line_names_modules_as_the_flag_does(tmp_path, tiny_model_dir):
    """PEFT reads a string as one regular expression over the whole module name: a recipe's
    ``lora_target_modules: q_proj`` matched nothing, where ``--lora_target_modules q_proj`` trains."""
    from metachunk.train.sft import check, parse_args

    (tmp_path / "ds" / "data").mkdir(parents=True)
    recipe = yaml.safe_load(RECIPE.read_text())
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**recipe, "use_peft": True, "lora_target_modules": "q_proj"}))
    base = ["--config", str(path), "--dataset_name", str(tmp_path / "ds"), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tiny_model_dir)]  # fmt: skip
    model_args, sft_args = parse_args(base, check_inputs=False)
    check(model_args, sft_args)
    assert model_args.lora_target_modules == ["q_proj"]
    model_args, sft_args = parse_args([*base, "--lora_target_modules", "q_proj"], check_inputs=False)
    assert model_args.lora_target_modules == ["q_proj"]
    # PEFT's shorthand and a pattern stay strings, in a recipe or as a flag (a one-item list would name no module)
    from metachunk.train.sft import lora_targets

    assert lora_targets("all-linear") == lora_targets(["all-linear"]) == "all-linear"
    assert lora_targets([r".*\.(q|v)_proj"]) == r".*\.(q|v)_proj" and lora_targets(["q_proj", "v_proj"]) == [
        "q_proj",
        "v_proj",
    ]


def test_resume_from_a_named_folder_that_is_no_whole_checkpoint_is_refused(tmp_path):
    """A dataset folder, or a checkpoint whose save was cut short, named explicitly: refused before the
    model loads (it had failed on trainer_state.json after it)."""
    from types import SimpleNamespace

    from metachunk.train.sft import resume_point

    cut = tmp_path / "checkpoint-6"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"")
    for folder in (cut, tmp_path):
        args = SimpleNamespace(resume_from_checkpoint=str(folder), output_dir=str(tmp_path))
        with pytest.raises(ValueError, match="holds no whole trainer_state.json"):
            resume_point(args)
    (cut / "trainer_state.json").write_text('{"global_step": 6}')
    assert resume_point(SimpleNamespace(resume_from_checkpoint=str(cut), output_dir=str(tmp_path))) == str(
        cut
    )


def test_a_full_save_over_a_lora_run_leaves_no_adapter_files(tmp_path):
    """A LoRA run's adapter_config.json left beside a full run's weights made transformers load the
    folder as an adapter and fail; the final save removes what the new save does not write."""
    from types import SimpleNamespace

    from metachunk.train.sft import save_final_model

    def trainer(files: dict[str, str]):
        def save_model(folder):
            Path(folder).mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (Path(folder) / name).write_text(text)

        return SimpleNamespace(args=SimpleNamespace(push_to_hub=False), is_world_process_zero=lambda: True,
                               save_model=save_model)  # fmt: skip

    out = tmp_path / "out"
    save_final_model(trainer({"adapter_config.json": "{}", "adapter_model.safetensors": "a"}), out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    save_final_model(
        trainer({"config.json": "{}", "model.safetensors": "w", "generation_config.json": "{}"}), out
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    save_final_model(trainer({"adapter_config.json": "{}", "adapter_model.safetensors": "b"}), out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_the_runs_identity_leaves_out_how_it_is_watched(tmp_path):
    """The regeneration fingerprint: the recipe and the flags as given, less --config FILE and the runtime
    fields (report_to, logging_dir), in the recipe or as flags, with their values."""
    from types import SimpleNamespace

    from metachunk.train.sft import identity

    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1.0e-5\nreport_to: tensorboard\nlogging_dir: logs\n")
    argv = ["--config", str(recipe), "--report_to", "wandb", "tensorboard", "--max_length", "64",
            "--logging-dir=elsewhere", "--seed", "3"]  # fmt: skip
    assert identity(SimpleNamespace(argv=argv)) == {
        "recipe": {"learning_rate": 1.0e-5},
        "flags": ["--max_length", "64", "--seed", "3"],
    }


@pytest.mark.parametrize("packing, strategy, kept", [(False, "bfd", 1), (True, "bfd", 1), (True, "bfd_split", 2),
                                                     (True, "wrapped", 2)])  # fmt: skip
def test_a_row_past_max_length_is_dropped_only_where_trl_would_cut_it(
    tiny_model_dir, packing, strategy, kept
):
    """TRL cuts a long row's tail when not packing and under bfd packing; bfd_split and wrapped packing
    keep all of it (in pieces), so the row stays."""
    from types import SimpleNamespace

    from datasets import Dataset
    from metachunk.train.sft import fit_max_length
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    short = {
        "prompt": [{"role": "user", "content": "Hi."}],
        "completion": [{"role": "assistant", "content": "Yes."}],
    }
    long = {
        "prompt": [{"role": "user", "content": "Emma was clever. " * 40}],
        "completion": short["completion"],
    }
    rows = Dataset.from_list([short, long])
    args = SimpleNamespace(max_length=64, packing=packing, packing_strategy=strategy, dataset_num_proc=None)
    fitted, over = fit_max_length(rows, tokenizer, args)
    assert len(fitted) == kept and over == 2 - kept


def test_help_names_the_command_and_the_recipe(capsys):
    from metachunk.train.sft import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    assert out.startswith("usage: metachunk train --config RECIPE.yaml")
    assert "deepspeed --module metachunk.train --config RECIPE.yaml" in out
    assert "a Hub id ORG/NAME" in out


def test_a_shard_cut_short_is_named_before_the_model_loads(
    sft_dataset, tiny_model_dir, tmp_path, capsys, no_model_load
):
    """datasets' DatasetGenerationError named no file."""
    import shutil

    dataset = Path(shutil.copytree(sft_dataset, tmp_path / "ds"))
    shard = sorted((dataset / "data").glob("train-*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    argv = ["--config", str(RECIPE), "--dataset_name", str(dataset), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tiny_model_dir)]  # fmt: skip
    status, err = _cli(argv, capsys)
    assert status == 2, err
    _one_line_error(err, f"field 'dataset_name': {shard} does not read as parquet")
