"""Checks for the offline tiny-model factory in tests/tiny_model.py."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from tiny_model import build_tiny_qwen2  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

MIXED = "Meta-Chunking 把长文本切成块。Is it good? 是的！“引号”…第1段；第2段\n\nEnd 2024."


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_folder_layout(tiny_model_dir: Path):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (tiny_model_dir / name).is_file(), name


def test_tokenizer_round_trip_is_lossless(tok):
    ids = tok.encode(MIXED, add_special_tokens=False)
    assert tok.decode(ids) == MIXED
    assert len(ids) < len(MIXED.encode("utf-8"))  # BPE merged something


def test_tokenizer_specials_and_digits(tok):
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    # 1536: the vocabulary it trains to, from the text the repository holds.
    assert 259 < len(tok) <= 2000
    for digit in ("1", "2"):
        ids = tok.encode(digit, add_special_tokens=False)
        assert len(ids) == 1, (digit, ids)
    assert tok.encode("12", add_special_tokens=False) == tok.encode(
        "1", add_special_tokens=False
    ) + tok.encode("2", add_special_tokens=False)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.encode(special, add_special_tokens=False) == [tok.convert_tokens_to_ids(special)]


def test_chat_template_generation_prompt_and_assistant_mask(tok):
    msgs = [{"role": "user", "content": "这两句话要分开吗？Answer 1 or 2."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert text.endswith(
        "<|im_start|>user\n这两句话要分开吗？Answer 1 or 2.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "{% generation %}" in tok.chat_template or "{%- generation %}" in tok.chat_template

    out = tok.apply_chat_template(
        [*msgs, {"role": "assistant", "content": "1"}],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    assistant_ids = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(assistant_ids) == "\n1<|im_end|>\n"


def test_forward_logits_shape(tok, model):
    batch = tok(["hello 世界", "1"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tok))
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model.config.tie_word_embeddings
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id


def test_build_is_deterministic(tmp_path: Path, tiny_model_dir: Path):
    again = build_tiny_qwen2(tmp_path / "again", seed=0)
    other = build_tiny_qwen2(tmp_path / "other", seed=1)
    ref, same, diff = (load_file(str(d / "model.safetensors")) for d in (tiny_model_dir, again, other))
    assert ref.keys() == same.keys() == diff.keys()
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    assert not all(torch.equal(ref[k], diff[k]) for k in ref)
    assert (tiny_model_dir / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_greedy_generate_runs(tok, model):
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "1 or 2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert (
        out.shape[0] == 1 and prompt["input_ids"].shape[1] < out.shape[1] <= prompt["input_ids"].shape[1] + 3
    )


def test_the_tokenizer_trains_on_text_the_repository_holds(monkeypatch, tmp_path):
    """The same tokenizer wherever the clone sits: no named dataset elsewhere changes its corpus."""
    from tiny_model import training_corpus

    before = training_corpus()
    planted = tmp_path / "gutenqa-emma"
    planted.mkdir()
    (planted / "paragraphs.jsonl").write_text('{"text": "not Emma"}\n', encoding="utf-8")
    monkeypatch.setenv("METACHUNK_DATA", str(tmp_path))
    monkeypatch.setenv("METACHUNK_CACHE", str(tmp_path))
    assert training_corpus() == before
    assert "not Emma" not in before and any("Emma Woodhouse" in t for t in before)
