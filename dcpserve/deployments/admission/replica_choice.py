"""Which replica a request goes to: what the admission queue knows of each replica's KV (`ReplicaKv`, in logical
blocks), and the choice among them (`pick_replica`), which dcpserve/deployments/admission/queue.py calls for every
grant.

Prefix-aware routing. With prefix caching each replica also reports the prefix blocks it caches
(dcpserve.engine.core.prefix_cache.PrefixReport: changes since the queue's copy, or the whole state), and a request
carries the hashes of its prompt's blocks (`PrefixAsk`). For each replica the queue finds the longest cached run of them
(`PrefixIndex.match`): blocks there that a running request holds (pinned) are shared, not added, so the request's
need on that replica is its admission blocks less those; blocks the replica caches but nobody holds cost as much as
free ones (they are counted free). Among the replicas that have room for the request's need there and are in
balance (running at most max(least + 2, 1.5 * least) sequences, least being the least busy one's count: prefix
affinity never piles requests onto one replica while another idles; a replica's sequences are its grants and the
tickets its last report names, less those released here since), it grants the one that holds the longest run
of the prompt's blocks; among equal runs the one where the fewest whole engine steps of prefill come before the
request's first token (`steps_to_start`: the prompt tokens the replica reported still to compute, the grants made
since that its report does not name yet, and the request's own uncached blocks, over the tokens one step takes);
then the one with the most KV free after the grant. So a conversation goes back to the replica holding its history,
and requests sharing a system prompt spread over the replicas that cache it; a replica that has the prefix but no
room, or is out of balance, is never waited for. A request with no cached run anywhere (a chat's first turn) goes
where it starts soonest, not behind another replica's long prompts because that replica had more KV free: in the
simulator (bench/simulate_pools.py, 32 GPUs at 10 chat and 4 agentic sessions/s per node) this took the goodput of
all tp=8 dcp=8 from 152.9 to 161.8 req/s and of all tp=8 from 168.7 to 170.7. The queued prefill decides only
between equal runs: weighing it against the prefix (steps to start first) sent agentic turns away from their
history to recompute it elsewhere whenever their replica had prefill queued, which added prefill everywhere (the
same run: 168.7 -> 157.3 req/s); the same happened earlier with free KV weighed against the prefix, which sent a
turn away whenever the other replica ran one request fewer. With no prefix anywhere (or prefix_routing off) and no
step budget reported, it is the replica with the most free KV, as without caching. Grants still in flight count as
cached on their replica for routing (not for the KV need): a burst sharing a new prefix follows the first request
to one replica instead of computing the prefix everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dcpserve.deployments.admission.prefix_routing import ReplicaPrefix
from dcpserve.deployments.messages import PrefixAsk

# A replica is in balance while it runs at most max(least + BALANCE_SLACK_SEQUENCES, BALANCE_RATIO * least)
# sequences, least being the count of the least busy replica with room; only replicas in balance compete on cost.
BALANCE_SLACK_SEQUENCES = 2
BALANCE_RATIO = 1.5


@dataclass
class ReplicaKv:
    """What the queue knows of one replica's KV, in logical blocks."""

    replica_id: str
    capacity: int
    tokens_per_block: int
    pool: str = "default"  # its layout pool (dcpserve/deployments/admission/pools.py)
    step_s: float = 0.0  # its recent mean engine step (the ITL its batch gets); 0: not reported
    gpus: int = 1  # the GPUs it runs on (tp * pcp)
    max_seqs: int = 0  # the sequences one engine step takes (max_num_seqs); 0: not reported
    prefill_tokens: int = 0  # prompt tokens it had still to compute at its last report (KvLedger.prefill_tokens)
    step_tokens: int = 0  # the tokens one of its steps takes (max_num_batched_tokens); 0: not reported
    grants: dict[str, tuple[int, float]] = field(default_factory=dict)  # ticket -> (blocks, granted at)
    grant_prefill: dict[str, int] = field(default_factory=dict)  # ticket -> blocks its grant has to prefill there
    num_granted: int = 0  # grants ever made to it (a replica that joined is seen taking traffic)
    held: dict[str, int] = field(default_factory=dict)  # ticket -> blocks the replica's ledger last reported
    # Tickets released here that its last report may still name (a report made before they ended): not counted as
    # sequences nor as external blocks. Each report keeps only the tickets it names, so the set never outgrows `held`
    # past the next one.
    released: set[str] = field(default_factory=set)
    external: int = 0  # blocks the replica holds for tickets not granted here
    headroom: int = 0  # blocks the replica's "usage" admission keeps free as growth room
    healthy: bool = True
    routable: bool = True  # Serve's controller probes it (RUNNING): the routers can reach it
    probes: int = 0  # how many controller probes the replica has seen (its reports carry the count)
    unreachable_at_probe: int | None = None  # a caller could not reach it when it had seen this many probes
    last_report: float = 0.0
    prefix: ReplicaPrefix = field(default_factory=ReplicaPrefix)  # its cached prefixes, and grants in flight

    @property
    def num_sequences(self) -> int:
        """Requests it runs or was granted: the granted tickets and the ones it reports holding, less those released
        since (a finished turn must not count against its replica when the conversation's next turn comes before
        the replica's next report)."""
        return len(self.grants) + sum(1 for ticket in self.held
                                      if ticket not in self.grants and ticket not in self.released)

    @property
    def prefill_ahead(self) -> int:
        """Blocks of prompt it has still to compute before a request granted now starts: what its last report
        counted, and the grants since that the report does not name (each its prompt less the cached run it hits)."""
        reported = -(-self.prefill_tokens // max(self.tokens_per_block, 1))
        return reported + sum(blocks for ticket, blocks in self.grant_prefill.items() if ticket not in self.held)

    @property
    def grantable(self) -> bool:
        """Healthy, routable, and probed again since a caller last found it unreachable."""
        if self.unreachable_at_probe is not None and self.probes <= self.unreachable_at_probe:
            return False
        return self.healthy and self.routable

    @property
    def granted(self) -> int:
        """Blocks of the granted tickets: each the larger of its grant and what the replica holds for it."""
        return sum(max(blocks, self.held.get(ticket, 0)) for ticket, (blocks, _) in self.grants.items())

    @property
    def free(self) -> int:
        return self.capacity - self.headroom - self.granted - self.external


def why_not_grantable(replica: ReplicaKv) -> str:
    """Why a replica gets no grant now, for error messages ("ready" when it would)."""
    if not replica.healthy:
        return "unhealthy or silent"
    if not replica.routable:
        return "starting or draining"
    if not replica.grantable:
        return "unreachable"
    return "ready"


def prompt_blocks(need: int, ask: PrefixAsk | None) -> int:
    """The request's prompt in blocks: from its ask, else its admission need (which may count its outputs too)."""
    if ask is None:
        return need
    return -(-ask.num_prompt_tokens // max(ask.tokens_per_block, 1))


def steps_to_start(replica: ReplicaKv, own_blocks: int) -> int:
    """Whole engine steps of prefill on that replica before a request granted now gets its first token: the
    prompt it has still to compute (`prefill_ahead`) and the request's own uncached blocks, over the tokens one step
    takes. 0 where the replica has not reported its step budget: then only the prefix and free KV decide."""
    if replica.step_tokens <= 0:
        return 0
    step_blocks = max(replica.step_tokens // max(replica.tokens_per_block, 1), 1)
    return (replica.prefill_ahead + max(own_blocks, 0)) // step_blocks


def pick_replica(replicas: Iterable[ReplicaKv], need: int, ask: PrefixAsk | None,
                 prefix_routing: bool) -> tuple[int, ReplicaKv, int] | None:
    """The grantable replica with room for a request of `need` admission blocks, in balance, holding the longest
    cached run of its prompt (not weighed when prefix_routing is off), then the most KV free after the grant
    (module doc), as (need there, replica, prompt blocks it caches); None if no replica has room now."""
    roomy = []
    for replica in replicas:
        if not replica.grantable:
            continue
        reported, inflight = replica.prefix.match(ask)
        need_here = need - reported.pinned_blocks
        if replica.free >= need_here:
            roomy.append((replica, reported, inflight, need_here))
    if not roomy:
        return None
    # Load balance first: a replica running many more sequences than the least busy one is passed over, however
    # much of the prefix it holds (otherwise every request sharing a system prompt would pile onto one replica).
    least = min(replica.num_sequences for replica, *_ in roomy)
    limit = max(least + BALANCE_SLACK_SEQUENCES, BALANCE_RATIO * least)
    best: tuple[tuple[int, int, int], int, ReplicaKv, int] | None = None
    for replica, reported, inflight, need_here in roomy:
        if replica.num_sequences > limit:
            continue
        # What routing counts on there: the blocks it reported cached, or those its grants in flight (or
        # finished since its last report) are computing, whichever run is longer.
        hit_blocks = max(reported.hit_blocks, inflight)
        own = prompt_blocks(need, ask) - (hit_blocks if prefix_routing else 0)
        key = (hit_blocks if prefix_routing else 0, -steps_to_start(replica, own), replica.free - need_here)
        if best is None or key > best[0]:
            best = (key, need_here, replica, hit_blocks)
    return None if best is None else best[1:]
