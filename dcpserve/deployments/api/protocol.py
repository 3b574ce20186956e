"""OpenAI request bodies, validated (their responses: dcpserve/deployments/api/responses.py).

Completions and chat completions with the OpenAI sampling fields (n, temperature, top_p, seed, stop, penalties,
logit_bias, logprobs / top_logprobs, echo, best_of, stream + stream_options) and vLLM's extensions (top_k,
repetition_penalty, min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens, ignore_eos,
prompt_logprobs, continuous_usage_stats, return_tokens_as_token_ids). Fields that do not change what is generated
(user, metadata, store: false, service_tier, request_id) are accepted and ignored; `priority`
(vLLM's: lower first) and `deadline` (ours) set the request's service level
(dcpserve/deployments/admission/fair_share.py); OpenAI's `prompt_cache_key` (or the `X-Session-Id` header, for clients
that cannot send it: `session_key`) names the request's session, whose turns the admission queue keeps on one replica
and shares its tenant between (dcpserve/deployments/admission/session_affinity.py); structured outputs
(response_format, vLLM's structured_outputs and guided_*: dcpserve/deployments/api/structured.py) and tools
(dcpserve/deployments/api/tool_calls.py) constrain the output; fields that would silently change results without being
implemented (suffix, beam search, ...) are refused with a 400 that names them. docs/operations.md has the table of
every field.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, field_validator, model_validator

from dcpserve.deployments.api.structured import request_constraint
from dcpserve.deployments.api.tool_calls import ToolPlan, plan_tools
from dcpserve.deployments.messages import PRIORITY_MAX, PRIORITY_MIN
from dcpserve.engine.generation_defaults import NO_DEFAULTS, GenerationDefaults
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.structured_output import StructuredOutput

# Stop sequences: OpenAI's own count limit, and a length bound (every step scans the text's tail for each).
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
# Choices per prompt (n, best_of), prompts per completions request, and sequences per request in all (each choice is
# a sequence that admission counts on its own); logprobs alternatives per token (OpenAI's limit).
MAX_N = 16
MAX_PROMPTS = 64
MAX_SEQUENCES = 64
MAX_LOGPROBS = 20
# The longest session key (prompt_cache_key, X-Session-Id): the admission queue remembers up to 100,000 of them.
MAX_SESSION_KEY_CHARS = 256
# The header that names a request's session for clients that cannot send prompt_cache_key (the body wins).
SESSION_HEADER = "X-Session-Id"


def session_key(value: object, name: str) -> str:
    """A session key as sent in `name` (the body's prompt_cache_key or the X-Session-Id header), checked: a non-empty
    string of at most MAX_SESSION_KEY_CHARS characters. ValueError naming the field, what it got and the fix."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string (a name for the conversation or agent the request belongs to), "
                         f"got {type(value).__name__}; send it as a string, or omit it")
    if not value:
        raise ValueError(f"{name} is empty; send a non-empty string naming the conversation, or omit it")
    if len(value) > MAX_SESSION_KEY_CHARS:
        raise ValueError(f"{name} is {len(value)} characters, longer than the {MAX_SESSION_KEY_CHARS} allowed; send a "
                         f"shorter key (a hash of a longer one, for instance)")
    return value


