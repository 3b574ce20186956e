"""The simulated replica's host KV tier (dcpserve/simulator/host_tier.py): its LRU, the engine's block manager with
the tier under it (device evictions go to the host and are reported HOSTED, host drops EVICTED, a prefix that
continues on the host is copied back and not computed), the copy time of a step, the --host-kv-per-node option, and
whole simulations where the tier raises prefix hits."""

from __future__ import annotations

import pytest

from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.prefix_cache import CACHED, EVICTED, HOSTED, PINNED, PrefixIndex
from dcpserve.engine.core.request import Request
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.simulator.gpus import B200, H100
from dcpserve.simulator.host_tier import (
    HOST_LINK_EFFICIENCY,
    HostKvOption,
    HostKvTier,
    HostTierShape,
    TieredBlockManager,
    host_tier_shape,
    parse_host_kv,
)
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.step_fit import LinearStepModel
from dcpserve.simulator.trace import TraceRequest, expected_hash_ids

BLOCK = 4  # tokens per page; dcp 1: a logical block is 4 tokens
FAST = HostTierShape(num_blocks=4, bytes_per_block_per_rank=1000, load_bytes_per_s=1e6, offload_bytes_per_s=2e6)


def test_the_host_pool_is_an_lru_that_never_drops_a_block_being_copied() -> None:
    tier = HostKvTier(3)
    assert tier.put(1) == (True, []) and tier.put(2) == (True, []) and tier.put(3) == (True, [])
    assert tier.put(1) == (False, [])  # already there: no copy, most recently used now
    assert tier.put(4) == (True, [2])  # 2 is the least recently used
    tier.hold(3)
    tier.hold(1)
    assert tier.put(5) == (True, [4])  # 3 and 1 are held: only 4 and 5 could go, the older first
    assert 3 in tier and 1 in tier and 5 in tier and len(tier) == 3
    assert tier.release(3) == [] and tier.release(1) == [] and len(tier) == 3
    assert tier.put(6) == (True, [5])  # 3 and 1 came back as the most recently used: 5 is the oldest


def request(name: str, tokens: list[int]) -> Request:
    return Request(name, tokens, SamplingParams(max_tokens=1, detokenize=False))


def compute(manager: TieredBlockManager, req: Request) -> None:
    """What a scheduler does for a whole prompt in one step: admit, allocate, compute it, name its blocks."""
    assert manager.admit(req, req.num_tokens)
    assert manager.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    manager.cache_computed(req)


def test_device_evictions_go_to_the_host_and_a_prefix_there_is_copied_back_not_computed() -> None:
    manager = TieredBlockManager(num_blocks=5, block_size=BLOCK, dcp_size=1, tier=FAST)
    index = PrefixIndex()
    first = list(range(100, 117))  # 17 tokens: 4 full blocks before the last token
    a = request("a", first)
    compute(manager, a)
    hashes = list(a.block_hashes[:4])
    manager.free(a)
    index.apply(manager.prefix_reporter.report(None, 0))
    assert all(index.blocks[h] == CACHED for h in hashes)
    assert manager.take_copies() == (0, 0)

    # Another prompt takes every page: a's four cached blocks leave the device for the host.
    b = request("b", list(range(500, 520)))
    compute(manager, b)
    index.apply(manager.prefix_reporter.report(index.epoch, index.version))
    assert [index.blocks[h] for h in hashes] == [HOSTED] * 4
    assert manager.take_copies() == (0, 4)  # four offloads, no load
    manager.free(b)

    # a's prompt again, with a new last block: its cached run is all on the host; it comes back, not computed.
    again = request("again", first + [7, 7, 7])
    assert manager.admit(again, again.num_tokens)
    assert again.num_computed_tokens == 16 and again.num_cached_blocks == 4
    assert manager.num_host_hit_tokens == 16 and manager.num_hit_tokens == 0
    # Room for them on the device: four of b's blocks leave it, but the host's 4 blocks are a's, being copied back:
    # b's are dropped without a copy, reported EVICTED.
    assert manager.take_copies() == (4, 0)
    index.apply(manager.prefix_reporter.report(index.epoch, index.version))
    assert [index.blocks[h] for h in hashes] == [PINNED] * 4
    match = index.match(hashes, BLOCK, b"")
    assert match.hit_blocks == 4 and match.host_blocks == 0
    b_hashes = b.block_hashes[:5]
    assert sum(h in index.blocks for h in b_hashes) == 1  # the one b block the device still holds
    assert manager.num_host_evictions == 0 and all(h in manager.tier for h in hashes)  # a's stay on the host too


