"""The engine replica's end of a delta stream: one `Outbox` per subscribed ingress, the engine's sink
(dcpserve.engine.protocol.DeltaSink) for every request of that ingress here. The engine delivers each step's deltas of
those requests in one call; the outbox keeps what arrived since its last item and merges it
(dcpserve.engine.protocol.merge_deltas, per request) into one `DeltaBatch`. A request's first delta and a finishing one
go out at once; otherwise at most one item per interval. An error of one request travels as that request's error in
the batch; the others go on. Nothing here splits a step's output per request: the ingress' end
(dcpserve/deployments/dispatch/streams.py, `DeltaLinks`) is the one place that does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence

from dcpserve.deployments.messages import LEASE_S, DeltaBatch
from dcpserve.engine.protocol import RequestDelta, merge_deltas

logger = logging.getLogger("ray.serve")


class Outbox:
    """What one subscribed ingress gets from this replica: the deltas of its requests, batched."""

    def __init__(self, subscriber: str, lease_s: float = LEASE_S) -> None:
        self.subscriber = subscriber
        self.lease_s = lease_s
        self.renewed_at = asyncio.get_running_loop().time()
        self.closed = False  # the ingress' stream ended: nothing more is forwarded
        self._on_end: dict[str, Callable[[str, bool], None]] = {}  # request id -> on_end, until it ends
        self._pending: dict[str, list[RequestDelta]] = {}
        self._errors: list[tuple[str, str]] = []
        self._started: set[str] = set()  # requests that had a delta out already
        self._ready = asyncio.Event()  # something is pending
        self._urgent = asyncio.Event()  # a first delta, a finishing one or an error is pending: no waiting

    @property
    def num_requests(self) -> int:
        """Requests whose deltas still come here."""
        return len(self._on_end)

    def expect(self, request_id: str, on_end: Callable[[str, bool], None]) -> None:
        """Makes the outbox ready for a request about to be submitted to the engine with this outbox as its sink
        (its first deltas may come before the engine answers). on_end(request_id, finished) runs however it ends:
        finished False when it was cancelled, closed or failed (the replica then aborts it in the engine)."""
        self._on_end[request_id] = on_end

    def forget(self, request_id: str) -> None:
        """The engine did not take the request after all (refused or rejected): nothing came, nothing will."""
        self._on_end.pop(request_id, None)

    def deliver(self, deltas: Sequence[RequestDelta]) -> None:
        """DeltaSink: one engine step's deltas of this outbox's requests."""
        for delta in deltas:
            if delta.request_id not in self._on_end:
                continue  # cancelled here: its abort is on the way to the engine
            self._pending.setdefault(delta.request_id, []).append(delta)
            if delta.finished or delta.request_id not in self._started:
                self._started.add(delta.request_id)
                self._urgent.set()
            if delta.finished:
                self._end(delta.request_id, True)
        self._ready.set()

    def fail(self, request_id: str, error: BaseException) -> None:
        """DeltaSink: the request failed in the engine; its error goes to the ingress, the other requests go on."""
        if request_id not in self._on_end:
            return
        logger.warning("request %s failed in the engine: %r", request_id, error)
        self._errors.append((request_id, f"{type(error).__name__}: {error}"))
        self._ready.set()
        self._urgent.set()
        self._end(request_id, False)

    def _end(self, request_id: str, finished: bool) -> None:
        on_end = self._on_end.pop(request_id)
        self._started.discard(request_id)
        on_end(request_id, finished)

    def renew(self) -> None:
        """The ingress is alive and still reads this stream: the lease runs LEASE_S from now."""
        self.renewed_at = asyncio.get_running_loop().time()

    def cancel(self, request_id: str) -> bool:
        """Stops forwarding one request (its on_end aborts it in the engine). False: not here (finished or unknown)."""
        if request_id not in self._on_end:
            return False
        self._end(request_id, False)
        return True

    def close(self) -> None:
        """The ingress' stream ended: every request still here is aborted (nobody would read its deltas)."""
        self.closed = True
        for request_id in list(self._on_end):
            self._end(request_id, False)

    async def batches(self, interval_s: float) -> AsyncGenerator[DeltaBatch]:
        """The outbox's items until its lease runs out (the ingress stopped renewing it): after waking for a step's
        deltas (the engine delivers them in one call), unless something urgent is pending, it waits out the rest of
        interval_s since the last item."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            expires_in = self.renewed_at + self.lease_s - loop.time()
            if expires_in <= 0:
                logger.warning("ingress %s stopped renewing its delta stream for %gs: it ends, and its %d requests "
                               "here are aborted", self.subscriber, self.lease_s, self.num_requests)
                return
            try:
                await asyncio.wait_for(self._ready.wait(), expires_in)
            except TimeoutError:
                continue
            wait = next_at - loop.time()
            if wait > 0 and not self._urgent.is_set():
                try:
                    await asyncio.wait_for(self._urgent.wait(), wait)
                except TimeoutError:
                    pass
            self._ready.clear()
            self._urgent.clear()
            pending, self._pending = self._pending, {}
            errors, self._errors = self._errors, []
            if not pending and not errors:
                continue
            yield DeltaBatch(tuple(merge_deltas(deltas) for deltas in pending.values()), tuple(errors))
            next_at = loop.time() + interval_s
