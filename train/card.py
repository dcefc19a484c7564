"""The model card of an export: README.md, written from what the run recorded.

`render_model_card` says only what `Run` holds, as ``metachunk.train.export`` read it from the checkpoint:
``metachunk_run.json`` (``metachunk.train.sft.run_facts``: base model, dataset build report, hyperparameters, counts)
and the trainer's log history (``train_log.json``, or a ``checkpoint-N``'s ``trainer_state.json``, whose
losses and step are that checkpoint's, not the run's end), plus the export's own facts (the weights it
wrote, the card's title and Hub ids). A missing fact reads "not recorded". Rendering only: no file is read.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from metachunk.train.sft import RUN_FACTS

from metachunk import markdown

NOT_RECORDED = "not recorded"
TAGS = ["metachunk", "text-chunking", "rag"]
# The Hub ids of the presets' upstream models (metachunk.models.PRESETS ships them as GGUF files).
PRESET_HUB_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}
# What the presets' own Hub cards declare; their converted folders carry no card to read it from.
PRESET_LICENSES = {"smollm2": {"license": "apache-2.0"}, "gemma3-270m": {"license": "gemma"}}
# What a distilled model is for, by the dataset's task (metachunk.distill.sft: rewrite | summary).
PURPOSE = {
    "rewrite": (
        "a **chunk rewriter**: given a text chunk cut out of a document and the document context, it rewrites "
        "the chunk so that it stands on its own (Meta-Chunking's chunk rewriting)",
        "--rewrite",
    ),
    "summary": (
        "a **chunk summarizer**: given a text chunk and its document, it writes one sentence that states the "
        "chunk's content from the whole document's perspective (Meta-Chunking's chunk summaries)",
        "--summarize",
    ),
}


@dataclass
class Run:
    """What the card is written from. Any part may be missing."""

    facts: dict = field(default_factory=dict)  # metachunk_run.json ({} when there is none)
    log: list[dict] = field(default_factory=list)  # the trainer's log history
    global_step: int | None = None
    checkpoint_step: int | None = None  # set when exporting checkpoint-N of a run
    eval_results: dict | None = None
    loss_png: Path | None = None


def last_logged(log: list[dict], key: str):
    """The last value of ``key`` in a trainer log history (None when it was never logged)."""
    return next((e[key] for e in reversed(log) if key in e), None)


def results(run: Run) -> dict:
    """Final losses, steps and runtime: from the log history (the checkpoint's own), else the facts."""
    facts = run.facts if run.checkpoint_step is None else {}
    return {
        "final_train_loss": last_logged(run.log, "loss") if run.log else facts.get("final_train_loss"),
        "final_eval_loss": last_logged(run.log, "eval_loss") if run.log else facts.get("final_eval_loss"),
        "global_steps": run.global_step,
        "epochs": last_logged(run.log, "epoch"),  # how far through the rows the steps went (0.27: not all)
        "train_runtime_s": last_logged(run.log, "train_runtime") or facts.get("train_runtime_s"),
    }


def _value(value) -> str:
    if value is None:
        return NOT_RECORDED
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _code(text) -> str:
    return f"`{text}`" if text else NOT_RECORDED


def _flatten(obj, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _flatten(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), obj)]


def _recorded(value):
    """A word or value the run recorded, its absolute paths as ``…/name``: they were typed in the training
    run's working directory, not in this one."""
    return markdown.shown_argument(value, relative_to_cwd=False)


def _local(path) -> str:
    return _code(None if path is None else markdown.shown_path(path, relative_to_cwd=False))


def _where(export_facts: dict) -> str:
    """How the usage lines name the model: its Hub id when pushed, else the folder it is in."""
    return export_facts.get("repo_id") or f"path/to/{export_facts['title']}"


def _base_model_id(export_facts: dict, facts: dict) -> str | None:
    if export_facts["base_model_id"]:
        return export_facts["base_model_id"]
    return PRESET_HUB_IDS.get(facts.get("base_model"))


def base_license(base_model_dir) -> dict:
    """The license the base model's own card declares (``license``, and ``license_name`` /
    ``license_link`` for ``other``), read from the README.md of the folder it was trained from: a
    fine-tune's weights are under its base's terms, not its training data's. ``{"license":
    "other"}`` when that card is not there (a converted preset, another machine) or names none."""
    from huggingface_hub import ModelCard

    card = Path(str(base_model_dir)) / "README.md" if base_model_dir else None
    if card is None or not card.is_file():
        return {"license": "other"}
    try:
        data = ModelCard.load(card).data
    except Exception:  # noqa: BLE001 - a card the Hub's parser cannot read declares nothing we can use
        return {"license": "other"}
    found = {k: getattr(data, k, None) for k in ("license", "license_name", "license_link")}
    return (
        {k: v for k, v in found.items() if isinstance(v, str) and v}
        if found["license"]
        else {"license": "other"}
    )


