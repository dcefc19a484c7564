"""A streamed chat completion, assembled into the body a non-streamed request would have returned.

With ``stream: true`` an OpenAI-compatible server sends ``chat.completion.chunk`` events over SSE
(https://platform.openai.com/docs/api-reference/chat-streaming): each chunk's ``choices[0].delta``
carries a piece of ``content`` and, on reasoning servers, of ``reasoning_content`` (DashScope,
DeepSeek, SGLang, llama.cpp) or ``reasoning`` (vLLM); the last choice chunk carries
``finish_reason``. With ``stream_options: {"include_usage": true}`` one more chunk comes before
``data: [DONE]``, with ``usage`` and an empty ``choices`` list (every earlier chunk has
``usage: null``). `ChatStream` folds the chunks into ``{"id", "object": "chat.completion",
"created", "model", "choices": [{"index": 0, "message": {...}, "finish_reason"}], "usage"}``, so the
answer store, the parsers, the cost and the records read a streamed answer exactly as any other.

A stream that ends without a ``finish_reason`` was cut: `ChatStream.finished` is False, and
the teacher client treats it as a transport failure (retried, never a short ok answer).
"""

from __future__ import annotations

import json

# Where a reasoning server puts the thought, in a message and in a delta.
REASONING_FIELDS = ("reasoning_content", "reasoning")


class ChatStream:
    """Feed it each parsed chunk (`add`), then read `body`."""

    def __init__(self):
        self.head: dict = {}
        self.content: list[str] = []
        self.reasoning: dict[str, list[str]] = {}
        self.role = "assistant"
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.extra: dict = {}  # fields a provider adds beside choices (Qianfan's flag, ban_round)

    def add(self, chunk: dict) -> None:
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if isinstance(chunk.get("usage"), dict):  # the include_usage chunk (cumulative elsewhere: last wins)
            self.usage = chunk["usage"]
        for name in ("flag", "ban_round"):
            if chunk.get(name) is not None:
                self.extra[name] = chunk[name]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("role"):
                self.role = delta["role"]
            if delta.get("content"):
                self.content.append(delta["content"])
            for name in REASONING_FIELDS:
                if delta.get(name):
                    self.reasoning.setdefault(name, []).append(delta[name])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    @property
    def finished(self) -> bool:
        """A ``finish_reason`` arrived: the answer is whole (or was stopped by the server on purpose)."""
        return self.finish_reason is not None

    def body(self) -> str:
        """The assembled ``chat.completion`` as JSON text (no ``usage`` key when none came)."""
        message = {"role": self.role, "content": "".join(self.content)}
        for name, parts in self.reasoning.items():
            message[name] = "".join(parts)
        body = {
            "id": self.head.get("id"),
            "object": "chat.completion",
            "created": self.head.get("created"),
            "model": self.head.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}],
            **self.extra,
        }
        if self.usage is not None:
            body["usage"] = self.usage
        return json.dumps(body, ensure_ascii=False)
