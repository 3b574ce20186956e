"""The admission queue over layout pools: a request's need per pool, the pool it is granted, and the per-pool
head-of-line rule (a request waits only behind requests that could use the same pools). The real AdmissionQueue
on a simulated clock: every outcome here is a function of the calls, not of timing."""

from __future__ import annotations

import asyncio

import pytest

from dcpserve.deployments.admission.errors import NeverFits
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import KvReport, PoolNeed
from dcpserve.simulator.clock import run_simulated

# Two pools of one replica each, 2 GPUs and 4 seats per step: "short" (tp=2 dcp=1: 16-token blocks, 100 blocks,
# 20 ms steps) and "long" (tp=2 dcp=2: 32-token blocks, 100 blocks = twice the tokens, 30 ms steps).


def report(queue: AdmissionQueue, held_short: dict[str, int] | None = None,
           held_long: dict[str, int] | None = None) -> None:
    queue.report(KvReport(replica_id="s0", capacity=100, tokens_per_block=16, held=held_short or {}, probes=1,
                          pool="short", step_s=0.020, gpus=2, max_seqs=4))
    queue.report(KvReport(replica_id="l0", capacity=100, tokens_per_block=32, held=held_long or {}, probes=1,
                          pool="long", step_s=0.030, gpus=2, max_seqs=4))


def need(tokens: int) -> dict[str, PoolNeed]:
    """A request of `tokens` prompt tokens: its blocks in each pool's block size."""
    return {"short": PoolNeed(-(-tokens // 16)), "long": PoolNeed(-(-tokens // 32))}


def test_a_short_request_goes_to_the_faster_pool_until_its_kv_share_there_costs_more_than_the_slower_pool() -> None:
    async def scenario() -> list[str]:
        queue = AdmissionQueue(max_queued=16, clock=asyncio.get_running_loop().time)
        report(queue)
        # 10 short / 5 long blocks each. Per token: short 2 GPUs x 20 ms x max(10 / free, 1/4 seat), long 2 x 30 ms
        # x 1/4 = 15 ms. Short is cheaper while its free KV is 30 or more (at 30: 13.3 ms), not at 20 (20 ms).
        return [await queue.acquire(f"r{i}", need(160), 1.0) for i in range(9)]

    assert run_simulated(scenario()) == ["s0"] * 8 + ["l0"]


def test_a_request_that_takes_much_of_the_fast_pools_kv_goes_to_the_pool_where_it_costs_fewer_gpu_seconds() -> None:
    async def scenario() -> list[str]:
        queue = AdmissionQueue(max_queued=8, clock=asyncio.get_running_loop().time)
        report(queue)
        # 800 tokens: short 2 x 20 ms x 50/100 = 20 ms per token, long 2 x 30 ms x 25/100 = 15 ms.
        return [await queue.acquire(f"r{i}", need(800), 1.0) for i in range(3)]

    # The third: long 25/50 of its free KV (30 ms) against short 50/100 (20 ms).
    assert run_simulated(scenario()) == ["l0", "l0", "s0"]


def test_every_grant_names_its_pool_and_why() -> None:
    heard: list[tuple[str, str]] = []

    async def scenario() -> None:
        queue = AdmissionQueue(max_queued=8, clock=asyncio.get_running_loop().time,
                               on_pool=lambda pool, reason: heard.append((pool, reason)))
        report(queue)
        await queue.acquire("short", need(160), 1.0)
        await queue.acquire("long", need(800), 1.0)
        await queue.acquire("fills-short", need(1440), 1.0)  # 90 short blocks (free 90), 45 long (free 75)
        await queue.acquire("only-room", need(1280), 1.0)  # 40 long blocks: long has 30 free, short 90 for its 80
        await queue.acquire("only-long", {"long": PoolNeed(10)}, 1.0)
        grant = queue.grant_of("only-long")
        assert grant is not None and grant.pool == "long"

    run_simulated(scenario())
    # fills-short: short 2 x 20 ms x 90/90 = 40 ms, long 2 x 30 ms x 45/75 = 36 ms: long.
    assert heard == [("short", "cheapest"), ("long", "cheapest"), ("long", "cheapest"), ("short", "only_room"),
                     ("long", "only_pool")]


def test_a_request_only_the_long_pool_holds_goes_there_and_one_no_pool_holds_is_refused() -> None:
    async def scenario() -> str:
        queue = AdmissionQueue(max_queued=8, clock=asyncio.get_running_loop().time)
        report(queue)
        with pytest.raises(NeverFits, match=r"pool long: this request needs 157 KV blocks .* pool short: this "
                                            r"request needs 313 KV blocks"):
            await queue.acquire("huge", need(5000), 1.0)
        return await queue.acquire("r", need(2400), 1.0)  # 150 short blocks: only the long pool (75) holds it

    assert run_simulated(scenario()) == "l0"


def test_a_long_request_waits_without_holding_back_short_ones_that_another_pool_has_room_for() -> None:
    async def scenario() -> list[tuple[str, str, float]]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=8, clock=loop.time)
        report(queue)
        events: list[tuple[str, str, float]] = []

        async def ask(ticket: str, request: dict[str, PoolNeed]) -> None:
            replica = await queue.acquire(ticket, request, 10.0)
            events.append((ticket, replica, loop.time()))

        await ask("long-a", {"long": PoolNeed(80)})  # the long pool: 80 of 100 blocks
        waiting = loop.create_task(ask("long-b", {"long": PoolNeed(60)}))  # waits for long-a
        await asyncio.sleep(0.1)
        await ask("short-a", {"short": PoolNeed(30)})  # the short pool is open: no wait behind long-b
        await asyncio.sleep(0.9)
        queue.release("long-a")
        await waiting
        return events

    events = run_simulated(scenario())
    assert [(ticket, replica) for ticket, replica, _ in events] == [
        ("long-a", "l0"), ("short-a", "s0"), ("long-b", "l0")]
    assert events[1][2] == pytest.approx(0.1) and events[2][2] == pytest.approx(1.0)


def test_a_waiting_request_closes_every_pool_it_could_use_to_those_behind_it() -> None:
    async def scenario() -> list[str]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=8, clock=loop.time)
        report(queue)
        order: list[str] = []

        async def ask(ticket: str, request: dict[str, PoolNeed]) -> None:
            await queue.acquire(ticket, request, 10.0)
            order.append(ticket)

        await ask("fill-short", {"short": PoolNeed(90)})
        await ask("fill-long", {"long": PoolNeed(90)})
        big = loop.create_task(ask("big", {"short": PoolNeed(60), "long": PoolNeed(30)}))  # fits neither now
        await asyncio.sleep(0.1)
        small = loop.create_task(ask("small", {"short": PoolNeed(5), "long": PoolNeed(3)}))  # would fit both
        await asyncio.sleep(0.1)
        assert order == ["fill-short", "fill-long"]  # small waits behind big: strict FIFO over their pools
        queue.release("fill-long")
        await asyncio.gather(big, small)
        return order

    assert run_simulated(scenario()) == ["fill-short", "fill-long", "big", "small"]


def test_an_int_need_is_the_one_pool_app_strict_fifo() -> None:
    async def scenario() -> list[str]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=8, clock=loop.time)
        queue.report(KvReport(replica_id="a", capacity=10, tokens_per_block=16, held={}, probes=1))
        order: list[str] = []

        async def ask(ticket: str, blocks: int) -> None:
            await queue.acquire(ticket, blocks, 10.0)
            order.append(ticket)

        await ask("first", 8)
        head = loop.create_task(ask("head", 5))
        await asyncio.sleep(0.1)
        behind = loop.create_task(ask("behind", 1))  # 2 blocks free, but the head waits
        await asyncio.sleep(0.1)
        assert order == ["first"]
        queue.release("first")
        await asyncio.gather(head, behind)
        return order

    assert run_simulated(scenario()) == ["first", "head", "behind"]


