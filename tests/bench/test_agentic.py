"""bench/agentic.py's pure parts: the seeded trace (sessions, growing contexts, keys, think times), the device KV it
sizes, the report's maths (TTFT percentiles of first / later turns and by turn, the targets' ratios, nothing lost)
and the Prometheus series it reads the prefix hits from. No Ray, no served app."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench.agentic_client import difference, host_metric_names, tier_copies, tier_split, totals
from bench.agentic_report import (
    ConfigResult,
    PrefixCounts,
    TurnRecord,
    check_accounted,
    ratio,
    table,
    target_ratios,
    ttft_by_turn,
    verdict,
)
from bench.agentic_trace import FIRST_TOKEN_ID, TIER_MARGIN, Workload, device_kv_tokens, kv_ratio, make_trace

WORKLOAD = Workload(sessions=5, turns=6, system_tokens=40, task_tokens=30, chunk_tokens=(8, 20), reply_tokens=(3, 9),
                    think_mean_s=0.5, arrival_mean_s=0.2, kv_ratio=6.0, seed=7)
VOCAB = 512


def test_the_trace_is_seeded_token_for_token() -> None:
    assert make_trace(WORKLOAD, VOCAB) == make_trace(WORKLOAD, VOCAB)
    other = make_trace(dataclasses.replace(WORKLOAD, seed=8), VOCAB)
    assert other.system != make_trace(WORKLOAD, VOCAB).system
    assert other.sessions[0].turns[0].chunk != make_trace(WORKLOAD, VOCAB).sessions[0].turns[0].chunk


def test_sessions_have_distinct_keys_and_the_workloads_shape() -> None:
    trace = make_trace(WORKLOAD, VOCAB)
    assert len(trace.sessions) == 5 and trace.num_requests == 30
    assert len({s.key for s in trace.sessions}) == 5
    assert all(s.key.startswith("agent-7-") for s in trace.sessions)
    assert len(trace.system) == 40
    for session in trace.sessions:
        assert len(session.turns) == 6
        assert len(session.turns[0].chunk) == 30  # the task
        assert all(8 <= len(t.chunk) <= 20 for t in session.turns[1:])
        assert all(3 <= t.max_tokens <= 9 for t in session.turns)
        assert all(FIRST_TOKEN_ID <= token < VOCAB for t in session.turns for token in t.chunk)
    seeds = [t.seed for s in trace.sessions for t in s.turns]
    assert len(set(seeds)) == len(seeds)


def test_think_times_and_starts_are_seeded_exponentials() -> None:
    many = dataclasses.replace(WORKLOAD, sessions=40, turns=30)
    trace = make_trace(many, VOCAB)
    assert all(s.turns[0].think_s == 0.0 for s in trace.sessions)
    later = [t.think_s for s in trace.sessions for t in s.turns[1:]]
    assert all(x > 0 for x in later)
    assert statistics.mean(later) == pytest.approx(0.5, rel=0.1)  # 1160 draws of mean 0.5
    starts = [s.start_s for s in trace.sessions]
    assert starts[0] == 0.0 and starts == sorted(starts) and len(set(starts)) == len(starts)
    still = make_trace(dataclasses.replace(WORKLOAD, think_mean_s=0.0, arrival_mean_s=0.0), VOCAB)
    assert {t.think_s for s in still.sessions for t in s.turns} == {0.0}
    assert {s.start_s for s in still.sessions} == {0.0}


def test_each_turns_context_grows_by_its_chunk_and_the_previous_reply() -> None:
    """As the run builds prompts: system + every earlier chunk and reply + this turn's chunk."""
    trace = make_trace(WORKLOAD, VOCAB)
    for session in trace.sessions:
        history = list(trace.system)
        lengths = []
        for turn in session.turns:
            prompt = history + list(turn.chunk)
            lengths.append(len(prompt))
            history = prompt + [FIRST_TOKEN_ID] * turn.max_tokens  # a reply that runs to max_tokens
        assert all(b > a for a, b in zip(lengths, lengths[1:], strict=False))
        assert len(history) == session.max_context_tokens(len(trace.system))
    own = sum(s.max_context_tokens(40) - 40 for s in trace.sessions)
    assert trace.planned_kv_tokens == own + 40  # the shared system prompt once
    assert trace.longest_request_tokens == max(s.max_context_tokens(40) for s in trace.sessions)


