"""KvAwareRouter driven through Ray Serve's own routing loop (RequestRouter, no cluster), with in-memory replicas.

The loop that wedged the ingress: a request that no candidate can take must back off (the event loop keeps
serving other work) and a request whose caller gave up must be dropped at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest, RunningReplica

from dcpserve.deployments.dispatch.router import KvAwareRouter, ReplicaGone
from dcpserve.deployments.messages import EngineRequest, ReplicaQuery
from dcpserve.engine.sampling_params import SamplingParams

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="dcpserve")
# With Serve's backoff (25 ms doubling to 500 ms) a request retried for RUN_S is tried about a dozen times; a loop
# that never awaits tries it thousands of times, so the counting router stops it at this bound instead of hanging.
RUN_S = 1.5
MAX_ATTEMPTS = 2000


class FakeReplica:
    """The part of RunningReplica that Serve's routing loop and KvAwareRouter read."""

    def __init__(self, unique_id: str, free_blocks: int | None, queue_len: int = 0) -> None:
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.routing_stats: dict[str, Any] = {} if free_blocks is None else {"kv_free_blocks": free_blocks}
        self.queue_len = queue_len
        self.node_id = ""
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = 100

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def running(*replicas: FakeReplica) -> list[RunningReplica]:
    """The fakes, as the RunningReplicas they stand in for."""
    return cast("list[RunningReplica]", list(replicas))


