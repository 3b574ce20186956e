"""The TTFT bound's parked holds (dcpserve/deployments/admission/bound_holds.py) in the real AdmissionQueue on the
simulated clock (dcpserve/simulator/clock.py): a held request leaves the queue's walk, and comes back when its hold
ends or a replica it watches could start it within the bound, so the walk costs the events, not events x held."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

import dcpserve.deployments.admission.queue as admission_queue
from dcpserve.deployments.admission.bound_holds import COMPACT_SLACK, BoundHolds
from dcpserve.deployments.admission.errors import QueueFull
from dcpserve.deployments.admission.pools import choose as real_choose
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import KvReport, PoolNeed
from dcpserve.simulator.clock import run_simulated

TOKENS = 16  # tokens per block
STEP_S = 0.1  # one engine step
STEP_TOKENS = 64  # four blocks a step: a block of prefill takes 0.025 s
BLOCK_S = STEP_S * TOKENS / STEP_TOKENS
BOUND_S = 2.0


def report(queue: AdmissionQueue, replica_id: str, backlog_s: float, capacity: int = 100_000, pool: str = "default",
           held: dict[str, int] | None = None) -> None:
    """A replica's report with backlog_s of prefill queued (whole blocks)."""
    queue.report(KvReport(replica_id=replica_id, capacity=capacity, tokens_per_block=TOKENS, held=held or {},
                          prefill_tokens=round(backlog_s / BLOCK_S) * TOKENS, step_s=STEP_S,
                          step_tokens=STEP_TOKENS, pool=pool))


def counting_choose(monkeypatch: pytest.MonkeyPatch, limit: int) -> list[int]:
    """Counts the queue's evaluations of a request (pools.choose, called through); raises past `limit`, so that a
    walk that looks at every held request at every event fails at once instead of running on."""
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > limit:
            raise AssertionError(f"more than {limit} evaluations")
        return real_choose(*args, **kwargs)

    monkeypatch.setattr(admission_queue, "choose", counted)
    return calls


def new_queue(**kwargs: Any) -> AdmissionQueue:
    return AdmissionQueue(max_queued=100_000, clock=asyncio.get_running_loop().time, ttft_bound_s=BOUND_S, **kwargs)


