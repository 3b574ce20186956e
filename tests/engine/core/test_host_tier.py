"""The host KV tier's index (HostTier: slots, LRU, the step's copies), the block manager's swap decisions over it,
its size and refusals at start (kv_host_tier), and why its key needs no layout (one tier per engine instance)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs, parse_host_tier
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.host_tier import HostTier, StepCopies, host_tier_blocks, tier_layout, with_host_tier
from dcpserve.engine.core.prefix_cache import CACHED, EVICTED, HOSTED, PINNED, chain_hashes
from dcpserve.engine.core.request import Request
from dcpserve.engine.sampling_params import SamplingParams

# ---- the index -------------------------------------------------------------------------------------------------


def test_tier_fills_free_slots_then_drops_its_least_recently_used() -> None:
    tier = HostTier(2)
    assert tier.store(10, device_block=5) == (True, None)
    assert tier.store(11, device_block=6) == (True, None)
    assert tier.drain().swap_out == [(5, 0), (6, 1)]
    assert tier.store(10, device_block=7) == (True, None)  # already held: most recently used now, no copy
    assert tier.drain().swap_out == []
    assert tier.store(12, device_block=8) == (True, 11)  # 11 was the least recently used
    assert tier.slot(12) == 1 and tier.slot(11) is None and 11 not in tier
    assert tier.drain().swap_out == [(8, 1)]
    assert (tier.num_stored, tier.num_dropped, len(tier)) == (4, 1, 2)


def test_a_slot_a_swap_in_reads_is_never_overwritten_in_the_step() -> None:
    tier = HostTier(2)
    tier.store(10, device_block=0)
    tier.store(11, device_block=1)
    tier.drain()
    tier.load(10, device_block=3)  # 10 is the LRU entry, but its slot is read this step
    kept, dropped = tier.store(12, device_block=4)
    assert kept and dropped == 11  # the next one goes instead
    tier.load(12, device_block=5)
    assert tier.store(13, device_block=6) == (False, None)  # every slot is read this step: 13 is not kept
    copies = tier.drain()
    assert copies.swap_out == [(4, 1)] and copies.swap_in == [(0, 3), (1, 5)]
    assert tier.store(13, device_block=6) == (True, 10)  # the next step: nothing locked


def test_a_slot_reused_within_a_step_is_copied_once_with_its_last_content() -> None:
    tier = HostTier(1)
    tier.store(10, device_block=0)
    assert tier.store(11, device_block=1) == (True, 10)
    assert tier.drain().swap_out == [(1, 0)]  # one copy to slot 0: never two writes of one slot in a step


# ---- the block manager's decisions ---------------------------------------------------------------------------------


def request(name: str, tokens: list[int]) -> Request:
    return Request(name, list(tokens), SamplingParams(max_tokens=4))


def run_to_end(manager: BlockManager, req: Request) -> StepCopies:
    """Admits the request, computes its whole prompt in one step (naming its full blocks) and frees it; the step's
    copies (taken when the scheduler takes them: once the step is scheduled, before it runs)."""
    assert manager.admit(req, req.num_tokens)
    assert manager.allocate(req, req.num_tokens)
    copies = drain(manager)
    req.num_computed_tokens = req.num_tokens
    manager.cache_computed(req)
    manager.free(req)
    return copies


def drain(manager: BlockManager) -> StepCopies:
    copies = manager.drain_copies()
    assert copies is not None
    return copies


def tiered(num_blocks: int, slots: int) -> BlockManager:
    return BlockManager(num_blocks, block_size=2, dcp_size=1, enable_prefix_caching=True, hash_seed=b"s",
                        verify_hits=True, host_tier=HostTier(slots))


def test_an_evicted_cached_block_is_copied_to_the_host_and_reported_hosted() -> None:
    manager = tiered(num_blocks=3, slots=4)
    a = request("a", [1, 2, 3, 4, 5])  # blocks (1, 2), (3, 4) cached; 5 partial
    run_to_end(manager, a)
    assert drain(manager).swap_out == []
    hashes = chain_hashes(a.prompt_token_ids, 2, b"s")
    b = request("b", [9, 9, 9, 9, 9, 9])  # 3 blocks: the free one, then both cached ones, LRU first
    assert manager.admit(b, b.num_tokens) and manager.allocate(b, b.num_tokens)
    copies = drain(manager)
    assert sorted(block for block, _ in copies.swap_out) == sorted(b.block_ids[1:])
    assert copies.swap_in == []
    assert manager.reporter is not None
    assert {h: manager.reporter.state[h] for h in hashes} == {hashes[0]: HOSTED, hashes[1]: HOSTED}
    assert manager.num_evictions == 2 and len(manager.host_tier or ()) == 2


def test_a_prefix_that_goes_on_in_the_tier_is_reloaded_not_recomputed() -> None:
    manager = tiered(num_blocks=5, slots=4)
    a = request("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks cached
    run_to_end(manager, a)
    filler = request("f", [9, 8, 7, 6, 5, 4, 3, 2])  # 4 blocks: the 2 free ones and two of a's, its tail first
    out = run_to_end(manager, filler).swap_out
    assert len(out) == 2
    again = request("a2", [1, 2, 3, 4, 5, 6, 7, 8, 0])  # a's 3 blocks and more: 1 on device, 2 in the tier
    assert len(manager.find_cached(again)) == 1 and manager.hit_blocks(again) == 3
    assert manager.admit(again, again.num_tokens)
    assert again.num_computed_tokens == 6 and again.num_cached_blocks == 3
    copies = drain(manager)
    slots = {slot for _, slot in out}
    assert [page for _, page in copies.swap_in] == again.block_ids[1:3]
    assert {slot for slot, _ in copies.swap_in} == slots
    hashes = chain_hashes(again.prompt_token_ids, 2, b"s")
    assert manager.reporter is not None and [manager.reporter.state[h] for h in hashes[:3]] == [PINNED] * 3
    assert manager.num_host_hit_tokens == 4 and manager.num_hit_tokens == 6
    # Evicting a reloaded block again needs no copy: the tier still holds it.
    reloaded = again.block_ids[1:3]
    manager.free(again)
    other = request("o", list(range(100, 110)))
    assert manager.admit(other, other.num_tokens) and manager.allocate(other, other.num_tokens)
    copies = drain(manager)
    assert {manager.reporter.state[h] for h in hashes[1:3]} == {HOSTED}
    assert not any(block in reloaded for block, _ in copies.swap_out)
    assert any(block not in reloaded for block, _ in copies.swap_out)  # the others' blocks are copied


def test_the_last_prompt_token_is_always_computed_even_from_the_tier() -> None:
    manager = tiered(num_blocks=2, slots=4)
    a = request("a", [1, 2, 3, 4])
    run_to_end(manager, a)
    run_to_end(manager, request("f", [7, 7, 7, 7]))  # both of a's blocks go to the tier
    drain(manager)
    same = request("s", [1, 2, 3, 4])
    assert manager.hit_blocks(same) == 1  # the block of its last token is computed again
    assert manager.admit(same, same.num_tokens) and same.num_computed_tokens == 2


def test_blocks_given_back_before_their_step_cancel_their_swap_ins() -> None:
    manager = tiered(num_blocks=3, slots=4)
    run_to_end(manager, request("a", [1, 2, 3, 4, 5]))
    run_to_end(manager, request("f", [7, 7, 7, 7, 7, 7]))
    drain(manager)
    again = request("a2", [1, 2, 3, 4, 5])
    assert manager.admit(again, again.num_tokens)
    hashes = chain_hashes(again.prompt_token_ids, 2, b"s")
    manager.free(again)  # e.g. the step's budget could not take its first chunk
    copies = drain(manager)
    assert copies.swap_in == []
    assert manager.find_cached(request("x", [1, 2, 3, 4, 5])) == []  # no block is named for KV never loaded
    assert manager.reporter is not None and manager.reporter.state[hashes[0]] == HOSTED
    assert manager.hit_blocks(request("y", [1, 2, 3, 4, 5])) == 2  # still in the tier


def test_a_block_evicted_and_hit_in_one_step_is_written_before_it_is_read() -> None:
    manager = tiered(num_blocks=3, slots=4)
    a = request("a", [1, 2, 3])  # one full block cached
    run_to_end(manager, a)
    b = request("b", [5, 6, 7, 8])  # takes both free blocks...
    assert manager.admit(b, 4) and manager.allocate(b, 4)
    c = request("c", [9, 9])  # ...so this one evicts a's block into the tier
    assert manager.admit(c, 2) and manager.allocate(c, 2)
    again = request("a2", [1, 2, 3])  # and this one hits it there in the same step
    manager.free(b)
    assert manager.admit(again, again.num_tokens)
    copies = drain(manager)
    (out,), (into,) = copies.swap_out, copies.swap_in
    assert out[1] == into[0]  # the slot: written by the swap-out, then read by the swap-in (ranks: outs first)
    assert manager.reporter is not None
    assert manager.reporter.state[chain_hashes([1, 2], 2, b"s")[0]] == PINNED


def test_the_tiers_lru_drop_is_reported_evicted() -> None:
    manager = tiered(num_blocks=2, slots=1)
    reporter = manager.reporter
    assert reporter is not None
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]}
    hashes = {name: chain_hashes(tokens, 2, b"s")[0] for name, tokens in prompts.items()}
    run_to_end(manager, request("a", prompts["a"]))
    run_to_end(manager, request("b", prompts["b"]))  # a's block: device -> tier
    before = reporter.report(None, 0)
    assert before.changes == {hashes["a"]: HOSTED, hashes["b"]: CACHED}
    run_to_end(manager, request("c", prompts["c"]))  # b's block into the tier's one slot: a's is dropped
    after = reporter.report(before.epoch, before.version)
    assert not after.full and after.changes[hashes["a"]] == EVICTED and after.changes[hashes["b"]] == HOSTED
    assert reporter.state == {hashes["b"]: HOSTED, hashes["c"]: CACHED}
    assert manager.host_tier is not None and manager.host_tier.num_dropped == 1


# ---- size, refusals, layout ------------------------------------------------------------------------------------


def test_kv_host_tier_forms() -> None:
    assert parse_host_tier("8GiB") == (8 << 30, None)
    assert parse_host_tier(4096) == (4096, None)
    assert parse_host_tier("0.25") == parse_host_tier("25%") == (None, 0.25)
    for bad in ("0", "150%", "lots", True, -1):
        with pytest.raises(ValueError, match="kv_host_tier"):
            parse_host_tier(bad)


def test_host_tier_blocks_refuses_more_than_the_node_has_naming_both() -> None:
    assert host_tier_blocks(1 << 20, None, 1 << 10, 2, 4 << 20) == 1024
    assert host_tier_blocks(None, 0.5, 1 << 10, 2, 4 << 20) == 1024  # half of 4 MiB over 2 ranks
    with pytest.raises(ValueError, match=r"3\.00 GiB per rank, 6\.00 GiB for the 2 rank.*4\.00 GiB available"):
        host_tier_blocks(3 << 30, None, 1 << 10, 2, 4 << 30)
    with pytest.raises(ValueError, match="holds no block"):
        host_tier_blocks(100, None, 1 << 10, 1, 4 << 20)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tier_unit"), seed=0)


def test_engine_start_refuses_a_tier_past_memavailable_and_without_prefix_caching(tiny: Path,
                                                                                    tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8388608 kB\nMemAvailable:    1048576 kB\n")  # 1 GiB available
    config = EngineArgs(model=str(tiny), kv_host_tier="2GiB", device="cpu").create_engine_config()
    with pytest.raises(ValueError, match=r"2\.00 GiB per rank.*1\.00 GiB available"):
        with_host_tier(config, meminfo)
    sized = with_host_tier(EngineArgs(model=str(tiny), kv_host_tier="25%", device="cpu").create_engine_config(),
                           meminfo)
    assert sized.cache.host_tier_blocks == (1 << 28) // tier_layout(sized).bytes_per_block
    with pytest.raises(ValueError, match="enable_prefix_caching is off: turn enable_prefix_caching on"):
        EngineArgs(model=str(tiny), kv_host_tier="1GiB", enable_prefix_caching=False).create_engine_config()


def test_layouts_that_share_block_hashes_never_share_a_tier(tiny: Path) -> None:
    """block_size 8 at dcp 1 and block_size 4 at dcp 2 hash the same tokens to the same names (8 tokens a block,
    one seed): the hash alone cannot keep their KV apart. The tier does, by belonging to one engine instance whose
    layout is fixed (tier_layout: every part of the layout changes it)."""
    tokens = list(range(5, 40))
    assert chain_hashes(tokens, 8 * 1, b"seed") == chain_hashes(tokens, 4 * 2, b"seed")
    base = dict(model=str(tiny), device="cpu", kv_host_tier="1MiB")
    layouts = {tier_layout(EngineArgs(**args).create_engine_config()) for args in (
        base, {**base, "block_size": 8}, {**base, "tensor_parallel_size": 2, "decode_context_parallel_size": 2},
        {**base, "tensor_parallel_size": 2}, {**base, "dtype": "float16"},
        {**base, "tensor_parallel_size": 2, "decode_context_parallel_size": 2, "prefill_context_parallel_size": 2})}
    assert len(layouts) == 6 and len({layout.fingerprint for layout in layouts}) == 6


def test_a_tier_drop_of_a_block_back_on_device_is_not_reported_evicted() -> None:
    manager = tiered(num_blocks=3, slots=1)
    reporter = manager.reporter
    assert reporter is not None
    h_a = chain_hashes([1, 2], 2, b"s")[0]
    run_to_end(manager, request("a", [1, 2, 3]))
    run_to_end(manager, request("b", [4, 5, 6, 7, 8]))  # a's block -> the tier's one slot
    assert run_to_end(manager, request("a2", [1, 2, 3])).swap_in  # reloaded: on device, and still in the tier
    assert reporter.state[h_a] == CACHED
    run_to_end(manager, request("c", [9, 9, 9]))  # b's block takes the slot: a's leaves the tier, not the device
    assert manager.host_tier is not None and h_a not in manager.host_tier
    assert reporter.state[h_a] == CACHED and manager.find_cached(request("x", [1, 2, 3]))
