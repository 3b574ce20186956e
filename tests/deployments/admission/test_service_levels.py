"""Service levels in the real AdmissionQueue under a simulated clock (dcpserve/simulator/clock.py): priority bands, fair
shares of KV-seconds across tenants, deadlines, shedding, per-tenant limits. Every outcome here is a function of the
queue's state and the simulated time, so each is asserted exactly, whatever the machine does."""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable
from typing import Any

import pytest

from dcpserve.deployments.admission.errors import DeadlineExceeded, LimitExceeded, QueueFull, QueueTimeout, Shed
from dcpserve.deployments.admission.fair_share import TenantShares, admission_order, iter_admission_order
from dcpserve.deployments.admission.latency_window import LatencyWindow, nearest_rank
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.tenant_limits import Exceeded, Limits, TenantLimits
from dcpserve.deployments.messages import KvReport, ServiceLevel
from dcpserve.simulator.clock import run_simulated

TOKENS_PER_BLOCK = 16


def queue_on(loop: asyncio.AbstractEventLoop, capacity: int, **kwargs: Any) -> AdmissionQueue:
    events: list[tuple[str, float | None, ServiceLevel | None]] = []
    queue = AdmissionQueue(clock=loop.time, on_event=lambda *e: events.append(e), **{"max_queued": 64, **kwargs})
    queue.report(KvReport(replica_id="r", capacity=capacity, tokens_per_block=TOKENS_PER_BLOCK, held={}))
    queue.events = events  # type: ignore[attr-defined]  # the test reads what the queue told its observer
    return queue


def start(queue: AdmissionQueue, ticket: str, need: int, timeout_s: float = 100.0,
          **level: Any) -> asyncio.Task[str]:
    return asyncio.get_running_loop().create_task(queue.acquire(ticket, need, timeout_s, level=ServiceLevel(**level)))


def track(tasks: dict[str, asyncio.Task[str]]) -> list[str]:
    """The names of the tasks granted, in the order they were granted (a list that grows as they are)."""
    granted: list[str] = []

    def done(task: asyncio.Task[str], name: str) -> None:
        if not task.cancelled() and task.exception() is None:
            granted.append(name)

    for name, task in tasks.items():
        task.add_done_callback(functools.partial(done, name=name))
    return granted