def test_a_block_the_host_drops_is_reported_evicted_and_the_host_keeps_the_start_of_a_prefix() -> None:
    manager = TieredBlockManager(num_blocks=5, block_size=BLOCK, dcp_size=1,
                                 tier=HostTierShape(2, 1000, 1e6, 1e6))
    index = PrefixIndex()
    a = request("a", list(range(100, 117)))
    compute(manager, a)
    hashes = list(a.block_hashes[:4])
    manager.free(a)  # the end of a's run is first in line for eviction
    b = request("b", list(range(500, 520)))
    compute(manager, b)
    index.apply(manager.prefix_reporter.report(None, 0))
    assert [index.blocks.get(h) for h in hashes] == [HOSTED, HOSTED, None, None]
    assert manager.num_host_evictions == 2 and manager.take_copies() == (0, 4)
    manager.free(b)
    c = request("c", list(range(100, 109)) + [9, 9, 9])  # a's first two blocks, then its own
    assert manager.admit(c, c.num_tokens)
    assert c.num_computed_tokens == 8 and manager.num_host_hit_tokens == 8  # a's first two blocks, from the host
    assert manager.take_copies()[0] == 2


def test_without_room_on_the_host_a_device_eviction_is_reported_evicted() -> None:
    manager = TieredBlockManager(num_blocks=5, block_size=BLOCK, dcp_size=1,
                                 tier=HostTierShape(0, 1000, 1e6, 1e6))
    a = request("a", list(range(17)))
    compute(manager, a)
    manager.free(a)
    compute(manager, request("b", list(range(50, 70))))
    changes = manager.prefix_reporter.report(None, 0).changes
    assert EVICTED not in changes.values() and HOSTED not in changes.values()  # full state: evicted ones absent
    assert all(h not in changes for h in a.block_hashes[:4])
    assert manager.take_copies() == (0, 0)


def test_a_step_lasts_the_longer_of_its_compute_and_its_copies_each_way_at_once() -> None:
    shape = HostTierShape(num_blocks=8, bytes_per_block_per_rank=1_000_000, load_bytes_per_s=1e9,
                          offload_bytes_per_s=0.5e9)
    assert shape.load_seconds(3) == pytest.approx(3e-3)
    assert shape.offload_seconds(3) == pytest.approx(6e-3)
    assert shape.copy_seconds(3, 1) == pytest.approx(3e-3)  # the directions overlap
    assert shape.copy_seconds(1, 3) == pytest.approx(6e-3)


