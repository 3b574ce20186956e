"""The engine protocol: what a Serve replica (and anything else that serves) may ask of one replica's engine.

Two backends implement it: the native engine (dcpserve.engine.frontend.async_engine.AsyncEngine) and vLLM's AsyncLLM
behind dcpserve.engine.backends.vllm.engine.VllmEngine. Everything above the engine (the replica, admission, routing,
autoscaling, metrics) talks to an `EngineClient` and reads its typed `EngineStats` and `KvLedger`, so both backends look
the same from there. It imports no implementation: dcpserve.engine.backends starts the backend named by
`EngineArgs.backend`.

KV is counted in logical blocks of block_size * dcp tokens (a block is one page on every rank of a DCP group), the
unit of the whole system.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from dcpserve.engine.core.prefix_cache import PrefixReport
    from dcpserve.engine.sampling_params import SamplingParams
    from dcpserve.engine.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine's loop failed; requests in flight were ended with this error."""


class RequestError(ValueError):
    """A request the engine refuses as it is (the client's error, an OpenAI 400): never fits this configuration, token
    ids outside the vocabulary, a constraint the grammar engine refuses. Nothing was queued. Any other exception of
    the engine is its own failure, never the client's."""


class KvFull(RuntimeError):
    """submit(check_kv=True) refused a request: its admission blocks exceed the ledger's free blocks now."""

    def __init__(self, need: int, free_blocks: int) -> None:
        super().__init__(f"the request needs {need} KV blocks, {free_blocks} are free")
        self.need = need
        self.free_blocks = free_blocks


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the raw model logits (log_softmax over the whole vocabulary, before
    temperature, penalties, bias and top-k / top-p), its rank (1 + the tokens with a strictly higher logprob) and
    the top alternatives the request asked for, best first, as (token_id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class RequestDelta:
    """What one step added to a request: new tokens, newly completed text, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    # One per new token when the request asked for logprobs (SamplingParams.logprobs), else None.
    logprobs: list[TokenLogprob] | None = None
    # Only on the request's first delta, when it asked for prompt_logprobs: one per prompt token; entry 0 is None,
    # entry i is prompt token i given the tokens before it.
    prompt_logprobs: list[TokenLogprob | None] | None = None


def merge_deltas(deltas: Sequence[RequestDelta]) -> RequestDelta:
    """Consecutive deltas of one request as one: their tokens, text and logprobs in order, the last one's counts and
    finish, the prompt logprobs of the one that had them."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
    return RequestDelta(
        request_id=last.request_id,
        new_token_ids=[t for d in deltas for t in d.new_token_ids],
        new_text="".join(d.new_text for d in deltas),
        finished=last.finished,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        logprobs=logprobs if any(d.logprobs is not None for d in deltas) else None,
        prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
    )


@runtime_checkable
class DeltaSink(Protocol):
    """Where the engine delivers the deltas of the requests submitted to it with submit_to(): the serving layer's
    batch of requests bound for one reader (a replica's outbox for one ingress). The engine splits a step's output
    by sink, never by request, so that a step's deltas bound for one reader stay one batch; the per-request split
    happens once, where the reader demultiplexes them (dcpserve.deployments.dispatch.streams)."""

    def deliver(self, deltas: Sequence[RequestDelta]) -> None:
        """One engine step's deltas of this sink's requests, in the step's order (a request's finishing delta is its
        last: nothing more comes for it). Called on the engine's event loop; must not block."""
        ...

    def fail(self, request_id: str, error: BaseException) -> None:
        """The request ended with an error (the engine failed): nothing more comes for it."""
        ...


@dataclass(frozen=True)
class KvLedger:
    """One replica's KV in logical blocks (block_size * dcp tokens): the one ledger that accept / refuse, the reports
    to the admission queue and routers, and the metrics use."""

    admission: str  # "full" | "usage"
    capacity_blocks: int
    tokens_per_block: int
    used_blocks: int  # allocated: KV written or being written
    committed_blocks: int  # what the admission policy counts for every unfinished request (sum of per_request)
    headroom_blocks: int  # "usage": growth room admission keeps free for the sequences it holds
    per_request: dict[str, int]  # unfinished request id -> its committed blocks
    # Prompt tokens of the unfinished requests not computed yet: the prefill a new request would queue behind (less
    # a waiting request's cached prefix; the vLLM backend counts the whole prompt of a request with no output yet).
    prefill_tokens: int = 0

    @property
    def free_blocks(self) -> int:
        """What admission may still hand a new request."""
        return max(0, self.capacity_blocks - self.committed_blocks - self.headroom_blocks)

    def admits(self, need: int) -> bool:
        """Whether a new request asking for `need` blocks (admission_blocks) is accepted: it fits the free blocks,
        or the replica holds nothing (any request that passed the never-fits check may start alone)."""
        return need <= self.free_blocks or not self.per_request

    def require(self, need: int) -> None:
        """Raises KvFull unless admits(need): the accept check of both engine backends."""
        if not self.admits(need):
            raise KvFull(need, self.free_blocks)


@dataclass(frozen=True)
class RankKvStats:
    """One rank's KV (world rank: TP rank rank % tp of PCP group rank // tp): its pages (one per logical block) and the
    tokens of running sequences it holds."""

    rank: int
    dcp_rank: int
    pages_total: int
    pages_used: int
    tokens_capacity: int
    tokens_used: int


@dataclass(frozen=True)
class HostTierStats:
    """The host-memory KV tier of a replica, since start: slots (per rank: one slot holds each rank's page of a
    logical block), prefix-hit tokens by tier, copies each way (blocks, bytes over all ranks, seconds: the slowest
    rank's), evictions into the tier and out of it, and the measured seconds of reloading one block (0 until one is)."""

    capacity_blocks: int
    used_blocks: int
    hit_tokens_device: int
    hit_tokens_host: int
    blocks_out: int  # device -> host
    blocks_in: int  # host -> device
    bytes_out: int
    bytes_in: int
    seconds_out: float
    seconds_in: float
    evictions_to_host: int  # cached device blocks the device pool evicted into the tier
    host_drops: int  # blocks the tier's LRU dropped (gone from device and host)
    reload_seconds_per_block: float


@dataclass(frozen=True)
class EngineStats:
    """One replica's engine as of its last step: KV in logical blocks, sequences, counters, layout."""

    backend: str  # "native" | "vllm"
    tp: int
    dcp: int
    num_kv_heads: int  # of the model (1 for MLA's latent cache)
    admission: str
    kv_blocks_total: int  # logical blocks the KV pool holds
    kv_block_size_tokens: int  # tokens per logical block: block_size * dcp
    kv_blocks_used: int  # allocated to sequences
    kv_blocks_reserved: int  # promised to admitted sequences (used included)
    num_running: int
    num_waiting: int  # inside the engine, not yet running
    num_pending: int = 0  # accepted by the serving front, not yet handed to the engine
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    tokens_computed: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    last_step_seconds: float = 0.0
    last_exchange_seconds: float = 0.0  # of last_step_seconds, the DCP exchange (0 without DCP or unknown)
    last_step_tokens: int = 0  # tokens the last step computed (prompt and decode)
    last_step_prompt_tokens: int = 0  # of those, prompt tokens (chunks of prompts, recomputes): 0 for a decode step
    healthy: bool = True
    # Prefix caching: whether it is on, prompt tokens of new requests looked up and, of those, served from the cache
    # (both since start), blocks holding a cached prefix block now (held or evictable), evictions since start.
    prefix_caching: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_cached: int = 0
    prefix_cache_evictions: int = 0
    per_rank: tuple[RankKvStats, ...] = ()
    # The host KV tier (kv_host_tier): the native engine's, or vLLM's CPU offloading seen through its KV events (the
    # backend's stats.py); None: off.
    host_tier: HostTierStats | None = None

    @property
    def kv_blocks_free(self) -> int:
        return max(0, self.kv_blocks_total - self.kv_blocks_reserved)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks_total * self.kv_block_size_tokens

    @property
    def kv_used_tokens(self) -> int:
        return self.kv_blocks_used * self.kv_block_size_tokens

    @property
    def kv_reserved_tokens(self) -> int:
        return self.kv_blocks_reserved * self.kv_block_size_tokens

    @property
    def kv_free_tokens(self) -> int:
        return self.kv_blocks_free * self.kv_block_size_tokens

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain data (fields and the derived KV figures), for reports that cross process boundaries as JSON."""
        data = asdict(self)
        for name in ("kv_blocks_free", "kv_capacity_tokens", "kv_used_tokens", "kv_reserved_tokens",
                     "kv_free_tokens", "kv_usage"):
            data[name] = getattr(self, name)
        return data


@runtime_checkable
class EngineClient(Protocol):
    """One replica's engine, as the serving layer uses it. Every method is called on the replica's event loop."""

    backend: str
    dead_error: BaseException | None  # set once the engine failed; every request in flight got an error

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    async def submit(self, sampling_params: SamplingParams, prompt_token_ids: list[int], request_id: str,
                     check_kv: bool = False, *, prompt_hashes: Sequence[int] = ()) -> AsyncGenerator[RequestDelta]:
        """Hands a request to the engine and returns its stream of deltas (token ids, text, finish reason) once the
        engine took it. Raises ValueError (never fits, bad token ids), KvFull (check_kv and the ledger cannot admit
        it now) or EngineDeadError, and then nothing is queued. A caller that never iterates the stream must
        abort(). prompt_hashes: the hashes of the prompt's first full blocks as dcpserve.engine.core.prefix_cache's
        prompt_hashes names them with this engine's ModelLimits (the ingress computed them to route the request):
        the engine's prefix cache starts from them instead of hashing those blocks again."""
        ...

    async def submit_to(self, sink: DeltaSink, sampling_params: SamplingParams, prompt_token_ids: list[int],
                        request_id: str, check_kv: bool = False, *, prompt_hashes: Sequence[int] = ()) -> None:
        """submit(), with the request's deltas delivered to `sink` (batched per step with the sink's other requests)
        instead of a stream of its own. Raises what submit() raises, and then nothing is queued. Deltas may reach
        the sink before this returns: the caller makes the sink ready for the request first. Until the request's
        finishing delta (or fail()) reached the sink, abort() is the caller's to call when it gives up."""
        ...

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV. Idempotent; unknown ids are ignored."""
        ...

    def has_request(self, request_id: str) -> bool: ...

    def admission_blocks(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The logical blocks a new request asks admission for under this engine's policy."""
        ...

    async def admission_need(self, prompt_token_ids: list[int], max_tokens: int) -> int:
        """The blocks this request would add here now: admission_blocks less the cached blocks of its prefix that
        requests here hold (shared, not added). What submit(check_kv=True) checks."""
        ...

    async def prefix_report(self, reader_epoch: str | None, reader_version: int) -> PrefixReport | None:
        """The prefix cache's changes since the reader's (epoch, version), or its whole state
        (dcpserve.engine.core.prefix_cache); None when prefix caching is off."""
        ...

    def kv_ledger(self) -> KvLedger:
        """The ledger as of the engine's last change it reported: an immutable value."""
        ...

    def stats(self) -> EngineStats:
        """The stats as of the engine's last step: an immutable value."""
        ...

    async def check_health(self) -> None:
        """Raises if the engine (any rank) is dead."""
        ...

    async def shutdown(self) -> None: ...


@dataclass(frozen=True)
class ModelLimits:
    """What the serving front needs to check and count a request before any replica sees it, for either backend:
    the context limit, the vocabulary, the KV unit and policy, and where the tokenizer is."""

    model: str
    max_model_len: int
    vocab_size: int
    tokens_per_block: int  # block_size * dcp
    admission: str
    eos_token_ids: tuple[int, ...]
    prefix_caching: bool = False
    prefix_hash_seed: bytes = b""  # core.prefix_cache.prefix_hash_seed: the block hashes the replicas report
