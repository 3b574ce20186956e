"""The ingress' end of the replica -> ingress delta stream: one Ray stream per (ingress replica, engine replica) pair
carries the deltas of every request that ingress has on that replica, one item per engine step (or per
stream_interval_s when steps are faster), instead of one stream per request with an item per token. The replica's end
is dcpserve/deployments/replica/outbox.py (`Outbox`); the items are dcpserve/deployments/messages.py's `Subscribed`,
then `DeltaBatch`es.

`DeltaLinks`: opens the stream to a replica on the first request it dispatches there (in a context of its own, so
that no request's cancellation cancels it; given up past subscribe_timeout_s), demultiplexes each batch into
per-request queues, and closes it when no request of this ingress has been there for LINK_IDLE_S (so a draining
replica's graceful shutdown, which waits for its calls, is not held by an idle stream). A stream that ends or fails
fails every request waiting on it at once; the next dispatch to that replica opens a new one.

Ordering: the ingress registers a request's queue before it calls generate(), so deltas that overtake the
generate() reply on the stream are kept, never dropped.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dcpserve.deployments.messages import RENEW_S, Subscribed
from dcpserve.engine.protocol import RequestDelta

logger = logging.getLogger("ray.serve")

# An ingress closes its stream to a replica once no request of its own has been there for this long.
LINK_IDLE_S = 2.0


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
                 renew: Callable[[str, str], Awaitable[bool]], *, idle_s: float = LINK_IDLE_S,
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
