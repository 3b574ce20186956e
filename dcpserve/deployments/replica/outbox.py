"""The engine replica's end of a delta stream: one `Outbox` per subscribed ingress. Each accepted request's engine
stream is forwarded into it by a task of its own; the outbox merges what arrived since its last item
(dcpserve.engine.protocol.merge_deltas, per request) into one `DeltaBatch`. A request's first delta and a finishing one
go out at once; otherwise at most one item per interval. An error of one request's engine stream travels as that
request's error in the batch; the stream of the others goes on. The ingress' end is dcpserve/deployments/dispatch/
streams.py (`DeltaLinks`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

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
        self.forwarders: dict[str, asyncio.Task[None]] = {}  # request id -> the task forwarding its engine stream
        self._pending: dict[str, list[RequestDelta]] = {}
        self._errors: list[tuple[str, str]] = []
        self._started: set[str] = set()  # requests that had a delta out already
        self._ready = asyncio.Event()  # something is pending
        self._urgent = asyncio.Event()  # a first delta, a finishing one or an error is pending: no waiting

    def forward(self, request_id: str, stream: AsyncIterator[RequestDelta],
                on_end: Callable[[str, bool], None]) -> None:
        """Forwards one accepted request's engine stream into this outbox, in a task of its own.
        on_end(request_id, finished) runs however the stream ends (finished False: it was cancelled or failed)."""
        self.forwarders[request_id] = asyncio.get_running_loop().create_task(
            self._forward(request_id, stream, on_end))

    async def _forward(self, request_id: str, stream: AsyncIterator[RequestDelta],
                       on_end: Callable[[str, bool], None]) -> None:
        finished = False
        try:
            async for delta in stream:
                finished = delta.finished
                self._put(delta)
                if finished:
                    break
        except asyncio.CancelledError:
            pass  # aborted (the ingress asked, or its stream went away): on_end aborts the engine's request
        except Exception as err:  # noqa: BLE001 - the request's error goes to its ingress; the stream goes on
            logger.warning("request %s failed in the engine: %r", request_id, err)
            self._errors.append((request_id, f"{type(err).__name__}: {err}"))
            self._ready.set()
            self._urgent.set()
        finally:
            self.forwarders.pop(request_id, None)
            self._started.discard(request_id)
            on_end(request_id, finished)

    def _put(self, delta: RequestDelta) -> None:
        self._pending.setdefault(delta.request_id, []).append(delta)
        if delta.finished or delta.request_id not in self._started:
            self._started.add(delta.request_id)
            self._urgent.set()
        self._ready.set()

    def renew(self) -> None:
        """The ingress is alive and still reads this stream: the lease runs LEASE_S from now."""
        self.renewed_at = asyncio.get_running_loop().time()

    def cancel(self, request_id: str) -> bool:
        """Stops forwarding one request (its on_end aborts it in the engine). False: not here (finished or unknown)."""
        task = self.forwarders.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    def close(self) -> None:
        """The ingress' stream ended: every request still forwarding is aborted (nobody would read its deltas)."""
        self.closed = True
        for task in list(self.forwarders.values()):
            task.cancel()

    async def batches(self, interval_s: float) -> AsyncGenerator[DeltaBatch]:
        """The outbox's items until its lease runs out (the ingress stopped renewing it): after waking for a delta it
        lets the rest of the step's deltas arrive (they are delivered in one pass of the event loop), then, unless
        something urgent is pending, waits out the rest of interval_s since the last item."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            expires_in = self.renewed_at + self.lease_s - loop.time()
            if expires_in <= 0:
                logger.warning("ingress %s stopped renewing its delta stream for %gs: it ends, and its %d requests "
                               "here are aborted", self.subscriber, self.lease_s, len(self.forwarders))
                return
            try:
                await asyncio.wait_for(self._ready.wait(), expires_in)
            except TimeoutError:
                continue
            await asyncio.sleep(0)  # the other forwarders woken by the same engine step put theirs first
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
