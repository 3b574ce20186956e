"""deployments/metrics.py's recorders without a Ray cluster: what each update and event records.

Ray's metric objects work outside a replica (no Serve labels then); every value they would export goes through
Metric._record, which the `recorded` fixture captures instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from ray.util import metrics as ray_metrics

from deployments.metrics import ReplicaMetrics
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
