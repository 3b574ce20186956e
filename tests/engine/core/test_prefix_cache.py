"""Prefix caching in the native engine at tp = 1 (the block manager and scheduler as properties:
test_prefix_cache_properties.py; multi-rank: test_prefix_cache_ray.py).

A cached run gives the same greedy tokens and logprobs as an uncached one (prefix ending inside a block, on a block
boundary, a prompt that is all cached prefix, chunked prefill after the hit, penalties, a preempted request hitting
its own blocks), shared blocks are shared and counted once, the collision guard, caching off looks nothing up, and
the block-size check of EngineArgs.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

import dcpserve.engine.core.block_manager as block_manager_module
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.core.block_manager import BlockManager, PrefixCacheCorruption
from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.core.request import Request
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from tests.engine.llm_parts import engine_of
from tests.engine.prefix_harness import (
    GREEDY,
    check_preempted_request_hits_its_own_blocks,
    exactness_scenario,
    generate_one,
    run_cached_and_compare,
    run_reference,
)

SEED = b"test-seed"

# ---- the engine at tp = 1 ------------------------------------------------------------------------------------------

BLOCK_SIZE = 4  # tp = 1: logical blocks of 4 tokens
SMALL_BUDGET = BLOCK_SIZE + 3  # chunks that straddle blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_cached_run_equals_uncached_run_at_tp1(tiny: Path) -> None:
    """Each kind of hit (exactness_scenario) gives the uncached engine's greedy tokens and logprobs, with prefill
    chunked over small budgets after the hit; every request hits exactly the blocks a cache of everything before it
    holds, and only the tokens after the hit run through the model."""
    steps = exactness_scenario(BLOCK_SIZE)
    with LLM(tiny, block_size=BLOCK_SIZE, enable_prefix_caching=False) as llm:  # each prompt in one chunk
        reference = run_reference(llm, steps)
    with LLM(tiny, block_size=BLOCK_SIZE, max_num_batched_tokens=SMALL_BUDGET) as llm:
        assert engine_of(llm).block_manager.verify_hits  # tests/conftest.py: every hit compares token ids
        hit = run_cached_and_compare(llm, reference, "tp=1")
    assert hit > 0


def test_penalties_see_the_cached_prefix(tiny: Path) -> None:
    """The sampler's history of a penalized request that starts after a cached run holds the cached tokens too:
    the same tokens as without the cache, and not the tokens of a history without the prefix."""
    steps = exactness_scenario(BLOCK_SIZE)
    with LLM(tiny, block_size=BLOCK_SIZE, enable_prefix_caching=False) as llm:
        reference = run_reference(llm, steps)
    penalized = [(what, prompt, params, out) for what, prompt, params, out in reference if params.has_penalties]
    assert len(penalized) == 3
    # The penalties matter here: the same prompts without them give other tokens.
    with LLM(tiny, block_size=BLOCK_SIZE, enable_prefix_caching=False) as llm:
        plain = [generate_one(llm, prompt, GREEDY).outputs[0].token_ids for _, prompt, _, _ in penalized]
    assert all(p != out.outputs[0].token_ids for p, (_, _, _, out) in zip(plain, penalized, strict=True))


def test_preempted_request_hits_its_own_blocks_when_readmitted_at_tp1(tiny: Path) -> None:
    """usage admission on a pool that cannot hold every sequence's end: a preempted request comes back starting
    after the blocks it computed before (still cached), and every request gives the uncached engine's tokens."""
    check_preempted_request_hits_its_own_blocks(tiny, BLOCK_SIZE)