def test_device_kv_is_the_planned_kv_over_the_ratio_in_whole_blocks() -> None:
    trace = make_trace(dataclasses.replace(WORKLOAD, sessions=30, kv_ratio=5.0), VOCAB)
    device = device_kv_tokens(trace, 16)
    assert device % 16 == 0
    assert trace.planned_kv_tokens / 5.0 <= device < trace.planned_kv_tokens / 5.0 + 16
    assert kv_ratio(trace.planned_kv_tokens, device) == pytest.approx(5.0, rel=0.05)
    # a ratio that would leave less than the largest request: the largest request and two blocks
    tight = make_trace(dataclasses.replace(WORKLOAD, sessions=2, kv_ratio=8.0), VOCAB)
    assert device_kv_tokens(tight, 16) >= tight.longest_request_tokens + 32
    with pytest.raises(ValueError, match="no device KV"):
        kv_ratio(100, 0)


@pytest.mark.parametrize(("change", "message"), [
    ({"sessions": 0}, "must be >= 1"),
    ({"chunk_tokens": (9, 3)}, "chunk_tokens must be a range"),
    ({"reply_tokens": (0, 3)}, "reply_tokens must be a range"),
    ({"think_mean_s": -1.0}, "must be >= 0"),
    ({"kv_ratio": 0.5}, "kv_ratio must be in"),
])
def test_a_bad_workload_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(WORKLOAD, **change)


def answered(session: int, turn: int, ttft: float, tokens: int = 4, sent: float = 1.0) -> TurnRecord:
    return TurnRecord(session, turn, prompt_tokens=100, sent=sent, first_token=sent + ttft, finished=sent + ttft + 1,
                      completion_tokens=tokens)


def result(label: str, ttfts: dict[tuple[int, int], float], makespan: float = 10.0,
           prefix: PrefixCounts | None = None) -> ConfigResult:
    r = ConfigResult(label, "", capacity_tokens=1000, makespan_s=makespan, prefix=prefix, kv_tokens_seen=6000)
    r.records = [answered(s, t, v) for (s, t), v in ttfts.items()]
    return r


def test_ttft_percentiles_split_first_and_later_turns_and_by_turn() -> None:
    ttfts = {(0, 0): 0.1, (1, 0): 0.3, (0, 1): 1.0, (1, 1): 2.0, (0, 2): 3.0, (1, 2): 5.0}
    r = result("a", ttfts)
    r.records.append(TurnRecord(2, 1, sent=0.0, error="HTTP 500: boom"))  # failed: no TTFT
    assert r.ttft(False, 50) == pytest.approx(0.2)
    assert r.ttft(False, 90) == pytest.approx(0.1 + 0.9 * 0.2)
    assert r.ttft(True, 50) == pytest.approx(2.5)  # of 1, 2, 3, 5
    assert r.ttft(True, 90) == pytest.approx(3.0 + 0.7 * 2.0)  # rank 2.7 between 3 and 5
    assert ttft_by_turn(r.records) == {0: [pytest.approx(0.1), pytest.approx(0.3)], 1: [1.0, 2.0], 2: [3.0, 5.0]}
    assert (r.answered, r.failed, r.not_sent) == (6, 1, 0)
    assert r.output_tokens == 24 and r.output_tokens_per_s == pytest.approx(2.4)
    assert ConfigResult("empty", "").ttft(True, 50) is None


def test_the_targets_ratios_are_tier_on_over_tier_off() -> None:
    off = result("native, tier off", {(0, 0): 0.2, (0, 1): 2.0, (0, 2): 4.0}, makespan=12.0,
                 prefix=PrefixCounts(1000, 200, 200, 0, "test"))
    on = result("native, tier on", {(0, 0): 0.2, (0, 1): 0.5, (0, 2): 1.5}, makespan=10.0,
                prefix=PrefixCounts(1000, 700, 300, 400, "test"))
    got = {name: (value, bound, op) for name, value, bound, op in target_ratios(off, on)}
    assert got["later turns' TTFT p50"][0] == pytest.approx(1.0 / 3.0)
    assert got["prefix-hit tokens"][0] == pytest.approx(3.5)
    assert got["output tokens/s"][0] == pytest.approx(1.2)
    assert verdict(*got["later turns' TTFT p50"]).endswith("(met: target <= 0.5x)")
    assert verdict(0.7, 0.5, "<=").startswith("0.70x (missed")
    assert verdict(None, 2.0, ">=") == "not measured"
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    on.prefix = None
    assert dict((n, v) for n, v, _, _ in target_ratios(off, on))["prefix-hit tokens"] is None


def test_nothing_lost_every_turn_is_answered_failed_or_unsent_once() -> None:
    r = result("a", {(0, 0): 0.1, (0, 1): 0.2})
    r.records.append(TurnRecord(0, 2, not_sent="turn 1 of the session failed"))
    check_accounted(r, 3)
    with pytest.raises(SystemExit, match="4 planned"):
        check_accounted(r, 4)
    r.records[2] = TurnRecord(0, 2)  # neither answered, failed nor reported unsent
    with pytest.raises(SystemExit, match="session 0 turn 2 is neither"):
        check_accounted(r, 3)
    r.records[2] = TurnRecord(0, 2, sent=1.0, finished=2.0, error="HTTP 400: bad")  # failed, yet looks finished
    check_accounted(r, 3)
    assert not r.records[2].answered


