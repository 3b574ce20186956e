"""The OpenAPI document's models: what /openapi.json says the routes return (the request bodies are
dcpserve/deployments/api/protocol.py's models, which the routes parse themselves, see ingress._parse), and the helpers
the routes' decorators use to document them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


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


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int  # prompt i, choice j: i * n + j
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobItem(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobItem]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    """One served model, with vLLM's fields besides OpenAI's (`vllm bench serve` without --model reads id and root,
    and loads its tokenizer from root)."""

    id: str  # the name requests send as `model`
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "dcpserve"
    root: str  # the model directory it was loaded from (vLLM: the --model path)
    parent: str | None = None  # vLLM's: the base model of a LoRA adapter; none here
    max_model_len: int  # the engine's context limit: prompt + output tokens


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
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
