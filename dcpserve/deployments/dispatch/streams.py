"""The replica -> ingress delta stream, both ends: one Ray stream per (ingress replica, engine replica) pair carries
the deltas of every request that ingress has on that replica, one item per engine step (or per stream_interval_s
when steps are faster), instead of one stream per request with an item per token.

Engine replica side, `Outbox`: the replica keeps one per subscribed ingress. Each accepted request's engine stream
is forwarded into it by a task of its own; the outbox merges what arrived since its last item
(dcpserve.engine.protocol.merge_deltas, per request) into one `DeltaBatch`. A request's first delta and a finishing one
go out at once; otherwise at most one item per interval. An error of one request's engine stream travels as that
request's error in the batch; the stream of the others goes on.

Ingress side, `DeltaLinks`: opens the stream to a replica on the first request it dispatches there (in a context
of its own, so that no request's cancellation cancels it; given up past subscribe_timeout_s), demultiplexes each
batch into per-request queues, and closes it when no request of this ingress has been there for LINK_IDLE_S (so a
draining replica's graceful shutdown, which waits for its calls, is not held by an idle stream). A stream that ends
or fails fails every request waiting on it at once; the next dispatch to that replica opens a new one.

Ordering: the ingress registers a request's queue before it calls generate(), so deltas that overtake the
generate() reply on the stream are kept, never dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dcpserve.engine.protocol import RequestDelta, merge_deltas

logger = logging.getLogger("ray.serve")

# An ingress closes its stream to a replica once no request of its own has been there for this long.
LINK_IDLE_S = 2.0
# The ingress renews each of its streams every RENEW_S; a replica ends a stream not renewed for LEASE_S (and aborts its
# requests). Ray does not end a streaming call whose caller died, so without the lease the stream of an ingress that
# was killed stayed open on the replica, held its requests, and held the replica's graceful shutdown (which waits
# for every call) for its whole timeout.
RENEW_S = 5.0
LEASE_S = 30.0


@dataclass(frozen=True, slots=True)
class Subscribed:
    """The first item of a delta stream: the replica that serves it (the ingress checks it reached the one it asked)."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class DeltaBatch:
    """One item of a delta stream: each request's deltas since the last item, merged; the requests whose engine
    stream failed, with the error."""

    deltas: tuple[RequestDelta, ...] = ()
    errors: tuple[tuple[str, str], ...] = ()  # (request id, message)

    @property
    def num_tokens(self) -> int:
        return sum(len(d.new_token_ids) for d in self.deltas)


# ---- engine replica side ------------------------------------------------------------------------------------------


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


# ---- ingress side -------------------------------------------------------------------------------------------------


class StreamLost(Exception):
    """The delta stream from a replica ended or failed while a request was waiting on it."""


Item = RequestDelta | BaseException


