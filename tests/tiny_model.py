"""Offline factory for a tiny, randomly initialised Qwen2-style model used by the test suite.

``build_tiny_qwen2(out_dir)`` writes a normal Hugging Face folder (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``) that loads with ``AutoTokenizer.from_pretrained`` and
``AutoModelForCausalLM.from_pretrained`` without touching the network.

The tokenizer is a byte-level BPE trained on the fly with the ``tokenizers`` library, using the
exact Qwen2 normalizer / pre-tokenizer / decoder, so it behaves like the real Qwen2.5 tokenizer
(digits are split one per token, every byte is encodable, round trips are lossless for NFC text).
The chat template is TRL's Qwen2.5 *training* template: Qwen ChatML with ``{% generation %}``
markers around assistant output so ``return_assistant_tokens_mask`` / TRL ``assistant_only_loss``
work.
"""

from __future__ import annotations

import json
from pathlib import Path

# Same regex as transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX.
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

VOCAB_SIZE = 1536
SHARED_LINES_PER_FILE = 100
SHARED_CHARS_PER_LINE = 400

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# TRL's qwen2_5_training.jinja (Qwen2.5 ChatML + {% generation %} markers), verbatim minus its header.
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- generation %}
        {%- if not message.tool_calls %}
            {{- '\\n' + message.content + '<|im_end|>\\n' }}
        {%- else %}
            {%- if message.content %}
                {{- '\\n' + message.content }}
            {%- endif %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '\\n<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {{- tool_call.arguments | tojson }}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
        {%- endgeneration %}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_BUILTIN_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years in the world.",
    "Split the document into chunks; each chunk should be self-contained!",
    "Is this a boundary? Answer 1 for yes and 2 for no.",
    "Retrieval-augmented generation (RAG) needs good text chunking…",
    "He said, “It's fine,” and she replied, “We'll see.”",
    "They're here, I've seen them, you'd know, I'm sure, we'll go.",
    "In 2023, the model scored 87.5% on 12 benchmarks; costs fell by 3x.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024-07-31 14:22.",
    "The answer is 1.\nThe answer is 2.\n\nNew paragraph here.",
    "Meta-Chunking uses perplexity to find where a text should be split.",
    "Mr. Knightley was a sensible man about seven or eight and thirty.",
    "今天天气很好，我们去公园散步。",
    "这是一个测试句子！你好吗？我很好；谢谢……",
    "“文本分块”是检索增强生成中的重要步骤。",
    "近日，抖音直播发布第二十期“不良直播PK内容”治理公示。",
    "2023年7月1日以来，平台已对110991个账号进行处罚。",
    "请判断这两个句子是否应该分开：回答1表示是，回答2表示否。",
    "北京是中国的首都，上海是最大的城市。",
    "模型训练完成后，我们在测试集上评估了它的表现！",
    "他说：“我明天再来。”她点了点头；然后离开了……",
    "Mixed 中英文 text: RAG 系统 uses chunking 分块 to work well。",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n1<|im_end|>\n",
]


def _read_jsonl_texts(path: Path, limit: int) -> list[str]:
    texts: list[str] = []
    if not path.is_file():
        return texts
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if len(texts) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                text = json.loads(line).get("text", "")
            except (json.JSONDecodeError, AttributeError):
                continue
            if text:
                texts.append(text[:SHARED_CHARS_PER_LINE])
    return texts


def training_corpus(shared_data: Path | None = None) -> list[str]:
    """Built-in zh/en sentences plus (if present) ~200 lines of the real corpora."""
    if shared_data is None:
        shared_data = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    corpus = list(_BUILTIN_CORPUS) * 3
    corpus += _read_jsonl_texts(shared_data / "crud-news" / "news.jsonl", SHARED_LINES_PER_FILE)
    corpus += _read_jsonl_texts(shared_data / "gutenqa-emma" / "paragraphs.jsonl", SHARED_LINES_PER_FILE)
    return corpus


def build_tokenizer(shared_data: Path | None = None):
    """Train a Qwen2-style byte-level BPE and wrap it as a transformers ``Qwen2Tokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer

    raw = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(training_corpus(shared_data), trainer=trainer)

    model_json = json.loads(raw.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]
    # Qwen2Tokenizer rebuilds the exact same normalizer/pre-tokenizer/decoder from vocab + merges,
    # which is also what AutoTokenizer does when it reloads the saved folder (transformers 5).
    tok = Qwen2Tokenizer(
        vocab=model_json["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tok.add_special_tokens({"additional_special_tokens": [ENDOFTEXT, IM_START, IM_END]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)  # fmt: skip


def build_tiny_qwen2(out_dir: Path, seed: int = 0) -> Path:
    """Build a tiny random Qwen2 causal LM + tokenizer into ``out_dir`` and return it."""
    return build_random_qwen2(out_dir, TINY_SHAPE, seed=seed, max_positions=4096)


def build_random_qwen2(out_dir: Path, shape: dict, seed: int = 0, vocab_size: int | None = None,
                       max_positions: int = 32768) -> Path:  # fmt: skip
    """A random Qwen2 causal LM of ``shape`` (hidden/intermediate sizes, layers, heads) with this
    module's tokenizer, saved into ``out_dir``; ``vocab_size`` defaults to the tokenizer's (a
    larger one keeps a real model's LM-head cost: the tokenizer uses only its first ids)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    tok.save_pretrained(out_dir)

    endoftext_id = tok.convert_tokens_to_ids(ENDOFTEXT)
    im_end_id = tok.convert_tokens_to_ids(IM_END)
    config = Qwen2Config(
        vocab_size=vocab_size or len(tok),
        **shape,
        max_position_embeddings=max_positions,
        max_window_layers=shape["num_hidden_layers"],
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=endoftext_id,
        eos_token_id=im_end_id,
        pad_token_id=endoftext_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext_id,
        eos_token_id=[im_end_id, endoftext_id],
        pad_token_id=endoftext_id,
        do_sample=False,
    )
    model.save_pretrained(out_dir)
    return out_dir
