"""Prefix caching on the vLLM backend: vLLM caches, this replica reports and counts what it caches.

The first part drives dcpserve.engine.backends.vllm.prefix.VllmPrefixCache with vLLM's events by hand (no vLLM needed):
our hashes for vLLM's blocks, copies, removals, lost events, PINNED / CACHED by the requests held, each shared block
charged once. The `vllm` part runs vLLM's AsyncLLM (the CPU wheel, `make test-vllm`): a repeated prompt is served from
vLLM's cache and reported under exactly the hashes the app computes (dcpserve.engine.core.prefix_cache.prompt_hashes), a
concurrent request sharing a prefix sees it PINNED and the ledger counts the shared blocks once, evictions are reported,
greedy tokens are the same with the cache off, and the configurations vLLM would quietly run uncached are refused at
deploy.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dcpserve.engine.args import EngineArgs
from dcpserve.engine.backends.vllm.prefix import HeldRequest, VllmPrefixCache
from dcpserve.engine.core.block_manager import admission_blocks
from dcpserve.engine.core.prefix_cache import (
    CACHED,
    EVICTED,
    HOSTED,
    PINNED,
    PrefixIndex,
    chain_hashes,
    prompt_hashes,
)
from dcpserve.engine.sampling_params import SamplingParams

TPB = 4  # tokens per block in the hand-driven tests
SEED = b"seed"


def _held(prompt: list[int], max_tokens: int = 8) -> HeldRequest:
    return HeldRequest(len(prompt), max_tokens, token_ids=list(prompt))


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
    # A parent no event named (lost events): not reported. Other block sizes and other tiers (vLLM's storage
    # offloading): not this pool.
    cache.stored(["x"], "never-seen", [1, 2, 3, 4], TPB, "GPU")
    cache.stored(["y"], None, [1, 2, 3, 4, 5, 6, 7, 8], 2 * TPB, "GPU")
    cache.stored(["z"], None, [9, 9, 9, 9], TPB, "STORAGE")
    assert cache.cached_hashes() == {second: CACHED} and cache.num_unmapped_blocks == 1
    cache.cleared()
    assert cache.cached_hashes() == {} and cache.num_cached_blocks == 0
    report = cache.report(None, 0)
    assert report.full and report.changes == {}


def test_host_tier_copies_are_hosted_until_both_tiers_drop_them() -> None:
    """vLLM's CPU offloading: a block whose pool copy is evicted while its host copy stays is HOSTED (the queue's
    PrefixMatch counts it in host_blocks), and EVICTED once the host tier drops it too; a host copy is named by its own
    chain or, for the connector's placeholders (no parent, no tokens), by the pool's name of the same vLLM hash."""
    cache = VllmPrefixCache(TPB, SEED)
    tokens = list(range(1, 13))
    first, second, third = chain_hashes(tokens, TPB, SEED)
    _vllm_store(cache, tokens, 0, 3)
    cache.stored(["v0", "v1"], None, tokens[:2 * TPB], TPB, "CPU")  # offloaded with their chain
    cache.stored(["v2"], None, [], 0, "CPU")  # a placeholder: named through the pool's mapping
    assert cache.num_host_blocks == 3
    assert cache.cached_hashes() == {first: CACHED, second: CACHED, third: CACHED}  # on device: not HOSTED
    index = PrefixIndex()
    index.apply(cache.report(None, 0))
    cache.removed(["v0", "v1", "v2"], "GPU")  # the pool evicts them; the host tier keeps them
    assert cache.cached_hashes() == {first: HOSTED, second: HOSTED, third: HOSTED}
    index.apply(cache.report(index.epoch, index.version))
    match = index.match(prompt_hashes(tokens + [99], TPB, SEED), TPB, SEED)
    assert (match.hit_blocks, match.host_blocks, match.pinned_blocks) == (3, 3, 0)
    assert cache.pinned_hits(tokens + [99]) == 0  # a hosted block still needs device KV
    _vllm_store(cache, tokens, 0, 1)  # reloaded into the pool: on device again
    assert cache.cached_hashes()[first] == CACHED
    cache.removed(["v1"], "CPU")
    assert second not in cache.cached_hashes() and cache.num_host_evictions == 1
    index.apply(cache.report(index.epoch, index.version))
    assert index.match(prompt_hashes(tokens + [99], TPB, SEED), TPB, SEED).hit_blocks == 1  # the run breaks there
    cache.stored(["unknown"], None, [], 0, "CPU")  # a placeholder of a block never in the pool: not named
    assert cache.num_unmapped_blocks == 1
    cache.cleared()
    assert cache.cached_hashes() == {} and cache.num_host_blocks == 0


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


# ---- vLLM's AsyncLLM --------------------------------------------------------------------------------------------

BLOCK_SIZE = 32  # vLLM's CPU attention pages KV in multiples of 32 tokens; dcp = 1 on CPU: 32 tokens per block
KV_BYTES = 1 << 20  # 64 pages of the tiny model, 63 after vLLM's null block
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dcpserve.cluster.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _args(tiny: Path, **overrides: object) -> EngineArgs:
    options: dict[str, object] = dict(
        model=str(tiny), backend="vllm", dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory_bytes=KV_BYTES,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=8, admission="full", device="cpu",
    )
    options.update(overrides)
    return EngineArgs(**options)  # type: ignore[arg-type]


def _start(tiny: Path, **overrides: object):
    from dcpserve.engine.backends import start_engine

    loop = asyncio.new_event_loop()

    async def start():
        return start_engine(_args(tiny, **overrides))

    client = loop.run_until_complete(start())
    try:
        yield loop, client
    finally:
        loop.run_until_complete(client.shutdown())
        loop.close()


@pytest.fixture(scope="module")
def cached(tiny: Path):
    yield from _start(tiny)


@pytest.fixture(scope="module")
def uncached(tiny: Path):
    yield from _start(tiny, enable_prefix_caching=False)


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


async def _collect(client, prompt: list[int], request_id: str,
                   params: SamplingParams = GREEDY) -> list[int]:
    stream = await client.submit(sampling_params=params, prompt_token_ids=prompt, request_id=request_id)
    return [t async for d in stream for t in d.new_token_ids]


async def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    """vLLM's events and stat records arrive on their own: wait for them."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _seed(tiny: Path) -> bytes:
    return _args(tiny).prefix_hash_seed()


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_repeated_prompt_is_served_from_the_cache_and_reported_by_our_hashes(cached, tiny: Path) -> None:
    loop, client = cached
    prompt = list(range(10, 110))  # 100 tokens: 3 full blocks before the last token
    expected = prompt_hashes(prompt, BLOCK_SIZE, _seed(tiny))
    assert len(expected) == 3

    async def run() -> None:
        index = PrefixIndex()
        index.apply(await client.prefix_report(None, 0))
        before = client.stats()
        assert before.prefix_caching
        first = await _collect(client, prompt, "first")
        # 100 prompt + 3 fed-back outputs = 103 computed tokens: exactly the prompt's 3 full blocks are cached.
        await _until(lambda: set(expected) <= set(client.prefix.cached_hashes()), "the first request's blocks")
        report = await client.prefix_report(index.epoch, index.version)
        assert not report.full and report.tokens_per_block == BLOCK_SIZE and report.seed == _seed(tiny)
        assert report.changes == {h: CACHED for h in expected}
        index.apply(report)
        second = await _collect(client, prompt, "second")
        assert second == first
        await _until(lambda: client.stats().prefix_cache_queries == before.prefix_cache_queries + 200,
                     "the second request's lookup")
        stats = client.stats()
        assert stats.prefix_cache_hits - before.prefix_cache_hits == 3 * BLOCK_SIZE  # the second one's 3 blocks
        assert stats.kv_blocks_cached >= 3
        index.apply(await client.prefix_report(index.epoch, index.version))
        assert {h: index.blocks.get(h) for h in expected} == {h: CACHED for h in expected}

    loop.run_until_complete(run())


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_concurrent_request_sharing_a_prefix_sees_it_pinned_and_the_ledger_counts_it_once(cached,
                                                                                            tiny: Path) -> None:
    loop, client = cached
    prefix = list(range(200, 296))  # 3 blocks
    a, b = prefix + list(range(400, 410)), prefix + list(range(420, 430))
    shared = prompt_hashes(a, BLOCK_SIZE, _seed(tiny))
    assert shared == prompt_hashes(b, BLOCK_SIZE, _seed(tiny)) and len(shared) == 3
    long = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)

    async def run() -> None:
        before = client.stats()
        stream_a = await client.submit(sampling_params=long, prompt_token_ids=a, request_id="a", check_kv=True)
        await stream_a.__anext__()  # a's prefill is done; it decodes on (600 tokens) while b comes and goes
        await _until(lambda: set(shared) <= set(client.prefix.cached_hashes()), "a's prompt blocks")
        index = PrefixIndex()
        index.apply(await client.prefix_report(None, 0))
        assert {h: index.blocks[h] for h in shared} == {h: PINNED for h in shared}
        assert index.match(prompt_hashes(b, BLOCK_SIZE, _seed(tiny)), BLOCK_SIZE, _seed(tiny)).pinned_blocks == 3

        need_a = admission_blocks("full", len(a), 600, BLOCK_SIZE)
        need_b = admission_blocks("full", len(b), 8, BLOCK_SIZE)
        assert await client.admission_need(b, 8) == need_b - 3
        assert client.kv_ledger().per_request == {"a": need_a}
        params_b = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        stream_b = await client.submit(sampling_params=params_b, prompt_token_ids=b, request_id="b", check_kv=True)
        ledger = client.kv_ledger()
        assert ledger.per_request == {"a": need_a, "b": need_b - 3}  # the 3 shared blocks charged to a only
        assert ledger.committed_blocks == need_a + need_b - 3
        tokens_b = []
        async for delta in stream_b:
            tokens_b += delta.new_token_ids
            if not delta.finished:  # vLLM said how much of b it served from its cache: the same 3 blocks
                assert client._held["b"].num_cached_tokens == 3 * BLOCK_SIZE
                assert client.kv_ledger().per_request["b"] == need_b - 3
        assert len(tokens_b) == 8
        assert client.has_request("a") and client.kv_ledger().per_request == {"a": need_a}
        await _until(lambda: client.stats().prefix_cache_hits >= before.prefix_cache_hits + 3 * BLOCK_SIZE,
                     "b's hits in vLLM's stats")
        await stream_a.aclose()  # a goes away: the prefix is cached, held by none
        await _until(lambda: not client.kv_ledger().per_request and client.stats().num_running == 0, "a's end")
        index.apply(await client.prefix_report(index.epoch, index.version))
        assert {h: index.blocks[h] for h in shared} == {h: CACHED for h in shared}

    loop.run_until_complete(run())


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_greedy_tokens_are_the_same_with_the_cache_off(cached, uncached, tiny: Path) -> None:
    """Each prompt twice on the cached engine (the second from vLLM's cache) and once uncached: the same tokens.
    The uncached engine reports nothing and hits nothing."""
    prompts = [list(range(300, 364)), list(range(300, 371)), list(range(300, 332)) + [5, 6, 7]]  # 2 blocks exactly,
    # 71 tokens sharing them, a block and 3 tokens
    loop_on, on = cached
    loop_off, off = uncached

    def run(loop, client, prompts_, tag):
        async def go() -> list[list[int]]:
            return [await _collect(client, p, f"{tag}-{i}") for i, p in enumerate(prompts_)]
        return loop.run_until_complete(go())

    hits_before = on.stats().prefix_cache_hits
    first = run(loop_on, on, prompts, "on1")
    again = run(loop_on, on, prompts, "on2")
    plain = run(loop_off, off, prompts, "off")
    assert first == again == plain
    assert on.stats().prefix_cache_hits > hits_before
    stats = off.stats()
    assert loop_off.run_until_complete(off.prefix_report(None, 0)) is None
    assert not stats.prefix_caching and stats.prefix_cache_hits == 0 and stats.kv_blocks_cached == 0
    assert loop_off.run_until_complete(off.admission_need(prompts[0], 4)) == off.admission_blocks(len(prompts[0]), 4)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_evictions_are_reported(cached, tiny: Path) -> None:
    """More distinct prompts than the pool holds: vLLM evicts the least recently used cached blocks, the report says
    EVICTED, and what it names never exceeds the pool."""
    loop, client = cached
    prompts = [[5 + (k * 61 + i * 7) % 500 for i in range(300)] for k in range(8)]  # 9 full blocks each: 72 > 63
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def run() -> None:
        index = PrefixIndex()
        index.apply(await client.prefix_report(None, 0))
        evictions = client.stats().prefix_cache_evictions
        for k, prompt in enumerate(prompts):
            await _collect(client, prompt, f"evict-{k}", params)
        last = prompt_hashes(prompts[-1], BLOCK_SIZE, _seed(tiny))
        await _until(lambda: set(last) <= set(client.prefix.cached_hashes()), "the last prompt's blocks")
        report = await client.prefix_report(index.epoch, index.version)
        assert EVICTED in report.changes.values()
        index.apply(report)
        assert client.stats().prefix_cache_evictions > evictions
        assert len(index.blocks) == client.stats().kv_blocks_cached <= client.kv_ledger().capacity_blocks
        first = prompt_hashes(prompts[0], BLOCK_SIZE, _seed(tiny))
        assert not set(first) <= set(index.blocks)  # the least recently used went first

    loop.run_until_complete(run())