def test_each_dcp_rank_copies_only_its_shard() -> None:
    """A page per rank: the same tokens reload dcp times faster at dcp = 8 than at dcp = 1 (each rank copies
    1/8 of them over its own link), and the option gives each GPU its share of the node's host memory."""
    page = 64 * 35_136  # Kimi K2's fp8 latent: 576 values x 61 layers per token, 64-token pages
    dcp1 = host_tier_shape(parse_host_kv("2TiB"), 1000, page, 8, B200.host_link_bytes_per_s)
    tokens = 64 * 8 * 100
    seconds_dcp1 = dcp1.load_seconds(tokens // 64)  # logical blocks of 64 tokens
    seconds_dcp8 = dcp1.load_seconds(tokens // (64 * 8))  # of 512 tokens: one 64-token page per rank
    assert seconds_dcp1 == pytest.approx(8 * seconds_dcp8)
    assert dcp1.load_bytes_per_s == pytest.approx(64e9 * HOST_LINK_EFFICIENCY)
    assert dcp1.num_blocks == (2 << 40) // 8 // page
    assert host_tier_shape(parse_host_kv("4x"), 1000, page, 8, H100.host_link_bytes_per_s).num_blocks == 4000


@pytest.mark.parametrize("text", ["x", "0x", "-2x", "abcx", "12 parsecs", "0"])
def test_a_bad_host_kv_option_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="host KV"):
        parse_host_kv(text)


def test_host_kv_option_forms() -> None:
    assert parse_host_kv("4x") == HostKvOption(multiple=4.0)
    assert parse_host_kv("1.5TB") == HostKvOption(bytes_per_node=1_500_000_000_000)
    with pytest.raises(ValueError, match="prefix caching"):
        ReplicaShape(tp=1, dcp=1, num_blocks=10, block_size=4, scheduler=SchedulerConfig(max_model_len=64),
                     enable_prefix_caching=False, host_tier=FAST)


# ---- whole simulations ---------------------------------------------------------------------------------------

STEP_MODEL = LinearStepModel(c0=2e-3, c_tok=20e-6, c_seq=0.0, c_ctx=1e-9, c_pair=0.0)


def sessions(count: int, turns: int, first: int = 1200, grow: int = 300, output: int = 40) -> list[TraceRequest]:
    """count sessions of `turns` turns arriving together, each turn its previous prompt + answer + new tokens."""
    trace = []
    next_id = 0
    for session in range(count):
        length, ids = first, list(range(next_id, next_id + expected_hash_ids(first)))
        next_id += len(ids)
        for turn in range(turns):
            if turn:
                kept = length // 512
                length += output + grow
                fresh = expected_hash_ids(length) - kept
                ids = ids[:kept] + list(range(next_id, next_id + fresh))
                next_id += fresh
            trace.append(TraceRequest(None if turn else session * 10.0, length, output, tuple(ids),
                                      session_id=f"s{session}", delay_ms=2000.0 if turn else None))
    return trace


def replica_shape(tier: HostTierShape | None) -> ReplicaShape:
    scheduler = SchedulerConfig(max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=1024)
    return ReplicaShape(tp=1, dcp=2, num_blocks=160, block_size=16, scheduler=scheduler, host_tier=tier)


def simulate(tier: HostTierShape | None) -> tuple[Simulation, dict]:
    simulation = Simulation(SimulationConfig(replica_shape(tier), num_replicas=1, serve=ServeSettings()),
                            STEP_MODEL)
    return simulation, simulation.run(sessions(count=12, turns=4))


def test_the_tier_raises_prefix_hits_and_later_turns_reload_instead_of_recomputing() -> None:
    """12 sessions whose histories are 3x the device KV together: without the tier their prefixes are evicted
    between turns; with a host pool of 4x the device's they come back from the host."""
    _, without = simulate(None)
    tier = HostTierShape(num_blocks=640, bytes_per_block_per_rank=16 * 1000, load_bytes_per_s=50e9,
                         offload_bytes_per_s=50e9)
    simulation, summary = simulate(tier)
    assert without["host_tier"] is None and without["prefix_hit_rate_by_tier"]["host"] == 0
    host = summary["host_tier"]
    assert host["loaded_blocks"] > 0 and host["offloaded_blocks"] > 0
    assert summary["prefix_hit_rate_by_tier"]["host"] > 0
    assert summary["prefix_hit_rate"] == pytest.approx(sum(summary["prefix_hit_rate_by_tier"].values()))
    assert summary["prefix_hit_rate"] > without["prefix_hit_rate"] + 0.2
    replica = next(iter(simulation.replicas.values()), None)
    assert replica is None or replica.block_manager.usage().used == 0
    # Fewer tokens computed: the later turns start sooner.
    assert summary["turns"]["later"]["ttft_s"]["p50"] < without["turns"]["later"]["ttft_s"]["p50"]
    assert summary["turns"]["first"]["requests"] == 12 and summary["turns"]["later"]["requests"] == 36
    assert host["load_seconds"] == pytest.approx(host["loaded_blocks"] * tier.load_seconds(1))


def test_a_slow_host_link_makes_steps_wait_for_their_copies() -> None:
    slow = HostTierShape(num_blocks=640, bytes_per_block_per_rank=16 * 1000, load_bytes_per_s=1e6,
                         offload_bytes_per_s=1e6)
    _, summary = simulate(slow)
    fast = HostTierShape(640, 16 * 1000, 1e12, 1e12)
    _, quick = simulate(fast)
    assert summary["host_tier"]["exposed_copy_seconds"] > 1.0
    assert quick["host_tier"]["exposed_copy_seconds"] == 0.0
    assert summary["duration_s"] > quick["duration_s"]
