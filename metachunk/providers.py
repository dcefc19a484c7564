"""Provider profiles: how each teacher provider really takes a request, as data in one place.

A teacher block that names ``provider:`` needs nothing else to work against that provider: its
profile says how a stage's JSON schema is asked for, which field carries the token limit, which
sampling parameters a model refuses, which models answer only in stream mode, where the reasoning
arrives, the Batch API's path, per-file limits and discount, and which error codes mean a request
will be refused however often it is sent. `metachunk.teacher.TeacherConfig.__post_init__`
fills every key the recipe left unset from the profile (`resolve`); a key the recipe sets
wins. With no ``provider`` the generic behaviour applies (`GENERIC`).

Each profile is written from the provider's own documentation, cited beside it. What a page did
not say is said as such; ``tests/support/providers.py`` is the wire-level fake of each profile, and
``recipes/distill/providers/`` holds a recipe per provider.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# How a stage's answer schema is asked for (metachunk.teacher.response_format):
#   json_schema         {"type": "json_schema", "json_schema": {"name", "schema", "strict": true}}
#   json_object_schema  llama.cpp's {"type": "json_object", "schema": ...}
#   json_object         {"type": "json_object"}, the schema shown in the system message
#   none                nothing sent; the answer is read and repaired
STRUCTURED_OUTPUTS = ("json_schema", "json_object_schema", "json_object", "none")
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
# The sampling parameters a profile may refuse (TeacherConfig's own fields).
SAMPLING_PARAMS = ("temperature", "top_p", "seed", "frequency_penalty", "stop")


@dataclass(frozen=True)
class ModelRule:
    """What differs for the models whose name matches ``pattern`` (``re.search``, case-insensitive)."""

    pattern: str
    stream: bool | None = None  # True: the model answers only in stream mode
    refused_params: tuple[str, ...] | None = None  # sampling params the model refuses or ignores
    max_tokens_field: str | None = None
    structured_output: str | None = None


@dataclass(frozen=True)
class Provider:
    name: str
    docs: tuple[str, ...]  # the pages this profile was written from
    structured_output: str = "json_schema"
    max_tokens_field: str = "max_tokens"
    refused_params: tuple[str, ...] = ()
    stream: bool = False
    batch_endpoint: str | None = "/v1/chat/completions"  # None: the provider has no Batch API
    batch_max_requests: int = 50_000
    batch_max_bytes: int = 200_000_000
    batch_discount: float = 0.5  # share of the online price a batch request costs
    # Error codes that mean every request like this one will be refused: the run stops at the first
    # (OpenAI's for a rejected parameter or value, DashScope's for an invalid parameter).
    permanent_codes: tuple[str, ...] = (
        "unsupported_parameter",
        "unsupported_value",
        "invalid_parameter_error",
    )
    models: tuple[ModelRule, ...] = field(default=())

    def rule(self, model: str) -> ModelRule | None:
        return next((r for r in self.models if re.search(r.pattern, model, re.IGNORECASE)), None)

    def settings(self, model: str) -> dict:
        """The profile's value of every TeacherConfig key it governs, for ``model``."""
        rule = self.rule(model) or ModelRule("")
        return {
            "structured_output": rule.structured_output or self.structured_output,
            "max_tokens_field": rule.max_tokens_field or self.max_tokens_field,
            "refused_params": list(
                rule.refused_params if rule.refused_params is not None else self.refused_params
            ),
            "stream": self.stream if rule.stream is None else rule.stream,
            "batch_endpoint": self.batch_endpoint,
            "batch_max_requests": self.batch_max_requests,
            "batch_max_bytes": self.batch_max_bytes,
            "batch_discount": self.batch_discount,
        }


# No provider named: what metachunk always did (nothing asked of the endpoint for a schema,
# max_tokens, no streaming, OpenAI's Batch API and limits).
GENERIC = Provider("generic", (), structured_output="none")

