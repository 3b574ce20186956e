"""dcpserve/deployments/metrics.py's recorders without a Ray cluster: what each update and event records.

Ray's metric objects work outside a replica (no Serve labels then); every value they would export goes through
Metric._record, which the `recorded` fixture captures instead, with the tags Ray would export it with (the metric's
default tags merged with the call's, every tag key checked as Ray checks it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from ray.util import metrics as ray_metrics

from dcpserve.deployments.messages import KvReport, ServiceLevel
from dcpserve.deployments.metrics import AdmissionMetrics, ReplicaMetrics
from dcpserve.deployments.replica.engine_replica import EngineReplica
from dcpserve.engine.protocol import EngineStats, KvLedger, RankKvStats


class Recorded:
    """Every value the recorders handed Ray, by metric name, in order."""

    def __init__(self) -> None:
        self.values: dict[str, list[tuple[float, dict[str, str]]]] = defaultdict(list)

    def counter(self, name: str, **tags: str) -> float:
        """A counter's exported value: the sum of what was recorded for these tags."""
        return sum(value for value, got in self.values[name] if got == tags)

    def increments(self, name: str) -> list[float]:
        return [value for value, _ in self.values[name]]

    def gauge(self, name: str, **tags: str) -> float:
        """A gauge's exported value: the last one set for these tags."""
        return [value for value, got in self.values[name] if got == tags][-1]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    record = Recorded()

    def capture(self: ray_metrics.Metric, value: float, tags: dict[str, str] | None = None) -> None:
        final = self._get_final_tags(tags)  # what Metric._record exports: default tags, then the call's
        self._validate_tags(final)  # Ray refuses a value missing one of the metric's tag keys
        record.values[self._name].append((value, dict(final)))

    monkeypatch.setattr(ray_metrics.Metric, "_record", capture)
    return record


STATS = EngineStats(backend="native", tp=2, dcp=2, num_kv_heads=1, admission="full", kv_blocks_total=32,
                    kv_block_size_tokens=32, kv_blocks_used=0, kv_blocks_reserved=0, num_running=0, num_waiting=0)
LEDGER = KvLedger(admission="full", capacity_blocks=32, tokens_per_block=32, used_blocks=0, committed_blocks=0,
                  headroom_blocks=0, per_request={})


POOL = "long"  # the layout pool of the replica under test


def replica_metrics() -> ReplicaMetrics:
    return ReplicaMetrics(pool=POOL, tp=2, dcp=2, num_kv_heads=1, target_sequences_per_replica=4, admission="full")


def test_engine_counts_become_counters_that_start_at_zero_and_advance_by_the_difference(recorded: Recorded) -> None:
    metrics = replica_metrics()
    assert recorded.increments("dcpserve_preemptions") == [0.0]  # the series exists before the first preemption
    for preemptions, recomputed in ((0, 0), (2, 40), (2, 40), (5, 100)):
        metrics.update(replace(STATS, num_preemptions=preemptions, num_recomputed_tokens=recomputed), LEDGER)
    assert recorded.increments("dcpserve_preemptions") == [0.0, 2.0, 3.0]  # nothing recorded while it stood still
    assert recorded.counter("dcpserve_preemptions", pool=POOL) == 5
    assert recorded.counter("dcpserve_recomputed_tokens", pool=POOL) == 100


def test_an_engine_restart_counts_what_the_new_engine_did_and_never_goes_back(recorded: Recorded) -> None:
    metrics = replica_metrics()
    metrics.update(replace(STATS, num_preemptions=5), LEDGER)
    metrics.update(replace(STATS, num_preemptions=2), LEDGER)  # the engine started over and preempted twice
    metrics.update(replace(STATS, num_preemptions=4), LEDGER)
    metrics.update(replace(STATS, num_preemptions=0), LEDGER)  # again, nothing yet
    metrics.update(replace(STATS, num_preemptions=1), LEDGER)
    assert recorded.increments("dcpserve_preemptions") == [0.0, 5.0, 2.0, 2.0, 1.0]
    assert recorded.counter("dcpserve_preemptions", pool=POOL) == 10


