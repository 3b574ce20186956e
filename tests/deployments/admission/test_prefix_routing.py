"""Prefix-aware routing in the admission queue (dcpserve/deployments/admission/prefix_routing.py and
replica_choice.py): the replicas' reported caches applied in order, grants steered to the replica caching a
prompt's prefix and counted by the blocks they add, and never at the cost of balance or room."""


from __future__ import annotations

import asyncio

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import PrefixAsk
from dcpserve.engine.core.prefix_cache import (
    CACHED,
    EVICTED,
    PINNED,
    PrefixIndex,
    PrefixReport,
    PrefixReporter,
    prompt_hashes,
)
from tests.deployments.admission.test_admission import SEED, ask_for, cache_report, grant_of, kv, make_queue


def test_prefix_report_changes_apply_in_order_and_a_lost_report_brings_the_whole_state() -> None:
    writer, index = PrefixReporter(32, SEED), PrefixIndex()
    writer.set(1, PINNED)
    writer.set(2, PINNED)
    first = writer.report(index.epoch, index.version)
    assert first.full  # a new reader gets the whole state
    index.apply(first)
    writer.set(2, CACHED)
    writer.set(3, PINNED)
    delta = writer.report(index.epoch, index.version)
    assert not delta.full and delta.changes == {2: CACHED, 3: PINNED}
    index.apply(delta)
    assert index.blocks == {1: PINNED, 2: CACHED, 3: PINNED}
    writer.set(1, EVICTED)
    writer.report(index.epoch, index.version)  # lost on the way: the reader stays where it was
    writer.set(4, CACHED)
    again = writer.report(index.epoch, index.version)
    assert again.full and again.changes == {2: CACHED, 3: PINNED, 4: CACHED}
    index.apply(again)
    assert index.blocks == writer.state
    assert index.epoch is not None
    stale = PrefixReport(index.epoch, index.version + 5, index.version + 4, False, {9: PINNED}, 32, SEED)
    index.apply(stale)  # changes from a state the reader never had are ignored
    assert 9 not in index.blocks


def test_routes_to_the_replica_caching_the_prefix_and_counts_only_the_blocks_it_adds() -> None:
    async def run() -> None:
        queue = make_queue({"a": 20, "b": 20})
        prompt = list(range(100))  # 3 full blocks of 32 before the last token
        writer = PrefixReporter(32, SEED)
        for block in prompt_hashes(prompt, 32, SEED):
            writer.set(block, CACHED)  # cached but held by nobody: saves compute, not KV
        cache_report(writer, queue, "b", 20)
        queue.report(kv("a", 20))
        assert await queue.acquire("t1", 5, 1.0, ask=ask_for(prompt + [7, 8])) == "b"
        assert grant_of(queue, "t1").need == 5 and grant_of(queue, "t1").hit_blocks == 3
        for block in prompt_hashes(prompt, 32, SEED):
            writer.set(block, PINNED)  # t1 runs and holds them
        cache_report(writer, queue, "b", 20, {"t1": 5})
        assert await queue.acquire("t2", 5, 1.0, ask=ask_for(prompt + [9])) == "b"
        assert grant_of(queue, "t2").need == 2  # its 3 shared blocks are t1's
        assert queue.replicas["b"].free == 20 - 5 - 2
        assert queue.stats().prefix_hit_blocks == 6 and queue.stats().prefix_query_blocks == 6

    asyncio.run(run())


def test_a_replica_with_the_prefix_but_no_room_does_not_hold_the_request_back() -> None:
    async def run() -> None:
        queue = make_queue({"a": 20, "b": 20})
        prompt = list(range(100))
        writer = PrefixReporter(32, SEED)
        for block in prompt_hashes(prompt, 32, SEED):
            writer.set(block, CACHED)
        cache_report(writer, queue, "b", 20, {"other": 18})  # b has 2 blocks free
        assert await queue.acquire("t", 5, 1.0, ask=ask_for(prompt)) == "a"
        assert grant_of(queue, "t").hit_blocks == 0

    asyncio.run(run())