def test_thousands_of_held_requests_cost_the_walk_per_event_not_per_event_and_waiter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas whose backlogs stay past the bound (each report says so again), 1,000 requests arriving 1 ms
    apart, each granted request released 50 ms later: every request is held until the bound's hold runs out. The
    queue's evaluations of a request (`choose`) stay a few per request and per report; walking every held request
    at each arrival, release and report made it about requests^2 / 2 (half a million here)."""
    requests = 1000
    calls = counting_choose(monkeypatch, 10 * requests)

    async def run() -> tuple[list[tuple[float, float]], Mapping[str, int], int]:
        loop = asyncio.get_running_loop()
        queue = new_queue()
        steady = {"a": 3.0, "b": 2.6}  # past the bound for a 0.1 s prompt: it waits 0.7 s behind b's
        reports = 0

        async def report_loop() -> None:
            nonlocal reports
            while True:
                for replica_id, backlog_s in steady.items():
                    report(queue, replica_id, backlog_s)
                    reports += 1
                await asyncio.sleep(0.5)

        times: list[tuple[float, float]] = []

        async def client(index: int) -> None:
            await asyncio.sleep(index * 0.001)
            arrived = loop.time()
            await queue.acquire(f"t{index}", 4, 30.0)  # 4 blocks: 0.1 s of its own prefill
            times.append((arrived, loop.time()))
            await asyncio.sleep(0.05)
            queue.release(f"t{index}")

        reporter = loop.create_task(report_loop())
        await asyncio.gather(*(client(i) for i in range(requests)))
        reporter.cancel()
        return times, queue.stats().decisions, reports

    times, decisions, reports = run_simulated(run())
    assert len(times) == requests
    # Never held past the bound: each is granted within the bound of its arrival.
    # Most are held first (the others arrive while a burst of grants at one hold's end is queued on b for longer
    # than a hold may last, and go over the bound at once); none is granted within the bound.
    assert decisions["backlog_deferred"] > requests // 2
    assert decisions["over_bound"] == requests
    assert all(granted - arrived <= BOUND_S + 1e-6 for arrived, granted in times)
    # One evaluation at arrival, one at each end of a hold (its budget of 2 s in holds of about 0.5 s between
    # reports), and the walk's look at reports that move no backlog under the bound is none.
    assert calls[0] <= 6 * requests + reports, calls[0]


def test_a_report_that_finds_a_backlog_drained_ends_the_hold_at_once() -> None:
    async def run() -> tuple[str, float, str]:
        loop = asyncio.get_running_loop()
        queue = new_queue()
        report(queue, "a", backlog_s=3.0)
        report(queue, "b", backlog_s=2.5)  # the hold would end at 0.6 s, when b drains under the bound
        task = loop.create_task(queue.acquire("t", 4, 30.0))
        await asyncio.sleep(0.2)
        assert not task.done() and queue.num_queued == 1  # held, and counted as waiting
        report(queue, "a", backlog_s=0.0)  # a was faster than estimated
        replica_id = await task
        grant = queue.grant_of("t")
        assert grant is not None
        return replica_id, loop.time(), grant.decision

    replica_id, at, decision = run_simulated(run())
    assert (replica_id, at) == ("a", pytest.approx(0.2))
    assert decision in ("preferred", "backlog_rerouted", "only_choice", "start_soonest", "most_free")


def test_a_grant_that_goes_back_before_its_replica_reported_it_ends_the_hold() -> None:
    async def run() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        queue = new_queue()
        report(queue, "r", backlog_s=0.0)
        assert await queue.acquire("big", 60, 30.0) == "r"  # 1.5 s of prefill, within the bound: granted
        task = loop.create_task(queue.acquire("t", 40, 30.0))  # 1.0 s of its own behind 1.5 s: held 0.5 s
        await asyncio.sleep(0.1)
        assert not task.done()
        queue.release("big")  # its prefill, which no report named yet, leaves r's backlog
        replica_id = await task
        return replica_id, loop.time()

    replica_id, at = run_simulated(run())
    assert (replica_id, at) == ("r", pytest.approx(0.1))


def test_a_replica_that_joins_takes_the_held_request_at_once() -> None:
    async def run() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        queue = new_queue()
        report(queue, "old", backlog_s=2.5)
        task = loop.create_task(queue.acquire("t", 4, 30.0))
        await asyncio.sleep(0.1)
        report(queue, "new", backlog_s=0.0)
        replica_id = await task
        return replica_id, loop.time()

    replica_id, at = run_simulated(run())
    assert (replica_id, at) == ("new", pytest.approx(0.1))


def test_held_requests_count_against_the_queue_bound_and_go_when_released() -> None:
    async def run() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=2, clock=loop.time, ttft_bound_s=BOUND_S)
        report(queue, "r", backlog_s=2.5)
        held = [loop.create_task(queue.acquire(f"t{i}", 4, 30.0)) for i in range(2)]
        await asyncio.sleep(0.1)
        assert queue.num_queued == 2 and queue.stats().num_queued == 2
        with pytest.raises(QueueFull):
            await queue.acquire("third", 4, 30.0)  # the held two fill the queue
        queue.release("t0")  # the caller gave up: the held request leaves the queue
        with pytest.raises(asyncio.CancelledError):
            await held[0]
        queued_after = queue.num_queued
        await held[1]
        return queued_after, queue.num_queued

    assert run_simulated(run()) == (1, 0)


def test_a_held_request_does_not_watch_a_replica_within_the_bound_that_a_closed_pool_keeps_from_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pool x's replica would start the request at once, but a larger request ahead that only x can hold waits for
    KV there and closes x to those behind it; y's replica is past the bound. The request is held for y's backlog; it
    must not watch x (it would wake at once, again and again, at one instant), and its hold ends on time."""
    calls = counting_choose(monkeypatch, 100)

    async def run() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        queue = new_queue()
        report(queue, "x0", backlog_s=0.0, capacity=100, pool="x", held={"other": 90})
        report(queue, "y0", backlog_s=2.5, pool="y")
        big = loop.create_task(queue.acquire("big", {"x": PoolNeed(50)}, 30.0))  # no room on x: it waits, closing x
        await asyncio.sleep(0.01)
        replica_id = await queue.acquire("t", {"x": PoolNeed(4), "y": PoolNeed(4)}, 30.0)
        at = loop.time()
        big.cancel()
        return replica_id, at

    replica_id, at = run_simulated(run())
    assert (replica_id, at) == ("y0", pytest.approx(0.6))  # 2.5 + 0.1 - 2.0: then y0 starts it within the bound
    assert calls[0] < 20


class _Held:
    def __init__(self, until: float) -> None:
        self.timeout_at = 1e9
        self.deadline_at: float | None = None
        self.defer_end: float | None = until
        self.defer_until: float | None = until


def test_parking_many_requests_that_each_watch_every_replica_compacts_in_amortized_constant_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A park pushes one heap entry per replica it watches: at 64 replicas the live entries are 65 per parked request.
    Compaction is paid by the entries pushed since the last one (each scanned O(1) times on average), not once per
    park over every live entry; and parks that end leave at most as many stale entries as there are live ones."""
    replicas = [f"r{i}" for i in range(64)]
    holds: BoundHolds[_Held] = BoundHolds(2.0, lambda: None)
    scanned = [0]
    compact = BoundHolds._compact

    def counted(self: BoundHolds[_Held]) -> None:
        scanned[0] += self._entries
        compact(self)

    monkeypatch.setattr(BoundHolds, "_compact", counted)
    waiters = [_Held(10.0 + i) for i in range(400)]
    for waiter in waiters:
        holds.park(waiter, [(replica, 0.5) for replica in replicas])
    pushed = 400 * 65
    assert len(holds) == 400
    assert scanned[0] <= 3 * pushed  # each park compacting over every live entry scanned ~pushed x 200 here

    def heap_entries() -> int:
        return (len(holds._ends) + sum(map(len, holds._watch.values())) + sum(map(len, holds._room.values())))

    for cycle, waiter in enumerate(waiters * 5):  # parked again and again: the entries of each earlier park go stale
        holds.park(waiter, [(replica, 0.5) for replica in replicas])
        assert heap_entries() <= 2 * 400 * 65 + 2 * 65 + COMPACT_SLACK, cycle
    assert len(holds) == 400
    # every parked request still wakes when its hold ends
    assert len(holds.wake(1e6, {})) == 400