def card_license(run: Run, export_facts: dict) -> dict:
    """The model card's ``license`` (and ``license_name`` / ``license_link``): what ``export`` was
    told (``--license``), else what the base model's card declares, else the preset's, else
    ``other`` with no name (the Hub's model card spec then asks for one:
    https://huggingface.co/docs/hub/model-cards#specifying-a-license)."""
    if export_facts.get("license"):
        return {
            k: export_facts[k] for k in ("license", "license_name", "license_link") if export_facts.get(k)
        }
    found = base_license(run.facts.get("base_model_dir"))
    if found == {"license": "other"}:
        return dict(PRESET_LICENSES.get(run.facts.get("base_model"), found))
    return found


def _front_matter(run: Run, export_facts: dict) -> str:
    from huggingface_hub import ModelCardData

    report = run.facts.get("dataset_report") or {}
    task = report.get("task")
    return ModelCardData(
        base_model=_base_model_id(export_facts, run.facts),
        datasets=[export_facts["dataset_id"]] if export_facts["dataset_id"] else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=TAGS + ([task] if task else []),
        **card_license(run, export_facts),
        language=report.get("language") or None,  # unknown: left out rather than guessed
    ).to_yaml()


def _what_it_is(run: Run, title: str, where: str) -> str:
    task = (run.facts.get("dataset_report") or {}).get("task")
    if task in PURPOSE:
        what, flag = PURPOSE[task]
        field_name = "`rewritten`" if task == "rewrite" else "`summary`"
        text = (
            f"`{title}` is {what}. It was fine-tuned with metachunk on completions written by teacher LLMs. "
            f"Use it with metachunk: `metachunk chunk docs.jsonl -o chunks.jsonl {flag} {where}` adds a "
            f"{field_name} field to every chunk, prompting the model exactly as in training."
        )
    elif task:
        text = (
            f"`{title}` is a student model for metachunk's `{task}` task, fine-tuned with metachunk on "
            "completions written by teacher LLMs. It answers the prompt it was trained on."
        )
    elif run.facts:
        text = f"`{title}` is a causal LM fine-tuned with `metachunk train`; its task: {NOT_RECORDED}."
    else:
        text = (
            f"`{title}` is a causal LM exported with `metachunk export`. How it was trained: {NOT_RECORDED} "
            f"(no {RUN_FACTS} next to the checkpoint)."
        )
    return f"# {title}\n\n{text}"


def _base_section(run: Run, export_facts: dict) -> str:
    facts = run.facts
    base, hub_id = facts.get("base_model"), _base_model_id(export_facts, facts)
    from metachunk.models import PRESETS

    preset = PRESETS.get(base) if base else None
    lines = [
        f"- Base model: {_local(base)}"
        + (f", the metachunk preset {preset.description}" if preset else "")
        + (f" ([{hub_id}](https://huggingface.co/{hub_id}))" if hub_id else ""),
        f"- Base model folder used in training: {_local(facts.get('base_model_dir'))}",
    ]
    model_args = facts.get("model_args") or {}
    if model_args.get("use_peft"):
        lines.append(
            f"- Fine-tuning: LoRA (r={model_args.get('lora_r')}, alpha={model_args.get('lora_alpha')}, "
            f"dropout={model_args.get('lora_dropout')}), merged into the base weights in this export"
        )
    elif model_args:
        lines.append("- Fine-tuning: all weights")
    else:
        lines.append(f"- Fine-tuning: {NOT_RECORDED}")
    kind = {
        "full": "safetensors weights",
        "lora": "a LoRA adapter merged into its base",
        "zero": "DeepSpeed ZeRO shards consolidated to the fp32 master weights",
    }[export_facts["kind"]]
    lines += [
        f"- Exported from: {_local(export_facts['checkpoint'])} ({kind})"
        + (f", the checkpoint at step {run.checkpoint_step}" if run.checkpoint_step is not None else ""),
        f"- Parameters: {export_facts['parameters']:,} ({export_facts['dtype']})",
        f"- Generation config: {export_facts['generation_config']}",
    ]
    return "## Base model\n\n" + "\n".join(lines)