def test_prefix_cache_counters_and_cached_blocks(recorded: Recorded) -> None:
    metrics = replica_metrics()
    for name in ("dcpserve_prefix_cache_query_tokens", "dcpserve_prefix_cache_hit_tokens",
                 "dcpserve_prefix_cache_evictions"):
        assert recorded.increments(name) == [0.0], name  # exported before the first request
    updates = [  # (queries, hits, evictions, cached blocks) as the engine counts them
        (0, 0, 0, 0),
        (380, 0, 0, 12),  # a new prompt: looked up, nothing cached yet
        (760, 352, 0, 12),  # the same prompt again: its 11 full blocks before the last token come from the cache
        (760, 352, 3, 9),  # quiet: 3 blocks evicted for other KV
        (200, 64, 0, 2),  # the engine started over: its counts since the restart are new
        (300, 64, 1, 2),
    ]
    for queries, hits, evictions, cached in updates:
        metrics.update(replace(STATS, prefix_caching=True, prefix_cache_queries=queries, prefix_cache_hits=hits,
                               prefix_cache_evictions=evictions, kv_blocks_cached=cached), LEDGER)
    assert recorded.increments("dcpserve_prefix_cache_query_tokens") == [0.0, 380.0, 380.0, 200.0, 100.0]
    assert recorded.counter("dcpserve_prefix_cache_query_tokens", pool=POOL) == 1060
    assert recorded.increments("dcpserve_prefix_cache_hit_tokens") == [0.0, 352.0, 64.0]
    assert recorded.counter("dcpserve_prefix_cache_hit_tokens", pool=POOL) == 416
    assert recorded.increments("dcpserve_prefix_cache_evictions") == [0.0, 3.0, 1.0]
    assert recorded.gauge("dcpserve_kv_cached_blocks", pool=POOL) == 2
    assert [v for v, _ in recorded.values["dcpserve_kv_cached_blocks"]] == [0, 12, 12, 9, 2, 2]  # every update


def test_prefix_routing_counts_blocks_and_requests_by_hit(recorded: Recorded) -> None:
    metrics = AdmissionMetrics()
    routed = "dcpserve_admission_prefix_routed_requests"
    for name in ("dcpserve_admission_prefix_query_blocks", "dcpserve_admission_prefix_hit_blocks"):
        assert recorded.increments(name) == [0.0], name
    assert recorded.values[routed] == [(0.0, {"prefix_hit": "true"}), (0.0, {"prefix_hit": "false"})]
    metrics.on_routed(11, 0)  # a new prompt: the replica caches none of it
    metrics.on_routed(11, 11)  # the same prompt again
    metrics.on_routed(12, 4)  # a prompt sharing 4 blocks with a cached one
    metrics.on_routed(0, 0)  # nothing of it could be cached: not counted
    assert recorded.counter("dcpserve_admission_prefix_query_blocks") == 34
    assert recorded.counter("dcpserve_admission_prefix_hit_blocks") == 15
    assert recorded.counter(routed, prefix_hit="true") == 2
    assert recorded.counter(routed, prefix_hit="false") == 1
    assert {tuple(tags.items()) for _, tags in recorded.values[routed]} == {(("prefix_hit", "true"),),
                                                                             (("prefix_hit", "false"),)}


def test_the_admission_queue_reports_each_grant_to_on_routed(recorded: Recorded) -> None:
    """The queue's side of the contract: on_routed(prompt blocks, hit blocks) once per grant of a request that named
    its prompt blocks; the counters then equal the queue's own counts."""
    import asyncio

    from dcpserve.deployments.admission.queue import AdmissionQueue
    from dcpserve.deployments.messages import PrefixAsk
    from dcpserve.engine.core.prefix_cache import CACHED, PrefixReporter, prompt_hashes

    metrics = AdmissionMetrics()
    calls: list[tuple[int, int]] = []

    def on_routed(prompt_blocks: int, hit_blocks: int) -> None:
        calls.append((prompt_blocks, hit_blocks))
        metrics.on_routed(prompt_blocks, hit_blocks)

    seed, cached, new = b"seed", list(range(100)), list(range(200, 300))  # 3 full blocks before the last token
    queue = AdmissionQueue(max_queued=4, on_routed=on_routed)
    reporter = PrefixReporter(32, seed)
    for block in prompt_hashes(cached, 32, seed):
        reporter.set(block, CACHED)
    queue.report(KvReport(replica_id="a", capacity=32, tokens_per_block=32, held={},
                          prefix=reporter.report(*queue.prefix_position("a"))))

    def ask(tokens: list[int]) -> PrefixAsk:
        return PrefixAsk(tuple(prompt_hashes(tokens, 32, seed)), 32, seed, len(tokens))

    async def run() -> None:
        await queue.acquire("t1", 4, 1.0, ask=ask(cached + [1]))
        await queue.acquire("t2", 4, 1.0, ask=ask(new))
        await queue.acquire("t3", 1, 1.0, ask=ask([1, 2, 3]))  # no full block: nothing to report
        await queue.acquire("t4", 1, 1.0)  # named no blocks (prefix caching off)

    asyncio.run(run())
    assert calls == [(3, 3), (3, 0)]
    stats = queue.stats()
    assert stats.prefix_query_blocks == recorded.counter("dcpserve_admission_prefix_query_blocks") == 6
    assert stats.prefix_hit_blocks == recorded.counter("dcpserve_admission_prefix_hit_blocks") == 3
    routed = "dcpserve_admission_prefix_routed_requests"
    assert recorded.counter(routed, prefix_hit="true") == recorded.counter(routed, prefix_hit="false") == 1


