"""dcpserve's Prometheus metrics, exported through Ray's metrics pipeline (docs/metrics.md lists every one).

Each Serve replica records its metrics with ray.serve.metrics, which adds the `deployment`, `replica` and
`application` labels; Ray's per-node metrics agent exports them, and Prometheus finds every node through the
service-discovery file Ray writes (<temp dir>/prom_metrics_service_discovery.json), so no replica opens a port.
Ray prefixes every name with `ray_` and exports a counter `x` as `ray_x_total`: the names below are the ones
given to Ray (no `ray_`, no `_total`); METRIC_NAMES holds the names Prometheus shows.

Three recorders, one per deployment: ReplicaMetrics (engine KV, prefix cache, host KV tier, sequences, layout,
steps; EngineReplica), AdmissionMetrics (outcomes, queue length and wait, prefix routing; KvAdmission),
IngressMetrics (HTTP statuses, tokens and latencies as the client sees them; OpenAIIngress); and
AutoscalingMetrics, the service-level autoscaling policy's inputs and decisions, recorded in Serve's controller (no
replica there: ray.util.metrics, with the application and deployment as tags of its own). Units are in the names
(seconds, tokens, blocks, bytes, ratio). Every series of an engine replica carries its layout pool (`pool`,
dcpserve/deployments/admission/pools.py: "default" in an app without pools), and so do the ingress' latencies (the pool
of the replica that served the request), so that PromQL can `sum by (pool)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import TypeVar

from ray.serve import metrics
from ray.util import metrics as util_metrics
from ray.util.metrics import Metric

from dcpserve.deployments.messages import ANONYMOUS, DECISION_REASONS, ServiceLevel
from dcpserve.engine.protocol import EngineStats, HostTierStats, KvLedger

# Outcomes of one KvAdmission.acquire call (label `outcome` of dcpserve_admission_requests_total).
ADMISSION_OUTCOMES = (
    "admitted",  # a replica was granted (at once, or after waiting: then `queued` counted too)
    "queued",  # no replica could hold it at once: it entered the FIFO
    "rejected_queue_full",  # 429: the queue was full
    "rejected_timeout",  # 429: it waited longer than queue_timeout_s
    "rejected_deadline",  # 429: its deadline came while it waited (or had passed when it arrived)
    "rejected_shed",  # 429: sheddable, refused under saturation (dcpserve/deployments/admission/fair_share.py)
    "rejected_limit",  # 429 (400 when the request alone is past it): a tenant's limit (admission/tenant_limits.py)
    "rejected_never_fits",  # 400: larger than any replica's whole KV
    "rejected_no_replica",  # 503: no healthy engine replica
)

# Grants that came back to the queue (label `reason` of dcpserve_admission_replica_refusals_total), by the
# AdmissionQueue event that reports them.
GRANT_RETURN_REASONS = {
    "refused_by_replica": "no_kv",  # the replica held less free KV than the queue knew
    "unreachable_replica": "unreachable",  # the call did not reach the replica in time, or failed (starting, gone)
}

# Seconds; wide enough for CPU (the tiny model) and GPU replicas alike.
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
STEP_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
QUEUE_WAIT_BUCKETS_S = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]

# How often a replica refreshes its gauges from the engine (Ray exports every metrics_report_interval_ms, 10 s
# by default, so faster only matters for tests that lower that interval).
GAUGE_PERIOD_S = 0.5

# The label naming a layout pool (dcpserve/deployments/admission/pools.py) on an engine replica's series and the
# ingress' latencies.
POOL_TAG = "pool"
# The labels naming a request's service level (dcpserve/deployments/admission/fair_share.py): its tenant (API key name)
# and priority.
TENANT_TAG, PRIORITY_TAG = "tenant", "priority"

_AnyMetric = TypeVar("_AnyMetric", bound=Metric)


def level_tags(level: ServiceLevel) -> dict[str, str]:
    """A request's service level as metric tags."""
    return {TENANT_TAG: level.tenant, PRIORITY_TAG: str(level.priority)}