@pytest.mark.parametrize("admission", ["usage", "full"])
def test_concurrent_requests_share_prefix_blocks_and_the_ledger_counts_them_once(
    tiny: Path, admission: Literal["full", "usage"]
) -> None:
    """A request that arrives while another holds its prefix takes the same blocks (reference count 2) and adds
    only its own: the ledger charges the shared blocks to one of them, a newcomer's admission need leaves them out,
    and both give the tokens they give alone."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(5, 500, (3 * BLOCK_SIZE,), generator=gen).tolist()
    prompt_a = prefix + [11, 12]
    prompt_b = prefix + [21, 22, 23, 24, 25]
    params = dataclasses.replace(GREEDY, max_tokens=8)
    with LLM(tiny, block_size=BLOCK_SIZE, enable_prefix_caching=False) as llm:
        alone = [generate_one(llm, p, params) for p in (prompt_a, prompt_b)]
    config = EngineArgs(model=str(tiny), block_size=BLOCK_SIZE, admission=admission).create_engine_config()
    engine = LLMEngine(config)
    try:
        manager, scheduler = engine.block_manager, engine.scheduler
        tokens: dict[str, list[int]] = {"a": [], "b": []}

        def step() -> None:
            for delta in engine.step():
                tokens[delta.request_id] += delta.new_token_ids

        engine.add_request(sampling_params=params, prompt_token_ids=prompt_a, request_id="a")
        step()  # a's prompt computed: its 3 full blocks cached
        engine.add_request(sampling_params=params, prompt_token_ids=prompt_b, request_id="b")
        a, b = scheduler.requests["a"], scheduler.requests["b"]
        assert engine.kv_ledger().per_request["b"] == scheduler.committed_blocks(b)
        step()  # b admitted on a's blocks
        assert b.block_ids[:3] == a.block_ids[:3] and a.block_ids[3] != b.block_ids[3]
        assert [manager._ref_count[x] for x in a.block_ids[:3]] == [2, 2, 2]
        assert engine.stats().prefix_cache_hits == 3 * BLOCK_SIZE
        distinct = set(a.block_ids) | set(b.block_ids)
        ledger = engine.kv_ledger()
        promised = sum(max(0, r.reserved_blocks - len(r.block_ids)) for r in (a, b))
        assert ledger.used_blocks == len(distinct) == engine.stats().kv_blocks_used
        assert ledger.committed_blocks == len(distinct) + promised == engine.stats().kv_blocks_reserved
        # The shared blocks are charged once: to a, which computed them.
        assert a.num_charged_blocks == len(a.block_ids) and b.num_charged_blocks == len(b.block_ids) - 3
        # The rank holds the shared tokens once.
        rank = engine.stats().per_rank[0]
        assert rank.tokens_used == a.num_computed_tokens + b.num_computed_tokens - 3 * BLOCK_SIZE
        assert rank.tokens_used <= rank.pages_used * BLOCK_SIZE
        if admission == "usage":
            assert promised == 0 and ledger.per_request == {"a": len(a.block_ids), "b": len(b.block_ids) - 3}
        # A third request on the same prefix would add only its own blocks.
        newcomer = Request("c", prefix + [31, 32, 33], params)
        need = manager.blocks_for(newcomer.max_total_tokens if admission == "full" else newcomer.num_tokens)
        assert engine.admission_need(newcomer) == need - 3
        while engine.has_unfinished_requests():
            step()
        assert [tokens["a"], tokens["b"]] == [o.outputs[0].token_ids for o in alone]
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and stats.kv_blocks_reserved == 0 and stats.kv_blocks_cached > 0
        assert engine.kv_ledger().committed_blocks == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("admission", ["full", "usage"])
def test_engine_random_shared_prefix_workload_never_over_commits(tiny: Path, admission: str) -> None:
    """The engine with the tiny model over a small pool, requests arriving while others run, prompts cut from two
    shared sequences: at every step the referenced + promised blocks fit the pool and equal the ledger of the
    running requests; everything finishes with every block back (the cached ones evictable, counted free), and
    each request gives the tokens of an uncached engine."""
    rng = random.Random(admission)
    bases = [torch.randint(5, 500, (40,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    arrivals = [(rng.randrange(0, 30), rng.choice(bases)[:rng.randint(2, 40)]) for _ in range(14)]
    arrivals.sort(key=lambda a: a[0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # 24 blocks of 4 tokens: the arrivals' prompts do not all fit at once.
    args: dict[str, Any] = dict(block_size=BLOCK_SIZE, kv_cache_memory_bytes=24 * BLOCK_SIZE * 512,
                                admission=admission, max_num_batched_tokens=16, kv_headroom=0.1)

    def run(enable: bool) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(EngineArgs(model=str(tiny), enable_prefix_caching=enable, **args).create_engine_config())
        got: dict[str, list[int]] = {}
        pending = list(arrivals)
        step = 0
        try:
            while pending or engine.has_unfinished_requests():
                while pending and pending[0][0] <= step:
                    _, prompt = pending.pop(0)
                    engine.add_request(sampling_params=params, prompt_token_ids=prompt, request_id=f"r{len(got)}")
                    got[f"r{len(got)}"] = []
                for delta in engine.step():
                    got[delta.request_id] += delta.new_token_ids
                stats, ledger = engine.stats(), engine.kv_ledger()
                assert stats.kv_blocks_used <= stats.kv_blocks_reserved <= stats.kv_blocks_total, "over-committed"
                running = engine.scheduler.running
                assert sum(ledger.per_request[r.request_id] for r in running) == stats.kv_blocks_reserved
                assert stats.per_rank[0].tokens_used <= stats.per_rank[0].pages_used * BLOCK_SIZE
                step += 1
            stats = engine.stats()
            assert stats.kv_blocks_used == 0 and stats.kv_blocks_reserved == 0
            assert engine.block_manager.num_free_blocks == stats.kv_blocks_total
            assert len(engine.block_manager._evictable) == stats.kv_blocks_cached
            if admission == "full":
                assert stats.num_preemptions == 0
            return got, engine
        finally:
            engine.shutdown()

    expected, _ = run(False)
    got, engine = run(True)
    assert got == expected
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.kv_blocks_cached > 0
    assert stats.prefix_cache_queries == sum(len(p) for _, p in arrivals)


# ---- the collision guard, caching off, the arguments ------------------------------------------------------------


def first_token_chain(token_ids: Sequence[int], tokens_per_block: int, seed: bytes, known: Sequence[int] = (),
                      max_blocks: int | None = None) -> list[int]:
    """A broken chain hash: each block named by its parent and its first token only (collides on purpose)."""
    count = len(token_ids) // tokens_per_block
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes: list[int] = []
    for index in range(count):
        hashes.append(hash((hashes[-1] if hashes else seed, token_ids[index * tokens_per_block])))
    return hashes


def test_a_hash_collision_is_refused_with_verify_on(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts whose blocks collide under a broken hash: the second's hit compares the stored token ids and
    raises PrefixCacheCorruption naming the block, instead of serving the first prompt's KV."""
    monkeypatch.setattr(block_manager_module, "chain_hashes", first_token_chain)
    first = [7, 1, 1, 1, 9, 2, 2, 2, 5]
    collides = [7, 3, 3, 3, 9, 4, 4, 4, 5]  # same first token in each block: same (broken) names
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with LLM(tiny, block_size=BLOCK_SIZE) as llm:
        llm.generate(prompt_token_ids=[first], sampling_params=params)
        with pytest.raises(PrefixCacheCorruption, match=r"prefix cache hit on block \d+ .* for request .* at block 0, "
                                                        r"but the block holds other token ids: a hash collision"):
            llm.generate(prompt_token_ids=[collides], sampling_params=params)
    # Without the check the same collision is a silent hit on another prompt's blocks: why the tests keep it on.
    manager = BlockManager(8, BLOCK_SIZE, 1, enable_prefix_caching=True, hash_seed=SEED, verify_hits=False)
    owner = Request("owner", first, params)
    assert manager.admit(owner, owner.num_tokens) and manager.allocate(owner, owner.num_tokens)
    owner.num_computed_tokens = owner.num_tokens
    manager.cache_computed(owner)
    assert manager.find_cached(Request("victim", collides, params)) == owner.block_ids[:2]