async def settle() -> None:
    """Lets every task that can run do so (a grant reaches its caller through a few callbacks); no time passes."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_priority_bands_grant_lower_values_first_and_a_large_head_still_blocks_its_band() -> None:
    async def main() -> list[str]:
        queue = queue_on(asyncio.get_running_loop(), capacity=10)
        assert await queue.acquire("hold", 10, 1.0) == "r"
        granted = track({name: start(queue, name, need, priority=priority) for name, need, priority in
                         [("p5-a", 2, 5), ("p5-b", 2, 5), ("p0-big", 9, 0), ("p0-small", 1, 0), ("p-1", 3, -1)]})
        await settle()
        assert not granted
        queue.release("hold")
        await settle()
        # -1 first (3 blocks), then band 0 in arrival order: the big one does not fit (7 left) and blocks the
        # small one behind it and band 5, so a large request is never starved by smaller ones.
        assert granted == ["p-1"]
        queue.release("p-1")
        await settle()
        assert granted == ["p-1", "p0-big", "p0-small"]
        queue.release("p0-big")
        queue.release("p0-small")
        await settle()
        return list(granted)

    assert run_simulated(main()) == ["p-1", "p0-big", "p0-small", "p5-a", "p5-b"]


def test_a_light_tenant_goes_ahead_of_a_flooding_tenant_and_finds_room_for_its_next_request() -> None:
    """A holds the KV and floods the queue; B's one request, arriving last, is the next granted: A has attained
    KV-seconds, B none (FIFO would put it behind all of A's). Then A, over its fair share (half the KV with B seen
    in the last half-life), does not take the last free block: B's next request finds it at once. Once B has been
    quiet for a half-life, A takes everything again."""

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        queue = queue_on(loop, capacity=4, fair_share_half_life_s=30.0)
        for i in range(4):
            await queue.acquire(f"a-run{i}", 1, 1.0, level=ServiceLevel("A"))
        waiting = [start(queue, f"a-wait{i}", 1, 1000.0, tenant="A") for i in range(6)]
        await asyncio.sleep(2.0)
        b = start(queue, "b", 1, tenant="B")
        await settle()
        granted = track({**{f"a-wait{i}": t for i, t in enumerate(waiting)}, "b": b})
        queue.release("a-run0")  # B's request takes it
        await settle()
        queue.release("a-run1")  # A holds 2 of 4 blocks, B 1: granting A would leave nothing for B's next
        await settle()
        assert granted == ["b"] and queue.replicas["r"].free == 1
        queue.release("b")  # A may hold 3 of 4: one block stays free for B
        await settle()
        assert granted == ["b", "a-wait0"]
        await asyncio.sleep(1.0)
        b2 = start(queue, "b2", 1, tenant="B")
        await settle()
        assert b2.done() and await b2 == "r"  # at once
        queue.release("b2")
        await asyncio.sleep(31.0)  # B quiet for a half-life: A may hold all of the KV
        queue.release("a-run2")
        await settle()
        return list(granted)

    # a-wait0 when b ended (one block stays free for B), b2 at once, a-wait1 and a-wait2 once B was quiet.
    assert run_simulated(main()) == ["b", "a-wait0", "a-wait1", "a-wait2"]


def test_grants_made_at_one_instant_alternate_between_tenants_by_weight() -> None:
    """Two tenants with no history, one weighted 2: a release that frees room for six grants gives them in the
    pattern deficit round robin's rounds would (each grant charges its tenant need x quantum at once)."""

    async def main() -> list[str]:
        queue = queue_on(asyncio.get_running_loop(), capacity=6)
        await queue.acquire("hold", 6, 1.0, level=ServiceLevel("C"))
        tasks = {f"heavy{i}": start(queue, f"heavy{i}", 1, tenant="H", weight=2.0) for i in range(6)}
        tasks |= {f"light{i}": start(queue, f"light{i}", 1, tenant="L") for i in range(6)}
        granted = track(tasks)
        await settle()
        queue.release("hold")
        await settle()
        return list(granted)

    granted = run_simulated(main())
    assert [g.rstrip("0123456789") for g in granted] == ["heavy", "light", "heavy", "heavy", "light", "heavy"]


def test_kv_seconds_shares_follow_the_weights_under_a_simulated_closed_loop() -> None:
    """Three tenants keep 8 requests each outstanding for 300 simulated seconds, requests of random sizes and
    hold times (seeded); each tenant's KV token-seconds over the run, divided by its weight, are within 10% of each
    other. Under FIFO they would follow the request mix, not the weights."""
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}

    async def main() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        queue = queue_on(loop, capacity=40, fair_share_half_life_s=30.0)
        rng = random.Random(7)
        used = dict.fromkeys(weights, 0.0)
        end = 300.0

        async def client(tenant: str, k: int) -> None:
            n = 0
            while loop.time() < end:
                n += 1
                need = rng.randint(1, 6) if tenant != "c" else rng.randint(4, 8)  # c asks for more per request
                ticket = f"{tenant}{k}-{n}"
                await queue.acquire(ticket, need, 1e6, level=ServiceLevel(tenant, weight=weights[tenant]))
                granted_at = loop.time()
                await asyncio.sleep(rng.uniform(0.5, 3.0))
                used[tenant] += need * TOKENS_PER_BLOCK * (min(loop.time(), end) - min(granted_at, end))
                queue.release(ticket)

        await asyncio.gather(*(client(t, k) for t in weights for k in range(8)))
        return {t: used[t] / weights[t] for t in weights}

    shares = run_simulated(main())
    mean = sum(shares.values()) / len(shares)
    assert all(abs(s / mean - 1) < 0.10 for s in shares.values()), shares


