"""KV-aware request router for the engine deployment (a ray.serve.request_router.RequestRouter).

It runs in every caller process (each ingress replica). A request carries its KV need in logical blocks and,
normally, the replica the admission queue granted it (`target_replica`): the router sends it only there. A
request without a grant (a direct handle call) goes to a replica whose reported free KV, minus what this router
has sent it since that report, holds the request, the most free first. Either way the replica re-checks and may
refuse. Other calls go to any replica, or, given a `ReplicaQuery` (dcpserve/deployments/replica/engine_replica.py), to
the one it names: stats() of every replica, which Serve's own choice among idle replicas does not reach one by one.

A call addressed to a replica this router has seen removed (it died, or was stopped) fails at once with
`ReplicaGone`: replica ids are never reused, so it could only wait for ever, and Serve runs at most 2 routing tasks
per replica (50 at most): two such calls waiting would hold every routing task of the handle, and no other call
through it (the new replica's included) would be routed. A call addressed to a replica the router does not know yet
(just started) waits for it.

When no candidate can take a request (its granted replica is not, or not yet, among the routable replicas; no
replica reports enough free KV), Serve's routing loop tries again. That loop sleeps between attempts only when
`routing_context.should_backoff` is set, so choose_replicas always sets it: without it the retry never awaits and
starves the router's event loop, which then also never clears the requests whose callers gave up. A request whose
caller already gave up gets the candidates back at once, so the loop sees its done future and drops it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# How many removed replicas a router remembers (calls addressed to them fail at once).
GONE_REMEMBERED = 10_000


class ReplicaGone(RuntimeError):
    """A call was addressed to a replica that has left the deployment (died or stopped)."""


def target_of(pending_request: PendingRequest | None) -> str | None:
    """The replica a call is addressed to: the target_replica of its first argument that names one (an
    EngineRequest's grant, or a ReplicaQuery for stats()); None when the router may choose."""
    if pending_request is None:
        return None
    for value in list(pending_request.args) + list(pending_request.kwargs.values()):
        target: str | None = getattr(value, "target_replica", None)
        if target is not None:
            return target
    return None


def request_of(pending_request: PendingRequest | None) -> Any | None:
    """The EngineRequest of a generate() call (its first argument), if this is one."""
    if pending_request is None:
        return None
    for value in list(pending_request.args) + list(pending_request.kwargs.values()):
        if hasattr(value, "kv_blocks") and hasattr(value, "target_replica"):
            return value
    return None


class Reporting(Protocol):
    """What ranking reads of a replica: a RunningReplica, or a test's stand-in for one."""

    @property
    def replica_id(self) -> Hashable: ...

    @property
    def routing_stats(self) -> dict[str, Any] | None: ...


_Replica = TypeVar("_Replica", bound=Reporting)


def free_blocks(replica: Reporting) -> int | None:
    """The replica's last reported free KV in logical blocks; None before its first report."""
    value = (replica.routing_stats or {}).get("kv_free_blocks")
    return int(value) if value is not None else None


def rank_by_free_kv(
    candidates: Sequence[_Replica], need: int, sent_since_report: Mapping[Any, int]
) -> list[list[_Replica]]:
    """Replicas that can hold `need` blocks by their reports, most free first, one per rank."""
    scored = []
    for replica in candidates:
        free = free_blocks(replica)
        if free is None or not (replica.routing_stats or {}).get("healthy", True):
            continue
        free -= sent_since_report.get(replica.replica_id, 0)
        if free >= need:
            scored.append((free, replica))
    scored.sort(key=lambda item: -item[0])
    return [[replica] for _, replica in scored]


class KvAwareRouter(RequestRouter):
    """Routes each request to its granted replica, or to the replica with the most free KV that can hold it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Blocks sent per replica since its last routing-stats report; a new report resets its count.
        self._sent_blocks: dict[ReplicaID, int] = {}
        self._last_stats: dict[ReplicaID, Any] = {}
        self._known: set[str] = set()  # unique ids of the replicas of the last update
        self._gone: OrderedDict[str, None] = OrderedDict()  # unique ids of replicas removed since, newest last
        super().__init__(*args, **kwargs)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id.unique_id for r in replicas}
        for removed in self._known - current:
            self._gone[removed] = None
        while len(self._gone) > GONE_REMEMBERED:
            self._gone.popitem(last=False)
        self._known = current
        for replica in replicas:
            stats = replica.routing_stats
            if self._last_stats.get(replica.replica_id) is not stats:
                self._last_stats[replica.replica_id] = stats
                self._sent_blocks.pop(replica.replica_id, None)
        for gone in set(self._last_stats) - {r.replica_id for r in replicas}:
            self._last_stats.pop(gone, None)
            self._sent_blocks.pop(gone, None)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # see the module docstring: never a tight loop
            if pending_request.future.done():
                return [candidate_replicas]  # the caller gave up: Serve's loop drops it before choosing
        target = target_of(pending_request)
        if target is not None and target in self._gone and pending_request is not None:
            pending_request.future.set_exception(ReplicaGone(
                f"replica {target} has left the deployment (it died or was stopped); the call was not sent"))
            return [candidate_replicas]  # Serve's loop sees the done future and drops the request
        if target is not None:  # a granted request, or a call addressed to one replica
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        request = request_of(pending_request)
        if request is None:
            return [candidate_replicas]  # not a generate() call (stats, health): any replica
        return rank_by_free_kv(candidate_replicas, request.kv_blocks, self._sent_blocks)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = request_of(pending_request)
        if request is None:
            return
        self._sent_blocks[replica_id] = self._sent_blocks.get(replica_id, 0) + request.kv_blocks
