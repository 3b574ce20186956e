"""Prefix caching's block manager and scheduler as properties (no model runs; the engine: test_prefix_cache.py).

- The block manager under random request lifecycles (Hypothesis state machine): after every operation the reference
  counts, the free / evictable / referenced partition, the charging of shared blocks, the promises, the names of
  the cached blocks (recomputed here from the token runs that were written into them), LRU eviction, and what every
  running request would read from its blocks (its own tokens, never another prefix's) are checked against a model
  kept by the test.
- The scheduler over random workloads with shared prefixes under both admission policies: never over-committed,
  the ledger counts each block once, everything returns at the end.
"""

from __future__ import annotations

import random
from typing import Literal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.prefix_cache import CACHED, PINNED, PrefixIndex, chain_hashes, max_hit_blocks, prompt_hashes
from dcpserve.engine.core.request import Request, RequestStatus
from dcpserve.engine.core.scheduler import Scheduler
from dcpserve.engine.sampling_params import SamplingParams

SEED = b"test-seed"


# ---- the block manager against a model of it -------------------------------------------------------------------


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random lifecycles of requests whose tokens come from a 2-token alphabet (so prefixes repeat), driven the way
    the scheduler drives the block manager: admit (takes the cached run), allocate + compute + cache_computed,
    sample, finish, preempt; and reports of the cache to a reader, some lost. The model kept here: which request
    holds which block in which order (the charged holder is the first of the current holders), what tokens were
    written into each block's slots and the token run from the start of its sequence, the order unreferenced cached
    blocks were released in (LRU)."""

    @initialize(block_size=st.sampled_from([1, 2, 3]), dcp=st.sampled_from([1, 2]), num_blocks=st.integers(2, 12))
    def setup(self, block_size: int, dcp: int, num_blocks: int) -> None:
        self.manager = BlockManager(num_blocks, block_size, dcp, enable_prefix_caching=True, hash_seed=SEED,
                                    verify_hits=True)
        self.tpb = block_size * dcp
        self.num_blocks = num_blocks
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.next_id = 0
        self.holders: dict[int, list[str]] = {b: [] for b in range(num_blocks)}  # in the order they took it
        self.slots: dict[int, list[int | None]] = {}  # block -> the token written at each slot
        self.run: dict[int, tuple[int, ...]] = {}  # full block -> the tokens from its sequence's start to its end
        self.lru: list[int] = []  # unreferenced cached blocks, least recently released first
        self.done: list[tuple[int, ...]] = []  # the tokens of finished requests (prefixes for new ones)
        self.index = PrefixIndex()  # a reader of the cache's reports

    # ---- helpers -----------------------------------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        m = self.manager
        return (list(m._free_block_ids), list(m._evictable), list(m._ref_count), m._promised, dict(m._cached),
                dict(m._block_hash), [(r.request_id, list(r.block_ids), r.reserved_blocks, r.num_computed_tokens,
                                       r.num_charged_blocks, r.num_cached_blocks) for r in self.waiting + self.running])

    def _new(self, tokens: list[int], max_tokens: int) -> None:
        self.waiting.append(Request(f"r{self.next_id}", tokens, SamplingParams(max_tokens=max_tokens)))
        self.next_id += 1

    def _release(self, request: Request) -> None:
        """What free() must do to the model: drop the request as holder; blocks nobody holds any more that are
        cached join the LRU order, the end of the request's run first."""
        for block in reversed(request.block_ids):
            self.holders[block].remove(request.request_id)
            if not self.holders[block] and block in self.manager._block_hash:
                self.lru.append(block)
        self.manager.free(request)

    # ---- rules ---------------------------------------------------------------------------------------------------

    @rule(tokens=st.lists(st.integers(1, 2), min_size=1, max_size=8), max_tokens=st.integers(1, 6))
    def new_request(self, tokens: list[int], max_tokens: int) -> None:
        self._new(tokens, max_tokens)

    @precondition(lambda self: self.running or self.waiting or self.done)
    @rule(data=st.data(), tail=st.lists(st.integers(1, 2), max_size=4), max_tokens=st.integers(1, 6))
    def new_request_sharing_a_prefix(self, data: st.DataObject, tail: list[int], max_tokens: int) -> None:
        """A prompt that starts with a prefix of another request's tokens (running, waiting or finished)."""
        other = data.draw(st.sampled_from([r.all_token_ids for r in self.running + self.waiting] + self.done))
        cut = data.draw(st.integers(0, len(other)))
        tokens = list(other[:cut]) + tail
        if tokens:
            self._new(tokens, max_tokens)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), full=st.booleans(), keep_free=st.integers(0, 2))
    def admit(self, data: st.DataObject, full: bool, keep_free: int) -> None:
        m = self.manager
        request = data.draw(st.sampled_from(self.waiting))
        reserve_tokens = request.max_total_tokens if full else request.num_tokens
        free_before = m.num_free_blocks
        before = self._snapshot()
        evictable_before = set(m._evictable)
        if not m.admit(request, reserve_tokens, keep_free):
            assert self._snapshot() == before, "a refused admission changed something"
            hits = m.find_cached(request)
            taken_from_free = sum(1 for b in hits if b in evictable_before)
            # Refused only when the blocks it adds do not fit the free blocks less keep_free.
            assert m.blocks_for(reserve_tokens) - len(hits) > free_before - taken_from_free - keep_free
            return
        hits = list(request.block_ids)
        limit = max_hit_blocks(request.num_tokens, self.tpb)
        assert len(hits) <= limit and len(hits) * self.tpb < request.num_tokens, "a hit covers the last token"
        assert request.num_computed_tokens == len(hits) * self.tpb == request.num_cached_blocks * self.tpb
        # The longest run: the next block of the request (if it may hit at all) is not cached.
        hashes = chain_hashes(request.all_token_ids, self.tpb, SEED, max_blocks=limit)
        assert hashes[:len(hits)] == [m._block_hash[b] for b in hits]
        if len(hits) < limit:
            assert hashes[len(hits)] not in m._cached
        assert m.num_free_blocks >= keep_free
        for block in hits:
            if block in evictable_before:
                self.lru.remove(block)
            self.holders[block].append(request.request_id)
        self.waiting.remove(request)
        self.running.append(request)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.running))
    @rule(data=st.data())
    def compute_a_chunk(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens < r.num_tokens]))
        self._compute(request, request.num_computed_tokens + data.draw(
            st.integers(1, request.num_tokens - request.num_computed_tokens)))

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.running))
    @rule(data=st.data())
    def compute_to_the_end(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens < r.num_tokens]))
        self._compute(request, request.num_tokens)

    def _compute(self, request: Request, end: int) -> None:
        """Allocates blocks for the request's tokens up to `end`, writes them (the model's slots) and names the
        blocks it completed, as a step and Scheduler.update do."""
        m = self.manager
        start = request.num_computed_tokens
        free_before, lru_before = list(m._free_block_ids), list(self.lru)
        old = len(request.block_ids)
        outstanding = max(0, request.reserved_blocks - old)
        before = self._snapshot()
        if not m.allocate(request, end):
            assert self._snapshot() == before, "a refused allocation changed something"
            needed = m.blocks_for(end) - old
            assert needed - min(needed, outstanding) > m.num_free_blocks
            return
        new = request.block_ids[old:]
        from_free = min(len(new), len(free_before))
        # Never-cached blocks first, then cached unreferenced ones, least recently released first.
        assert new[:from_free] == free_before[:from_free]
        evicted = new[from_free:]
        assert evicted == lru_before[:len(evicted)], "eviction out of LRU order"
        for block in evicted:
            assert not self.holders[block], "evicted a referenced block"
            self.lru.remove(block)
            self.run.pop(block, None)
        for block in new:
            self.holders[block].append(request.request_id)
            self.slots[block] = [None] * self.tpb
        for position in range(start, end):
            block = request.block_ids[position // self.tpb]
            # A block is written only by its one holder, and never once it is named (shared or shareable).
            assert self.holders[block] == [request.request_id], "a shared block was written"
            assert block not in m._block_hash, "a cached block was written"
            self.slots[block][position % self.tpb] = request.all_token_ids[position]
            if position % self.tpb == self.tpb - 1:
                self.run[block] = tuple(request.all_token_ids[:position + 1])
        request.num_computed_tokens = end
        m.cache_computed(request)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(data=st.data(), token=st.integers(1, 2))
    def sample(self, data: st.DataObject, token: int) -> None:
        request = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens == r.num_tokens]))
        request.append_output(token)

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running + self.waiting))
        self._release(request)
        (self.running if request in self.running else self.waiting).remove(request)
        self.done.append(tuple(request.all_token_ids))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """As Scheduler._preempt: its blocks freed, back to the head of the queue to compute everything again."""
        request = data.draw(st.sampled_from(self.running))
        self._release(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.running.remove(request)
        self.waiting.insert(0, request)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def look_up(self, data: st.DataObject) -> None:
        """The ledger's look-ups (find_cached, pinned_hits) change nothing."""
        request = data.draw(st.sampled_from(self.waiting))
        before = self._snapshot()
        hits = self.manager.find_cached(request)
        pinned = self.manager.pinned_hits(request)
        assert pinned == sum(1 for b in hits if self.holders[b]) <= len(hits)
        assert self._snapshot() == before

    @rule(lose=st.booleans())
    def report(self, lose: bool) -> None:
        """The replica reports its cache to a reader (the router's PrefixIndex); a lost report makes the next one
        the whole state. A delivered one leaves the reader with exactly the cache's blocks and states, and it then
        matches every fresh waiting prompt as the engine's own lookup does."""
        reporter = self.manager.reporter
        assert reporter is not None  # prefix caching is on
        report = reporter.report(self.index.epoch, self.index.version)
        if lose:
            return
        self.index.apply(report)
        assert self.index.blocks == reporter.state
        for request in self.waiting:
            if request.output_token_ids:
                continue  # a preempted request: its lookup covers its outputs too, the ingress sees only prompts
            match = self.index.match(prompt_hashes(request.prompt_token_ids, self.tpb, SEED), self.tpb, SEED)
            assert match.hit_blocks == len(self.manager.find_cached(request))
            assert match.pinned_blocks == self.manager.pinned_hits(request)

    # ---- invariants ------------------------------------------------------------------------------------------------

    @invariant()
    def blocks_are_partitioned_and_counted(self) -> None:
        m = self.manager
        referenced = {b for b, holders in self.holders.items() if holders}
        for block in range(self.num_blocks):
            assert m._ref_count[block] == len(self.holders[block]), f"block {block}: ref count"
            assert sorted(m._holders[block]) == sorted(self.holders[block])
        for request in self.running:
            assert len(set(request.block_ids)) == len(request.block_ids), "a request holds a block twice"
        free, evictable = list(m._free_block_ids), list(m._evictable)
        assert len(set(free)) == len(free)
        assert not referenced & set(free), "a referenced block is in the free list"
        assert not referenced & set(evictable), "a referenced block is evictable"
        assert not set(free) & set(evictable)
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks
        assert evictable == self.lru, "the evictable blocks are not in release order"
        assert all(b in m._block_hash for b in evictable), "an evictable block holds no cached prefix"
        promised = sum(max(0, r.reserved_blocks - len(r.block_ids)) for r in self.running)
        assert m._promised == promised
        assert m.num_free_blocks >= 0, "promised more than the pool holds"
        assert m.num_free_blocks + len(referenced) + promised == self.num_blocks
        usage = m.usage()
        assert (usage.used, usage.reserved) == (len(referenced), len(referenced) + promised)
        for request in self.waiting:
            assert request.block_ids == [] and request.reserved_blocks == 0 and request.num_charged_blocks == 0

    @invariant()
    def each_held_block_is_charged_to_exactly_one_holder(self) -> None:
        charged: dict[str, int] = {}
        for holders in self.holders.values():
            if holders:
                charged[holders[0]] = charged.get(holders[0], 0) + 1  # the first current holder carries it
        for request in self.running:
            assert request.num_charged_blocks == charged.get(request.request_id, 0), request.request_id
            assert self.manager.shared_blocks(request) == len(request.block_ids) - request.num_charged_blocks >= 0
        assert sum(r.num_charged_blocks for r in self.running) == sum(1 for h in self.holders.values() if h)

    @invariant()
    def every_cached_hash_names_the_tokens_its_block_holds(self) -> None:
        m = self.manager
        assert {m._cached[h]: h for h in m._cached} == m._block_hash, "hash -> block and block -> hash disagree"
        assert m.num_cached_blocks == len(m._cached)
        for block, name in m._block_hash.items():
            assert block in self.run, f"block {block} is named before all its slots were computed"
            run = self.run[block]
            assert len(run) % self.tpb == 0
            assert tuple(self.slots[block]) == run[-self.tpb:], f"block {block} holds other tokens than its run"
            # The hash names the whole run from the sequence's start, recomputed here.
            assert chain_hashes(run, self.tpb, SEED)[-1] == name, f"block {block}: hash of another run"
            assert m._block_tokens[block] == run[-self.tpb:]
        reporter = m.reporter
        assert reporter is not None
        assert reporter.state == {h: (PINNED if self.holders[b] else CACHED) for h, b in m._cached.items()}

    @invariant()
    def running_requests_read_their_own_tokens(self) -> None:
        """The KV a request attends to: every computed position's slot holds the request's own token there."""
        for request in self.running:
            assert len(request.block_ids) * self.tpb >= request.num_computed_tokens
            for position in range(request.num_computed_tokens):
                block = request.block_ids[position // self.tpb]
                assert self.slots[block][position % self.tpb] == request.all_token_ids[position], (
                    f"{request.request_id} position {position} reads block {block}")


TestBlockManagerPrefixCacheMachine = PrefixCacheMachine.TestCase
TestBlockManagerPrefixCacheMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None,
                                                       suppress_health_check=[HealthCheck.too_slow])


def test_free_blocks_stay_cached_and_a_hit_never_takes_the_last_token() -> None:
    """A worked case of the rules the machine checks at random."""
    m = BlockManager(num_blocks=4, block_size=2, dcp_size=1, enable_prefix_caching=True, hash_seed=SEED,
                     verify_hits=True)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    assert m.admit(a, a.num_tokens) and a.block_ids == [] and a.num_computed_tokens == 0
    assert m.allocate(a, 5)
    a.num_computed_tokens = 5
    m.cache_computed(a)
    assert m.num_cached_blocks == 2  # [1, 2] and [3, 4]; [5] is not full
    m.free(a)
    assert (m.usage().used, m.num_free_blocks, m.num_cached_blocks) == (0, 4, 2)
    # Same prompt: the block of its last token ([5]) is computed again; [1, 2], [3, 4] hit.
    b = Request("b", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    assert m.admit(b, b.num_tokens) and b.block_ids == cached_block_ids(m, [1, 2, 3, 4]) and b.num_computed_tokens == 4
    # A prompt that is exactly two blocks: only the first may hit (the second holds the last token).
    c = Request("c", [1, 2, 3, 4], SamplingParams(max_tokens=1))
    assert m.find_cached(c) == b.block_ids[:1]
    assert m.pinned_hits(c) == 1  # b holds it
    m.free(b)
    assert m.pinned_hits(c) == 0 and m.num_free_blocks == 4


def cached_block_ids(m: BlockManager, tokens: list[int]) -> list[int]:
    """The blocks that cache the full blocks of `tokens`, by their names."""
    return [m._cached[h] for h in chain_hashes(tokens, m.tokens_per_block, SEED)]


# ---- the scheduler over random workloads -----------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), admission=st.sampled_from(["full", "usage"]), block_size=st.sampled_from([1, 2]),
       dcp=st.sampled_from([1, 2]), num_blocks=st.integers(6, 16), budget=st.sampled_from([3, 8, 64]))
def test_admission_with_caching_never_over_commits_and_returns_every_block(
        seed: int, admission: Literal["full", "usage"], block_size: int, dcp: int, num_blocks: int,
        budget: int) -> None:
    """Random arrivals whose prompts share prefixes (and prefixes of earlier requests' outputs), some with
    penalties, under both policies: at every step the referenced + promised blocks fit the pool and the ledger's
    per-request counts add up to exactly them (each shared block once); a request that starts after a cached run
    starts at a block boundary before its last token, its whole block table and (penalties) its whole history sent
    with it; "full" never preempts; at the end every block is back, the cached ones evictable."""
    rng = random.Random(seed)
    manager = BlockManager(num_blocks, block_size, dcp, enable_prefix_caching=True, hash_seed=SEED, verify_hits=True)
    tpb = manager.tokens_per_block
    config = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=budget, admission=admission,
                             kv_headroom=rng.choice([0.0, 0.1]), max_num_seqs=rng.choice([2, 4, 8]))
    scheduler = Scheduler(config, manager, frozenset({0}))
    pool = num_blocks * tpb
    bases = [[rng.randint(1, 3) for _ in range(pool)] for _ in range(2)]
    known: list[list[int]] = []  # token sequences of earlier requests: more prefixes to share
    added: list[Request] = []

    def new_request() -> None:
        source = rng.choice(bases + known)
        prompt = source[:rng.randint(1, min(len(source), pool // 2))] + [rng.randint(1, 3)] * rng.randint(0, 2)
        max_tokens = rng.randint(1, max(1, pool - len(prompt)) if admission == "full" else 2 * tpb)
        params = SamplingParams(max_tokens=max_tokens, repetition_penalty=rng.choice([1.0, 1.0, 1.3]))
        request = Request(f"r{len(added)}", prompt, params)
        scheduler.add_request(request)
        added.append(request)

    for step in range(5000):  # arrivals for 150 steps, then everything left runs to its end
        if step < 150 and rng.random() < 0.35:
            new_request()
        if not scheduler.has_unfinished:
            if step >= 150:
                break
            continue
        output = scheduler.schedule()
        for entry in output.scheduled:
            request = scheduler.requests[entry.request_id]
            if entry.is_new:
                assert entry.new_block_ids == request.block_ids
                assert entry.start_position % tpb == 0 and entry.start_position < request.num_tokens
                expected_prefix = request.all_token_ids[:entry.start_position]
                if request.sampling_params.has_penalties and entry.start_position:
                    assert entry.prefix_token_ids == expected_prefix
                else:
                    assert entry.prefix_token_ids is None
        # The fake runner's token depends on the request's output index only: outputs repeat across requests.
        scheduler.update(output, {e.request_id: 1 + (e.num_output_tokens % 3) for e in output.scheduled if e.sample})
        usage = scheduler.usage()
        assert usage.used <= usage.reserved <= usage.total, "over-committed"
        running = scheduler.running
        held = {b for r in running for b in r.block_ids}
        assert len(held) == usage.used
        assert sum(scheduler.committed_blocks(r) for r in running) == usage.reserved, "a shared block counted twice"
        assert all(scheduler.committed_blocks(r) >= 0 for r in list(running) + list(scheduler.waiting))
        known.extend(r.all_token_ids[:] for r in running if rng.random() < 0.05)
    assert not scheduler.has_unfinished
    assert all(r.is_finished for r in added)
    if admission == "full":
        assert scheduler.num_preemptions == 0
    usage = scheduler.usage()
    assert usage.used == 0 and usage.reserved == 0 and manager.num_free_blocks == num_blocks
    assert len(manager._evictable) == manager.num_cached_blocks  # every cached block is evictable, none leaked
    assert manager.num_hit_tokens <= manager.num_queried_tokens == sum(r.num_prompt_tokens for r in added)


def test_a_request_waiting_for_budget_without_chunked_prefill_is_looked_up_once() -> None:
    """Without chunked prefill a request whose uncached rest does not fit this step's budget waits. Waiting must
    not count as lookups (the hit statistics count each request once) nor move its cached blocks to the most
    recently used end of the LRU order."""
    manager = BlockManager(64, 4, 1, enable_prefix_caching=True, hash_seed=SEED, verify_hits=True)
    config = SchedulerConfig(max_model_len=24, max_num_batched_tokens=24, enable_chunked_prefill=False,
                             admission="full")
    scheduler = Scheduler(config, manager, frozenset({0}))

    def step() -> None:
        output = scheduler.schedule()
        scheduler.update(output, {e.request_id: 3 for e in output.scheduled if e.sample})

    warm = Request("warm", list(range(10, 22)), SamplingParams(max_tokens=1))  # 12 tokens: 3 blocks
    other = Request("other", list(range(40, 52)), SamplingParams(max_tokens=1))
    scheduler.add_request(warm)
    scheduler.add_request(other)
    step()
    assert not scheduler.has_unfinished and manager.num_cached_blocks == 6
    lru_before = list(manager._evictable)
    decoders = [Request(f"d{i}", [100 + i], SamplingParams(max_tokens=6)) for i in range(8)]
    for request in decoders:
        scheduler.add_request(request)
    step()  # 8 decoding requests take 8 tokens of each step's 24
    late = Request("late", list(range(10, 14)) + list(range(60, 78)), SamplingParams(max_tokens=1))  # hits 1 block
    scheduler.add_request(late)
    step()  # 18 uncached tokens > 24 - 8: waits
    step()
    assert late.status == RequestStatus.WAITING
    assert list(manager._evictable) == lru_before, "a request that did not start touched its cached blocks"
    while scheduler.has_unfinished:
        step()
    assert manager.num_queried_tokens == 24 + 8 + late.num_prompt_tokens
    assert manager.num_hit_tokens == 4