def test_metric_names_are_the_ones_docs_metrics_md_documents(recorded: Recorded) -> None:
    """METRIC_NAMES (what Prometheus shows) = the tables of docs/metrics.md = what the recorders create. The
    dashboard test proves the same against what Ray really exports, with a cluster; this one needs none."""
    import re
    from pathlib import Path

    from dcpserve.deployments.metrics import METRIC_NAMES, AutoscalingMetrics, IngressMetrics

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = dict(re.findall(r"^\| `(ray_[a-z0-9_]+)` \| (gauge|counter|histogram) \|", doc, re.M))
    assert METRIC_NAMES == documented
    created: dict[str, str] = {}
    for recorder in (replica_metrics(), AdmissionMetrics(), IngressMetrics(), AutoscalingMetrics()):
        for metric in vars(recorder).values():
            if isinstance(metric, ray_metrics.Counter):
                created[f"ray_{metric._name}_total"] = "counter"
            elif isinstance(metric, ray_metrics.Histogram):
                created[f"ray_{metric._name}"] = "histogram"
            elif isinstance(metric, ray_metrics.Gauge):
                created[f"ray_{metric._name}"] = "gauge"
    assert created == METRIC_NAMES


def test_the_labels_docs_metrics_md_lists_are_the_tags_each_metric_records() -> None:
    """The labels column of docs/metrics.md = each metric's own tag keys (Serve's and Ray's labels are the
    module's prose): a replica's metrics list `pool`, the admission queue's none but pool grants'."""
    import re
    from pathlib import Path

    from dcpserve.deployments.metrics import AutoscalingMetrics, IngressMetrics

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = {name: set(re.findall(r"`(\w+)`", labels)) for name, labels in re.findall(
        r"^\| `(ray_[a-z0-9_]+)` \| (?:gauge|counter|histogram) \|([^|]*)\|", doc, re.M)}
    tagged: dict[str, set[str]] = {}
    for recorder in (replica_metrics(), AdmissionMetrics(), IngressMetrics(), AutoscalingMetrics()):
        for metric in vars(recorder).values():
            if isinstance(metric, ray_metrics.Metric):
                suffix = "_total" if isinstance(metric, ray_metrics.Counter) else ""
                tagged[f"ray_{metric._name}{suffix}"] = set(metric._tag_keys)
    assert documented == tagged
    assert all("pool" in tags for name, tags in tagged.items() if name in {
        "ray_dcpserve_kv_usage_ratio", "ray_dcpserve_sequences_running", "ray_dcpserve_inter_token_latency_seconds"})


def _replica_metric_names(metrics: ReplicaMetrics) -> set[str]:
    return {metric._name for metric in vars(metrics).values() if isinstance(metric, ray_metrics.Metric)}


def test_every_series_of_a_replica_carries_its_pool_and_keeps_its_own_tags(recorded: Recorded) -> None:
    """Everything a replica records (its gauges, the engine's counts, the step histograms, and the counters the
    replica itself increments) is tagged with its layout pool, so PromQL can sum by (pool); the metrics' own tags
    stay as they were."""
    metrics = replica_metrics()
    ranks = tuple(RankKvStats(rank=r, dcp_rank=r % 2, pages_total=32, pages_used=4, tokens_capacity=512,
                              tokens_used=100) for r in range(2))
    stats = replace(STATS, per_rank=ranks, num_preemptions=1, num_recomputed_tokens=8, prefix_cache_queries=64,
                    prefix_cache_hits=32, prefix_cache_evictions=1, last_step_seconds=0.02)
    metrics.update(stats, LEDGER)
    metrics.on_step(stats)
    # What EngineReplica records itself (generate(), deltas()): its own tags only; the pool comes with the metric.
    metrics.accepted.inc(tags={"admission": "full"})
    metrics.stream_items.inc()
    metrics.stream_tokens.inc(3)
    assert set(recorded.values) == _replica_metric_names(metrics)  # every metric recorded at least once
    untagged = {name: tags for name, values in recorded.values.items() for _, tags in values
                if tags.get("pool") != POOL}
    assert not untagged, untagged
    assert recorded.gauge("dcpserve_kv_rank_capacity_tokens", rank="1", dcp_rank="1", pool=POOL) == 512
    assert recorded.gauge("dcpserve_layout_info", tp="2", dcp="2", kv_heads="1", kv_head_copies="1",
                          duplication_removed="2", pool=POOL) == 1
    assert recorded.gauge("dcpserve_replica_node_info", node_id="", node_type="", pool=POOL) == 1
    assert recorded.gauge("dcpserve_sequences_running", pool=POOL) == 0
    assert recorded.counter("dcpserve_requests_accepted", admission="full", pool=POOL) == 1
    assert recorded.counter("dcpserve_stream_tokens", pool=POOL) == 3
    assert recorded.values["dcpserve_engine_step_seconds"] == [(0.02, {"pool": POOL})]


