"""Wire-level fakes of the teacher providers, each behaving as its own documentation says.

``LoopbackServer(provider=NAME)`` (``--provider NAME``) answers as that provider: it refuses what the
provider refuses, with the provider's status, error code and message, puts the reasoning where the
provider puts it, and sends streamed usage only when the request asks for it (``stream_options:
{"include_usage": true}``), in a last chunk whose ``choices`` is empty. Where a page gives no exact
error body, the body is the one real users reported, cited beside it.

These fakes test metachunk's profiles (``metachunk/providers.py``) against an independent reading
of the same pages: the profile decides what to send, the fake decides whether the provider would
take it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

JSON_WORD = re.compile("json", re.IGNORECASE)


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str
    message: str
    kind: str = "invalid_request_error"
    param: str | None = None


@dataclass(frozen=True)
class FakeProvider:
    name: str
    stream_only: str | None = None  # models answering only in stream mode (regex)
    reasoning_models: str | None = None  # models that think (regex): their answers carry reasoning
    reasoning_field: str = "reasoning_content"
    refused_params: tuple[str, ...] = ()  # params refused with unsupported_parameter (reasoning_models)
    refuses_json_schema: bool = False
    json_object_needs_word: bool = True
    stream_usage: bool = True  # include_usage honoured
    flat_errors: bool = False  # SGLang: {"object": "error", "message", "type", "param", "code": int}

    def refusal(self, payload: dict, text: str) -> Refusal | None:
        """Why this provider refuses ``payload`` (whose message contents are ``text``), if it does."""
        model = str(payload.get("model", ""))
        thinking = bool(self.reasoning_models and re.search(self.reasoning_models, model, re.IGNORECASE))
        if (
            self.stream_only
            and re.search(self.stream_only, model, re.IGNORECASE)
            and not payload.get("stream")
        ):
            return STREAM_ONLY
        if thinking:
            for name in self.refused_params:
                if name in payload:
                    if name == "temperature" and payload[name] == 1:
                        continue
                    return REFUSED_PARAM[name](self)
        fmt = payload.get("response_format") or {}
        if fmt.get("type") == "json_schema" and self.refuses_json_schema:
            return DEEPSEEK_NO_JSON_SCHEMA
        if fmt.get("type") == "json_object" and self.json_object_needs_word and not JSON_WORD.search(text):
            return Refusal(400, "invalid_parameter_error" if self.name == "dashscope" else "invalid_request_error",
                           "'messages' must contain the word 'json' in some form, to use 'response_format' "
                           "of type 'json_object'.")  # fmt: skip
        return None

    def thinks(self, model: str) -> bool:
        return bool(self.reasoning_models and re.search(self.reasoning_models, model, re.IGNORECASE))

    def error_body(self, refusal: Refusal) -> dict:
        if self.flat_errors:
            return {"object": "error", "message": refusal.message, "type": refusal.kind, "param": refusal.param,
                    "code": refusal.status}  # fmt: skip
        body = {"error": {"message": refusal.message, "type": refusal.kind, "param": refusal.param,
                          "code": refusal.code}}  # fmt: skip
        if self.name == "dashscope":  # DashScope adds the request's ids beside the error
            body.update(id="chatcmpl-fake", request_id="fake-request")
        return body


# DashScope, QwQ without stream: the page says only "most of these models only support streaming
# output" (https://www.alibabacloud.com/help/en/model-studio/deep-thinking); the body is the one
# users report (https://github.com/infiniflow/ragflow/issues/5912), trailing space included.
STREAM_ONLY = Refusal(
    400,
    "invalid_parameter_error",
    "This model only support stream mode, please enable the stream parameter to access the model. ",
)
# DeepSeek, json_schema: https://api-docs.deepseek.com/guides/json_mode offers json_object only; the
# body is the one reported in https://github.com/UKGovernmentBEIS/inspect_ai/issues/4916.
DEEPSEEK_NO_JSON_SCHEMA = Refusal(
    400, "invalid_request_error", "This response_format type is unavailable now"
)


def _unsupported(name: str):
    # OpenAI's reasoning models (https://platform.openai.com/docs/guides/reasoning); bodies as in
    # https://github.com/IBM/chuk-llm/issues/3 and https://github.com/repowise-dev/repowise/issues/987.
    if name == "max_tokens":
        message = "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead."
        return lambda p: Refusal(400, "unsupported_parameter", message, param=name)
    if name == "temperature":
        message = "Unsupported value: 'temperature' does not support that value with this model. Only the default (1) value is supported."
        return lambda p: Refusal(400, "unsupported_value", message, param=name)
    message = f"Unsupported parameter: '{name}' is not supported with this model."
    return lambda p: Refusal(400, "unsupported_parameter", message, param=name)


REFUSED_PARAM = {
    name: _unsupported(name) for name in ("max_tokens", "temperature", "top_p", "frequency_penalty")
}

FAKES = {
    # https://platform.openai.com/docs/guides/reasoning : o-series and gpt-5 refuse max_tokens,
    # temperature other than 1, top_p and the penalties; the reasoning is not returned.
    "openai": FakeProvider(
        "openai",
        reasoning_models=r"^(o\d|gpt-5)",
        reasoning_field="",
        refused_params=("max_tokens", "temperature", "top_p", "frequency_penalty"),
    ),  # fmt: skip
    # https://www.alibabacloud.com/help/en/model-studio/deep-thinking : QwQ streams only, its thought
    # in reasoning_content. https://www.alibabacloud.com/help/en/model-studio/qwen-structured-output :
    # json_object needs the word JSON in the messages.
    "dashscope": FakeProvider(
        "dashscope", stream_only=r"^(qwq|qvq)|thinking", reasoning_models=r"^(qwq|qvq)|thinking"
    ),
    # https://cloud.baidu.com/doc/qianfan-api/s/3m7of64lb : finish_reason content_filter (the
    # loopback server's [[fault:filter]] marker); no rule about the word json in the messages.
    "qianfan": FakeProvider("qianfan", json_object_needs_word=False),
    # https://api-docs.deepseek.com/guides/json_mode and /guides/reasoning_model.
    "deepseek": FakeProvider("deepseek", reasoning_models=r"reasoner", refuses_json_schema=True),
    # https://docs.vllm.ai/en/latest/features/reasoning_outputs.html : message.reasoning.
    "vllm": FakeProvider(
        "vllm", reasoning_models=r"qwq|r1|thinking", reasoning_field="reasoning", json_object_needs_word=False
    ),  # fmt: skip
    # https://docs.sglang.ai/advanced_features/separate_reasoning.html : reasoning_content; its
    # errors are flat (python/sglang/srt/entrypoints/openai/protocol.py, ErrorResponse).
    "sglang": FakeProvider(
        "sglang", reasoning_models=r"qwq|qwen3|r1", json_object_needs_word=False, flat_errors=True
    ),  # fmt: skip
    # llama-cpp-python's server (https://llama-cpp-python.readthedocs.io/en/latest/server/): no
    # stream_options, so a stream carries no usage; no reasoning parser.
    "llamacpp": FakeProvider("llamacpp", json_object_needs_word=False, stream_usage=False),
}