@pytest.mark.vllm
def test_configurations_vllm_would_run_uncached_are_refused_at_deploy(tiny: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import dcpserve.engine.backends.vllm.args as vllm_args
    from dcpserve.cluster.tiny_model import write_tiny_mla_model

    with pytest.raises(ValueError, match=r"enable_prefix_caching caches full logical blocks of block_size \* dcp = "
                                         r"32 \* 1 = 32 tokens, but max_model_len=32 .* enable_prefix_caching=false"):
        vllm_args.validate_vllm_args(_args(tiny, max_model_len=32, kv_cache_memory_bytes=None), "cpu")
    vllm_args.validate_vllm_args(_args(tiny, max_model_len=32, kv_cache_memory_bytes=None,
                                       enable_prefix_caching=False), "cpu")
    mla = write_tiny_mla_model(tmp_path / "mla")
    monkeypatch.setattr(vllm_args, "cpu_has_amx", lambda: False)
    with pytest.raises(ValueError, match=r"enable_prefix_caching=true with backend='vllm' on CPU for an MLA model "
                                         r"\(kv_lora_rank=40\): without AMX .* turns prefix caching off .* set "
                                         r"enable_prefix_caching=false"):
        vllm_args.validate_vllm_args(_args(mla, kv_cache_memory_bytes=None), "cpu")
    vllm_args.validate_vllm_args(_args(mla, kv_cache_memory_bytes=None, enable_prefix_caching=False), "cpu")
    monkeypatch.setattr(vllm_args, "cpu_has_amx", lambda: True)  # vLLM's AMX MLA keeps prefix caching
    vllm_args.validate_vllm_args(_args(mla, kv_cache_memory_bytes=None), "cpu")
    # The engine's events reach it on loopback only.
    with pytest.raises(ValueError, match="loopback"):
        vllm_args.kv_events_config("tcp://*:5557", "t")
