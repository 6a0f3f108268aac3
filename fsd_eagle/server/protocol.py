"""The OpenAI-compatible HTTP protocol as pydantic models: what requests may hold, what responses hold.

Requests refuse unknown fields (``extra="forbid"``) and wrong types, so a misspelt or unsupported field is
an HTTP 400 naming it rather than silently ignored. Fields of the OpenAI API that this server does not
implement are declared so that their default is accepted and any other value refused by name
(``unsupported``). Extensions: ``top_k``, ``fsd`` (the Fuzzy Speculative Decoding rule of this request) and
``speculative`` (False: plain decoding of the target for this request).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import MAX_TOP_K, SEED_RANGE

MAX_N = 16  # choices per request
MAX_STOP = 16  # stop strings per request
SEED_MIN, SEED_MAX = SEED_RANGE


class Strict(BaseModel):
    """Unknown fields refused, and no coercion between types ("yes" is no bool, "4" no integer)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FSDOptions(Strict):
    """The FSD rule of one request: a draft token is also accepted where the divergence between the
    target's and the draft's next-token distributions is at most ``threshold`` (0: exact)."""

    threshold: float = Field(0.0, ge=0.0, allow_inf_nan=True)
    divergence: str = "kl"
    mode: str = "hybrid"

    @field_validator("threshold")
    @classmethod
    def _not_nan(cls, v: float) -> float:
        if v != v:
            raise ValueError("threshold must be a number >= 0 or inf, not NaN")
        return v


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Fields that chat and completion requests share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    fsd: FSDOptions | None = None
    speculative: bool = True
    # OpenAI fields this server does not implement: their defaults are accepted, anything else is refused.
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> str | None:
        """The first field given with a value this server does not implement, or None."""
        for name, default in (("logprobs", (None, False)), ("top_logprobs", (None, 0)),
                              ("presence_penalty", (None, 0, 0.0)), ("frequency_penalty", (None, 0, 0.0)),
                              ("logit_bias", (None, {}))):
            if getattr(self, name) not in default:
                return name
        return None


class TextPart(Strict):
    """A text part of a message's content (the OpenAI content-part form, ``{"type": "text", "text": ...}``)."""

    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    """One message: its content a string, or a list of text parts that join into one (with newlines, as
    vLLM joins them). Other parts (images, audio, files) are refused by name: the target reads text."""

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("a list of content parts needs at least one part")
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"part {i} is of type {kind!r}; this server takes text parts only")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i} needs a 'text' string")
                if set(part) - {"type", "text"}:
                    raise ValueError(f"part {i}: unknown field {sorted(set(part) - {'type', 'text'})[0]!r}")
        return v

    def text(self) -> str:
        """The message's content as one string."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        for name, default in (("echo", (False,)), ("suffix", (None,)), ("best_of", (None, 1))):
            if getattr(self, name) not in default:
                return name
        return super().unsupported()


# ------------------------------------------------------------------------------------ responses


class SpeculationUsage(BaseModel):
    """How the request decoded: tau (new tokens per target forward), target forwards, tokens accepted by
    the fuzzy test alone (0 with the exact rule), and how its rounds ran ("compiled", "graph" or "eager";
    a request decodes in one mode from its start to its end)."""

    tau: float
    target_forwards: int
    fuzzy_accepted: int
    mode: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: SpeculationUsage | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fsd-eagle"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