def test_deadlines_order_a_tenant_s_requests_and_end_their_wait_exactly_at_the_deadline() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = queue_on(loop, capacity=2)
        await queue.acquire("hold", 2, 1.0)
        late = start(queue, "no-deadline", 1)
        soon = start(queue, "deadline-9s", 1, deadline_s=9.0)
        expires = start(queue, "deadline-3s", 2, deadline_s=3.0)
        await settle()
        with pytest.raises(DeadlineExceeded, match=r"deadline came after 3.0s in the admission queue"):
            await expires
        assert loop.time() == pytest.approx(3.0)
        assert queue.events[-1][0] == "rejected_deadline"  # type: ignore[attr-defined]
        queue.release("hold")
        await settle()
        assert await soon == "r" and await late == "r"
        with pytest.raises(DeadlineExceeded, match="passed 0.500s before it reached the admission queue"):
            await queue.acquire("past", 1, 5.0, level=ServiceLevel(deadline_s=-0.5))
        with pytest.raises(QueueTimeout):  # a deadline later than queue_timeout_s: the timeout answers
            await queue.acquire("later", 1, 1.0, level=ServiceLevel(deadline_s=50.0))

    run_simulated(main())


def test_deadline_orders_before_arrival_within_a_tenant() -> None:
    async def main() -> list[str]:
        queue = queue_on(asyncio.get_running_loop(), capacity=1)
        await queue.acquire("hold", 1, 1.0)
        granted = track({name: start(queue, name, 1, deadline_s=deadline)
                         for name, deadline in [("none", None), ("d20", 20.0), ("d10", 10.0)]})
        await settle()
        for ticket in ["hold", "d10", "d20"]:
            queue.release(ticket)
            await settle()
        return list(granted)

    assert run_simulated(main()) == ["d10", "d20", "none"]


def test_sheddable_requests_are_refused_newest_first_once_one_that_is_not_sheddable_waits() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = queue_on(loop, capacity=4, sheddable_priority=10, max_queued=3)
        await queue.acquire("hold", 4, 1.0)
        refused: list[str] = []
        batch = [start(queue, f"batch{i}", 1, priority=10 + i) for i in range(3)]  # only sheddable ones wait
        def shed(task: asyncio.Task[str], name: str) -> None:
            if task.exception() is not None:
                refused.append(name)

        for i, task in enumerate(batch):
            task.add_done_callback(functools.partial(shed, name=f"batch{i}"))
        await asyncio.sleep(1.0)
        assert refused == [] and queue.num_queued == 3  # not saturated: they wait
        interactive = start(queue, "interactive", 1)  # a full queue, and it must wait: the app is saturated
        await settle()
        assert refused == ["batch2", "batch1", "batch0"]  # newest first, before it waited a moment
        with pytest.raises(Shed, match=r"priority 10 is sheddable \(sheddable_priority=10\) and the app is "
                                       r"saturated \(1 requests that are not sheddable wait"):
            await batch[0]
        with pytest.raises(Shed):  # a new sheddable one while saturated: at once
            await queue.acquire("batch3", 1, 5.0, level=ServiceLevel(priority=50))
        assert [e[0] for e in queue.events].count("rejected_shed") == 4  # type: ignore[attr-defined]
        queue.release("hold")
        assert await interactive == "r"
        assert await queue.acquire("batch4", 1, 1.0, level=ServiceLevel(priority=50)) == "r"  # not saturated now

    run_simulated(main())