def test_admission_series_carry_no_replica_pool(recorded: Recorded) -> None:
    """The admission queue's metrics are the whole app's: no pool of a replica (pool grants name theirs)."""
    metrics = AdmissionMetrics()
    metrics.on_event("admitted", 0.5, ServiceLevel("team-a", priority=-1))
    metrics.on_pool("long", "cheapest")
    metrics.update(1, 4, {("team-a", -1): 1})
    metrics.update(0, 0, {})
    assert recorded.counter("dcpserve_admission_requests", outcome="admitted", tenant="team-a", priority="-1") == 1
    assert recorded.values["dcpserve_admission_queue_wait_seconds"] == [(0.5, {"tenant": "team-a", "priority": "-1"})]
    # A level that had waiters reads 0 once none wait, not its last count.
    assert recorded.values["dcpserve_admission_queued_requests_by_level"][-2:] == [
        (1, {"tenant": "team-a", "priority": "-1"}), (0, {"tenant": "team-a", "priority": "-1"})]
    assert recorded.values["dcpserve_admission_pool_grants"] == [(1.0, {"pool": "long", "reason": "cheapest"})]


class _StubEngine:
    """The EngineClient an EngineReplica starts, as far as its constructor and metrics loop use it."""

    def stats(self) -> EngineStats:
        return STATS

    def kv_ledger(self) -> KvLedger:
        return LEDGER


class _Replica(EngineReplica):
    """EngineReplica outside Serve: nothing for the garbage collector to call Serve's async __del__ on."""

    def __del__(self) -> None:  # type: ignore[override]  # Serve awaits the real one; nothing to tear down here
        pass


@pytest.mark.parametrize(("app_pools", "pool", "tag"), [
    (None, None, "default"),  # an app without pools: its one pool is "default"
    ([{"name": "short", "tensor_parallel_size": 2},
      {"name": "long", "tensor_parallel_size": 2, "decode_context_parallel_size": 2}], "long", "long"),
])
def test_the_engine_replica_tags_its_metrics_with_its_pool(recorded: Recorded, monkeypatch: pytest.MonkeyPatch,
                                                          app_pools: list[dict] | None, pool: str | None,
                                                          tag: str) -> None:
    """EngineReplica's constructor (with a stand-in engine, outside Serve) makes metrics tagged with the pool it was
    deployed for, and its metrics loop records the engine's gauges with that tag."""
    import asyncio
    import types

    from ray import serve

    import dcpserve.engine.backends as backends
    from dcpserve.deployments.config import parse_args
    from dcpserve.deployments.replica import engine_replica as replica_module

    started: list[object] = []

    def start_engine(args: object, on_step: object) -> _StubEngine:
        started.append(args)
        return _StubEngine()

    monkeypatch.setattr(backends, "start_engine", start_engine)
    monkeypatch.setattr(replica_module, "_node_tags", lambda: {"node_id": "n1", "node_type": "head"})
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id="r1")))
    args = parse_args({"model": "/m", "device": "cpu", **({"pools": app_pools} if app_pools else {})})

    async def run() -> None:
        replica = object.__new__(_Replica)
        await (_Replica.__init__(replica, args, None, pool) if pool else _Replica.__init__(replica, args, None))
        task = replica._metrics_task
        assert task is not None
        try:
            await asyncio.sleep(0)  # the metrics loop's first update
            assert not task.done()
        finally:
            task.cancel()

    asyncio.run(run())
    assert len(started) == 1
    assert recorded.gauge("dcpserve_kv_capacity_tokens", pool=tag) == STATS.kv_capacity_tokens
    assert recorded.gauge("dcpserve_replica_node_info", node_id="n1", node_type="head", pool=tag) == 1
    assert {tags.get("pool") for values in recorded.values.values() for _, tags in values} == {tag}


