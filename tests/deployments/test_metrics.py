"""deployments/metrics.py's recorders without a Ray cluster: what each update and event records.

Ray's metric objects work outside a replica (no Serve labels then); every value they would export goes through
Metric._record, which the `recorded` fixture captures instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from ray.util import metrics as ray_metrics

from deployments.metrics import AdmissionMetrics, ReplicaMetrics
from engine.protocol import EngineStats, KvLedger


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
        record.values[self._name].append((value, dict(tags or {})))

    monkeypatch.setattr(ray_metrics.Metric, "_record", capture)
    return record


STATS = EngineStats(backend="native", tp=2, dcp=2, num_kv_heads=1, admission="full", kv_blocks_total=32,
                    kv_block_size_tokens=32, kv_blocks_used=0, kv_blocks_reserved=0, num_running=0, num_waiting=0)
LEDGER = KvLedger(admission="full", capacity_blocks=32, tokens_per_block=32, used_blocks=0, committed_blocks=0,
                  headroom_blocks=0, per_request={})


def replica_metrics() -> ReplicaMetrics:
    return ReplicaMetrics(tp=2, dcp=2, num_kv_heads=1, target_sequences_per_replica=4, admission="full")


def test_engine_counts_become_counters_that_start_at_zero_and_advance_by_the_difference(recorded: Recorded) -> None:
    metrics = replica_metrics()
    assert recorded.increments("dcpserve_preemptions") == [0.0]  # the series exists before the first preemption
    for preemptions, recomputed in ((0, 0), (2, 40), (2, 40), (5, 100)):
        metrics.update(replace(STATS, num_preemptions=preemptions, num_recomputed_tokens=recomputed), LEDGER)
    assert recorded.increments("dcpserve_preemptions") == [0.0, 2.0, 3.0]  # nothing recorded while it stood still
    assert recorded.counter("dcpserve_preemptions") == 5
    assert recorded.counter("dcpserve_recomputed_tokens") == 100


def test_an_engine_restart_counts_what_the_new_engine_did_and_never_goes_back(recorded: Recorded) -> None:
    metrics = replica_metrics()
    metrics.update(replace(STATS, num_preemptions=5), LEDGER)
    metrics.update(replace(STATS, num_preemptions=2), LEDGER)  # the engine started over and preempted twice
    metrics.update(replace(STATS, num_preemptions=4), LEDGER)
    metrics.update(replace(STATS, num_preemptions=0), LEDGER)  # again, nothing yet
    metrics.update(replace(STATS, num_preemptions=1), LEDGER)
    assert recorded.increments("dcpserve_preemptions") == [0.0, 5.0, 2.0, 2.0, 1.0]
    assert recorded.counter("dcpserve_preemptions") == 10


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
    assert recorded.counter("dcpserve_prefix_cache_query_tokens") == 1060
    assert recorded.increments("dcpserve_prefix_cache_hit_tokens") == [0.0, 352.0, 64.0]
    assert recorded.counter("dcpserve_prefix_cache_hit_tokens") == 416
    assert recorded.increments("dcpserve_prefix_cache_evictions") == [0.0, 3.0, 1.0]
    assert recorded.gauge("dcpserve_kv_cached_blocks") == 2
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

    from deployments.admission import AdmissionQueue
    from deployments.prefix_routing import PrefixAsk
    from engine.core.prefix_cache import CACHED, PrefixReporter, prompt_hashes

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
    queue.report("a", 32, 32, {}, prefix=reporter.report(*queue.prefix_position("a")))

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
    assert stats["prefix_query_blocks"] == recorded.counter("dcpserve_admission_prefix_query_blocks") == 6
    assert stats["prefix_hit_blocks"] == recorded.counter("dcpserve_admission_prefix_hit_blocks") == 3
    routed = "dcpserve_admission_prefix_routed_requests"
    assert recorded.counter(routed, prefix_hit="true") == recorded.counter(routed, prefix_hit="false") == 1


def test_metric_names_are_the_ones_docs_metrics_md_documents(recorded: Recorded) -> None:
    """METRIC_NAMES (what Prometheus shows) = the tables of docs/metrics.md = what the recorders create. The
    dashboard test proves the same against what Ray really exports, with a cluster; this one needs none."""
    import re
    from pathlib import Path

    from deployments.metrics import METRIC_NAMES, IngressMetrics

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = dict(re.findall(r"^\| `(ray_[a-z0-9_]+)` \| (gauge|counter|histogram) \|", doc, re.M))
    assert METRIC_NAMES == documented
    created: dict[str, str] = {}
    for recorder in (replica_metrics(), AdmissionMetrics(), IngressMetrics()):
        for metric in vars(recorder).values():
            if isinstance(metric, ray_metrics.Counter):
                created[f"ray_{metric._name}_total"] = "counter"
            elif isinstance(metric, ray_metrics.Histogram):
                created[f"ray_{metric._name}"] = "histogram"
            elif isinstance(metric, ray_metrics.Gauge):
                created[f"ray_{metric._name}"] = "gauge"
    assert created == METRIC_NAMES