PROVIDERS: dict[str, Provider] = {
    # https://platform.openai.com/docs/api-reference/chat/create : max_tokens is deprecated for
    #   max_completion_tokens, which every chat model takes and reasoning models require
    #   (400 code unsupported_parameter "Use 'max_completion_tokens' instead").
    # https://platform.openai.com/docs/guides/reasoning : o-series and gpt-5 take temperature only
    #   at its default (1; 400 code unsupported_value), and refuse top_p and the penalties
    #   (unsupported_parameter). The reasoning itself is not returned by chat completions.
    # https://platform.openai.com/docs/guides/structured-outputs : json_schema with a name, strict.
    # https://platform.openai.com/docs/guides/batch : /v1/chat/completions, at most 50,000
    #   requests and 200 MB per input file, 50% of the online price.
    "openai": Provider(
        "openai",
        (
            "https://platform.openai.com/docs/api-reference/chat/create",
            "https://platform.openai.com/docs/guides/reasoning",
            "https://platform.openai.com/docs/guides/structured-outputs",
            "https://platform.openai.com/docs/guides/batch",
        ),
        max_tokens_field="max_completion_tokens",
        models=(ModelRule(r"^(o\d|gpt-5)", refused_params=("temperature", "top_p", "frequency_penalty")),),
    ),
    # https://www.alibabacloud.com/help/en/model-studio/deep-thinking : QwQ and the thinking-only
    #   models answer only in stream mode (400 invalid_parameter_error "This model only support
    #   stream mode"); the thought arrives in reasoning_content; enable_thinking and
    #   thinking_budget go in the body (extra_body); include_usage puts usage in the last chunk.
    # https://www.alibabacloud.com/help/en/model-studio/qwen-structured-output : json_object needs
    #   the word "JSON" in the messages; json_schema only on some models, and not in thinking mode:
    #   json_object with the schema in the prompt works on all of them.
    # https://www.alibabacloud.com/help/en/model-studio/batch-interfaces-compatible-with-openai and
    # https://www.alibabacloud.com/help/en/model-studio/batch-inference : /v1/chat/completions,
    #   at most 50,000 requests and 500 MB per file, 50% of the real-time price.
    "dashscope": Provider(
        "dashscope",
        (
            "https://www.alibabacloud.com/help/en/model-studio/deep-thinking",
            "https://www.alibabacloud.com/help/en/model-studio/qwen-structured-output",
            "https://www.alibabacloud.com/help/en/model-studio/batch-inference",
        ),
        structured_output="json_object",
        batch_max_bytes=500_000_000,
        models=(ModelRule(r"^(qwq|qvq)|thinking", stream=True),),
    ),
    # https://cloud.baidu.com/doc/qianfan-api/s/3m7of64lb (chat, v2): max_tokens; response_format
    #   json_object or json_schema; finish_reason content_filter when the output was cut or
    #   replaced by the safety filter; reasoning_content for thinking models; include_usage.
    # https://cloud.baidu.com/doc/qianfan/s/Oml4r78ea (batch): lines and the batch's endpoint are
    #   /v2/chat/completions. The page gives no per-file limits or discount: 5,000 requests per
    #   file is the limit of Qianfan's batch console; set batch_discount from your contract.
    "qianfan": Provider(
        "qianfan",
        (
            "https://cloud.baidu.com/doc/qianfan-api/s/3m7of64lb",
            "https://cloud.baidu.com/doc/qianfan/s/Oml4r78ea",
        ),
        structured_output="json_object",
        batch_endpoint="/v2/chat/completions",
        batch_max_requests=5_000,
        batch_max_bytes=100_000_000,
        batch_discount=0.5,
    ),
    # https://api-docs.deepseek.com/guides/json_mode : json_object only, and the messages must
    #   contain the word "json"; json_schema is refused (400 "This response_format type is
    #   unavailable now").
    # https://api-docs.deepseek.com/guides/reasoning_model : deepseek-reasoner returns
    #   reasoning_content; temperature, top_p and the penalties have no effect on it.
    # No Batch API.
    "deepseek": Provider(
        "deepseek",
        (
            "https://api-docs.deepseek.com/guides/json_mode",
            "https://api-docs.deepseek.com/guides/reasoning_model",
            "https://api-docs.deepseek.com/quick_start/error_codes",
        ),
        structured_output="json_object",
        batch_endpoint=None,
        models=(ModelRule(r"reasoner", refused_params=("temperature", "top_p", "frequency_penalty")),),
    ),
    # https://docs.vllm.ai/en/latest/features/reasoning_outputs.html : with --reasoning-parser the
    #   thought is in message.reasoning (reasoning_content was removed); chat_template_kwargs
    #   (enable_thinking) and top_k are extra body fields.
    # https://docs.vllm.ai/en/latest/features/structured_outputs.html : json_schema.
    # https://docs.vllm.ai/en/latest/cli/run-batch.html : `vllm run-batch` reads OpenAI batch lines
    #   (/v1/chat/completions); its --served-model-name must equal the recipe's model.
    "vllm": Provider(
        "vllm",
        (
            "https://docs.vllm.ai/en/latest/features/reasoning_outputs.html",
            "https://docs.vllm.ai/en/latest/features/structured_outputs.html",
            "https://docs.vllm.ai/en/latest/cli/run-batch.html",
        ),
        batch_discount=1.0,
    ),
    # https://docs.sglang.ai/advanced_features/separate_reasoning.html : --reasoning-parser puts the
    #   thought in reasoning_content. https://docs.sglang.ai/advanced_features/structured_outputs.html :
    #   json_schema. No Batch API of its own.
    "sglang": Provider(
        "sglang",
        (
            "https://docs.sglang.ai/advanced_features/separate_reasoning.html",
            "https://docs.sglang.ai/advanced_features/structured_outputs.html",
        ),
        batch_endpoint=None,
    ),
    # https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md : response_format
    #   {"type": "json_object", "schema": ...} constrains decoding; --reasoning-format deepseek puts
    #   the thought in reasoning_content. llama-cpp-python's server takes the same response_format
    #   (https://llama-cpp-python.readthedocs.io/en/latest/server/). No Batch API.
    "llamacpp": Provider(
        "llamacpp",
        (
            "https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md",
            "https://llama-cpp-python.readthedocs.io/en/latest/server/",
        ),
        structured_output="json_object_schema",
        batch_endpoint=None,
    ),
}


def resolve(provider: str | None, model: str) -> dict:
    """The profile's settings for ``model`` under ``provider`` (None: `GENERIC`)."""
    if provider is None:
        return GENERIC.settings(model)
    if provider not in PROVIDERS:
        raise ValueError(f"'provider' must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    return PROVIDERS[provider].settings(model)


def permanent_codes(provider: str | None) -> tuple[str, ...]:
    return (PROVIDERS[provider] if provider else GENERIC).permanent_codes