@dataclass
class _Link:
    """This ingress' stream from one replica and the requests waiting on it."""

    replica_id: str
    subscribed: asyncio.Future[None]  # done once the replica's Subscribed came (or failed: the link ended)
    queues: dict[str, asyncio.Queue[Item]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    renewer: asyncio.Task[None] | None = None
    idle_close: asyncio.TimerHandle | None = None
    closed: bool = False


class DeltaLinks:
    """An ingress replica's delta streams, one per engine replica it has requests on.

    open_stream(replica_id, subscriber) makes the streaming call (the engine handle's deltas() addressed to that
    replica); it must return an object with __anext__ and cancel() (a Serve DeploymentResponseGenerator).
    renew(replica_id, subscriber) renews the stream's lease on the replica (its renew()): False when the replica no
    longer has the stream, which then ends here too. on_lost(replica_id) runs when a stream fails (the call raised:
    the replica died, its node went, or it did not open the stream in time), not when it ends or closes."""

    def __init__(self, open_stream: Callable[[str, str], Any],
                 renew: Callable[[str, str], Awaitable[bool]], idle_s: float = LINK_IDLE_S,
                 subscribe_timeout_s: float = 60.0, renew_s: float = RENEW_S,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.subscriber = uuid.uuid4().hex  # this ingress replica, as the engine replicas know it
        self._open_stream = open_stream
        self._renew = renew
        self._on_lost = on_lost
        self._renew_s = renew_s
        self._idle_s = idle_s
        self._subscribe_timeout_s = subscribe_timeout_s
        self._links: dict[str, _Link] = {}

    def register(self, replica_id: str, request_id: str) -> tuple[asyncio.Queue[Item], asyncio.Future[None]]:
        """The queue the request's deltas (or the stream's failure) will arrive in, and a future done once the
        stream to the replica is open (its Subscribed came). Opens the stream if there is none."""
        link = self._links.get(replica_id)
        if link is None or link.closed:
            link = self._start(replica_id)
        if link.idle_close is not None:
            link.idle_close.cancel()
            link.idle_close = None
        queue: asyncio.Queue[Item] = asyncio.Queue()
        link.queues[request_id] = queue
        return queue, link.subscribed

    def unregister(self, replica_id: str, request_id: str) -> None:
        """The request is done with its queue; the link closes after idle_s without requests."""
        link = self._links.get(replica_id)
        if link is None or link.queues.pop(request_id, None) is None or link.queues or link.closed:
            return
        link.idle_close = asyncio.get_running_loop().call_later(self._idle_s, self._close_if_idle, link)

    def is_open(self, replica_id: str) -> bool:
        """Whether this ingress' stream from the replica is open (or opening)."""
        link = self._links.get(replica_id)
        return link is not None and not link.closed

    def num_links(self) -> int:
        return sum(not link.closed for link in self._links.values())

    def close(self) -> None:
        for link in list(self._links.values()):
            self._end(link, StreamLost("the ingress is shutting down"))

    def _start(self, replica_id: str) -> _Link:
        loop = asyncio.get_running_loop()
        link = _Link(replica_id, loop.create_future())
        self._links[replica_id] = link
        # A fresh, empty context: Serve cancels the calls a cancelled request made, and this stream serves them all.
        link.reader = loop.create_task(self._read(link), context=contextvars.Context())
        return link

    async def _read(self, link: _Link) -> None:
        stream = None
        error: BaseException = StreamLost(f"the delta stream from replica {link.replica_id} ended")
        try:
            stream = self._open_stream(link.replica_id, self.subscriber)
            try:
                first = await asyncio.wait_for(stream.__anext__(), self._subscribe_timeout_s)
            except TimeoutError:
                raise StreamLost(f"replica {link.replica_id} did not open a delta stream within "
                                 f"{self._subscribe_timeout_s:g}s") from None
            if not isinstance(first, Subscribed) or first.replica_id != link.replica_id:
                raise StreamLost(f"asked replica {link.replica_id} for a delta stream, got {first!r}")
            if not link.subscribed.done():
                link.subscribed.set_result(None)
            link.renewer = asyncio.get_running_loop().create_task(self._keep_renewing(link))
            while True:
                batch = await stream.__anext__()
                for delta in batch.deltas:
                    queue = link.queues.get(delta.request_id)
                    if queue is not None:  # else: the request is gone here (its abort is on the way)
                        queue.put_nowait(delta)
                for request_id, message in batch.errors:
                    queue = link.queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(RuntimeError(message))
        except StopAsyncIteration:
            pass
        except asyncio.CancelledError:
            error = StreamLost(f"the delta stream from replica {link.replica_id} was closed")
        except Exception as err:  # noqa: BLE001 - the replica died or Serve could not reach it: its requests fail
            error = StreamLost(f"the delta stream from replica {link.replica_id} failed ({type(err).__name__}: "
                               f"{err})")
            if self._on_lost is not None:
                self._on_lost(link.replica_id)
        finally:
            if stream is not None:
                stream.cancel()
            self._end(link, error)

    async def _keep_renewing(self, link: _Link) -> None:
        while not link.closed:
            await asyncio.sleep(self._renew_s)
            try:
                held = await asyncio.wait_for(self._renew(link.replica_id, self.subscriber), self._renew_s)
            except Exception as err:  # noqa: BLE001 - a replica that is gone fails the stream itself; retry meanwhile
                logger.warning("renewing the delta stream from replica %s failed: %r", link.replica_id, err)
                continue
            if not held:
                self._end(link, StreamLost(f"replica {link.replica_id} no longer has this ingress' delta stream"))

    def _end(self, link: _Link, error: BaseException) -> None:
        if link.closed:
            return
        link.closed = True
        if self._links.get(link.replica_id) is link:
            del self._links[link.replica_id]
        if link.idle_close is not None:
            link.idle_close.cancel()
        if not link.subscribed.done():
            link.subscribed.set_exception(error)
            link.subscribed.exception()  # retrieved: a link nobody awaited logs nothing
        for queue in link.queues.values():
            queue.put_nowait(error)
        for task in (link.reader, link.renewer):
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    def _close_if_idle(self, link: _Link) -> None:
        link.idle_close = None
        if not link.queues and not link.closed:
            self._end(link, StreamLost("idle"))
