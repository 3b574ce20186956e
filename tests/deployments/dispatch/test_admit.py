"""The admission-dispatch loop (dcpserve/deployments/dispatch/admit.py) on simulated time: a grant the replica refuses
or that does not reach it goes back and the request asks again at the head, with the backoffs the module names; the
queue's refusal and the last chance after queue_timeout_s end it with their HTTP status. The app's port to the queue
(KvAdmission through its handle) and the simulator's (the in-process AdmissionQueue) answer one scripted sequence of
grants and refusals alike."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dcpserve.deployments.admission.kv_admission import KvAdmission
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.dispatch.admit import (
    REQUEUE_MIN_WAIT_S,
    AdmissionPort,
    AdmitSettings,
    Admitted,
    Dispatched,
    Taken,
    Unreachable,
    admit,
)
from dcpserve.deployments.dispatch.sessions import AdmissionHandle
from dcpserve.deployments.messages import (
    Accepted,
    Acquire,
    AcquireReply,
    ApiError,
    Granted,
    KvReport,
    Refusal,
    Refused,
    Rejected,
    ServiceLevel,
)
from dcpserve.simulator.clock import run_simulated
from dcpserve.simulator.ingress import SimAdmission

SETTINGS = AdmitSettings(queue_timeout_s=30.0, retry_after_s=7)


class ScriptedQueue:
    """An admission port that answers acquires from a script, each after `latency_s`, and logs every call with the
    simulated time it came at."""

    def __init__(self, replies: list[AcquireReply], latency_s: float = 0.0) -> None:
        self.replies = list(replies)
        self.latency_s = latency_s
        self.log: list[tuple[float, str, Any]] = []

    def _now(self) -> float:
        return round(asyncio.get_running_loop().time(), 6)

    async def acquire(self, request: Acquire) -> AcquireReply:
        self.log.append((self._now(), "acquire", (request.front, round(request.timeout_s, 6))))
        await asyncio.sleep(self.latency_s)
        return self.replies.pop(0)

    async def refused(self, ticket: str, replica_id: str, free_blocks: int) -> None:
        self.log.append((self._now(), "refused", (replica_id, free_blocks)))

    async def unreachable(self, ticket: str, replica_id: str) -> None:
        self.log.append((self._now(), "unreachable", replica_id))


def scripted_dispatch(answers: list[Callable[[Granted], Dispatched[str]]]
                      ) -> Callable[[Granted, int], Awaitable[Dispatched[str]]]:
    async def dispatch(grant: Granted, attempt: int) -> Dispatched[str]:
        return answers.pop(0)(grant)
    return dispatch


def refuse(free: int) -> Callable[[Granted], Dispatched[str]]:
    return lambda grant: Refused(grant.replica_id, free)


def take(grant: Granted) -> Dispatched[str]:
    return Taken(Accepted(grant.replica_id), f"stream of {grant.replica_id}")


def run_admit(queue: AdmissionPort, answers: list[Callable[[Granted], Dispatched[str]]],
              settings: AdmitSettings = SETTINGS) -> Admitted[str]:
    async def main() -> Admitted[str]:
        return await admit("t", 2, ask=None, level=ServiceLevel(), arrived=asyncio.get_running_loop().time(),
                           admission=queue, dispatch=scripted_dispatch(answers), settings=settings)
    return run_simulated(main())


def test_grants_that_do_not_take_go_back_and_the_request_asks_again_at_the_head_with_backoffs() -> None:
    queue = ScriptedQueue([Granted("r0", 2), Granted("r1", 2), Granted("r1", 2), Granted("r0", 2)])
    answers = [refuse(1), refuse(0), lambda grant: Unreachable("did not take it"), take]
    admitted = run_admit(queue, answers)
    assert admitted == Admitted(Granted("r0", 2), 3, "stream of r0")
    assert queue.log == [
        (0.0, "acquire", (False, 30.0)),
        (0.0, "refused", ("r0", 1)),  # the first refusal: no backoff (the replica reported before it refused)
        (0.0, "acquire", (True, 30.0)),  # back at the head
        (0.0, "refused", ("r1", 0)),
        (0.01, "acquire", (True, 29.99)),  # the second: 10 ms
        (0.01, "unreachable", "r1"),
        (0.21, "acquire", (True, 29.79)),  # two grants back before it: 50 ms x 2^2
    ]


def test_the_queues_refusal_ends_it_with_its_status_and_what_became_of_earlier_grants() -> None:
    queue = ScriptedQueue([Granted("r0", 2), Refusal("queue_full", "the admission queue is full", 429, 3)])
    with pytest.raises(ApiError) as raised:
        run_admit(queue, [refuse(0)])
    err = raised.value
    assert (err.status, err.code, err.retry_after) == (429, "queue_full", 3)
    assert err.message == ("the admission queue is full; before that this request was granted KV but replica r0 "
                           "refused it (it had 0 free KV blocks)")


def test_a_replicas_rejection_is_the_clients_400() -> None:
    queue = ScriptedQueue([Granted("r0", 2)])
    with pytest.raises(ApiError) as raised:
        run_admit(queue, [lambda grant: Rejected(grant.replica_id, "prompt too long")])
    assert raised.value.status == 400 and "prompt too long" in raised.value.message


def test_a_request_granted_after_its_timeout_gets_one_last_chance_then_429() -> None:
    """Each acquire takes 4 s of queue wait here; with queue_timeout_s=10 the third grant comes back after the
    deadline: the request waits at the head once more, for REQUEUE_MIN_WAIT_S, then gets its 429."""
    queue = ScriptedQueue([Granted("r0", 2)] * 4, latency_s=4.0)
    with pytest.raises(ApiError) as raised:
        run_admit(queue, [refuse(0)] * 4, settings=AdmitSettings(queue_timeout_s=10.0, retry_after_s=7))
    assert [entry for _, kind, entry in queue.log if kind == "acquire"] == [
        (False, 10.0), (True, 6.0), (True, 1.99), (True, REQUEUE_MIN_WAIT_S)]
    err = raised.value
    assert (err.status, err.code, err.retry_after) == (429, "queue_timeout", 7)
    assert err.message.count("refused it") == 4


def test_the_apps_port_and_the_simulators_agree_on_a_scripted_sequence() -> None:
    """One script (two replicas of 10 blocks, three requests of 6 blocks; the replicas refuse the first grant of
    each, saying they have all 10 blocks free) through the app's port (KvAdmission behind a handle) and the
    simulator's (AdmissionQueue in process): the same grants, refusals and answers in the same order."""

    def run(make_port: Callable[[], tuple[AdmissionPort, AdmissionQueue]]) -> list[Any]:
        async def main() -> list[Any]:
            port, queue = make_port()
            for replica in ("r0", "r1"):
                queue.report(KvReport(replica_id=replica, capacity=10, tokens_per_block=16, probes=1))
            events: list[Any] = []
            refused: set[str] = set()

            async def dispatch(grant: Granted, attempt: int) -> Dispatched[str]:
                first = grant.replica_id + str(attempt) not in refused and attempt == 0
                events.append(("grant", grant.replica_id, grant.need, attempt))
                if first:
                    refused.add(grant.replica_id + str(attempt))
                    return Refused(grant.replica_id, 10)
                return Taken(Accepted(grant.replica_id), grant.replica_id)

            loop = asyncio.get_running_loop()
            for ticket in ("a", "b", "c"):
                try:
                    admitted = await admit(ticket, 6, ask=None, level=ServiceLevel(), arrived=loop.time(),
                                           admission=port, dispatch=dispatch,
                                           settings=AdmitSettings(queue_timeout_s=5.0, retry_after_s=7))
                    events.append(("admitted", ticket, admitted.stream, admitted.attempt))
                except ApiError as err:
                    events.append(("refused", ticket, err.status, err.code))
            return events
        return run_simulated(main())

    def app_port() -> tuple[AdmissionPort, AdmissionQueue]:
        deployment = KvAdmission.func_or_class(max_queued=4, retry_after_s=7)  # type: ignore[attr-defined]  # mypy ignores class decorators: @serve.deployment made it a Deployment
        deployment._expiry.cancel()  # its replica expiry runs on the wall clock's seconds; the script reports once
        handle = types.SimpleNamespace(**{name: types.SimpleNamespace(remote=getattr(deployment, name))
                                          for name in ("acquire", "refused", "unreachable")})
        return AdmissionHandle(handle), deployment.queue

    def simulator_port() -> tuple[AdmissionPort, AdmissionQueue]:
        queue = AdmissionQueue(max_queued=4, clock=asyncio.get_running_loop().time)
        return SimAdmission(queue, retry_after_s=7), queue

    app, simulated = run(app_port), run(simulator_port)
    assert app == simulated
    assert app == [
        ("grant", "r0", 6, 0), ("grant", "r0", 6, 1), ("admitted", "a", "r0", 1),  # refused, then again at the head
        ("grant", "r1", 6, 0), ("grant", "r1", 6, 1), ("admitted", "b", "r1", 1),  # r0 holds a: the most free is r1
        ("refused", "c", 429, "queue_timeout"),  # 4 blocks free on each: it waits out queue_timeout_s
    ]
