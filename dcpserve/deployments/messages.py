"""The messages that cross a process boundary in the app: every value one deployment hands another over a Ray hop is
a frozen, typed message defined here (SGLang's io_struct, vLLM's EngineCoreRequest / EngineCoreOutputs), so a
misspelled field is an error where it is made, not a silent default where it is read.

The hops, and what travels on each:
- ingress -> KvAdmission: `Acquire` (the request's KV need at its `ServiceLevel`), answered `Granted` or `Refusal`;
  then refused / unreachable / release by ticket;
- engine replica -> KvAdmission: `KvReport` (its ledger, health, prefix cache changes, step time), answered
  `KvReportReply` (the queue's length, where the queue's copy of its prefix cache stands, its pool's `SloReport`);
- ingress -> engine replica: `EngineRequest`, answered `Accepted`, `Refused` or `Rejected`; `ReplicaQuery` addresses
  every other call to one replica;
- engine replica -> ingress: the delta stream, `Subscribed` then `DeltaBatch`es;
- for the ingress' /health, benchmarks and tests: `AdmissionStats` (KvAdmission.stats()) and `ReplicaStats`
  (EngineReplica.stats()). Only Serve's own hooks (record_routing_stats, record_autoscaling_stats) answer dicts: Serve
  asks for them.

Errors carry their HTTP status from where they are raised: `ApiError` (status, OpenAI error code, Retry-After), and a
`Refusal` is the admission queue's error as a value, with its status and Retry-After set by the queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dcpserve.engine.protocol import EngineStats, KvLedger, RequestDelta

if TYPE_CHECKING:
    from dcpserve.engine.core.prefix_cache import PrefixReport
    from dcpserve.engine.sampling_params import SamplingParams

# ---- errors -------------------------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered with an OpenAI-shaped body: its HTTP status, OpenAI error code and Retry-After (seconds)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after


# ---- service levels -----------------------------------------------------------------------------------------------

ANONYMOUS = "anonymous"  # the tenant of every request when the app has no API keys

# The range of a request's priority (metrics label their series by it: the range bounds their number).
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000


@dataclass(frozen=True)
class ServiceLevel:
    """Who sends a request and how urgent it is (dcpserve/deployments/admission/fair_share.py orders by it)."""

    tenant: str = ANONYMOUS
    priority: int = 0
    weight: float = 1.0
    deadline_s: float | None = None  # the longest it may wait in the queue, from when it arrives there
    tokens: int = 0  # prompt + max_tokens: what it counts against its tenant's tokens_per_minute
    # The conversation or agent it belongs to (OpenAI's prompt_cache_key, or the X-Session-Id header): the queue keeps
    # a session's turns on the replica that served its last one and shares a tenant fairly between its sessions
    # (dcpserve/deployments/admission/session_affinity.py). None: the request is a session of its own.
    session: str | None = None

    def __post_init__(self) -> None:
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ValueError(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {self.priority}")
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")


# ---- ingress -> admission queue -----------------------------------------------------------------------------------

DEFAULT_POOL = "default"  # the pool of an app without layout pools


@dataclass(frozen=True)
class PrefixAsk:
    """A request's prompt as the prefix cache names it: the hashes of the blocks it could find cached
    (dcpserve.engine.core.prefix_cache.prompt_hashes, computed by the ingress with the app's block unit and seed)."""

    hashes: tuple[int, ...]
    tokens_per_block: int
    seed: bytes
    num_prompt_tokens: int


@dataclass(frozen=True)
class PoolNeed:
    """A request's need on one pool: its admission blocks there and its prompt's block hashes at that block size."""

    blocks: int
    ask: PrefixAsk | None = None
    # The blocks of the whole sequence (prompt + max_tokens): a pool whose largest replica holds fewer could admit
    # the request under "usage" but never finish it. 0: the same as blocks.
    total_blocks: int = 0

    @property
    def ever_blocks(self) -> int:
        return max(self.blocks, self.total_blocks)


Need = int | Mapping[str, PoolNeed]  # an int: the same blocks (and the acquire's ask) on every replica


@dataclass(frozen=True)
class Acquire:
    """A request (one sequence, by its ticket) asking the admission queue for a replica that holds its KV."""

    ticket: str
    need: Need
    timeout_s: float  # the longest it waits in the queue (its level's deadline may end the wait sooner)
    front: bool = False  # a replica refused it after a grant: it goes first, and its tenant is not charged again
    ask: PrefixAsk | None = None  # its prompt's blocks, for prefix-aware routing (an int need's)
    level: ServiceLevel = ServiceLevel()


@dataclass(frozen=True)
class Granted:
    """Where the queue granted a ticket: the replica, the blocks counted for it there (its admission blocks less the
    cached blocks of its prefix that requests there hold), how many of its prompt blocks routing found there, and the
    replica's layout pool."""

    replica_id: str
    need: int
    hit_blocks: int = 0
    pool: str = DEFAULT_POOL


@dataclass(frozen=True)
class Refusal:
    """The queue did not grant a ticket: why (`code`, the OpenAI error code), the HTTP status it answers with, and
    Retry-After in seconds where a retry may succeed."""

    code: str  # queue_full, queue_timeout, deadline_exceeded, shed, limit_exceeded, never_fits, no_replica
    message: str
    status: int
    retry_after_s: int | None = None

    def error(self, earlier: str = "") -> ApiError:
        """The refusal as the ingress' error; `earlier` says what became of the request's earlier grants."""
        message = f"{self.message}; before that this request was granted KV but {earlier}" if earlier else self.message
        return ApiError(self.status, message, code=self.code, retry_after=self.retry_after_s)


AcquireReply = Granted | Refusal


# ---- engine replica -> admission queue ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class KvReport:
    """One replica's report to the admission queue: its KV ledger, whether it can take requests, the changes of its
    prefix cache since the queue's copy, and what the queue's replica choice weighs (step time, prefill backlog)."""

    replica_id: str
    capacity: int  # KV blocks in all
    tokens_per_block: int  # block_size * dcp
    held: Mapping[str, int] = field(default_factory=dict)  # request id -> blocks it holds
    healthy: bool = True
    routable: bool = True  # Serve's controller probed it recently: the routers know it
    probes: int = 0  # how often Serve has probed it (a replica lost and back is grantable again once probed since)
    headroom: int = 0  # blocks its "usage" admission keeps free for growth
    prefix: PrefixReport | None = None  # its prefix cache's changes since the queue's copy (None: caching off)
    pool: str = DEFAULT_POOL
    step_s: float = 0.0  # its recent mean engine step
    gpus: int = 1
    max_seqs: int = 0
    prefill_tokens: int = 0  # prompt tokens it has yet to compute
    step_tokens: int = 0  # its engine's token budget per step
    # Its measured seconds to copy one KV block from its host tier back to the device (0: not measured; the queue then
    # assumes a share of recomputing it: dcpserve/deployments/admission/replica_choice.py ASSUMED_RELOAD_FRACTION).
    reload_s_per_block: float = 0.0
    # Its measured seconds per token of the steps that compute prompt tokens (dcpserve/deployments/replica/
    # prefill_rate.py): the queue's price of its queued prefill and of recomputing a block (0: not measured yet; the
    # queue then derives one from step_s and step_tokens).
    prefill_s_per_token: float = 0.0
    slo_window_s: float = 0.0  # > 0: the reply carries the pool's SloReport over this window
    slo_percentile: float = 0.9


@dataclass(frozen=True)
class SloReport:
    """The admission queue's answer to a replica's KV report for its pool's service-level policy (KvReport with
    slo_window_s > 0): the pool's latencies at the percentile over the window (None: no request of the pool
    finished in it) and its KV load (AdmissionQueue.pool_load)."""

    ttft_s: float | None
    itl_s: float | None
    kv_load_blocks: int  # held or granted on the pool's healthy replicas + blocks of the requests waiting for it
    kv_capacity_blocks: int  # of those replicas together
    pool_replicas: int  # how many they are


@dataclass(frozen=True)
class KvReportReply:
    """The queue's reply to a KvReport: the requests waiting for the replica's pool (the autoscaler's signal), the
    blocks all waiting requests need, where the queue's copy of the replica's prefix cache stands (its next report
    starts from there), and with slo_window_s its pool's SloReport."""

    num_queued: int
    queued_blocks: int
    prefix_epoch: str | None
    prefix_version: int
    slo: SloReport | None = None


# ---- ingress -> engine replica ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineRequest:
    """What the ingress sends a replica: tokens, sampling, the KV need, and the replica the queue granted."""

    ticket: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_blocks: int  # blocks the queue counts for it on target_replica (admission_blocks less shared cached prefix)
    target_replica: str | None = None  # the router sends it only there (None: the router picks by KV)
    reply_to: str = ""  # the ingress whose delta stream carries its deltas
    attempt: int = 0  # how many grants of this ticket came back before this one (an abort names its attempt)
    # The prompt's block hashes the ingress computed for prefix routing
    # (dcpserve.engine.core.prefix_cache.prompt_hashes): the engine starts from them instead of hashing the prompt
    # again. Empty without prefix caching.
    prompt_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Accepted:
    """generate()'s answer when the replica took the request: its deltas follow on the ingress' delta stream."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class Refused:
    """generate()'s answer when the request does not fit the replica's free KV now."""

    replica_id: str
    free_blocks: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """generate()'s answer when the request can never run here (the engine's request error: the client's, a 400)."""

    replica_id: str
    message: str


Admission = Accepted | Refused | Rejected


@dataclass(frozen=True)
class ReplicaQuery:
    """Addresses a call other than generate() to one replica (the router sends it only there), e.g.
    `handle.stats.remote(ReplicaQuery(replica_id))` for each id of KvAdmission.stats().replicas."""

    target_replica: str


# ---- engine replica -> ingress: the delta stream ------------------------------------------------------------------

# The ingress renews each of its streams every RENEW_S; a replica ends a stream not renewed for LEASE_S (and aborts its
# requests). Ray does not end a streaming call whose caller died, so without the lease the stream of an ingress that
# was killed stayed open on the replica, held its requests, and held the replica's graceful shutdown (which waits
# for every call) for its whole timeout.
RENEW_S = 5.0
LEASE_S = 30.0


@dataclass(frozen=True, slots=True)
class Subscribed:
    """The first item of a delta stream: the replica that serves it (the ingress checks it reached the one it asked)."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class DeltaBatch:
    """One item of a delta stream: each request's deltas since the last item, merged; the requests whose engine
    stream failed, with the error."""

    deltas: tuple[RequestDelta, ...] = ()
    errors: tuple[tuple[str, str], ...] = ()  # (request id, message)

    @property
    def num_tokens(self) -> int:
        return sum(len(d.new_token_ids) for d in self.deltas)


# ---- stats: KvAdmission.stats() and EngineReplica.stats() (the ingress' /health, benchmarks, tests) ---------------


@dataclass(frozen=True)
class TenantStats:
    """One tenant in the admission queue: its attained KV token-seconds, the KV it holds, and how long its last (up to
    1,000) granted requests waited in the queue (p50, p90, max; None before its first grant)."""

    attained_kv_token_s: float
    holding_kv_tokens: int
    granted: int
    wait_p50_s: float | None
    wait_p90_s: float | None
    wait_max_s: float | None


@dataclass(frozen=True)
class QueueReplicaView:
    """The admission queue's view of one replica: its capacity, what the queue granted there and the replica holds
    beyond the grants (external), what is free to grant, and whether it may be granted."""

    pool: str
    capacity: int
    granted: int
    external: int
    free: int
    healthy: bool
    grantable: bool
    num_grants: int  # grants outstanding now
    num_granted: int  # grants since it joined
    cached_prefix_blocks: int
    prefill_ahead_blocks: int


# Why the admission queue granted a request where it did (AdmissionStats.decisions; label `reason` of
# dcpserve_admission_decisions_total). The replica ranking's first key that told the chosen replica from the next
# (dcpserve/deployments/admission/replica_choice.py): session (its session's last replica), prefix (the longest cached
# run, host-tier blocks credited with what their reload saves), start_soonest (the fewest engine steps of prefill
# before its first token), most_free (the most KV free after the grant, or all alike); only_choice (one replica had
# room and balance); and the TTFT bound's (dcpserve/deployments/admission/ttft_bound.py): backlog_rerouted (the
# preferred replica would start it past the bound, another within it), over_bound (none would, nor would a short
# wait: where it starts soonest), backlog_deferred (not a grant: held in the queue for a backlog to drain, counted
# once per request); prefix_deferred (not a grant: held for the replica that caches more of its prompt to have room,
# replica_choice.py's prefix hold, counted once per request).
DECISION_REASONS = ("session", "prefix", "start_soonest", "most_free", "only_choice", "backlog_rerouted",
                    "over_bound", "backlog_deferred", "prefix_deferred")


@dataclass(frozen=True)
class AdmissionStats:
    """The admission queue's counters (since it started) and its view of each replica."""

    num_queued: int
    queued_blocks: int
    num_granted: int
    num_timeouts: int
    num_rejected_full: int
    num_refusals: int
    num_unreachable: int
    num_lost: int
    num_leaked: int
    num_shed: int
    num_deadline: int
    prefix_query_blocks: int
    prefix_hit_blocks: int
    pool_grants: Mapping[str, int]  # "pool/reason" -> grants
    tenants: Mapping[str, TenantStats]
    replicas: Mapping[str, QueueReplicaView]  # by replica id
    # Admission decisions by reason (DECISION_REASONS: each grant once, each request the TTFT bound held back once).
    decisions: Mapping[str, int] = field(default_factory=dict)
    num_sessions: int = 0  # sessions whose last replica the queue remembers


@dataclass(frozen=True)
class ReplicaStats:
    """One engine replica: its engine's stats and KV ledger as of its last step, and its delta stream's counters (items
    sent to the ingresses and the generated tokens they carried, since it started)."""

    replica_id: str
    engine: EngineStats
    ledger: KvLedger
    stream_items: int
    stream_tokens: int