def test_the_ingress_tags_latencies_with_the_pool_of_the_replica_that_served_the_request(
        recorded: Recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sessions.open records TTFT, ITL and end-to-end latency with the pool the admission queue's grant named
    (the replica's pool), the request's other counters untagged."""
    import asyncio
    import types
    from typing import cast

    from dcpserve.deployments.config import AppArgs
    from dcpserve.deployments.dispatch.admit import AdmitSettings, Taken
    from dcpserve.deployments.dispatch.sessions import AdmissionHandle, Sessions
    from dcpserve.deployments.dispatch.streams import DeltaLinks
    from dcpserve.deployments.messages import Accepted, Acquire, Granted, PoolNeed
    from dcpserve.deployments.metrics import IngressMetrics
    from dcpserve.engine.protocol import RequestDelta
    from dcpserve.engine.sampling_params import SamplingParams

    levels: list[ServiceLevel] = []
    released: list[tuple[str, float | None, float | None]] = []

    async def acquire(request: Acquire) -> Granted:
        levels.append(request.level)
        return Granted("r1", 3, pool="long")

    async def release(ticket: str, ttft_s: float | None, itl_s: float | None) -> None:
        released.append((ticket, ttft_s, itl_s))

    sessions = object.__new__(Sessions)
    sessions.args = cast(AppArgs, types.SimpleNamespace(queue_timeout_s=5.0, request_timeout_for=lambda tenant: 5.0,
                                                        dispatch_timeout_s=5.0))
    sessions.admission = types.SimpleNamespace(acquire=types.SimpleNamespace(remote=acquire),
                                               release=types.SimpleNamespace(remote=release))
    sessions.queue = AdmissionHandle(sessions.admission)
    sessions.admit_settings = AdmitSettings(queue_timeout_s=5.0, retry_after_s=1)
    sessions.metrics = IngressMetrics()
    sessions.prefix_caching = False
    sessions.tokens_per_block = 16
    sessions.pool_layouts = {"short": 16, "long": 32}
    sessions._replica_pools = {}
    sessions._background = set()
    sessions.links = cast(DeltaLinks, types.SimpleNamespace(subscriber="ingress-1", is_open=lambda replica: True,
                                                            unregister=lambda replica, ticket: None))

    async def run() -> list[RequestDelta]:
        deltas: asyncio.Queue[RequestDelta] = asyncio.Queue()
        for i, finished in enumerate((False, False, True)):
            deltas.put_nowait(RequestDelta("t1", [7 + i], "x", finished, "length" if finished else None, 4, i + 1))

        async def dispatch(request: object, replica_id: str) -> Taken[asyncio.Queue[RequestDelta]]:
            return Taken(Accepted(replica_id), deltas)

        monkeypatch.setattr(sessions, "_dispatch", dispatch)  # the replica, accepting at once
        need = {"short": PoolNeed(1), "long": PoolNeed(1)}
        got = [delta async for delta in sessions.open("t1", [1, 2, 3, 4], SamplingParams(max_tokens=3), need,
                                                      ServiceLevel("team-a", priority=2))]
        await asyncio.sleep(0)  # the grant's release, in the background
        return got

    assert len(asyncio.run(run())) == 4  # admitted, then three tokens
    level = {"pool": "long", "tenant": "team-a", "priority": "2"}
    assert [tags for _, tags in recorded.values["dcpserve_time_to_first_token_seconds"]] == [level]
    assert [tags for _, tags in recorded.values["dcpserve_inter_token_latency_seconds"]] == [level] * 2
    assert levels == [ServiceLevel("team-a", priority=2)]
    # The release hands the queue the request's TTFT and mean ITL (the service-level autoscaling window).
    ((ticket, ttft, itl),) = released
    ttft_seen = recorded.values["dcpserve_time_to_first_token_seconds"][0][0]
    itls_seen = [v for v, _ in recorded.values["dcpserve_inter_token_latency_seconds"]]
    assert ticket == "t1" and ttft == pytest.approx(ttft_seen) and itl == pytest.approx(sum(itls_seen) / 2)
    assert [tags for _, tags in recorded.values["dcpserve_request_latency_seconds"]] == [level]
    assert recorded.counter("dcpserve_generation_tokens") == 3
