"""What the admission queue knows of each replica and the grants it counts there (dcpserve/deployments/admission/
queue.py's invariants): the replicas' KV reports and their reconciliation with the grants, grants given back (the
replica refused the request, was not reached, or was lost), replicas that stop reporting, and the pools' KV load.
`ReplicaLedger` is the queue's base: every change that may make room calls the queue's `_fulfill`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dcpserve.deployments.admission.errors import NeverFits
from dcpserve.deployments.admission.fair_share import TenantShares
from dcpserve.deployments.admission.latency_window import LatencyWindow
from dcpserve.deployments.admission.pools import never_fits, pools_of, smallest_blocks
from dcpserve.deployments.admission.replica_choice import ReplicaKv
from dcpserve.deployments.admission.session_affinity import SessionHomes, SessionShares, session_of
from dcpserve.deployments.messages import DEFAULT_POOL, KvReport, Need, ServiceLevel, SloReport


@dataclass(frozen=True)
class Grant:
    """Where a ticket was granted: the replica, the blocks counted for it there (its admission blocks less the
    cached blocks of its prefix that requests there hold) and how many of its prompt blocks routing found there
    (reported cached, or computed by grants in flight or finished since the replica's last report)."""

    replica_id: str
    need: int
    hit_blocks: int
    pool: str = DEFAULT_POOL
    level: ServiceLevel = ServiceLevel()
    tokens: int = 0  # need x the replica's tokens per block: what its tenant's share is charged while it holds it
    decision: str = ""  # why that replica (messages.DECISION_REASONS)


class ReplicaLedger:
    """The replicas' KV as reported and the grants counted on each (the admission queue's state beside its waiters)."""

    # Set by the queue's constructor.
    replicas: dict[str, ReplicaKv]
    replica_ttl_s: float  # a replica silent this long gets no more grants
    leak_grace_s: float  # a grant its replica never saw this long is dropped (caller died)
    shares: TenantShares
    session_shares: SessionShares
    homes: SessionHomes
    latency: LatencyWindow
    num_lost: int  # replicas a caller's stream found dead (replica_lost)
    num_refusals: int
    num_unreachable: int
    num_leaked: int  # grants dropped by leak reconciliation (their caller never released them)
    _clock: Callable[[], float]
    _on_event: Callable[[str, float | None, ServiceLevel | None], None] | None
    _ticket_replica: dict[str, str]
    _grants: dict[str, Grant]  # ticket -> its grant, until released or given back
    _lost: dict[str, tuple[int, float]]  # lost replica -> (its probes then, when), until 6 x ttl

    def _fulfill(self) -> None:
        """Grants what a change of the ledger made room for (the queue's)."""
        raise NotImplementedError

    def _waiting_needs(self) -> list[Need]:
        """The needs of the requests waiting (the queue's)."""
        raise NotImplementedError

    def grant_of(self, ticket: str) -> Grant | None:
        """The ticket's grant while it holds one."""
        return self._grants.get(ticket)

    def _drop_grant(self, ticket: str, finished: bool = False) -> ReplicaKv | None:
        """Forgets the ticket's grant; returns its replica (if still known). A finished request's prompt stays a
        routing preference there until the replica reports its cache again."""
        replica_id = self._ticket_replica.pop(ticket, None)
        grant = self._grants.pop(ticket, None)
        if grant is not None:
            self._release_shares(grant)
        replica = self.replicas.get(replica_id) if replica_id is not None else None
        if replica is not None:
            replica.drop_grant(ticket)
            if finished:
                replica.prefix.retire(ticket)
            else:
                replica.prefix.drop(ticket)
        return replica

    def _release_shares(self, grant: Grant) -> None:
        """The grant no longer holds KV: its tenant and its session stop being charged for it."""
        now = self._clock()
        self.shares.release(grant.level.tenant, grant.tokens, now)
        self.session_shares.release(session_of(grant.level), grant.tokens, now)

    def refused(self, ticket: str, replica_id: str, free_blocks: int) -> None:
        """The replica refused the ticket's request (it holds less free KV than we thought): drop the grant and
        believe the replica's number until its next report."""
        self.num_refusals += 1
        self._event("refused_by_replica")
        self._drop_grant(ticket)
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.external = max(
                replica.external, replica.capacity - replica.headroom - replica.granted - max(free_blocks, 0))
        self._fulfill()

    def unreachable(self, ticket: str, replica_id: str) -> None:
        """The granted replica did not take the ticket's request in time, or the call to it failed (it is still
        starting, draining, or gone): drop the grant, and grant that replica nothing more until Serve has probed
        it again (its next report with a higher probe count)."""
        self.num_unreachable += 1
        self._event("unreachable_replica")
        self._drop_grant(ticket)
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.unreachable_at_probe = replica.probes
        self._fulfill()

    def replica_lost(self, replica_id: str) -> None:
        """A caller's stream from the replica failed (the replica or its node died): the queue forgets it at once,
        its capacity and its grants (the requests there fail and their releases find nothing), instead of after
        replica_ttl_s without reports. A replica that is alive after all reports again within seconds and comes
        back, grantable once Serve has probed it since the loss."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        self.num_lost += 1
        self._lost[replica_id] = (replica.probes, self._clock())
        self.remove_replica(replica_id)
        self._fulfill()

    def report(self, report: KvReport) -> None:
        """A replica's truth (KvReport): its capacity, the blocks its ledger counts per ticket, its health, whether
        Serve routes to it (and how many controller probes it has seen), its admission headroom, the changes of its
        prefix cache, its pool and recent step (its GPUs and max_num_seqs), and the prompt tokens it has still to
        compute (with the tokens one of its steps takes, and its measured reload of a host-tier block). Reconciles
        grants with it."""
        replica_id, held, prefix = report.replica_id, report.held, report.prefix
        now = self._clock()
        replica = self.replicas.get(replica_id)
        if replica is None:
            replica = self.replicas[replica_id] = ReplicaKv(replica_id, report.capacity, report.tokens_per_block)
            lost = self._lost.pop(replica_id, None)
            if lost is not None:  # reported as lost, yet it reports: grantable once Serve probes it again
                replica.unreachable_at_probe = lost[0]
        replica.capacity = report.capacity
        replica.tokens_per_block = report.tokens_per_block
        replica.pool = report.pool
        replica.step_s = report.step_s
        replica.gpus = report.gpus
        replica.max_seqs = report.max_seqs
        replica.prefill_tokens = report.prefill_tokens
        replica.step_tokens = report.step_tokens
        replica.reload_s_per_block = report.reload_s_per_block
        replica.prefill_s_per_token = report.prefill_s_per_token
        replica.healthy = report.healthy
        replica.routable = report.routable
        replica.probes = report.probes
        replica.headroom = report.headroom
        replica.set_held(held)
        replica.last_report = now
        if prefix is not None:
            replica.prefix.index.apply(prefix)
        replica.prefix.on_report()
        for ticket, (_, granted_at) in list(replica.grants.items()):
            if ticket not in held and now - granted_at > self.leak_grace_s:
                self._drop_grant(ticket)  # granted long ago, never arrived or never released: the caller died
                self.num_leaked += 1
        # Released tickets the report still names were freed before their release (a finished request's KV at its
        # end, an unfinished one's abort completes first): the report was made before it, and is stale for them.
        replica.external = replica.unclaimed_blocks()
        self._fulfill()

    def remove_replica(self, replica_id: str) -> None:
        replica = self.replicas.pop(replica_id, None)
        if replica is not None:
            for ticket in replica.grants:
                self._ticket_replica.pop(ticket, None)
                grant = self._grants.pop(ticket, None)
                if grant is not None:
                    self._release_shares(grant)
            self.homes.forget_replica(replica_id)

    def prefix_position(self, replica_id: str) -> tuple[str | None, int]:
        """Where the queue's copy of the replica's prefix cache stands: (epoch, version), for its next report."""
        replica = self.replicas.get(replica_id)
        return (None, 0) if replica is None else (replica.prefix.index.epoch, replica.prefix.index.version)

    def expire(self) -> None:
        """Marks replicas that stopped reporting as unhealthy (no grants) and forgets long-dead ones."""
        now = self._clock()
        for replica_id, (_, lost_at) in list(self._lost.items()):
            if now - lost_at > 6 * self.replica_ttl_s:
                del self._lost[replica_id]
        for replica in list(self.replicas.values()):
            silent = now - replica.last_report
            if silent > 6 * self.replica_ttl_s:
                self.remove_replica(replica.replica_id)
            elif silent > self.replica_ttl_s:
                replica.healthy = False

    def pool_load(self, pool: str) -> tuple[int, int, int]:
        """(the KV the pool's healthy replicas hold or have granted, plus the blocks of the requests waiting that
        the pool could hold; their capacity; how many they are): whether fewer replicas could hold today's load."""
        replicas = [r for r in self.replicas.values() if r.pool == pool and r.healthy]
        held = sum(r.capacity - r.free for r in replicas)
        waiting = sum(smallest_blocks(need) for need in self._waiting_needs()
                      if pool in pools_of(need, self.replicas.values()))
        return held + waiting, sum(r.capacity for r in replicas), len(replicas)

    def slo_report(self, pool: str, percentile: float, window_s: float) -> SloReport:
        """The pool's served latencies at the percentile over the window and its KV load: what a replica's report
        asking for them (KvReport.slo_window_s) is answered with, for the service-level autoscaling policy."""
        latency = self.latency.percentile(self._clock(), pool, percentile, window_s)
        load, capacity, replicas = self.pool_load(pool)
        return SloReport(latency.ttft_s, latency.itl_s, load, capacity, replicas)

    def _healthy_replicas(self) -> list[ReplicaKv]:
        return [r for r in self.replicas.values() if r.healthy]

    def _event(self, outcome: str, waited_s: float | None = None, level: ServiceLevel | None = None) -> None:
        if self._on_event is not None:
            self._on_event(outcome, waited_s, level)

    def _check_fits_somewhere(self, need: Need) -> None:
        why = never_fits(need, None, self._healthy_replicas() or list(self.replicas.values()))
        if why is not None:
            raise NeverFits(why)
