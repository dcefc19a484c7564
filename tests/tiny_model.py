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


# Chinese news-style sentences written for these tests (CRUD's articles are not ours to ship), so
# that the BPE learns common Chinese merges as a Qwen tokenizer has them.
_CHINESE_NEWS = [
    "2023-08-15 09：30，正文：记者从市交通运输局获悉，今年上半年全市公共交通客运量同比增长百分之十二。",
    "市政府新闻办公室昨日举行发布会，介绍了城市更新行动的最新进展和下一步工作安排。",
    "据了解，该项目总投资约八亿元，计划于明年年底前全部建成并投入使用。",
    "专家表示，随着消费需求逐步恢复，第三季度经济运行有望继续保持稳中向好的态势。",
    "当天上午，来自全国各地的两百余名代表参加了会议，围绕科技创新和产业发展展开讨论。",
    "气象部门提醒，未来三天我省大部分地区将出现强降雨天气，请市民注意出行安全。",
    "公司相关负责人介绍，新产品上市以来销量持续增长，已覆盖全国三十多个省份。",
    "为进一步规范市场秩序，有关部门近期开展了专项整治行动，查处违法案件一百余起。",
    "学校负责人说，今年秋季学期将新增五个专业，招生计划比去年增加了八百人。",
    "医院数据显示，门诊量在节假日期间明显上升，部分科室的候诊时间超过两个小时。",
    "该省文化和旅游厅发布消息，国庆假期全省共接待游客三千万人次，实现旅游收入两百亿元。",
    "志愿者们在社区里开展了垃圾分类宣传活动，向居民发放了宣传手册和分类垃圾袋。",
    "业内人士认为，新能源汽车的普及离不开充电基础设施的完善和电池技术的进步。",
    "法院经审理查明，被告人在担任公司经理期间，利用职务便利侵占公司资金。",
    "农业农村部门表示，今年全国粮食生产形势总体良好，夏粮产量再创历史新高。",
    "（记者 张明 通讯员 李华）本报讯 近日，一场以“绿色发展”为主题的论坛在北京举行。",
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


def training_corpus() -> list[str]:
    """Only text this repository holds, so the tokenizer is the same wherever the clone sits: the
    built-in zh/en sentences, the Chinese news-style passage below, and the first 100 paragraphs of
    the Emma that ships in the package (never $METACHUNK_DATA or the cache)."""
    from metachunk.named_data import SHIPPED

    corpus = list(_BUILTIN_CORPUS) * 3 + list(_CHINESE_NEWS) * 2
    corpus += _read_jsonl_texts(SHIPPED / "gutenqa-emma" / "paragraphs.jsonl", SHARED_LINES_PER_FILE)
    return corpus


def build_tokenizer():
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
    raw.train_from_iterator(training_corpus(), trainer=trainer)

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
                       max_positions: int = 32768, device: str = "cpu", dtype: str = "float32",
                       tie: bool = True) -> Path:  # fmt: skip
    """A random Qwen2 causal LM of ``shape`` (hidden/intermediate sizes, layers, heads) with this
    module's tokenizer, saved into ``out_dir``; ``vocab_size`` defaults to the tokenizer's (a
    larger one keeps a real model's LM-head cost: the tokenizer uses only its first ids). The
    weights are made on ``device`` in ``dtype`` (a 7B model is built in seconds on a GPU in bf16,
    in minutes in fp32 on a CPU); ``tie`` ties the LM head to the input embedding."""
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
        tie_word_embeddings=tie,
        bos_token_id=endoftext_id,
        eos_token_id=im_end_id,
        pad_token_id=endoftext_id,
        dtype=dtype,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext_id,
        eos_token_id=[im_end_id, endoftext_id],
        pad_token_id=endoftext_id,
        do_sample=False,
    )
    model.save_pretrained(out_dir)
    return out_dir
