"""OpenAI wire format: request bodies (validated), response and stream-chunk bodies, error bodies.

Supported: completions and chat completions with max_tokens, temperature, top_p, top_k (extension), seed, stop,
stream (+ stream_options.include_usage and vLLM's continuous_usage_stats), ignore_eos (extension). Parameters OpenAI defines that this server does
not implement are accepted only at their neutral value (n=1, logprobs null, echo false, penalties 0, ...), so a
client never silently gets something other than what it asked for.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.sampling_params import SamplingParams


# Stop sequences: OpenAI's own count limit, and a length bound (every step scans the text's tail for each).
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's extension (guidellm sends it): with include_usage, every chunk also carries the usage so far.
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # OpenAI parameters accepted only at their neutral value.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence may be at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return value

    @model_validator(mode="after")
    def _neutral(self) -> _SamplingFields:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported: this server returns one choice per request (n=1)")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (leave them at 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    def output_limit(self) -> int | None:
        """The client's max_tokens; None when unset (OpenAI's default: until EOS, a stop, or the context end)."""
        return self.max_tokens

    def sampling_params(self, context_left: int) -> SamplingParams:
        """Sampling parameters; an unset max_tokens becomes context_left (max_model_len minus the prompt)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        limit = self.output_limit()
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=limit if limit is not None else max(context_left, 1),
            seed=self.seed,
            stop=tuple(stop) if stop else None,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if all(isinstance(v, str) for v in value) and len(value) != 1:
                raise ValueError(f"send one prompt per request (got a batch of {len(value)})")
        elif not value:
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ... are not used by the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs is not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- responses ------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's reasons (stop, length, abort) in OpenAI's vocabulary."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def completion_body(request_id: str, model: str, text: str, finish: str | None, used: dict[str, int]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": openai_finish_reason(finish)}],
        "usage": used,
    }


def completion_chunk(request_id: str, model: str, text: str, finish: str | None) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": openai_finish_reason(finish)}],
    }


def chat_body(request_id: str, model: str, text: str, finish: str | None, used: dict[str, int]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": openai_finish_reason(finish),
        }],
        "usage": used,
    }


def chat_chunk(request_id: str, model: str, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": openai_finish_reason(finish)}],
    }


def usage_chunk(request_id: str, model: str, obj: str, used: dict[str, int]) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": used}


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}


# ---- OpenAPI: the schema /openapi.json serves (bodies are parsed by the routes themselves, see ingress._parse) ----


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's shape."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description} for status, description in (
        (400, "invalid request (names the problem), never-fits, context length exceeded"),
        (401, "missing or wrong API key (when the app has keys)"),
        (413, "request body larger than max_request_body_bytes"),
        (429, "admission queue full or waited past queue_timeout_s (Retry-After)"),
        (503, "no engine replica can take requests (Retry-After)"),
        (504, "the request ran past request_timeout_s"),
    )
}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    """POST /v1/completions without stream (with stream: server-sent events of the same shape, without usage
    unless stream_options.include_usage, then `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionResponse(BaseModel):
    """POST /v1/chat/completions without stream (with stream: chat.completion.chunk events, then [DONE])."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(BaseModel):
    """GET /health (open, for load balancers): status and counts only."""

    status: Literal["ok"]
    replicas: int  # engine replicas the admission queue knows
    healthy_replicas: int
    queued: int  # requests waiting in the admission queue
    kv_capacity_blocks: int
    kv_granted_blocks: int  # blocks granted to requests through the queue
    kv_external_blocks: int  # blocks replicas hold for requests the queue did not grant
    kv_free_blocks: int  # what the queue may still grant on healthy replicas
    num_grants: int  # requests holding a grant


def ok_response(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """A route's 200: `model` as JSON, or (with "stream": true) server-sent events of its chunks."""
    return {200: {"model": model, "description": description,
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


# Request-body schemas by name, for the OpenAPI document's components (ingress merges them in).
OPENAPI_SCHEMAS: dict[str, Any] = {}


def request_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A route's openapi_extra that documents `model` as its JSON body (the route parses and validates it itself,
    so that size limits, authentication and OpenAI-shaped errors come first)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    OPENAPI_SCHEMAS.update(schema.pop("$defs", {}))
    OPENAPI_SCHEMAS[model.__name__] = schema
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