def _pool_keys(tag_keys: tuple[str, ...], pool: str | None) -> tuple[str, ...]:
    return tag_keys if pool is None else (*tag_keys, POOL_TAG)


def _in_pool(metric: _AnyMetric, pool: str | None) -> _AnyMetric:
    """Tags every value the metric records with the layout pool (a default tag: the callers name only their own
    tags, the pool is added to each)."""
    if pool is not None:
        metric.set_default_tags({POOL_TAG: pool})  # a dict of its own: Serve adds its replica tags to it
    return metric


def _gauge(name: str, description: str, tag_keys: tuple[str, ...] = (), pool: str | None = None) -> metrics.Gauge:
    return _in_pool(metrics.Gauge(name, description=description, tag_keys=_pool_keys(tag_keys, pool)), pool)  # type: ignore[arg-type]  # Ray annotates tag_keys as a 1-tuple


def _counter(name: str, description: str, tag_keys: tuple[str, ...] = (),
             pool: str | None = None) -> metrics.Counter:
    return _in_pool(metrics.Counter(name, description=description, tag_keys=_pool_keys(tag_keys, pool)), pool)  # type: ignore[arg-type]  # Ray annotates tag_keys as a 1-tuple


def _start_at_zero(counter: metrics.Counter, tags: dict[str, str] | None = None) -> None:
    """Exports the counter's series at 0 before its first event, so it exists in Prometheus (a preemption may
    never happen) and rate() / increase() see the first one. Ray's public inc() refuses 0, so this records 0
    through Metric._record, which inc() itself calls after its check (tests/dashboards proves the series exists)."""
    counter._record(0.0, tags=tags)


class _EngineCount:
    """Feeds a counter from one of EngineStats' cumulative counts (counted since the engine started): each update
    adds what the count grew by since the last one. A count below the last one seen means the engine started over
    from 0, so all of it is new (Prometheus' own counter-reset rule); the exported counter never goes back. `tags`:
    the one series of a labelled counter this count feeds (exported at 0 from the start, as the others)."""

    def __init__(self, counter: metrics.Counter, count: Callable[[EngineStats], float],
                 tags: dict[str, str] | None = None) -> None:
        self.counter = counter
        self.count = count
        self.tags = tags
        self.seen: float = 0
        _start_at_zero(counter, tags)

    def advance(self, stats: EngineStats) -> None:
        count = self.count(stats)
        new = count - self.seen if count >= self.seen else count
        if new > 0:
            self.counter.inc(new, tags=self.tags)  # type: ignore[arg-type]  # Ray's None default is untyped
        self.seen = count


def _host_tier(read: Callable[[HostTierStats], float]) -> Callable[[EngineStats], float]:
    """One of HostTierStats' counts as an EngineStats count: 0 while the engine has no host tier."""
    return lambda stats: read(stats.host_tier) if stats.host_tier is not None else 0


def _histogram(name: str, description: str, boundaries: list[float],
               tag_keys: tuple[str, ...] = (), pool: str | None = None) -> metrics.Histogram:
    return _in_pool(metrics.Histogram(name, description=description, boundaries=boundaries,
                                      tag_keys=_pool_keys(tag_keys, pool)), pool)  # type: ignore[arg-type]  # Ray annotates tag_keys as a 1-tuple