def deadline_unix_s(value: float | str) -> float:
    """A deadline as Unix seconds: a number is one already, a string must be ISO 8601 with its UTC offset."""
    if isinstance(value, int | float):
        if not 0 < value < 1e11:
            raise ValueError(f"deadline {value!r} is not a Unix time in seconds")
        return float(value)
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"deadline {value!r} is neither Unix seconds nor an ISO 8601 time such as "
                         f"'2026-12-05T12:00:00Z'") from None
    if when.tzinfo is None:
        raise ValueError(f"deadline {value!r} has no UTC offset; add one, e.g. 'Z' or '+01:00'")
    return when.timestamp()


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
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description=f"choices per prompt, each its own sequence (at most {MAX_N}); "
                   "with a seed, choice j samples with seed + j")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    # vLLM's extensions
    top_k: int = Field(0, ge=0, description="0: no top-k filter")
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids cannot end a choice before this many tokens")
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = Field(False, description="logprobs name tokens 'token_id:<id>'")
    # Accepted, and without effect on what is generated.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    request_id: str | None = None  # vLLM's: requests get ids of their own here
    # Service level (dcpserve/deployments/admission/fair_share.py): vLLM's priority (lower first; unset: the API key's
    # default), and by when the request must have started: Unix seconds, or an ISO 8601 time with its UTC offset.
    priority: StrictInt | None = Field(None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    deadline: StrictInt | StrictFloat | StrictStr | None = None
    # OpenAI's: the request's session (session_key; the X-Session-Id header when absent). Any here so that a value of
    # another type gets session_key's 400, not pydantic's.
    prompt_cache_key: Any = Field(None, description=f"the request's session (a conversation or agent): a non-empty "
                                  f"string of at most {MAX_SESSION_KEY_CHARS} characters; the header {SESSION_HEADER} "
                                  f"when absent")
    spaces_between_special_tokens: bool = True
    # Structured outputs (dcpserve/deployments/api/structured.py): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* fields; at most one constraint per request.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

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

    @field_validator("deadline")
    @classmethod
    def _deadline(cls, value: float | str | None) -> float | str | None:
        if value is not None:
            deadline_unix_s(value)
        return value

    def deadline_s(self, now: float | None = None) -> float | None:
        """Seconds from now (time.time()) to the request's deadline; ValueError naming the field when it passed."""
        if self.deadline is None:
            return None
        left = deadline_unix_s(self.deadline) - (time.time() if now is None else now)
        if left <= 0:
            raise ValueError(f"deadline: {self.deadline!r} passed {-left:.3f}s ago; send a time in the future (Unix "
                             f"seconds or ISO 8601 with a UTC offset)")
        return left

    @field_validator("prompt_cache_key")
    @classmethod
    def _prompt_cache_key(cls, value: object) -> str | None:
        return None if value is None else session_key(value, "prompt_cache_key")

    def session(self, header: str | None) -> str | None:
        """The request's session: its prompt_cache_key, else the X-Session-Id header's value (ValueError naming the
        header when that is not a valid key), else None."""
        if self.prompt_cache_key is not None:
            return str(self.prompt_cache_key)
        return None if header is None else session_key(header, f"the {SESSION_HEADER} header")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys are token ids (non-negative integers as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return value

    @model_validator(mode="after")
    def _ignored_only_when_neutral(self) -> _SamplingFields:
        if self.store:
            raise ValueError("store=true is not supported: this server stores no completions (send false or omit it)")
        if not self.spaces_between_special_tokens:
            raise ValueError("spaces_between_special_tokens=false is not supported (send true or omit it)")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        limit = self.output_limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({limit})")
        return self

    def output_limit(self) -> int | None:
        """The client's max_tokens; None when unset (OpenAI's default: until EOS, a stop, or the context end)."""
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        """Alternatives per generated token when logprobs are asked for (0: the sampled token only), else None."""
        return None

    def num_choices(self) -> int:
        """Sequences generated per prompt (best_of where it exceeds n)."""
        return self.n

    def tool_plan(self) -> ToolPlan | None:
        return None

    def constraint(self) -> tuple[StructuredOutput | None, str | None]:
        """The output constraint the request asks for and the field that asked (dcpserve.deployments.api.structured
        .request_constraint; FieldError naming the field)."""
        plan = self.tool_plan()
        return request_constraint({
            "response_format": self.response_format, "structured_outputs": self.structured_outputs,
            "guided_json": self.guided_json, "guided_regex": self.guided_regex, "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar, "guided_decoding_backend": self.guided_decoding_backend,
        }, plan.constraint() if plan is not None else None)

    def sampling_params(self, context_left: int, choice: int = 0,
                        defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
        """Choice `choice`'s sampling parameters; an unset max_tokens becomes context_left (max_model_len minus the
        prompt), or the model's max_new_tokens where that is less. With a seed, choice j gets seed + j: the same
        tokens as a one-choice request with that seed. `defaults`: the model's sampling defaults
        (dcpserve/engine/generation_defaults.py), which replace the OpenAI defaults of the fields the request
        omits (vLLM's --generation-config auto); a field the request sends is its own."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        limit = self.output_limit()
        if limit is None and defaults.max_tokens is not None:
            context_left = min(context_left, defaults.max_tokens)
        model_defaults = {name: value for name, value in defaults.sampling().items()
                          if name not in self.model_fields_set}
        return SamplingParams(
            temperature=model_defaults.get("temperature", self.temperature),
            top_p=model_defaults.get("top_p", self.top_p),
            top_k=model_defaults.get("top_k", self.top_k),
            max_tokens=max(limit, 1) if limit is not None else max(context_left, 1),
            seed=self.seed + choice if self.seed is not None else None,
            stop=tuple(stop) if stop else None,
            stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids else None,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_k(),
            prompt_logprobs=self.prompt_logprobs_k(),
            presence_penalty=model_defaults.get("presence_penalty", self.presence_penalty),
            frequency_penalty=model_defaults.get("frequency_penalty", self.frequency_penalty),
            repetition_penalty=model_defaults.get("repetition_penalty", self.repetition_penalty),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_output=self.constraint()[0],
        )

    def prompt_logprobs_k(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"a string, a list of strings, a list of token ids, or a list of token-id lists (at most "
                    f"{MAX_PROMPTS} prompts); prompt i, choice j has index i * n + j")
    max_tokens: int | None = Field(None, ge=0, description="0 with echo: score the prompt only (lm-eval's "
                                   "log-likelihood requests)")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM's: logprobs of every prompt "
                                        "token, per choice")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if len(value) > MAX_PROMPTS and not all(isinstance(v, int) for v in value):
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
            if any(isinstance(v, list) and not v for v in value) or any(isinstance(v, str) and not v for v in value):
                raise ValueError("every prompt must be non-empty")
        elif not value:
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported (insertion needs a fill-in-the-middle model)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed (the best choices are known only at the end)")
        if self.num_prompts() * self.num_choices() > MAX_SEQUENCES:
            sequences = self.num_prompts() * self.num_choices()
            raise ValueError(f"{self.num_prompts()} prompt(s) x {self.num_choices()} choice(s) = {sequences} "
                             f"sequences; at most {MAX_SEQUENCES} per request")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: use it with echo=true to score the prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch: each a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        # The field's types: a list of one kind (token ids, strings or lists of token ids).
        token_ids = [p for p in self.prompt if isinstance(p, int)]
        if len(token_ids) == len(self.prompt):
            return [token_ids]
        return [p for p in self.prompt if not isinstance(p, int)]

    def num_prompts(self) -> int:
        return len(self.prompts())

    def num_choices(self) -> int:
        return max(self.n, self.best_of or 1)

    def logprobs_k(self) -> int | None:
        if self.logprobs is None and self.best_of is not None and self.best_of > self.n:
            return 0  # best_of ranks choices by their tokens' cumulative logprob
        return self.logprobs

    def prompt_logprobs_k(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, ... are not used by the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant's turn of tool calls
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's past calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool result's call

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's tool calls may have none)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message for a chat template: role and text, plus tool_calls / tool_call_id where present."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # vLLM's: only true (the template always adds the assistant's turn)
    continue_final_message: bool = False
    # vLLM's: extra variables of the chat template, e.g. {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template, "
                                                        "e.g. {\"enable_thinking\": false}")

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if not self.add_generation_prompt or self.continue_final_message:
            raise ValueError("only add_generation_prompt=true and continue_final_message=false are supported")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def thinking_disabled(self) -> bool:
        """The request turned the template's thinking off (chat_template_kwargs {"enable_thinking": false}, Qwen3's
        switch, which vLLM's qwen3 reasoning parser reads)."""
        return (self.chat_template_kwargs or {}).get("enable_thinking", True) is False

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def tool_plan(self) -> ToolPlan | None:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
