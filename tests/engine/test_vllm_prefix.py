"""Prefix caching on the vLLM backend: vLLM caches, this replica reports and counts what it caches.

The first part drives engine.vllm_engine.VllmPrefixCache with vLLM's events by hand (no vLLM needed): our hashes for
vLLM's blocks, copies, removals, lost events, PINNED / CACHED by the requests held, each shared block charged once.
"""

from __future__ import annotations

from engine.prefix_cache import CACHED, EVICTED, PINNED, PrefixIndex, chain_hashes
from engine.vllm_engine import VllmPrefixCache, _Held

TPB = 4  # tokens per block in the hand-driven tests
SEED = b"seed"


def _held(prompt: list[int], max_tokens: int = 8) -> _Held:
    return _Held(len(prompt), max_tokens, token_ids=list(prompt))


def _vllm_store(cache: VllmPrefixCache, tokens: list[int], first: int, last: int, tag: str = "") -> list[str]:
    """vLLM storing blocks [first, last) of `tokens` (its hashes: made-up names, chained by the parent's)."""
    names = [f"v{tag}{i}" for i in range(first, last)]
    parent = f"v{tag}{first - 1}" if first else None
    cache.stored(names, parent, tokens[first * TPB:last * TPB], TPB, "GPU")
    return names


def test_stored_blocks_are_named_by_our_chain_hashes() -> None:
    cache = VllmPrefixCache(TPB, SEED)
    tokens = list(range(1, 14))  # 3 full blocks and a partial one
    _vllm_store(cache, tokens, 0, 1)
    _vllm_store(cache, tokens, 1, 3)  # a later event: its parent named by the first
    expected = chain_hashes(tokens, TPB, SEED)
    assert cache.cached_hashes() == {h: CACHED for h in expected}
    report = cache.report(None, 0)
    assert report.full and report.changes == {h: CACHED for h in expected}
    assert report.tokens_per_block == TPB and report.seed == SEED
    assert cache.num_cached_blocks == 3


def test_copies_removals_and_what_cannot_be_named() -> None:
    cache = VllmPrefixCache(TPB, SEED)
    tokens = list(range(1, 9))
    first, second = chain_hashes(tokens, TPB, SEED)
    _vllm_store(cache, tokens, 0, 2)
    _vllm_store(cache, tokens, 0, 1)  # a second copy of block 0 (vLLM does not de-duplicate)
    assert cache.num_cached_blocks == 3
    cache.removed(["v0"], "GPU")
    assert cache.cached_hashes() == {first: CACHED, second: CACHED}  # one copy left
    cache.removed(["v0"], "GPU")
    assert cache.cached_hashes() == {second: CACHED} and cache.num_evictions == 2
    cache.removed(["unknown"], "GPU")  # never stored here: nothing
    assert cache.num_evictions == 2
    # A parent no event named (lost events): not reported. Other block sizes and other tiers: not this pool.
    cache.stored(["x"], "never-seen", [1, 2, 3, 4], TPB, "GPU")
    cache.stored(["y"], None, [1, 2, 3, 4, 5, 6, 7, 8], 2 * TPB, "GPU")
    cache.stored(["z"], None, [9, 9, 9, 9], TPB, "CPU")
    assert cache.cached_hashes() == {second: CACHED} and cache.num_unmapped_blocks == 1
    cache.cleared()
    assert cache.cached_hashes() == {} and cache.num_cached_blocks == 0
    report = cache.report(None, 0)
    assert report.full and report.changes == {}


def test_lost_events_forget_everything() -> None:
    cache = VllmPrefixCache(TPB, SEED)
    tokens = list(range(1, 9))
    _vllm_store(cache, tokens, 0, 2)
    index = PrefixIndex()
    index.apply(cache.report(None, 0))
    cache.lost(3)
    report = cache.report(index.epoch, index.version)
    assert not report.full and set(report.changes.values()) == {EVICTED}
    index.apply(report)
    assert index.blocks == {} and cache.num_lost_batches == 3
    # A child of a forgotten parent stays unnamed.
    cache.stored(["v2"], "v1", [9, 9, 9, 9], TPB, "GPU")
    assert cache.cached_hashes() == {}


def test_held_requests_pin_and_are_charged_once() -> None:
    cache = VllmPrefixCache(TPB, SEED)
    prefix = list(range(1, 9))  # 2 blocks
    a, b = prefix + [50, 51, 52], prefix + [60, 61, 62]
    held = {"a": _held(a)}
    cache.hold("a", held["a"])
    _vllm_store(cache, a, 0, 2)  # a's prefill stored its 2 full blocks
    assert set(cache.cached_hashes().values()) == {PINNED}
    assert cache.pinned_hits(b) == 2  # b would take both from the cache, and a holds them
    assert cache.pinned_hits([99] + b) == 0
    held["b"] = _held(b)
    cache.hold("b", held["b"])
    assert cache.shared_blocks(held) == {"a": 0, "b": 2}  # charged to a, the first holder
    held["b"].num_cached_tokens = 4  # vLLM's word: b took 1 block from the cache
    assert cache.shared_blocks(held) == {"a": 0, "b": 1}
    cache.release("a", held.pop("a"))
    assert set(cache.cached_hashes().values()) == {PINNED}  # b still holds them
    assert cache.shared_blocks(held) == {"b": 0}  # now charged to b
    cache.release("b", held.pop("b"))
    assert set(cache.cached_hashes().values()) == {CACHED}
    # Outputs extend a held request's blocks: a block stored from them is pinned by it.
    c = _held(prefix + [70, 71])
    cache.hold("c", c)
    c.token_ids += [72, 73]
    cache.hold("c", c)
    _vllm_store(cache, c.token_ids, 2, 3)
    assert cache.cached_hashes() == {h: PINNED for h in chain_hashes(c.token_ids, TPB, SEED)}
