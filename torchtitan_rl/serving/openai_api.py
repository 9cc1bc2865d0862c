"""The OpenAI-style request bodies the rollout server accepts, and its error replies.

Requests are checked field by field (pydantic) and every problem becomes a
4xx whose message names the field, in OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``. Fields OpenAI clients
send that change nothing here (``user``, ``presence_penalty`` at 0, ...) are
ignored; fields that would change the answer and that the server does not
implement (``stream``, ``echo``, ``best_of`` > 1, ``suffix``, penalties,
``logit_bias``, ``tools``, a JSON ``response_format``) are refused unless left at
their no-op value, rather than silently dropped.

Extensions (vLLM's names where vLLM has one): ``top_k``, ``stop_token_ids``,
``return_token_ids`` (each choice then carries ``token_ids`` and
``prompt_token_ids``: agent loops must not re-tokenize text), and in every
response ``weight_version``, the trainer version whose weights produced it
(also the ``X-Weight-Version`` header).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class HttpError(Exception):
    """An error reply: status, message, OpenAI error type, offending parameter."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    stream: Literal[False] = False
    """Streaming is not implemented: a request asking for it is refused."""
    # Would change the answer and are not implemented: refused unless left at their no-op value.
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logit_bias: dict | None = Field(default=None, max_length=0)
    response_format: dict | None = None
    tools: None = None
    tool_choice: Literal["none"] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        if v not in (None, {"type": "text"}):
            raise ValueError("only {'type': 'text'} is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v):
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("an empty stop string would end every completion at once")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("must be -1 (off) or >= 1")
        return v

    def stop_strings(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: Literal[False] = False
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ...: the chat template reads what it knows

    role: str
    content: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=5)


def parse(model: type[BaseModel], body) -> BaseModel:
    """``body`` (parsed JSON) as ``model``; HttpError 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise HttpError(400, f"{field}: {first['msg']}", param=field) from None
    except RecursionError:
        raise HttpError(400, "the request body is nested too deeply") from None