class CountingRouter(KvAwareRouter):
    """Counts choose_replicas calls and fails (instead of spinning for ever) past MAX_ATTEMPTS."""

    def __init__(self) -> None:
        super().__init__(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        self.attempts = 0

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        self.attempts += 1
        if self.attempts > MAX_ATTEMPTS:
            raise RuntimeError(f"choose_replicas called {self.attempts} times: a retry loop without backoff")
        return await super().choose_replicas(candidate_replicas, pending_request)


def pending(kv_blocks: int, target_replica: str | None, internal_id: str = "r") -> PendingRequest:
    request = EngineRequest("ticket", [1, 2, 3], SamplingParams(max_tokens=4), kv_blocks, target_replica)
    metadata = RequestMetadata(request_id=internal_id, internal_request_id=internal_id)
    return PendingRequest(args=[request], kwargs={}, metadata=metadata)


async def _route_for(router: CountingRouter, request: PendingRequest) -> tuple[asyncio.Task[Any], int]:
    """Starts routing `request`, lets it run RUN_S while a heartbeat ticks on the same loop; returns the routing
    task (still running when nothing could take the request) and the heartbeat's ticks."""
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    beat = asyncio.create_task(heartbeat())
    routing = asyncio.create_task(router._choose_replica_for_request(request))
    await asyncio.sleep(RUN_S)
    beat.cancel()
    return routing, ticks


@pytest.mark.parametrize("case", ["granted replica missing", "no replica has room"])
def test_an_unplaceable_request_backs_off_and_a_cancelled_one_is_dropped(case: str) -> None:
    async def run() -> None:
        router = CountingRouter()
        router.update_replicas(running(FakeReplica("a", free_blocks=4), FakeReplica("b", free_blocks=2)))
        if case == "granted replica missing":
            request = pending(kv_blocks=1, target_replica="starting-replica")  # not (yet) among the candidates
        else:
            request = pending(kv_blocks=8, target_replica=None)  # larger than every replica's reported free KV
        routing, ticks = await _route_for(router, request)
        assert not routing.done(), routing  # still waiting for a replica: nothing could take it
        # The loop backed off: few attempts, and the heartbeat on the same event loop kept ticking.
        assert router.attempts < 40, router.attempts
        assert ticks > 0.5 * RUN_S / 0.01, ticks
        # The caller gives up: the request leaves the router and its routing task ends (no task left retrying).
        routing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await routing
        for _ in range(100):
            if not router._routing_tasks:
                break
            await asyncio.sleep(0.01)
        assert not router._routing_tasks
        attempts = router.attempts
        await asyncio.sleep(0.3)
        assert router.attempts == attempts  # nothing retries it any more

    asyncio.run(run())


def test_a_granted_request_goes_to_its_replica_once_it_appears() -> None:
    async def run() -> None:
        router = CountingRouter()
        router.update_replicas(running(FakeReplica("a", free_blocks=100)))
        routing = asyncio.create_task(router._choose_replica_for_request(pending(4, target_replica="b")))
        await asyncio.sleep(0.2)
        assert not routing.done()  # "a" has room, but the grant is for "b"
        router.update_replicas(running(FakeReplica("a", free_blocks=100), FakeReplica("b", free_blocks=0)))
        replica = await asyncio.wait_for(routing, timeout=2.0)  # within Serve's longest backoff (0.5 s)
        assert replica.replica_id.unique_id == "b"

    asyncio.run(run())


def test_an_ungranted_request_goes_to_the_most_free_kv_net_of_what_was_sent() -> None:
    async def run() -> None:
        router = CountingRouter()
        a, b = FakeReplica("a", free_blocks=10), FakeReplica("b", free_blocks=8)
        router.update_replicas(running(a, b))
        first = await asyncio.wait_for(router._choose_replica_for_request(pending(4, None)), timeout=2.0)
        assert first.replica_id.unique_id == "a"
        router.on_request_routed(pending(4, None), first.replica_id, None)  # a: 10 - 4 = 6 left by this router
        second = await asyncio.wait_for(router._choose_replica_for_request(pending(4, None)), timeout=2.0)
        assert second.replica_id.unique_id == "b"

    asyncio.run(run())


def test_a_call_addressed_by_replica_query_reaches_that_replica_and_no_other() -> None:
    """stats() of every replica: Serve's own choice among idle replicas may send every call to the same one (its
    tie-break), so each call names its replica, whatever their free KV or queues."""
    async def run() -> None:
        router = CountingRouter()
        router.update_replicas(running(FakeReplica("a", free_blocks=100), FakeReplica("b", free_blocks=1, queue_len=5)))
        metadata = RequestMetadata(request_id="s", internal_request_id="s")
        for target in ["b", "a", "b", "b"]:
            call = PendingRequest(args=[ReplicaQuery(target)], kwargs={}, metadata=metadata)
            replica = await asyncio.wait_for(router._choose_replica_for_request(call), timeout=2.0)
            assert replica.replica_id.unique_id == target
        gone = asyncio.create_task(router._choose_replica_for_request(
            PendingRequest(args=[], kwargs={"query": ReplicaQuery("c")}, metadata=metadata)))
        await asyncio.sleep(0.2)
        assert not gone.done()  # never another replica in its place
        gone.cancel()

    asyncio.run(run())


def test_calls_addressed_to_a_removed_replica_fail_at_once_and_never_block_the_others() -> None:
    """Serve runs at most 2 routing tasks per replica: with one replica, two calls waiting for a replica that died
    held both, and nothing else through the handle was routed (a replacement replica got no call at all). A call
    addressed to a replica the router saw removed fails at once; one to a replica not known yet still waits."""
    async def run() -> None:
        router = CountingRouter()
        router.update_replicas(running(FakeReplica("old", free_blocks=100)))
        router.update_replicas(running(FakeReplica("new", free_blocks=100)))  # "old" died, "new" replaced it
        doomed = [asyncio.create_task(router._choose_replica_for_request(PendingRequest(
            args=[ReplicaQuery("old")], kwargs={}, metadata=RequestMetadata(request_id=d, internal_request_id=d))))
            for d in ("d0", "d1", "d2")]
        later = asyncio.create_task(router._choose_replica_for_request(pending(4, "not-yet", internal_id="later")))
        replica = await asyncio.wait_for(router._choose_replica_for_request(pending(4, "new", internal_id="now")), 2.0)
        assert replica.replica_id.unique_id == "new"
        for task in doomed:
            with pytest.raises(ReplicaGone, match="replica old has left"):
                await asyncio.wait_for(task, 2.0)
        await asyncio.sleep(0.2)
        assert not later.done()  # a replica this router has not seen yet may still come
        later.cancel()

    asyncio.run(run())