def test_a_full_queue_refuses_a_sheddable_newcomer_and_gives_a_more_urgent_one_the_place_of_a_less_urgent_one(
) -> None:
    async def main() -> None:
        queue = queue_on(asyncio.get_running_loop(), capacity=1, sheddable_priority=10, max_queued=1)
        await queue.acquire("hold", 1, 1.0)
        waiting = start(queue, "waiting", 1, priority=3)
        await settle()
        with pytest.raises(Shed):  # saturated (a request that is not sheddable waits): shed, not queue-full
            await queue.acquire("batch", 1, 1.0, level=ServiceLevel(priority=11))
        with pytest.raises(QueueFull, match="max_queued_requests=1"):  # as urgent, same tenant: refused
            await queue.acquire("same", 1, 1.0, level=ServiceLevel(priority=3))
        urgent = start(queue, "urgent", 1, priority=0)
        with pytest.raises(QueueFull, match="a request of priority 0 from tenant 'anonymous' took this one's place"):
            await waiting
        queue.release("hold")
        assert await urgent == "r"

    run_simulated(main())


def test_tenant_limits_concurrency_and_tokens_per_minute() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        limits = TenantLimits({"A": Limits(max_concurrent_requests=2, tokens_per_minute=1000)})
        queue = queue_on(loop, capacity=100, limits=limits)
        a = ServiceLevel("A", tokens=300)
        await queue.acquire("a1", 1, 1.0, level=a)
        await queue.acquire("a2", 1, 1.0, level=a)
        with pytest.raises(LimitExceeded, match="tenant 'A' has 2 requests waiting or running, its "
                                                "max_concurrent_requests=2") as full:
            await queue.acquire("a3", 1, 1.0, level=a)
        assert full.value.limit == "max_concurrent_requests"
        assert await queue.acquire("b1", 1, 1.0, level=ServiceLevel("B", tokens=10_000)) == "r"  # B: no limits
        queue.release("a1")
        await asyncio.sleep(20.0)
        assert await queue.acquire("a3", 1, 1.0, level=a) == "r"  # 900 tokens in the minute now
        queue.release("a2")
        queue.release("a3")
        await asyncio.sleep(10.0)
        with pytest.raises(LimitExceeded, match=r"started 900 tokens .* past its tokens_per_minute=1000; retry "
                                                r"in 30s") as rate:
            await queue.acquire("a4", 1, 1.0, level=a)
        assert rate.value.retry_after_s == pytest.approx(30.0)  # a1 and a2 (t=0) leave the window at 60 s
        with pytest.raises(LimitExceeded, match="more than tenant 'A' may start in a minute") as alone:
            await queue.acquire("a5", 1, 1.0, level=ServiceLevel("A", tokens=1001))
        assert alone.value.retry_after_s is None  # the ingress answers 400: no retry can pass
        await asyncio.sleep(30.0)
        assert await queue.acquire("a4", 1, 1.0, level=a) == "r"
        assert [e[0] for e in queue.events].count("rejected_limit") == 3  # type: ignore[attr-defined]
        # A request a replica refused after its grant comes back (front): its limits are not checked or charged again.
        queue.release("a4")
        assert await queue.acquire("a4", 1, 1.0, front=True, level=a) == "r"
        # In the window: a3 (t=20) and a4 once (t=60), not twice.
        exceeded = limits.check("A", 500, lambda: 0, loop.time())
        assert "started 600 tokens" in (exceeded or Exceeded("", "", None)).message

    run_simulated(main())


def test_a_request_the_queue_refuses_gives_its_tokens_back() -> None:
    async def main() -> None:
        limits = TenantLimits({"A": Limits(tokens_per_minute=500)})
        queue = queue_on(asyncio.get_running_loop(), capacity=1, limits=limits)
        await queue.acquire("hold", 1, 1.0, level=ServiceLevel("B"))
        with pytest.raises(QueueTimeout):
            await queue.acquire("a1", 1, 1.0, level=ServiceLevel("A", tokens=400))
        queue.release("hold")
        assert await queue.acquire("a2", 1, 1.0, level=ServiceLevel("A", tokens=400)) == "r"  # 400 of 500 in use

    run_simulated(main())