def _data_section(run: Run, dataset_id: str | None) -> str:
    report = run.facts.get("dataset_report")
    path = run.facts.get("dataset")
    if not report:
        return f"## Training data\n\nDataset: {_local(path)}; its build report: {NOT_RECORDED}."
    name = report.get("name") or NOT_RECORDED
    split_rows = report.get("rows") or {}
    teachers = sorted({t.get("model") for t in report.get("teachers") or [] if t.get("model")})
    over = (run.facts.get("rows_over_max_length") or {}).get("train")
    lines = [
        f"- Dataset: [{name}](https://huggingface.co/datasets/{dataset_id})"
        if dataset_id
        else f"- Dataset: {name} (Hub id: {NOT_RECORDED}; its card is README.md in the dataset folder)",
        f"- Dataset folder: {_local(path)}",
        f"- Task: {report.get('task') or NOT_RECORDED}",
        "- Rows: " + (", ".join(f"{s} {n:,}" for s, n in split_rows.items()) if split_rows else NOT_RECORDED),
        f"- Language: {', '.join(report['language']) if report.get('language') else NOT_RECORDED}",
        f"- Dataset license: {report.get('license') or NOT_RECORDED} (the model's own, in the front matter, "
        "is its base model's)",
        f"- Teacher models: {', '.join(teachers) if teachers else NOT_RECORDED}",
        f"- Training rows (that fit max_length): {_value(run.facts.get('rows'))}"
        + (f" ({over:,} more dropped: longer than max_length)" if over else "")
        + f"; {_value(run.facts.get('tokens'))} tokens, of which {_value(run.facts.get('completion_tokens'))} "
        "completion tokens carry the loss",
    ]
    text = "## Training data\n\n" + "\n".join(lines)
    student = next((p for p in report.get("prompts") or [] if p.get("role") == "student"), None)
    if student and student.get("text"):
        text += (
            f"\n\nThe prompt it was trained on: `{student.get('name', NOT_RECORDED)}` (sha256 "
            f"`{student.get('sha256', NOT_RECORDED)}`), as chat messages through the tokenizer's chat template; "
            "`{context}` and `{chunk}` are filled per chunk.\n\n" + markdown.fenced(student["text"])
        )
    return text


def _recipe_section(run: Run) -> str:
    facts = run.facts
    hyper = facts.get("hyperparameters")
    command = facts.get("command")
    text = "## Training recipe\n\n"
    text += (
        "Arguments of `python -m metachunk.train` (= `metachunk train`; TRL SFTTrainer, loss on the completion tokens "
        "only):\n\n" + markdown.fenced(shlex.join(_recorded(word) for word in command), "bash")
        if command
        else f"Command: {NOT_RECORDED}."
    )
    if hyper is None:
        return text + f"\n\nHyperparameters: {NOT_RECORDED}."
    rows = [
        [k, "none" if v is None else repr(v) if isinstance(v, float) else _value(_recorded(v))]
        for k, v in hyper.items()
    ]
    model_args = facts.get("model_args") or {}
    rows += [
        ["dtype", model_args.get("dtype", NOT_RECORDED)],
        ["precision", _precision(facts.get("precision"))],
        ["world_size (processes)", _value(facts.get("world_size"))],
        ["global batch (rows per optimizer step)", _value(facts.get("global_batch"))],
    ]
    return text + "\n\n" + markdown.table(["hyperparameter", "value"], rows)


def _precision(precision: dict | None) -> str:
    """What the run computed in, as ``metachunk.train.sft`` recorded it: "float32 weights, no mixed precision"."""
    if not precision:
        return NOT_RECORDED
    autocast = precision.get("autocast")
    text = f"{precision.get('dtype')} weights, {autocast + ' mixed' if autocast else 'no mixed'} precision"
    if precision.get("saved_dtype") not in (None, precision.get("dtype")):
        text += f", trained and saved in {precision['saved_dtype']}"  # DeepSpeed's bf16 / fp16 engine
    return text


def _results_section(run: Run, export_facts: dict) -> str:
    r = results(run)
    rows = [
        ["final training loss", _value(r["final_train_loss"])],
        ["final validation loss", _value(r["final_eval_loss"])],
        ["optimizer steps", _value(r["global_steps"])],
        ["epochs trained", _value(r["epochs"])],
        ["rows in the training set", _value(run.facts.get("rows"))],
        ["training tokens", _value(run.facts.get("tokens"))],
        ["completion tokens (carrying the loss)", _value(run.facts.get("completion_tokens"))],
        ["training time (s)", _value(r["train_runtime_s"])],
        # the run's speed, measured over its own steps: not said of an export of an earlier checkpoint
        *(_throughput_rows(run.facts.get("throughput")) if run.checkpoint_step is None else []),
    ]
    text = "## Results\n\nLosses are mean cross-entropy per completion token.\n\n" + markdown.table(
        ["", "value"], rows
    )
    if export_facts["loss_png"]:
        text += "\n\n![Training and validation loss](loss.png)"
    if run.eval_results is not None:
        flat = _flatten(run.eval_results)
        text += "\n\nEvaluation (`eval_results.json`):\n\n" + markdown.table(
            ["metric", "value"], [[k, _value(v)] for k, v in flat]
        )
    else:
        text += f"\n\nEvaluation beyond the validation loss: {NOT_RECORDED}."
    return text


