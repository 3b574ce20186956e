"""The host KV tier's metrics (issue 51, item 6): what ReplicaMetrics exports from EngineStats.host_tier, from a
sequence of hand-made stats and from a real native engine whose tier offloads and reloads; the replica's KV report
carrying the measured reload cost; the vLLM backend's HostTierStats from its KV events and connector hits; and the
tier's alerts evaluated by promtool on synthetic series (they fire on a thrashing tier, not on a healthy or an off
one).

Values are captured as tests/deployments/test_metrics.py does: every value Ray would export goes through
Metric._record (the `recorded` fixture).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import types
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from dcpserve.deployments.messages import KvReport, KvReportReply
from dcpserve.deployments.metrics import ReplicaMetrics
from dcpserve.engine.backends.vllm.prefix import HOST_MEDIUM, VllmPrefixCache
from dcpserve.engine.backends.vllm.stats import StatsRecorder, VllmHostTier, offloaded_block_bytes
from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.protocol import EngineStats, HostTierStats
from tests.deployments.test_metrics import LEDGER, POOL, STATS, Recorded, _Replica, recorded

__all__ = ["recorded"]  # the fixture, shared with test_metrics.py

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "dashboards" / "prometheus" / "alerts.yml"

# Each labelled counter of the tier, its label, and the HostTierStats field behind each label value.
TIER_COUNTERS = {
    "dcpserve_prefix_cache_tier_hit_tokens": ("tier", {"device": "hit_tokens_device", "host": "hit_tokens_host"}),
    "dcpserve_kv_host_tier_copied_blocks": ("direction", {"to_host": "blocks_out", "to_device": "blocks_in"}),
    "dcpserve_kv_host_tier_copied_bytes": ("direction", {"to_host": "bytes_out", "to_device": "bytes_in"}),
    "dcpserve_kv_host_tier_copy_seconds": ("direction", {"to_host": "seconds_out", "to_device": "seconds_in"}),
    "dcpserve_kv_host_tier_evictions": ("eviction", {"to_host": "evictions_to_host", "dropped": "host_drops"}),
}
TIER_GAUGES = {"dcpserve_kv_host_tier_capacity_blocks": "capacity_blocks",
               "dcpserve_kv_host_tier_used_blocks": "used_blocks",
               "dcpserve_kv_host_tier_reload_seconds_per_block": "reload_seconds_per_block"}


def replica_metrics() -> ReplicaMetrics:
    return ReplicaMetrics(pool=POOL, tp=2, dcp=2, num_kv_heads=1, target_sequences_per_replica=4, admission="usage")


def tier(**counts: Any) -> HostTierStats:
    """HostTierStats with these fields, the others 0."""
    zero = HostTierStats(*[0] * len(fields(HostTierStats)))
    return replace(zero, **counts)


def exported(recorded: Recorded, stats: HostTierStats | None = None) -> dict[tuple[str, str], float]:
    """(metric, label value) -> what each tier counter exported in all; with `stats`, its fields in the same keys."""
    out = {}
    for name, (label, by_value) in TIER_COUNTERS.items():
        for value, field in by_value.items():
            out[(name, value)] = (getattr(stats, field) if stats is not None
                                  else recorded.counter(name, **{label: value, "pool": POOL}))
    return out


def test_tier_series_exist_at_zero_and_stay_there_while_the_tier_is_off(recorded: Recorded) -> None:
    metrics = replica_metrics()
    for name, (label, by_value) in TIER_COUNTERS.items():  # every label value's series, before any event
        assert recorded.values[name] == [(0.0, {label: value, "pool": POOL}) for value in by_value], name
    for _ in range(3):
        metrics.update(replace(STATS, prefix_caching=True, prefix_cache_hits=64, prefix_cache_queries=128), LEDGER)
    for name in TIER_COUNTERS:
        assert recorded.increments(name) == [0.0] * len(TIER_COUNTERS[name][1]), name  # nothing but the zeros
    for name in TIER_GAUGES:
        assert [v for v, _ in recorded.values[name]] == [0, 0, 0], name


def test_tier_counters_advance_by_each_counts_growth_and_gauges_follow_the_engine(recorded: Recorded) -> None:
    metrics = replica_metrics()
    sequence = [
        tier(capacity_blocks=64),
        tier(capacity_blocks=64, used_blocks=6, blocks_out=6, bytes_out=6144, seconds_out=0.012,
             evictions_to_host=6, hit_tokens_device=96),
        tier(capacity_blocks=64, used_blocks=6, blocks_out=6, bytes_out=6144, seconds_out=0.012,
             evictions_to_host=6, hit_tokens_device=96, hit_tokens_host=64, blocks_in=4, bytes_in=4096,
             seconds_in=0.004, reload_seconds_per_block=0.001),
        tier(capacity_blocks=64, used_blocks=64, blocks_out=90, bytes_out=92160, seconds_out=0.2,
             evictions_to_host=90, host_drops=26, hit_tokens_device=96, hit_tokens_host=64, blocks_in=4,
             bytes_in=4096, seconds_in=0.004, reload_seconds_per_block=0.001),
    ]
    for stats in sequence:
        metrics.update(replace(STATS, host_tier=stats), LEDGER)
    last = sequence[-1]
    assert exported(recorded) == pytest.approx(exported(recorded, last))
    # Each increment is the growth since the last update; nothing recorded for a count that stood still.
    assert recorded.increments("dcpserve_kv_host_tier_evictions") == [0.0, 0.0, 6.0, 84.0, 26.0]
    assert recorded.increments("dcpserve_prefix_cache_tier_hit_tokens") == [0.0, 0.0, 96.0, 64.0]
    assert recorded.increments("dcpserve_kv_host_tier_copy_seconds") == pytest.approx([0, 0, 0.012, 0.004, 0.188])
    for name, field in TIER_GAUGES.items():
        assert [v for v, _ in recorded.values[name]] == [getattr(s, field) for s in sequence], name
        assert recorded.gauge(name, pool=POOL) == getattr(last, field)


def test_an_engine_restart_counts_the_new_engines_tier_from_zero_and_never_goes_back(recorded: Recorded) -> None:
    metrics = replica_metrics()
    before = tier(blocks_out=40, host_drops=10, seconds_out=0.5, hit_tokens_host=128)
    after = tier(blocks_out=3, host_drops=0, seconds_out=0.01, hit_tokens_host=0)  # a new engine: below the last
    later = tier(blocks_out=8, host_drops=2, seconds_out=0.03, hit_tokens_host=32)
    for stats in (before, after, later):
        metrics.update(replace(STATS, host_tier=stats), LEDGER)
    assert recorded.counter("dcpserve_kv_host_tier_copied_blocks", direction="to_host", pool=POOL) == 40 + 3 + 5
    assert recorded.counter("dcpserve_kv_host_tier_evictions", eviction="dropped", pool=POOL) == 10 + 2
    assert recorded.counter("dcpserve_kv_host_tier_copy_seconds", direction="to_host",
                            pool=POOL) == pytest.approx(0.5 + 0.01 + 0.02)
    assert recorded.counter("dcpserve_prefix_cache_tier_hit_tokens", tier="host", pool=POOL) == 128 + 32
    assert all(value >= 0 for name in TIER_COUNTERS for value in recorded.increments(name))
    # A tier that is turned off (an engine restarted without it) reads 0 counts: a reset, not a decrease.
    metrics.update(STATS, LEDGER)
    assert recorded.counter("dcpserve_kv_host_tier_copied_blocks", direction="to_host", pool=POOL) == 48
    assert recorded.gauge("dcpserve_kv_host_tier_capacity_blocks", pool=POOL) == 0


# ---- a real native engine ---------------------------------------------------------------------------------------

BLOCK_SIZE = 4
POOL_BLOCKS = 8
HOST_SLOTS = 64


def _native_engine(model: Path) -> LLMEngine:
    from dcpserve.engine.args import EngineArgs
    from dcpserve.engine.core.host_tier import tier_layout, with_host_tier

    config = EngineArgs(model=str(model), block_size=BLOCK_SIZE, max_num_seqs=2, device="cpu",
                        enable_prefix_caching=True, kv_host_tier="1MiB").create_engine_config()
    page = tier_layout(config).bytes_per_block
    cache = replace(config.cache, kv_cache_memory_bytes=POOL_BLOCKS * page, host_tier_bytes=HOST_SLOTS * page)
    return LLMEngine(with_host_tier(replace(config, cache=cache)))


def test_a_native_engine_with_a_host_tier_exports_what_its_stats_count(recorded: Recorded,
                                                                       tmp_path: Path) -> None:
    """A device pool of 8 blocks: prompt A, then B (whose blocks evict A's into the tier), then A's head again with
    a new tail: the tier copies A's blocks out and back. ReplicaMetrics fed the engine's stats after each request
    exports exactly the engine's HostTierStats."""
    import torch

    from dcpserve.cluster.tiny_model import write_tiny_model
    from dcpserve.engine.sampling_params import SamplingParams

    engine = _native_engine(write_tiny_model(tmp_path, seed=0))
    metrics = replica_metrics()
    gen = torch.Generator().manual_seed(7)
    a, b = (torch.randint(5, 500, (5 * BLOCK_SIZE + 1,), generator=gen).tolist() for _ in range(2))
    try:
        for name, prompt in (("A", a), ("B", b), ("A2", a[:5 * BLOCK_SIZE] + [7, 8, 9])):
            engine.add_request(prompt_token_ids=prompt, request_id=name,
                               sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
            metrics.update(engine.stats(), LEDGER)
        stats: EngineStats = engine.stats()
    finally:
        engine.shutdown()
    host = stats.host_tier
    assert host is not None and host.capacity_blocks == HOST_SLOTS
    assert host.blocks_out > 0 and host.blocks_in > 0 and host.hit_tokens_host > 0  # it offloaded and reloaded
    assert exported(recorded) == pytest.approx(exported(recorded, host))
    assert recorded.gauge("dcpserve_kv_host_tier_used_blocks", pool=POOL) == host.used_blocks
    assert recorded.gauge("dcpserve_kv_host_tier_reload_seconds_per_block",
                          pool=POOL) == pytest.approx(host.seconds_in / host.blocks_in)
    # The two tiers' hits add up to the prefix cache's.
    assert host.hit_tokens_device + host.hit_tokens_host == stats.prefix_cache_hits == recorded.counter(
        "dcpserve_prefix_cache_hit_tokens", pool=POOL)


# ---- the replica's KV report ------------------------------------------------------------------------------------


class _TierEngine:
    """The EngineClient an EngineReplica starts, as far as its constructor and KV reports use it."""

    dead_error = None

    def __init__(self, host_tier: HostTierStats | None) -> None:
        self.host_tier = host_tier

    def stats(self) -> EngineStats:
        return replace(STATS, host_tier=self.host_tier)

    def kv_ledger(self) -> object:
        return LEDGER

    async def prefix_report(self, epoch: str | None, version: int) -> None:
        return None


@pytest.mark.parametrize("host_tier", [tier(reload_seconds_per_block=0.0025, blocks_in=4, seconds_in=0.01), None])
def test_the_replica_reports_its_measured_reload_seconds_per_block(recorded: Recorded, monkeypatch: pytest.MonkeyPatch,
                                                                   host_tier: HostTierStats | None) -> None:
    """EngineReplica's KV report to the admission queue carries the engine's measured reload cost (0 without a tier:
    the queue then assumes its own)."""
    from ray import serve

    import dcpserve.engine.backends as backends
    from dcpserve.deployments.config import parse_args
    from dcpserve.deployments.replica import engine_replica as replica_module

    monkeypatch.setattr(backends, "start_engine", lambda args, on_step: _TierEngine(host_tier))
    monkeypatch.setattr(replica_module, "_node_tags", lambda: {"node_id": "n1", "node_type": "head"})
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id="r1")))
    reports: list[KvReport] = []

    async def report(kv: KvReport) -> KvReportReply:
        reports.append(kv)
        return KvReportReply(num_queued=0, queued_blocks=0, prefix_epoch=None, prefix_version=0)

    admission = types.SimpleNamespace(report=types.SimpleNamespace(remote=report))

    async def run() -> None:
        replica = object.__new__(_Replica)
        await _Replica.__init__(replica, parse_args({"model": "/m", "device": "cpu"}), admission)
        try:
            for _ in range(100):
                if reports:
                    break
                await asyncio.sleep(0.01)
        finally:
            for task in (replica._report_task, replica._metrics_task):
                if task is not None:
                    task.cancel()

    asyncio.run(run())
    assert reports and reports[0].replica_id == "r1"
    assert reports[0].reload_s_per_block == (host_tier.reload_seconds_per_block if host_tier else 0.0)