def test_random_service_levels_never_over_commit_and_answer_everyone() -> None:
    """Tenants, priorities, deadlines and sheddable requests at random against replicas that report and lose
    nothing: at every grant each replica holds at most its capacity; every request is granted or refused with a
    reason; nothing is held after the drain."""

    def check(queue: AdmissionQueue) -> Callable[[], None]:
        def invariant() -> None:
            for replica in queue.replicas.values():
                assert replica.granted + replica.external + replica.headroom <= replica.capacity
        return invariant

    async def main() -> dict[str, int]:
        loop = asyncio.get_running_loop()
        rng = random.Random(11)
        queue = AdmissionQueue(max_queued=12, clock=loop.time, sheddable_priority=5,
                               limits=TenantLimits({"t1": Limits(max_concurrent_requests=6)}))
        for r in ("r0", "r1"):
            queue.report(KvReport(replica_id=r, capacity=20, tokens_per_block=TOKENS_PER_BLOCK, held={}))
        invariant = check(queue)
        outcomes: dict[str, int] = {}

        async def request(i: int) -> None:
            await asyncio.sleep(rng.uniform(0, 60))
            level = ServiceLevel(f"t{rng.randrange(3)}", rng.choice([-1, 0, 0, 3, 5, 9]), rng.choice([1.0, 2.0]),
                                 rng.choice([None, None, rng.uniform(0.5, 10)]))
            try:
                await queue.acquire(f"q{i}", rng.randint(1, 12), rng.uniform(1, 20), level=level)
            except (QueueFull, QueueTimeout, DeadlineExceeded, Shed, LimitExceeded) as err:
                outcomes[err.code] = outcomes.get(err.code, 0) + 1
                return
            invariant()
            outcomes["granted"] = outcomes.get("granted", 0) + 1
            await asyncio.sleep(rng.uniform(0.1, 5))
            queue.release(f"q{i}")

        await asyncio.gather(*(request(i) for i in range(400)))
        assert queue.num_queued == 0 and not queue._grants
        assert all(r.granted == 0 for r in queue.replicas.values())
        assert queue.shares.holding == {}
        return outcomes

    outcomes = run_simulated(main())
    assert sum(outcomes.values()) == 400
    assert {"granted", "shed", "deadline_exceeded", "limit_exceeded"} <= set(outcomes), outcomes


def test_fair_order_is_a_pure_function_of_waiters_shares_and_time() -> None:
    class W:
        def __init__(self, seq: int, tenant: str, priority: int = 0, front: bool = False,
                     deadline_at: float | None = None, tokens: int = 16) -> None:
            self.seq, self.front, self.deadline_at, self.tokens = seq, front, deadline_at, tokens
            self.level = ServiceLevel(tenant, priority)

    shares = TenantShares(half_life_s=10.0, quantum_s=1.0)
    shares.grant("busy", 160, now=0.0)
    waiters = [W(1, "busy"), W(2, "busy"), W(3, "idle"), W(4, "busy", priority=-1), W(5, "idle", front=True)]
    order = [w.seq for w in admission_order(waiters, shares, now=5.0)]
    assert order == [5, 4, 3, 1, 2]
    assert [w.seq for w in admission_order(waiters, shares, now=5.0)] == order  # same state, same order
    # The queue's walk takes it one request at a time, granting as it goes: the grants it makes during the walk do
    # not reorder the rest (the order read the shares before its first request).
    walk = iter_admission_order(waiters, shares, now=5.0)
    taken = [next(walk).seq, next(walk).seq]
    shares.grant("idle", 10_000, now=5.0)
    assert taken + [w.seq for w in walk] == order
    assert [w.seq for w in admission_order(waiters, shares, now=5.0)] != order  # read afresh, it changes
    shares.release("idle", 10_000, now=5.0)
    # Decay: the busy tenant's 160 tokens x 1 s charge plus 10 s held (tau = 10 / ln 2), at 20 s.
    shares.release("busy", 160, now=10.0)
    assert shares.attained("busy", 20.0) == pytest.approx(
        (160 * 0.5 + 160 * (10 / 0.6931471805599453) * 0.5) * 0.5, rel=1e-9)