def _throughput_rows(summary: dict | None) -> list[list[str]]:
    """The speed the trainer measured (``metachunk.train.throughput``: the steps after warm-up, model FLOPs)."""
    # imported here: that module imports the Trainer, which loading the CLI's parser must not
    from metachunk.train.throughput import why_no_mfu

    if not summary:
        return [["training throughput", NOT_RECORDED]]
    first, last = summary["steps"]
    warm = summary["warmup_steps"]
    peak, mfu = summary.get("peak_tflops_per_device"), summary.get("mfu")
    memory = summary.get("peak_memory_gib")
    return [
        ["training throughput (tokens/s, all devices)", f"{summary['tokens_per_second']:,.1f}"],
        ["model TFLOP/s per device", f"{summary['tflops_per_device']:.4g}"],
        ["MFU", f"{mfu:.1%} of {peak:g} TFLOP/s (dense bf16 peak)" if mfu is not None
         else f"n/a: {why_no_mfu(summary)}"],
        ["devices", f"{summary['world_size']} x {summary['device']}"],
        ["peak device memory (GiB)", f"{memory:g}" if memory is not None else "n/a: not a CUDA device"],
        ["throughput measured over", f"steps {first}-{last}" + (f", after {warm} warm-up step(s)" if warm else "")],
    ]  # fmt: skip


def _use_section(run: Run, where: str) -> str:
    task = (run.facts.get("dataset_report") or {}).get("task")
    purpose = {
        "rewrite": "Rewriting RAG chunks so that each stands on its own before it is embedded and indexed, "
        "with the prompt above.",
        "summary": "Writing a one-sentence summary per RAG chunk, indexed or shown next to the chunk, "
        "with the prompt above.",
    }.get(
        task,
        f"The task it was trained for, with the prompt it was trained on (task: {task or NOT_RECORDED}).",
    )
    code = f"""from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{where}")
model = AutoModelForCausalLM.from_pretrained("{where}")
messages = [...]  # the system and user messages of the training prompt
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=256)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))"""
    if task:
        purpose += " It is not a general chat or instruction model: other prompts are out of its training "
        purpose += "distribution."
    return f"## Intended use\n\n{purpose}\n\n" + markdown.fenced(code, "python")


def _limitations(run: Run) -> str:
    facts, r = run.facts, results(run)
    report = facts.get("dataset_report") or {}
    rows, steps = facts.get("rows"), r["global_steps"]
    seen = f" ({r['epochs']:.2f} epochs of them)" if isinstance(r["epochs"], (int, float)) else ""
    items = [
        f"Trained on a set of {_value(rows)} rows{seen} for {_value(steps)} optimizer steps"
        + (
            f" (this export is the checkpoint at step {run.checkpoint_step})."
            if run.checkpoint_step is not None
            else "."
        )
        if rows is not None or steps is not None
        else f"Training rows and steps: {NOT_RECORDED}."
    ]
    if report.get("demo"):
        items.append(
            "Demo data: the dataset's teacher was a small local demo model, so its targets are often wrong or "
            "off-task; this model exists to test the pipeline end to end, not for use."
        )
    items += [f"Training data: {' '.join(str(x).split())}" for x in report.get("limitations") or []]
    if run.eval_results is None:
        items.append("No evaluation beyond the training and validation loss is recorded here.")
    items.append("Its output is generated text: it can drop or invent facts. Check it before indexing.")
    return "## Limitations\n\n" + "\n".join(f"- {item}" for item in items)


def render_model_card(run: Run, export_facts: dict) -> str:
    """README.md: YAML front matter, then what it is, base model, data, recipe, results, use, limits.

    ``export_facts`` (``metachunk.train.export``): ``title``, ``repo_id`` (where it is pushed, or None),
    ``base_model_id`` and ``dataset_id`` (Hub ids or None), ``license``, ``license_name`` and
    ``license_link`` (None: the base model's),
    ``checkpoint``, ``kind``, ``parameters``, ``dtype``, ``generation_config``, ``loss_png``."""
    title = export_facts["title"]
    sections = [
        _what_it_is(run, title, _where(export_facts)),
        _base_section(run, export_facts),
        _data_section(run, export_facts["dataset_id"]),
        _recipe_section(run),
        _results_section(run, export_facts),
        _use_section(run, _where(export_facts)),
        _limitations(run),
    ]
    return "---\n" + _front_matter(run, export_facts) + "\n---\n\n" + "\n\n".join(sections) + "\n"
