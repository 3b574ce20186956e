"""One request's way to a replica: ask the admission queue for a grant, send the request to the granted replica, and
when that replica does not take it (it refused it: less free KV than the queue knew; or the call did not reach it)
give the grant back and ask again, at the head of the queue, until a replica takes it or the queue refuses it.

This loop is the app's own: the ingress runs it (dcpserve/deployments/dispatch/sessions.py, over Serve handles) and
so does the simulator (dcpserve/simulator/run.py, over the in-process queue and simulated replicas), each through its
own ports, so the simulator can never drift from the app it claims to run. Its time is the event loop's: the
simulator's loop runs it on simulated time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from dcpserve.deployments.messages import (
    Accepted,
    Acquire,
    AcquireReply,
    ApiError,
    Granted,
    Need,
    PrefixAsk,
    Refusal,
    Refused,
    Rejected,
    ServiceLevel,
)

# A request whose grant came back (refused, replica unreachable) after its queue_timeout_s ran out waits at the
# head once more for this long: it had been granted, so it gets one more chance before its 429.
REQUEUE_MIN_WAIT_S = 1.0


def refusal_backoff_s(refusals: int) -> float:
    """How long a request waits before it asks the queue again after its `refusals`-th refusal by a replica: not
    after the first (the replica reported its KV before it refused, so the queue's next grant starts from the
    replica's state), then 10 ms doubling to at most 1 s, so that a queue and a replica that keep disagreeing never
    make a tight loop."""
    return 0.0 if refusals <= 1 else min(0.01 * 2.0 ** (refusals - 2), 1.0)


def unreachable_backoff_s(returned: int) -> float:
    """How long a request waits before its next grant after a replica was not reached, with `returned` grants back
    before it: 50 ms doubling to at most 1 s (bounded by the queue deadline), so a replica that keeps failing calls is
    never retried in a tight loop."""
    return min(0.05 * 2.0 ** returned, 1.0)


class AdmissionPort(Protocol):
    """The admission queue as the loop calls it (KvAdmission's handle in the app, AdmissionQueue in the simulator)."""

    async def acquire(self, request: Acquire) -> AcquireReply: ...

    async def refused(self, ticket: str, replica_id: str, free_blocks: int) -> None: ...

    async def unreachable(self, ticket: str, replica_id: str) -> None: ...


T = TypeVar("T")


@dataclass(frozen=True)
class Taken(Generic[T]):
    """The replica took the request; its deltas arrive on `stream` (the app: the request's queue on the ingress'
    delta stream; the simulator: the future of its end)."""

    accepted: Accepted
    stream: T


@dataclass(frozen=True)
class Unreachable:
    """The call did not reach the granted replica in time, or failed (still starting, draining, gone)."""

    why: str


Dispatched = Taken[T] | Refused | Rejected | Unreachable
# dispatch(grant, attempt): sends the granted request (its `attempt`-th grant) to grant.replica_id.
Dispatch = Callable[[Granted, int], Awaitable[Dispatched[T]]]


@dataclass(frozen=True)
class Admitted(Generic[T]):
    """Where the request runs: its grant, which attempt took, and the stream of its deltas."""

    grant: Granted
    attempt: int
    stream: T


@dataclass(frozen=True)
class AdmitSettings:
    """The app's settings the loop reads (AppArgs' fields of the same names)."""

    queue_timeout_s: float  # how long a request may wait for a replica to take it, in all
    retry_after_s: int  # the Retry-After of a 429


async def admit(ticket: str, need: Need, *, ask: PrefixAsk | None, level: ServiceLevel, arrived: float,
                admission: AdmissionPort, dispatch: Dispatch[T], settings: AdmitSettings) -> Admitted[T]:
    """Admits the request that arrived at `arrived` (the event loop's time) and sends it to its replica. Raises
    ApiError, with its status, when the queue refuses it, when no replica took it within queue_timeout_s (429
    queue_timeout), or when the replica rejected it (400: the engine's request error). Whatever it raises, the grant
    it held last is still the caller's to release."""
    loop = asyncio.get_running_loop()
    deadline = arrived + settings.queue_timeout_s
    deadline_at = None if level.deadline_s is None else arrived + level.deadline_s
    returned: list[str] = []  # what became of earlier grants, for an honest error
    late_chance_used = False
    refusals = 0
    while True:
        timeout = deadline - loop.time()
        if timeout <= 0:
            # Only a request whose grant came back gets here: it waits at the head once more, briefly.
            if late_chance_used or not returned:
                raise ApiError(
                    429, f"waited {loop.time() - arrived:.1f}s (queue_timeout_s={settings.queue_timeout_s:g}) and no "
                    f"replica took the request: it was granted KV but {'; '.join(returned)}; retry later",
                    code="queue_timeout", retry_after=settings.retry_after_s)
            late_chance_used = True
            timeout = REQUEUE_MIN_WAIT_S
        asking = level if deadline_at is None else dataclasses.replace(  # what is left of its deadline
            level, deadline_s=deadline_at - loop.time())
        reply = await admission.acquire(Acquire(ticket, need, timeout, front=bool(returned), ask=ask, level=asking))
        if isinstance(reply, Refusal):
            raise reply.error("; ".join(returned))
        attempt = len(returned)
        dispatched = await dispatch(reply, attempt)
        if isinstance(dispatched, Taken):
            return Admitted(reply, attempt, dispatched.stream)
        if isinstance(dispatched, Rejected):
            raise ApiError(400, f"the engine refused the request: {dispatched.message}")
        if isinstance(dispatched, Refused):  # it holds less free KV than the queue knew
            await admission.refused(ticket, reply.replica_id, dispatched.free_blocks)
            refusals += 1
            await asyncio.sleep(refusal_backoff_s(refusals))
            returned.append(f"replica {reply.replica_id} refused it (it had {dispatched.free_blocks} free KV blocks)")
        else:  # not reached in time, or the call failed: the grant goes back, the request to the head
            await admission.unreachable(ticket, reply.replica_id)
            await asyncio.sleep(unreachable_backoff_s(len(returned)))
            returned.append(f"replica {reply.replica_id} {dispatched.why}")