def test_latency_window_percentiles_by_pool_over_the_window() -> None:
    window = LatencyWindow()
    for i in range(10):
        window.add(float(i), "default", ttft_s=0.1 * (i + 1), itl_s=0.01)
    window.add(9.0, "other", ttft_s=5.0, itl_s=None)
    latest = window.percentile(9.0, "default", 0.9, window_s=100.0)
    assert (latest.ttft_s, latest.itl_s, latest.samples) == (pytest.approx(0.9), 0.01, 10)
    assert window.percentile(9.0, "default", 0.5, window_s=4.0).ttft_s == pytest.approx(0.8)  # samples 5..9
    assert window.percentile(9.0, "other", 0.9, 10.0).itl_s is None
    assert window.percentile(9.0, "missing", 0.9, 10.0).samples == 0
    assert nearest_rank([3.0, 1.0, 2.0], 1.0) == 3.0
    with pytest.raises(ValueError, match=r"percentile must be in \(0, 1\]"):
        window.percentile(0.0, "default", 0.0, 1.0)


def test_fifo_order_ignores_priorities_tenants_and_shedding() -> None:
    async def main() -> list[str]:
        queue = queue_on(asyncio.get_running_loop(), capacity=1, order="fifo", sheddable_priority=10)
        await queue.acquire("hold", 1, 1.0)
        granted = track({name: start(queue, name, 1, tenant=tenant, priority=priority) for name, tenant, priority in
                         [("batch", "A", 20), ("a", "A", 5), ("b", "B", 0), ("urgent", "B", -5)]})
        await settle()
        for ticket in ["hold", "batch", "a", "b"]:
            queue.release(ticket)
            await settle()
        return list(granted)

    assert run_simulated(main()) == ["batch", "a", "b", "urgent"]
    with pytest.raises(ValueError, match="admission_order must be 'service_levels' or 'fifo', got 'lifo'"):
        AdmissionQueue(max_queued=1, order="lifo")


def test_a_full_queue_is_shared_a_flooding_tenant_gives_up_its_newest_place() -> None:
    """The queue's bound is shared as its order is: when A's flood fills it, B's request takes the place of A's
    newest waiter (429 for that one, naming why) instead of being refused; a less urgent band gives way to a more
    urgent newcomer; equal shares refuse the newcomer."""

    async def main() -> list[str]:
        queue = queue_on(asyncio.get_running_loop(), capacity=1, max_queued=4)
        await queue.acquire("hold", 1, 1.0)
        a = [start(queue, f"a{i}", 1, tenant="A") for i in range(4)]
        await settle()
        b = start(queue, "b", 1, tenant="B")
        await settle()
        with pytest.raises(QueueFull, match=r"from tenant 'B' took this one's place \(the newest of 4 waiting "
                                            r"requests of tenant 'A' at priority 0\)"):
            await a[3]
        urgent = start(queue, "urgent", 1, tenant="A", priority=-1)
        await settle()
        with pytest.raises(QueueFull, match="a request of priority -1 from tenant 'A' took this one's place"):
            await a[2]  # band 0 gives way to band -1: A's newest there goes
        c = start(queue, "c", 1, tenant="C")
        await settle()
        with pytest.raises(QueueFull):  # A 2, B 1, C 1 (with it): A has not two more than C: C is refused
            await c
        granted = track({"urgent": urgent, "b": b, "a0": a[0], "a1": a[1]})
        queue.release("hold")
        for _ in range(4):
            await settle()
            queue.release(granted[-1])
        return list(granted)

    run_simulated(main())
