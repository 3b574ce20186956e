"""A request's state inside the engine, and what the engine returns for it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dcpserve.engine.protocol import RequestError, TokenLogprob
from dcpserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dcpserve.engine.structured_output import GrammarState


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request stopped (OpenAI's finish_reason values)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


class RequestRejected(RequestError):
    """A request that could never be served with this configuration (never-fits); nothing was queued."""


def resolve_prompt_token_ids(prompt: str | None, prompt_token_ids: list[int] | None,
                             encode: Callable[[str], list[int]], vocab_size: int,
                             sampling_params: SamplingParams | None = None) -> list[int]:
    """A request's prompt as token ids (`encode`d when given as text), each checked against the vocabulary, as are
    the token ids its sampling params name (logit_bias). Both engine backends check requests with it."""
    if prompt_token_ids is None:
        if prompt is None:
            raise RequestError("pass a prompt or prompt_token_ids")
        prompt_token_ids = encode(prompt)
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt_token_ids must be integers in [0, {vocab_size}), got {bad[:5]}")
    if sampling_params is not None:
        sampling_params.check_vocab(vocab_size)
    return list(prompt_token_ids)


@dataclass(eq=False)  # an entity: equal only to itself (the scheduler's lists remove a request by identity)
class Request:
    """One sequence being generated.

    Invariant (vLLM's): num_computed_tokens <= num_tokens = len(prompt) + len(output). Each step the scheduler
    gives a running request min(num_tokens - num_computed_tokens, remaining budget) tokens to compute; prefill,
    chunked prefill, decode and recompute after preemption all fall out of that.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_ids: list[int] = field(default_factory=list)  # logical blocks (= page ids on every DCP rank)
    reserved_blocks: int = 0  # blocks promised at admission, allocated or not
    num_preemptions: int = 0
    prompt: str | None = None
    # prompt + outputs, grown by append_output (never re-concatenated: a step's host work must not grow with context)
    all_token_ids: list[int] = field(init=False, repr=False)
    # how many of block_ids the ranks have been sent since they last (re)learned this request
    num_block_ids_sent: int = field(default=0, repr=False)
    # Prefix caching (dcpserve.engine.core.block_manager): the hashes of the request's full blocks computed so far, how
    # many of its blocks are named in the cache, and how many of the blocks it holds are charged to it (the others to
    # another request holding the same cached blocks).
    block_hashes: list[int] = field(default_factory=list, repr=False)
    num_cached_blocks: int = field(default=0, repr=False)
    num_charged_blocks: int = field(default=0, repr=False)
    # A constrained request's grammar state (SamplingParams.structured_output), advanced by each output token. It
    # lives here, in the scheduler, and survives preemption: recompute replays tokens through the model only.
    grammar: GrammarState | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output(self, token_id: int) -> None:
        """A sampled token joins the outputs and the sequence."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """Tokens the request may reach: prompt + max_tokens (the KV it can ever need)."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens


@dataclass
class CompletionOutput:
    """The generated part of a request (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per token when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    """What LLM.generate returns per prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # When SamplingParams.prompt_logprobs is set: one per prompt token (entry 0 None).
    prompt_logprobs: list[TokenLogprob | None] | None = None