def test_a_request_need_is_an_int_with_one_pool_and_blocks_of_each_pools_size_with_several() -> None:
    from dcpserve.deployments.admission.pools import request_need
    from dcpserve.deployments.config import parse_args

    one = parse_args({"model": "/m", "block_size": 16, "decode_context_parallel_size": 2,
                      "tensor_parallel_size": 2})
    assert one.pool_layouts() == {"default": 32}
    assert request_need(one.pool_layouts(), "full", 100, 28) == 4  # 128 tokens in 32-token blocks
    two = parse_args({"model": "/m", "block_size": 16, "pools": [
        {"name": "short", "tensor_parallel_size": 2}, {"name": "long", "tensor_parallel_size": 2,
                                                        "decode_context_parallel_size": 2}]})
    assert request_need(two.pool_layouts(), "full", 100, 28) == {"short": PoolNeed(8, total_blocks=8),
                                                                  "long": PoolNeed(4, total_blocks=4)}
    assert request_need(two.pool_layouts(), "usage", 100, 28) == {"short": PoolNeed(7, total_blocks=8),
                                                                   "long": PoolNeed(4, total_blocks=4)}


def test_each_pool_counts_the_waiting_requests_it_could_hold() -> None:
    async def scenario() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=8, clock=loop.time)
        report(queue)
        await queue.acquire("fill-long", {"long": PoolNeed(95)}, 1.0)
        await queue.acquire("fill-short", {"short": PoolNeed(95)}, 1.0)
        waiting = [loop.create_task(queue.acquire("long-only", {"long": PoolNeed(20)}, 5.0)),
                   loop.create_task(queue.acquire("either", {"short": PoolNeed(20), "long": PoolNeed(10)}, 5.0))]
        await asyncio.sleep(0.1)
        counts = queue.num_queued_for("short"), queue.num_queued_for("long")
        for task in waiting:
            task.cancel()
        return counts

    assert run_simulated(scenario()) == (1, 2)
