"""Simulated time for asyncio: an event loop whose clock jumps to the next timer instead of waiting for it.

The control plane under simulation is the real asyncio code (dcpserve.deployments.admission.queue.AdmissionQueue awaits
its waiters with asyncio.wait_for, replicas' step loops sleep for their step's duration). `SimulatedLoop` runs it
unchanged: `loop.time()` is the simulated time, and when nothing is ready to run, the loop's selector, instead of
blocking, moves the clock to the earliest timer. So a step of 30 ms simulated takes no wall time, every timeout
and sleep keeps its meaning, and the order of events is the order of their simulated times (ties in the order
asyncio's timer heap pops them, which depends only on the order they were scheduled: the same program gives the
same interleaving every run).

Nothing in a simulation may wait for the outside world (sockets, threads, subprocesses): with no timer pending and
nothing ready, the loop would wait forever, so it raises `SimulationStalled` instead. (A thread may still wake the
loop with call_soon_threadsafe: its self-pipe is a real one.) The tests of the control plane whose outcome depends on
interleaving run on this loop too.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Every task waits and no timer is pending: nothing could ever happen again."""


class _SimulatedSelector(selectors.BaseSelector):
    """A selector that never blocks: with nothing ready it advances its loop's clock by the timeout instead."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()  # the loop's self-pipe lives here (call_soon_threadsafe wakes it)
        self.clock: SimulatedLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            raise SimulationStalled(
                "the simulation stalled: every task waits and no timer is pending (a task waits for something no "
                "simulated event will ever set)")
        if timeout > 0 and self.clock is not None:
            self.clock.advance(timeout)
        return []

    def close(self) -> None:
        self._real.close()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()


class SimulatedLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop on simulated time, starting at `start` seconds."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _SimulatedSelector()
        self._now = start
        super().__init__(selector)
        selector.clock = self

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Moves the clock forward (the selector does this when the loop would wait)."""
        if seconds < 0:
            raise ValueError(f"simulated time cannot go back ({seconds} s)")
        self._now += seconds


def run_simulated(main: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Runs `main` to completion on a fresh SimulatedLoop and closes the loop; returns its result."""
    loop = SimulatedLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