def test_a_configuration_that_did_not_run_says_why_in_the_table() -> None:
    ran = result("native, tier off", {(0, 0): 0.1}, prefix=PrefixCounts(10, 4, 4, 0, "test"))
    missing = ConfigResult("native, tier on", "", unavailable="EngineArgs has no kv_host_tier yet")
    header, rows = table([ran, missing], " (no tier counters)")
    assert header == ["metric", "native, tier off", "native, tier on"]
    by_metric = {row[0]: row[1:] for row in rows}
    assert by_metric["prefix-hit tokens"] == ["4", "n/a"]
    assert by_metric["  of which from host (no tier counters)"] == ["0", "n/a"]
    assert by_metric["sessions' KV / device KV"] == ["6.0", "n/a"]
    assert by_metric["native, tier on: not run"] == ["EngineArgs has no kv_host_tier yet", ""]


def test_prefix_hits_by_tier_and_copies_from_the_apps_series() -> None:
    before = {("dcpserve_prefix_cache_hit_tokens", '{replica="a"}'): 5.0}
    after = {("dcpserve_prefix_cache_hit_tokens", '{replica="a"}'): 9.0,
             ("dcpserve_prefix_cache_hit_tokens", '{replica="b"}'): 3.0,
             ("dcpserve_prefix_cache_query_tokens", '{replica="b"}'): 20.0}
    delta = difference(after, before)
    assert totals(delta, "dcpserve_prefix_cache_hit_tokens") == 7
    assert totals(delta, "dcpserve_prefix_cache_query_tokens") == 20
    assert tier_split(delta) is None and tier_copies(delta) is None and host_metric_names(after) == []
    tiered = {("dcpserve_prefix_cache_tier_hit_tokens", '{replica="a",tier="device"}'): 30.0,
              ("dcpserve_prefix_cache_tier_hit_tokens", '{replica="a",tier="host"}'): 12.0,
              ("dcpserve_prefix_cache_tier_hit_tokens", '{replica="b",tier="host"}'): 1.0,
              ("dcpserve_kv_host_tier_copied_blocks", '{direction="to_host",replica="a"}'): 9.0,
              ("dcpserve_kv_host_tier_copied_blocks", '{direction="to_device",replica="a"}'): 4.0,
              ("dcpserve_kv_host_tier_copy_seconds", '{direction="to_device",replica="a"}'): 0.25,
              ("dcpserve_kv_host_tier_evictions", '{eviction="dropped",replica="a"}'): 2.0}
    assert tier_split(tiered) == (30, 13)
    copies = tier_copies(tiered)
    assert copies is not None
    assert (copies.blocks_to_host, copies.blocks_to_device, copies.seconds_to_host, copies.dropped) == (9, 4, 0.0, 2)
    assert copies.seconds_to_device == 0.25
    assert host_metric_names(tiered) == ["dcpserve_kv_host_tier_copied_blocks", "dcpserve_kv_host_tier_copy_seconds",
                                         "dcpserve_kv_host_tier_evictions", "dcpserve_prefix_cache_tier_hit_tokens"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dcpserve.cluster.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("agentic") / "model")


@pytest.mark.parametrize(("backend", "layout"), [("native", "tp1"), ("native", "tp2-dcp2"), ("vllm", "tp1")])
def test_the_replicas_kv_is_sized_from_the_trace(backend: str, layout: str, tiny_model: Path) -> None:
    """Per-rank bytes that hold the device KV the trace asks for (DCP: each rank a 1/dcp share; vLLM: one null
    page more), and a tier per rank that holds the sessions' planned KV with its margin."""
    import torch

    from bench.agentic import LAYOUTS, sizing
    from dcpserve.engine.config import ModelConfig

    model = ModelConfig.from_pretrained(tiny_model)
    trace = make_trace(dataclasses.replace(WORKLOAD, sessions=12), model.vocab_size)
    size = sizing(trace, model, backend, layout)
    tp, dcp = LAYOUTS[layout]
    per_token = model.kv_bytes_per_token_per_rank(tp, torch.float32)
    assert (size.tp, size.dcp) == (tp, dcp)
    pages = size.budget_bytes // (per_token * size.block_size)
    assert size.budget_bytes == pages * size.block_size * per_token
    assert pages * size.block_size * dcp == size.device_tokens + (size.block_size * dcp if backend == "vllm" else 0)
    assert size.device_tokens == device_kv_tokens(trace, size.block_size * dcp)
    assert size.tier_bytes * dcp >= trace.planned_kv_tokens * TIER_MARGIN * per_token
    assert trace.longest_request_tokens <= size.max_model_len <= model.max_position_embeddings