class ReplicaMetrics:
    """One engine replica's metrics: KV (replica and per rank), sequences, layout, preemptions, prefix cache, host KV
    tier, step timings; every series tagged with the replica's layout pool."""

    def __init__(self, *, pool: str, tp: int, dcp: int, num_kv_heads: int, target_sequences_per_replica: float,
                 admission: str = "usage", node_id: str = "", node_type: str = "") -> None:
        # Every metric of the replica carries `pool` (a default tag): PromQL can then sum by (pool).
        gauge = partial(_gauge, pool=pool)
        counter = partial(_counter, pool=pool)
        histogram = partial(_histogram, pool=pool)
        self.kv_capacity = gauge("dcpserve_kv_capacity_tokens", "KV tokens this replica holds in all")
        self.kv_used = gauge("dcpserve_kv_used_tokens", "KV tokens in allocated blocks (block granularity)")
        self.kv_reserved = gauge("dcpserve_kv_reserved_tokens",
                                 "KV tokens promised to admitted requests, not yet allocated")
        self.kv_usage = gauge("dcpserve_kv_usage_ratio", "allocated KV blocks / all KV blocks")
        self.kv_held = gauge("dcpserve_kv_held_tokens", "KV tokens the admission policy commits to accepted requests")
        self.kv_headroom = gauge("dcpserve_kv_headroom_tokens", "KV tokens usage admission keeps free as growth room")
        self.kv_block = gauge("dcpserve_kv_block_size_tokens", "tokens per logical KV block (block_size * dcp)")
        self.rank_capacity = gauge("dcpserve_kv_rank_capacity_tokens", "KV tokens one rank's shard holds",
                                   ("rank", "dcp_rank"))
        self.rank_used = gauge("dcpserve_kv_rank_used_tokens", "computed tokens stored on one rank",
                               ("rank", "dcp_rank"))
        self.rank_usage = gauge("dcpserve_kv_rank_usage_ratio", "tokens stored on one rank / its capacity",
                                ("rank", "dcp_rank"))
        self.layout = gauge("dcpserve_layout_info", "1, labelled with the replica's TP x DCP layout",
                            ("tp", "dcp", "kv_heads", "kv_head_copies", "duplication_removed"))
        # Which node the replica runs on: the dashboard's per-node panels join the per-replica series on `replica`.
        self.node = gauge("dcpserve_replica_node_info", "1, labelled with the node the replica runs on and its type",
                          ("node_id", "node_type"))
        self.running = gauge("dcpserve_sequences_running", "sequences the engine is running")
        self.waiting = gauge("dcpserve_sequences_waiting",
                             "sequences waiting inside the engine (accepted, not running)")
        self.target = gauge("dcpserve_autoscaling_target_sequences_per_replica",
                            "the autoscaling policy's target_sequences_per_replica")
        self.healthy = gauge("dcpserve_engine_healthy", "1 while the engine loop runs, 0 once it failed")
        self.preemptions = counter("dcpserve_preemptions", "requests preempted for KV (admission 'usage')")
        self.recomputed = counter("dcpserve_recomputed_tokens", "computed tokens preemption threw away (recomputed)")
        # Prefix caching: prompt tokens looked up and served from the cache, evictions, cached blocks (all but the
        # looked-up tokens stay 0 while it is off).
        self.prefix_queries = counter("dcpserve_prefix_cache_query_tokens",
                                      "prompt tokens of new requests looked up in the prefix cache")
        self.prefix_hits = counter("dcpserve_prefix_cache_hit_tokens",
                                   "prompt tokens of new requests served from the prefix cache (not computed)")
        self.prefix_evictions = counter("dcpserve_prefix_cache_evictions",
                                        "cached prefix blocks evicted to hold other KV")
        self.kv_cached = gauge("dcpserve_kv_cached_blocks",
                               "logical KV blocks holding a cached prefix block (in use or evictable)")
        # The host KV tier (kv_host_tier; EngineStats.host_tier): occupancy, prefix hits by the tier that held them,
        # copies each way, blocks into and out of the tier. All 0 while the engine has none.
        self.host_capacity = gauge("dcpserve_kv_host_tier_capacity_blocks",
                                   "logical KV blocks the host tier holds (one page of each rank per block)")
        self.host_used = gauge("dcpserve_kv_host_tier_used_blocks", "logical KV blocks in the host tier now")
        self.host_reload = gauge("dcpserve_kv_host_tier_reload_seconds_per_block",
                                 "measured seconds to copy one block back from the host tier (0: not measured)")
        self.tier_hits = counter("dcpserve_prefix_cache_tier_hit_tokens",
                                 "prompt tokens served from the prefix cache, by the tier holding them (device, host)",
                                 ("tier",))
        self.host_blocks = counter("dcpserve_kv_host_tier_copied_blocks",
                                   "logical KV blocks copied to_host / to_device", ("direction",))
        self.host_bytes = counter("dcpserve_kv_host_tier_copied_bytes",
                                  "bytes copied to_host / to_device, over all ranks", ("direction",))
        self.host_seconds = counter("dcpserve_kv_host_tier_copy_seconds",
                                    "step time spent copying to_host / to_device (the slowest rank's)", ("direction",))
        self.host_evictions = counter("dcpserve_kv_host_tier_evictions",
                                      "blocks the device pool evicted into the host tier (to_host) and blocks the "
                                      "host tier dropped (dropped: gone from device and host)", ("eviction",))
        self.accepted = counter("dcpserve_requests_accepted", "requests this replica accepted, by admission policy",
                                ("admission",))
        self.stream_items = counter(
            "dcpserve_stream_items",
            "stream items this replica sent to the ingress replicas (each: their requests' tokens since the last)",
        )
        self.stream_tokens = counter("dcpserve_stream_tokens", "generated tokens this replica sent to the ingress")
        self.steps = histogram("dcpserve_engine_step_seconds", "wall time of one engine step", STEP_BUCKETS_S)
        self.exchange = histogram("dcpserve_engine_dcp_exchange_seconds",
                                  "time of one step in the DCP exchange (max over ranks; 0 without DCP)",
                                  STEP_BUCKETS_S)
        self._engine_counts = (
            _EngineCount(self.preemptions, lambda stats: stats.num_preemptions),
            _EngineCount(self.recomputed, lambda stats: stats.num_recomputed_tokens),
            _EngineCount(self.prefix_queries, lambda stats: stats.prefix_cache_queries),
            _EngineCount(self.prefix_hits, lambda stats: stats.prefix_cache_hits),
            _EngineCount(self.prefix_evictions, lambda stats: stats.prefix_cache_evictions),
            _EngineCount(self.tier_hits, _host_tier(lambda tier: tier.hit_tokens_device), {"tier": "device"}),
            _EngineCount(self.tier_hits, _host_tier(lambda tier: tier.hit_tokens_host), {"tier": "host"}),
            _EngineCount(self.host_blocks, _host_tier(lambda tier: tier.blocks_out), {"direction": "to_host"}),
            _EngineCount(self.host_blocks, _host_tier(lambda tier: tier.blocks_in), {"direction": "to_device"}),
            _EngineCount(self.host_bytes, _host_tier(lambda tier: tier.bytes_out), {"direction": "to_host"}),
            _EngineCount(self.host_bytes, _host_tier(lambda tier: tier.bytes_in), {"direction": "to_device"}),
            _EngineCount(self.host_seconds, _host_tier(lambda tier: tier.seconds_out), {"direction": "to_host"}),
            _EngineCount(self.host_seconds, _host_tier(lambda tier: tier.seconds_in), {"direction": "to_device"}),
            _EngineCount(self.host_evictions, _host_tier(lambda tier: tier.evictions_to_host), {"eviction": "to_host"}),
            _EngineCount(self.host_evictions, _host_tier(lambda tier: tier.host_drops), {"eviction": "dropped"}),
        )
        _start_at_zero(self.accepted, {"admission": admission})
        _start_at_zero(self.stream_items)
        _start_at_zero(self.stream_tokens)
        copies = tp // num_kv_heads if tp > num_kv_heads else 1  # ranks holding one KV head
        self._layout_tags = {"tp": str(tp), "dcp": str(dcp), "kv_heads": str(num_kv_heads),
                             "kv_head_copies": str(copies // dcp), "duplication_removed": str(dcp)}
        self._target_sequences = float(target_sequences_per_replica)
        self._node_tags = {"node_id": node_id, "node_type": node_type}

    def on_step(self, stats: EngineStats) -> None:
        """After every engine step (the engine's on_step): the step's timings."""
        self.steps.observe(stats.last_step_seconds)
        self.exchange.observe(stats.last_exchange_seconds)

    def update(self, stats: EngineStats, ledger: KvLedger) -> None:
        """Gauges from the engine's stats() and KV ledger, every GAUGE_PERIOD_S. Constant gauges are set again each
        time too: Ray exports a gauge only while it is being recorded."""
        self.layout.set(1, tags=self._layout_tags)
        self.node.set(1, tags=self._node_tags)
        self.target.set(self._target_sequences)
        self.kv_capacity.set(stats.kv_capacity_tokens)
        self.kv_used.set(stats.kv_used_tokens)
        self.kv_reserved.set(stats.kv_reserved_tokens)
        self.kv_usage.set(stats.kv_usage)
        self.kv_held.set(ledger.committed_blocks * ledger.tokens_per_block)
        self.kv_headroom.set(ledger.headroom_blocks * ledger.tokens_per_block)
        self.kv_block.set(stats.kv_block_size_tokens)
        self.kv_cached.set(stats.kv_blocks_cached)
        tier = stats.host_tier
        self.host_capacity.set(tier.capacity_blocks if tier is not None else 0)
        self.host_used.set(tier.used_blocks if tier is not None else 0)
        self.host_reload.set(tier.reload_seconds_per_block if tier is not None else 0.0)
        for rank in stats.per_rank:
            tags = {"rank": str(rank.rank), "dcp_rank": str(rank.dcp_rank)}
            self.rank_capacity.set(rank.tokens_capacity, tags=tags)
            self.rank_used.set(rank.tokens_used, tags=tags)
            self.rank_usage.set(rank.tokens_used / rank.tokens_capacity if rank.tokens_capacity else 0.0, tags=tags)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting + stats.num_pending)
        self.healthy.set(1 if stats.healthy else 0)
        for count in self._engine_counts:
            count.advance(stats)


class AdmissionMetrics:
    """The admission queue's metrics: outcomes, queue length, wait time, prefix routing, tenants' limits (each
    configured limit's series exported at 0 from the start: `limits` maps a tenant to its max_concurrent_requests
    and tokens_per_minute, None where unset)."""

    def __init__(self, limits: dict[str, tuple[int | None, int | None]] | None = None) -> None:
        self.requests = _counter("dcpserve_admission_requests", "admission decisions by outcome, tenant and "
                                 "priority", ("outcome", TENANT_TAG, PRIORITY_TAG))
        self.queued = _gauge("dcpserve_admission_queued_requests", "requests waiting in the admission queue")
        self.queued_by_level = _gauge("dcpserve_admission_queued_requests_by_level",
                                      "requests waiting in the admission queue by tenant and priority",
                                      (TENANT_TAG, PRIORITY_TAG))
        self._levels_seen: set[tuple[str, int]] = set()
        self.limited = _counter("dcpserve_tenant_limited_requests",
                                "requests a tenant's limit refused, by tenant and limit (max_concurrent_requests, "
                                "tokens_per_minute)", (TENANT_TAG, "limit"))
        for tenant, (concurrent, per_minute) in (limits or {}).items():
            for limit, value in (("max_concurrent_requests", concurrent), ("tokens_per_minute", per_minute)):
                if value is not None:
                    _start_at_zero(self.limited, {TENANT_TAG: tenant, "limit": limit})
        self.queued_blocks = _gauge("dcpserve_admission_queued_kv_blocks", "KV blocks the waiting requests need")
        self.wait = _histogram("dcpserve_admission_queue_wait_seconds",
                               "time a queued request waited (until granted or refused), by tenant and priority",
                               QUEUE_WAIT_BUCKETS_S, (TENANT_TAG, PRIORITY_TAG))
        self.refusals = _counter("dcpserve_admission_replica_refusals",
                                 "grants that came back: the replica refused (no_kv) or was unreachable",
                                 ("reason",))
        self.prefix_query_blocks = _counter("dcpserve_admission_prefix_query_blocks",
                                            "prompt blocks of granted requests that a replica could have cached")
        self.prefix_hit_blocks = _counter("dcpserve_admission_prefix_hit_blocks",
                                          "of those, blocks the granted replica reported cached")
        self.prefix_routed = _counter("dcpserve_admission_prefix_routed_requests",
                                      "granted requests with prompt blocks, by whether the granted replica reported "
                                      "any of them cached", ("prefix_hit",))
        self.pool_grants = _counter("dcpserve_admission_pool_grants",
                                    "grants by layout pool and why that pool (only_pool, only_room, cheapest, "
                                    "most_free: dcpserve/deployments/admission/pools.py)", ("pool", "reason"))
        self.decisions = _counter("dcpserve_admission_decisions",
                                  "admission decisions by reason: every grant (session, prefix, start_soonest, "
                                  "most_free, only_choice, backlog_rerouted, over_bound) and every request the TTFT "
                                  "bound held back (backlog_deferred)", ("reason",))
        self.sessions = _gauge("dcpserve_admission_sessions",
                               "sessions (prompt_cache_key / X-Session-Id) whose last replica the queue remembers")
        for reason in DECISION_REASONS:
            _start_at_zero(self.decisions, {"reason": reason})
        for outcome in ADMISSION_OUTCOMES:
            _start_at_zero(self.requests, {"outcome": outcome, TENANT_TAG: ANONYMOUS, PRIORITY_TAG: "0"})
        _start_at_zero(self.prefix_query_blocks)
        _start_at_zero(self.prefix_hit_blocks)
        for hit in ("true", "false"):
            _start_at_zero(self.prefix_routed, {"prefix_hit": hit})
        for reason in GRANT_RETURN_REASONS.values():
            _start_at_zero(self.refusals, {"reason": reason})

    def on_event(self, outcome: str, waited_s: float | None, level: ServiceLevel | None = None) -> None:
        """AdmissionQueue's observer: one call per outcome; waited_s for requests that were queued, level the
        request's tenant and priority."""
        if outcome in GRANT_RETURN_REASONS:
            self.refusals.inc(tags={"reason": GRANT_RETURN_REASONS[outcome]})
            return
        tags = level_tags(level or ServiceLevel())
        self.requests.inc(tags={"outcome": outcome, **tags})
        if waited_s is not None:
            self.wait.observe(waited_s, tags=tags)

    def on_limit(self, level: ServiceLevel, limit: str) -> None:
        """A tenant's limit refused a request."""
        self.limited.inc(tags={TENANT_TAG: level.tenant, "limit": limit})

    def on_pool(self, pool: str, reason: str) -> None:
        """AdmissionQueue's observer of pool choices: one call per grant."""
        self.pool_grants.inc(tags={"pool": pool, "reason": reason})

    def on_decision(self, reason: str) -> None:
        """AdmissionQueue's observer of its decisions: every grant's reason, and every request the TTFT bound held
        back (messages.DECISION_REASONS)."""
        self.decisions.inc(tags={"reason": reason})

    def on_routed(self, prompt_blocks: int, hit_blocks: int) -> None:
        """AdmissionQueue's observer of prefix routing: one call per grant of a request, with the blocks of its prompt
        that could have been cached (full blocks before its last token) and how many of those the granted replica
        reported cached. A request with no such block is not counted (the queue does not report it either): none
        of its prompt can come from a cache, so it says nothing about routing."""
        if prompt_blocks <= 0:
            return
        self.prefix_query_blocks.inc(prompt_blocks)
        if hit_blocks > 0:
            self.prefix_hit_blocks.inc(hit_blocks)
        self.prefix_routed.inc(tags={"prefix_hit": "true" if hit_blocks > 0 else "false"})

    def update(self, num_queued: int, queued_blocks: int, by_level: dict[tuple[str, int], int] | None = None) -> None:
        self.queued.set(num_queued)
        self.queued_blocks.set(queued_blocks)
        by_level = by_level or {}
        self._levels_seen |= set(by_level)
        for tenant, priority in self._levels_seen:  # a level with none waiting now reads 0, not its last count
            self.queued_by_level.set(by_level.get((tenant, priority), 0),
                                     tags={TENANT_TAG: tenant, PRIORITY_TAG: str(priority)})


class IngressMetrics:
    """What clients see: responses by status, prompt / generation tokens, TTFT, inter-token and e2e latency (the
    latencies by the layout pool that served the request and by its service level: record them with
    tags={"pool": ..., **level_tags(level)}))."""

    def __init__(self) -> None:
        self.responses = _counter("dcpserve_http_responses", "API responses by endpoint and HTTP status",
                                  ("endpoint", "status_code"))
        self.prompt_tokens = _counter("dcpserve_prompt_tokens", "prompt tokens of requests a replica accepted")
        self.generation_tokens = _counter("dcpserve_generation_tokens", "tokens generated and sent to clients")
        self.ttft = _histogram("dcpserve_time_to_first_token_seconds",
                               "arrival to first generated token (admission wait included)", LATENCY_BUCKETS_S,
                               (POOL_TAG, TENANT_TAG, PRIORITY_TAG))
        self.itl = _histogram("dcpserve_inter_token_latency_seconds", "time between consecutive generated tokens",
                              LATENCY_BUCKETS_S, (POOL_TAG, TENANT_TAG, PRIORITY_TAG))
        self.e2e = _histogram("dcpserve_request_latency_seconds", "arrival to last token of a finished request",
                              LATENCY_BUCKETS_S, (POOL_TAG, TENANT_TAG, PRIORITY_TAG))
        _start_at_zero(self.prompt_tokens)
        _start_at_zero(self.generation_tokens)

    def response(self, endpoint: str, status_code: int) -> None:
        self.responses.inc(tags={"endpoint": endpoint, "status_code": str(status_code)})


# The labels naming the deployment an autoscaling policy decides for: Serve's controller has no replica context to add
# them, so AutoscalingMetrics tags them itself (the names Serve's own ray_serve_autoscaling_* metrics carry).
APPLICATION_TAG, DEPLOYMENT_TAG = "application", "deployment"


class AutoscalingMetrics:
    """The service-level autoscaling policy's inputs and decisions (SloAutoscalingPolicy,
    dcpserve/deployments/autoscaling.py), one record per policy call, tagged with the application and deployment it
    decides for."""

    def __init__(self) -> None:
        deployment = (APPLICATION_TAG, DEPLOYMENT_TAG)
        self.inputs = util_metrics.Gauge(
            "dcpserve_autoscaling_slo_input",
            description="the service-level policy's inputs by `input` (units in the name: ttft_s, itl_s, demand, "
                        "kv_usage, kv_load_blocks, kv_capacity_blocks, kv_remaining_blocks)",
            tag_keys=(*deployment, "input"))
        self.replicas = util_metrics.Gauge(
            "dcpserve_autoscaling_slo_replicas",
            description="the service-level policy's replica counts by `replicas`: current, target (Serve's), "
                        "sequences (the sequence rule's), wanted (the rules'), desired (returned)",
            tag_keys=(*deployment, "replicas"))
        self.decisions = util_metrics.Counter(
            "dcpserve_autoscaling_slo_decisions",
            description="the service-level policy's decisions by reason, one per call (rate: the share of time)",
            tag_keys=(*deployment, "reason"))

    def record(self, application: str, deployment: str, inputs: Mapping[str, float | None],
               replicas: Mapping[str, int], reason: str) -> None:
        """One decision: its inputs by name (a None input, such as a latency without samples, is not set: never
        exported as 0), its replica counts by name and its reason."""
        tags = {APPLICATION_TAG: application, DEPLOYMENT_TAG: deployment}
        for name, value in inputs.items():
            if value is not None:
                self.inputs.set(float(value), tags={**tags, "input": name})
        for name, count in replicas.items():
            self.replicas.set(float(count), tags={**tags, "replicas": name})
        self.decisions.inc(tags={**tags, "reason": reason})


# The names Prometheus shows (Ray's `ray_` prefix; `_total` on counters; histograms add _bucket/_sum/_count).
METRIC_NAMES: dict[str, str] = {
    **{f"ray_{n}": "gauge" for n in (
        "dcpserve_kv_capacity_tokens", "dcpserve_kv_used_tokens", "dcpserve_kv_reserved_tokens",
        "dcpserve_kv_usage_ratio", "dcpserve_kv_held_tokens", "dcpserve_kv_headroom_tokens",
        "dcpserve_kv_block_size_tokens",
        "dcpserve_kv_rank_capacity_tokens", "dcpserve_kv_rank_used_tokens", "dcpserve_kv_rank_usage_ratio",
        "dcpserve_layout_info", "dcpserve_replica_node_info", "dcpserve_sequences_running",
        "dcpserve_sequences_waiting",
        "dcpserve_autoscaling_target_sequences_per_replica", "dcpserve_engine_healthy",
        "dcpserve_admission_queued_requests", "dcpserve_admission_queued_kv_blocks", "dcpserve_kv_cached_blocks",
        "dcpserve_admission_queued_requests_by_level", "dcpserve_autoscaling_slo_input",
        "dcpserve_autoscaling_slo_replicas", "dcpserve_admission_sessions",
        "dcpserve_kv_host_tier_capacity_blocks", "dcpserve_kv_host_tier_used_blocks",
        "dcpserve_kv_host_tier_reload_seconds_per_block",
    )},
    **{f"ray_{n}_total": "counter" for n in (
        "dcpserve_preemptions", "dcpserve_recomputed_tokens", "dcpserve_requests_accepted",
        "dcpserve_admission_requests", "dcpserve_admission_replica_refusals",
        "dcpserve_http_responses", "dcpserve_prompt_tokens", "dcpserve_generation_tokens",
        "dcpserve_prefix_cache_query_tokens", "dcpserve_prefix_cache_hit_tokens", "dcpserve_prefix_cache_evictions",
        "dcpserve_admission_prefix_query_blocks", "dcpserve_admission_prefix_hit_blocks",
        "dcpserve_admission_prefix_routed_requests", "dcpserve_admission_pool_grants", "dcpserve_stream_items",
        "dcpserve_stream_tokens", "dcpserve_tenant_limited_requests", "dcpserve_autoscaling_slo_decisions",
        "dcpserve_admission_decisions",
        "dcpserve_prefix_cache_tier_hit_tokens", "dcpserve_kv_host_tier_copied_blocks",
        "dcpserve_kv_host_tier_copied_bytes", "dcpserve_kv_host_tier_copy_seconds", "dcpserve_kv_host_tier_evictions",
    )},
    **{f"ray_{n}": "histogram" for n in (
        "dcpserve_engine_step_seconds", "dcpserve_engine_dcp_exchange_seconds",
        "dcpserve_admission_queue_wait_seconds", "dcpserve_time_to_first_token_seconds",
        "dcpserve_inter_token_latency_seconds", "dcpserve_request_latency_seconds",
    )},
}