def test_the_longest_cached_run_wins_and_free_kv_decides_between_equal_runs() -> None:
    async def run() -> None:
        prompt = list(range(100))  # 3 blocks cached on b (and, in the last case, 2 on a)
        for b_held, a_blocks, routing, expected in [(2, 0, True, "b"),  # b caches more: b, though a has more free
                                                    (14, 0, True, "b"),  # far less free, still room: b
                                                    (16, 0, True, "a"),  # no room for 5 on b: a
                                                    (2, 3, True, "a"),  # equal runs: the most free KV
                                                    (2, 2, True, "b"),  # a's run is shorter: b
                                                    (1, 0, False, "a")]:  # prefix routing off: most free KV
            queue = AdmissionQueue(max_queued=4, prefix_routing=routing)
            writer_a, writer_b = PrefixReporter(32, SEED), PrefixReporter(32, SEED)
            for index, block in enumerate(prompt_hashes(prompt, 32, SEED)):
                writer_b.set(block, CACHED)
                if index < a_blocks:
                    writer_a.set(block, CACHED)
            cache_report(writer_a, queue, "a", 20)
            cache_report(writer_b, queue, "b", 20, {"other": b_held})
            assert await queue.acquire("t", 5, 1.0, ask=ask_for(prompt)) == expected, (b_held, a_blocks, routing)

    asyncio.run(run())


def test_a_burst_sharing_a_new_prefix_follows_the_first_grant_and_other_layouts_never_match() -> None:
    async def run() -> None:
        queue = make_queue({"a": 20, "b": 18})
        prompt = list(range(100))
        assert await queue.acquire("t1", 5, 1.0, ask=ask_for(prompt + [1])) == "a"  # most free
        assert grant_of(queue, "t1").hit_blocks == 0
        queue.release("t1")
        long_prompt = list(range(300))  # 9 blocks = 288 tokens
        assert await queue.acquire("t2", 10, 1.0, ask=ask_for(long_prompt + [1])) == "a"
        # Nothing reported yet, but t2 computes the prefix on a: t3 follows it (after the grant a would have no
        # block free and b 8 = 256 tokens, but the 288 tokens of prefix in flight on a weigh more).
        assert await queue.acquire("t3", 10, 1.0, ask=ask_for(long_prompt + [2])) == "a"
        assert grant_of(queue, "t3").need == 10  # in flight is a preference, never a KV discount
        queue.release("t2")
        queue.release("t3")
        other = PrefixAsk(tuple(prompt_hashes(long_prompt, 64, SEED)), 64, SEED, len(long_prompt))
        writer = PrefixReporter(32, SEED)
        for block in prompt_hashes(long_prompt, 32, SEED):
            writer.set(block, PINNED)
        cache_report(writer, queue, "b", 18, {})
        assert queue.replicas["b"].prefix.match(other)[0].hit_blocks == 0  # hashed with another block size
        assert queue.replicas["b"].prefix.match(ask_for(long_prompt))[0].pinned_blocks == 9

    asyncio.run(run())


def test_a_finished_turn_keeps_steering_its_conversation_until_the_replica_reports_its_cache() -> None:
    async def run() -> None:
        queue = make_queue({"a": 20, "b": 18})
        history = list(range(300))
        assert await queue.acquire("turn1", 10, 1.0, ask=ask_for(history)) == "a"
        queue.release("turn1")  # the answer ended; the next turn comes at once, before a's next report
        queue.report(kv("b", 21))  # b now has more free KV
        assert await queue.acquire("turn2", 10, 1.0, ask=ask_for(history + [1, 2])) == "a"
        queue.release("turn2")
        for _ in range(2):  # two reports from a (neither names the prefix): the preference is gone
            queue.report(kv("a", 20, prefix=PrefixReporter(32, SEED).report(None, 0)))
        assert await queue.acquire("turn3", 10, 1.0, ask=ask_for(history + [1, 2, 3])) == "b"

    asyncio.run(run())


def test_prefix_affinity_never_piles_requests_onto_one_replica_while_another_idles() -> None:
    async def run() -> None:
        queue = make_queue({"a": 100, "b": 100})
        system = list(range(640))  # a long shared system prompt: 20 blocks
        assert await queue.acquire("t0", 21, 1.0, ask=ask_for(system + [0])) == "a"
        writer = PrefixReporter(32, SEED)
        for block in prompt_hashes(system, 32, SEED):
            # t0 runs on a and holds the system prompt (19 whole blocks before its last token).
            writer.set(block, PINNED)
        cache_report(writer, queue, "a", 100, {"t0": 21})
        granted = [await queue.acquire(f"t{i}", 21, 1.0, ask=ask_for(system + [i])) for i in range(1, 5)]
        # a wins on cost every time, but with 3 sequences against none (past least + 2) b takes the next one; then
        # 3 against 1 is in balance again.
        assert granted == ["a", "a", "b", "a"], granted
        assert grant_of(queue, "t1").need == 2 and grant_of(queue, "t3").need == 21  # 19 of its 21 blocks shared on a

    asyncio.run(run())