# ---- the vLLM backend -------------------------------------------------------------------------------------------

TPB = 4


def _stored(cache: VllmPrefixCache, tokens: list[int], medium: str | None) -> None:
    """BlockStored of len(tokens) // TPB blocks named by vLLM hashes 'h0', 'h1', ... (a chain from the start)."""
    cache.stored([f"h{i}" for i in range(len(tokens) // TPB)], None, tokens, TPB, medium)


def test_vllm_host_tier_stats_come_from_its_events_and_connector_hits() -> None:
    """Copies vLLM's offloading stores and removes (KV events of medium CPU) give occupancy, blocks to host and
    drops; its connector's prefix hits the host tier's hits and blocks back; bytes are blocks x the block's bytes.
    Events lost (the cache forgets its copies) never make the stored count go back."""
    cache = VllmPrefixCache(TPB, b"seed")
    recorder = StatsRecorder()
    host = VllmHostTier(offload_bytes=1 << 20, block_bytes=4096, tokens_per_block=TPB)
    assert host.capacity_blocks == 256
    tokens = list(range(3 * TPB))
    _stored(cache, tokens, None)  # computed on the device
    _stored(cache, tokens, HOST_MEDIUM)  # and offloaded: 3 copies in the host tier
    cache.removed(["h2"], HOST_MEDIUM)  # the tier dropped one
    scheduler = types.SimpleNamespace(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0,
                                      prefix_cache_stats=types.SimpleNamespace(queries=24, hits=8),
                                      connector_prefix_cache_stats=types.SimpleNamespace(queries=16, hits=8))
    recorder.record(scheduler, None)
    stats = host.stats(cache, recorder)
    assert (stats.used_blocks, stats.blocks_out, stats.evictions_to_host, stats.host_drops) == (2, 3, 3, 1)
    assert (stats.hit_tokens_device, stats.hit_tokens_host, stats.blocks_in) == (8, 8, 2)
    assert (stats.bytes_out, stats.bytes_in) == (3 * 4096, 2 * 4096)
    assert stats.seconds_out == stats.seconds_in == stats.reload_seconds_per_block == 0.0  # vLLM does not tell
    cache.lost(1)  # its copies forgotten, uncounted
    assert host.stats(cache, recorder).blocks_out == 3
    assert VllmHostTier(1 << 20, 0, TPB).capacity_blocks == 0  # block size unknown: no capacity claimed


def test_offloaded_block_bytes_reads_vllms_model_and_cache_config() -> None:
    def config(use_mla: bool, cache_dtype: str) -> object:
        import torch

        model = types.SimpleNamespace(use_mla=use_mla, dtype=torch.bfloat16, get_num_layers=lambda parallel: 4,
                                      get_num_kv_heads=lambda parallel: 1 if use_mla else 2,
                                      get_head_size=lambda: 576 if use_mla else 64)
        return types.SimpleNamespace(model_config=model, parallel_config=types.SimpleNamespace(tensor_parallel_size=2),
                                     cache_config=types.SimpleNamespace(block_size=16, cache_dtype=cache_dtype))

    assert offloaded_block_bytes(config(False, "auto")) == 2 * 4 * 2 * 64 * 2 * 16 * 2  # K and V, bf16, 2 ranks
    assert offloaded_block_bytes(config(False, "fp8_e4m3")) == 2 * 4 * 2 * 64 * 1 * 16 * 2
    assert offloaded_block_bytes(config(True, "auto")) == 1 * 4 * 1 * 576 * 2 * 16 * 2  # MLA: one latent
    assert offloaded_block_bytes(types.SimpleNamespace(model_config=None, parallel_config=None,
                                                       cache_config=None)) == 0


# ---- the alerts, evaluated --------------------------------------------------------------------------------------


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    tags = ", ".join(f'{k}="{v}"' for k, v in {"application": "app", "pool": "default", **labels}.items())
    return {"series": f"{name}{{{tags}}}", "values": values}


def _alert_names(rules: Path) -> set[str]:
    return {rule["alert"] for group in yaml.safe_load(rules.read_text())["groups"] for rule in group["rules"]}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt-get install prometheus)")
def test_the_tier_alerts_fire_on_a_thrashing_tier_and_on_slow_copies_only(tmp_path: Path) -> None:
    """promtool's rule unit tests over alerts.yml, per minute for 40 minutes: replica `thrash` stores 2 blocks/s and
    drops 1.9 of them with 0.1/s reloaded; `useful` stores as much but reloads half and drops a third; `off` has the
    tier off (all 0); `slow` spends 30% of its step time copying, `busy` 10%."""
    evictions, copied = "ray_dcpserve_kv_host_tier_evictions_total", "ray_dcpserve_kv_host_tier_copied_blocks_total"
    seconds, steps = "ray_dcpserve_kv_host_tier_copy_seconds_total", "ray_dcpserve_engine_step_seconds"
    series = []
    for replica, (stored, dropped, reloaded) in {"thrash": (120, 114, 6), "useful": (120, 40, 60),
                                                 "off": (0, 0, 0)}.items():
        series += [_series(evictions, f"0+{stored}x40", eviction="to_host", replica=replica),
                   _series(evictions, f"0+{dropped}x40", eviction="dropped", replica=replica),
                   _series(copied, f"0+{reloaded}x40", direction="to_device", replica=replica),
                   _series(copied, f"0+{stored}x40", direction="to_host", replica=replica)]
    for replica, copying in {"slow": 18, "busy": 6, "off": 0}.items():  # seconds copied per minute of 60 s of steps
        series += [_series(seconds, f"0+{copying / 2}x40", direction=direction, replica=replica)
                   for direction in ("to_host", "to_device")]
        series += [_series(f"{steps}_sum", "0+60x40", replica=replica),
                   _series(f"{steps}_count", "0+600x40", replica=replica)]
    firing = {"alertname": "DcpserveHostKvTierThrashing", "replica": "thrash"}, {
        "alertname": "DcpserveHostKvTierCopiesSlowSteps", "replica": "slow"}
    assert {f["alertname"] for f in firing} <= _alert_names(ALERTS)
    rules = yaml.safe_load(ALERTS.read_text())
    # Only the tier's rules: the others' annotations are not this test's business.
    rules["groups"][0]["rules"] = [r for r in rules["groups"][0]["rules"] if r["alert"].startswith("DcpserveHostKv")]
    annotations = {r["alert"]: r["annotations"] for r in rules["groups"][0]["rules"]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [
            *({"eval_time": "10m", "alertname": name, "exp_alerts": []} for name in annotations),  # not yet: `for`
            *({"eval_time": "40m", "alertname": fire["alertname"], "exp_alerts": [{
                "exp_labels": {"severity": "warning", "application": "app", "replica": fire["replica"]},
                "exp_annotations": {key: _rendered(text, fire["replica"]) for key, text in
                                    annotations[fire["alertname"]].items()},
            }]} for fire in firing),
        ],
    }]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([shutil.which("promtool") or "promtool", "test", "rules", "tests.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _rendered(template: str, replica: str) -> str:
    """An annotation as Prometheus renders it for these series: the replica's label and the alert's value (1.9
    blocks/s dropped; 30% of the step time copying)."""
    value = {"thrash": "1.9", "slow": "30%"}[replica]
    return (template.replace("{{ $labels.replica }}", replica).replace("{{ $value | humanize }}", value)
            .replace("{{ $value | humanizePercentage }}", value))
