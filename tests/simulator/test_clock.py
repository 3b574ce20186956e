"""Simulated time drives the real asyncio control plane: sleeps and timeouts take no wall time and keep their
meaning, the admission queue's waits and timeouts run on it, and a stalled simulation fails instead of hanging."""

from __future__ import annotations

import asyncio
import time

import pytest

from dcpserve.deployments.admission.errors import QueueTimeout
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import KvReport
from dcpserve.simulator.clock import SimulatedLoop, SimulationStalled, run_simulated


def test_sleep_moves_the_clock_not_the_wall() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(3600.0)
        return start, loop.time()

    wall = time.perf_counter()
    start, end = run_simulated(main(), start=10.0)
    assert (start, end) == (10.0, 3610.0)
    assert time.perf_counter() - wall < 5.0  # an hour of simulated time; no wall-clock wait


def test_events_run_in_simulated_time_order() -> None:
    order: list[tuple[str, float]] = []

    async def after(name: str, delay: float) -> None:
        await asyncio.sleep(delay)
        order.append((name, asyncio.get_running_loop().time()))

    async def main() -> None:
        await asyncio.gather(after("c", 3.0), after("a", 1.0), after("b", 2.0), after("a2", 1.0))

    run_simulated(main())
    assert order == [("a", 1.0), ("a2", 1.0), ("b", 2.0), ("c", 3.0)]


def test_admission_queue_waits_and_times_out_in_simulated_time() -> None:
    """The real AdmissionQueue: a waiter is granted when a release comes 2.5 simulated seconds later, and another
    gets QueueTimeout after exactly its queue timeout."""

    async def main() -> tuple[float, float, str]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=4, clock=loop.time)
        queue.report(KvReport(replica_id="r0", capacity=10, tokens_per_block=16, held={}, probes=1))
        assert await queue.acquire("a", 8, timeout_s=1.0) == "r0"
        start = loop.time()
        with pytest.raises(QueueTimeout):
            await queue.acquire("b", 8, timeout_s=5.0)
        timed_out_after = loop.time() - start

        async def release_later() -> None:
            await asyncio.sleep(2.5)
            queue.release("a")

        releaser = loop.create_task(release_later())
        start = loop.time()
        replica = await queue.acquire("c", 8, timeout_s=5.0)
        await releaser
        return timed_out_after, loop.time() - start, replica

    timed_out_after, waited, replica = run_simulated(main())
    assert timed_out_after == pytest.approx(5.0, abs=1e-9)
    assert waited == pytest.approx(2.5, abs=1e-9)
    assert replica == "r0"


def test_a_stalled_simulation_raises() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nothing will ever set it

    with pytest.raises(SimulationStalled, match="stalled"):
        run_simulated(main())


def test_the_clock_never_goes_back() -> None:
    loop = SimulatedLoop()
    try:
        with pytest.raises(ValueError, match="cannot go back"):
            loop.advance(-1.0)
    finally:
        loop.close()
