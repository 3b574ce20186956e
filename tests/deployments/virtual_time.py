"""An asyncio event loop on a virtual clock, for tests of the control plane where time must be controlled.

`VirtualTimeLoop.time()` is a number the loop owns. When no callback is ready, the loop does not sleep until its next
timer: it moves the clock there and runs it at once. Everything the loop schedules (asyncio.sleep, wait_for,
call_later, timeouts) follows that clock, and so does code that reads `loop.time` as its clock (AdmissionQueue's
`clock`). Nothing depends on how fast the machine is or how loaded: a run is a function of its inputs and its seed.

Only the loop's own timers move the clock. Threads, subprocesses and real I/O are not simulated: a coroutine that
waits on them while no timer is pending would wait forever, so the loop raises instead (`VirtualTimeDeadlock`).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualTimeDeadlock(RuntimeError):
    """Nothing is ready and no timer is pending: the simulated program waits for something that never comes."""


class _JumpingSelector(selectors.BaseSelector):
    """A selector that never blocks: with nothing ready it advances its loop's clock by the timeout instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()  # the loop's self-pipe lives here
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            raise VirtualTimeDeadlock("no callback is ready and no timer is pending: the simulation would wait forever")
        self._loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock starts at 0 and jumps to the next timer whenever nothing else is ready."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine to completion on a fresh VirtualTimeLoop (as asyncio.run does on a real one)."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