def test_caching_off_never_looks_anything_up(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """enable_prefix_caching=False: no hash is computed, nothing is named or reported, identical prompts compute
    everything each time."""

    def no_hashing(*args: object, **kwargs: object) -> list[int]:
        raise AssertionError("a block hash was computed with prefix caching off")

    monkeypatch.setattr(block_manager_module, "chain_hashes", no_hashing)
    prompt = list(range(10, 31))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(tiny, block_size=BLOCK_SIZE, enable_prefix_caching=False) as llm:
        engine = engine_of(llm)
        llm.generate(prompt_token_ids=[prompt, prompt], sampling_params=params)
        llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        engine.kv_ledger()
        assert engine.admission_need(Request("x", prompt, params)) == engine.block_manager.blocks_for(len(prompt))
        stats = engine.stats()
        assert not stats.prefix_caching
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.kv_blocks_cached) == (0, 0, 0)
        assert stats.tokens_computed == 3 * (len(prompt) + 2)
        assert engine.prefix_report(None, 0) is None and engine.block_manager.reporter is None


@pytest.mark.parametrize("tp,dcp,block_size,max_model_len", [(1, 1, 16, 16), (1, 1, 32, 20), (2, 2, 8, 16)])
def test_prefix_caching_needs_a_full_block_before_the_last_token(tiny: Path, tp: int, dcp: int, block_size: int,
                                                                max_model_len: int) -> None:
    """block_size * dcp >= max_model_len: no request could ever hit a block; a clear error at config time, and
    the same arguments with prefix caching off (or one more token of context) are fine."""
    args: dict[str, Any] = dict(model=str(tiny), tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                                block_size=block_size, max_model_len=max_model_len)
    with pytest.raises(ValueError, match=(
            rf"enable_prefix_caching caches full logical blocks of block_size \* dcp = {block_size} \* {dcp} = "
            rf"{block_size * dcp} tokens, but max_model_len={max_model_len} leaves no request a full block before "
            rf"its last token: lower block_size, or set enable_prefix_caching=false")):
        EngineArgs(**args).create_engine_config()
    assert not EngineArgs(**args, enable_prefix_caching=False).create_engine_config().cache.enable_prefix_caching
    config = EngineArgs(**{**args, "max_model_len": block_size * dcp + 1}).create_engine_config()
    assert config.cache.enable_prefix_caching
