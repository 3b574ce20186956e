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

Host-tier prefixes (issue 51). A replica with a host-memory KV tier reports blocks that left its device for the tier
as HOSTED (`PrefixMatch.host_blocks`): a hit copies them back instead of recomputing them, so the run is credited
with what it saves (`prefix_credit`, in blocks of prefill: a device block 1, a host block 1 less its reload's share of
its recompute, measured by the replica as KvReport.reload_s_per_block, else ASSUMED_RELOAD_FRACTION), and routing
compares credits, not block counts. A host block is not shared KV: it needs its device block like a miss (only pinned
blocks come off the need), and the request's prefill there is its prompt less the credit.

Sessions (issue 51). Before the prefix comes the session's last replica (`home`, from
dcpserve/deployments/admission/session_affinity.py), when it is among the replicas with room and in balance: prefix
routing alone already sends a turn to its history while the replica reports it cached; the home keeps it there when
the device evicted the history to the host tier, or the reports lag. A home out of balance (the saturation the
balance rule defines) is passed over as any replica is, and the normal ranking decides; one with no room, below.

The prefix hold (issue 51). When every replica is full, the next one to free room took the next request in order,
wherever its history was: a session's turn went home only if home freed room first, and otherwise computed its whole
history again elsewhere (in the simulator, Kimi K2 at 4 x tp=8 with a host tier, 71% of later turns left their
replica and TP8's prefix hits were 58%; with the hold 33% and 84%, docs/benchmarks.md). Waiting for the replica that
caches the prompt is worth up to what its cache saves: the request is held (`prefix_deferred`, out of the queue's
walk, like the TTFT bound's holds) for the grantable replica without room that caches more of its prompt than the
one it would get now, for the difference between their estimated first tokens (start_estimate, that replica's as if
it had room), less what it has been held already; it wakes as soon as that replica has room for it, and when the
hold ends it goes where it would have gone. So it starts no later than moving would have started it if its replica
frees room within the hold, and the cluster prefills its history once. A replica that has not reported its step time
gives no estimate and no hold; neither does prefix_routing off.

The TTFT bound (issue 51; dcpserve/deployments/admission/ttft_bound.py). The ranking above keeps the queued prefill
as a tie-breaker, for the reason given; the bound is what keeps a replica's backlog from delaying a first token past
`ttft_bound_s`: over the ranked replicas, the best-ranked one that would start the request within the bound (by
`start_estimate`: its queued prefill, drained one step per step_s since its report, and the request's own) is granted,
or the request is held in the queue while a replica's backlog drains, or, when neither helps, it goes where it starts
soonest. Every pick says why (`Pick.reason`, messages.DECISION_REASONS).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import overload

from dcpserve.deployments.admission.prefix_routing import ReplicaPrefix
from dcpserve.deployments.admission.ttft_bound import BOUND_TOLERANCE_S, StartEstimate, bound_decision
from dcpserve.deployments.messages import PrefixAsk
from dcpserve.engine.core.prefix_cache import PrefixMatch

# A replica is in balance while it runs at most max(least + BALANCE_SLACK_SEQUENCES, BALANCE_RATIO * least)
# sequences, least being the count of the least busy replica with room; only replicas in balance compete on cost.
BALANCE_SLACK_SEQUENCES = 2
BALANCE_RATIO = 1.5

# A block only in a replica's host tier is credited with what its reload saves: its recompute less its copy back. A
# replica that has not measured the copy (KvReport.reload_s_per_block = 0) is assumed to reload a block in this share
# of the time recomputing it takes. Why 0.1: prefilling a token costs about 2 x params FLOPs plus attention over the
# context, copying it back its KV bytes over the host link; for Llama-3-70B in bf16 that is ~140 GFLOP (~0.3 ms at
# ~500 TFLOP/s) against ~320 KiB (~13 us at ~25 GB/s of PCIe 5 per GPU), a share of ~0.05, and less for MLA models
# (Kimi K2, DeepSeek: a few tens of KiB per token) and long contexts (attention grows the recompute, not the copy).
# 0.1 takes twice the estimate, so that a guess never credits a reload with more than it likely saves.
ASSUMED_RELOAD_FRACTION = 0.1

# The keys pick_replica ranks replicas by, as the decision reasons they give (messages.DECISION_REASONS): the first
# key that told the chosen replica from the next one.
RANKING_REASONS = ("session", "prefix", "start_soonest", "most_free")


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
    reload_s_per_block: float = 0.0  # its measured host -> device copy of one block; 0: not measured
    prefill_s_per_token: float = 0.0  # its measured prefill price (KvReport.prefill_s_per_token); 0: not measured
    num_granted: int = 0  # grants ever made to it (a replica that joined is seen taking traffic)
    external: int = 0  # blocks the replica holds for tickets not granted here
    headroom: int = 0  # blocks the replica's "usage" admission keeps free as growth room
    healthy: bool = True
    routable: bool = True  # Serve's controller probes it (RUNNING): the routers can reach it
    probes: int = 0  # how many controller probes the replica has seen (its reports carry the count)
    unreachable_at_probe: int | None = None  # a caller could not reach it when it had seen this many probes
    last_report: float = 0.0
    prefix: ReplicaPrefix = field(default_factory=ReplicaPrefix)  # its cached prefixes, and grants in flight
    # The tickets, changed only through add_grant / drop_grant / set_held / mark_released, which keep the totals below
    # (read as `grants`, `grant_prefill`, `held`, `released`):
    _grants: dict[str, tuple[int, float]] = field(default_factory=dict, init=False, repr=False)  # -> (blocks, at)
    _grant_prefill: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # -> blocks to prefill there
    _held: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # -> blocks its last report counted
    # Tickets released here that its last report may still name (a report made before they ended): not counted as
    # sequences nor as external blocks. Each report keeps only the tickets it names, so the set never outgrows `held`
    # past the next one.
    _released: set[str] = field(default_factory=set, init=False, repr=False)
    # Running totals of the sums the queue reads at every grant, for every replica (`granted`, `prefill_ahead`,
    # `num_sequences`): summed there, one grant cost O(replicas x grants per replica), the cluster's size squared
    # (docs/benchmarks.md, the simulator at 16 nodes). Each change of a ticket moves them by its own blocks; a report
    # (set_held) sums them again, once.
    _granted: int = field(default=0, init=False, repr=False)  # sum over grants of max(blocks, held)
    _prefill_since: int = field(default=0, init=False, repr=False)  # grant_prefill of the tickets `held` lacks
    _held_only: int = field(default=0, init=False, repr=False)  # tickets in `held`, neither granted nor released

    @property
    def grants(self) -> Mapping[str, tuple[int, float]]:
        """Granted tickets -> (blocks counted, granted at)."""
        return MappingProxyType(self._grants)

    @property
    def grant_prefill(self) -> Mapping[str, int]:
        """Granted tickets -> the blocks each has to prefill there (its prompt less the cached run it hits)."""
        return MappingProxyType(self._grant_prefill)

    @property
    def held(self) -> Mapping[str, int]:
        """Tickets -> blocks the replica's ledger counted at its last report."""
        return MappingProxyType(self._held)

    @property
    def released(self) -> AbstractSet[str]:
        """Tickets released here that the last report still names."""
        return self._released

    def unclaimed_blocks(self) -> int:
        """Blocks the last report counts for tickets neither granted nor released here (`external`'s reported part)."""
        return sum(blocks for ticket, blocks in self._held.items()
                   if ticket not in self._grants and ticket not in self._released)

    def add_grant(self, ticket: str, blocks: int, at: float, prefill_blocks: int) -> None:
        """The queue granted the ticket `blocks` here at `at`, with `prefill_blocks` of its prompt to compute."""
        self.drop_grant(ticket)
        self._grants[ticket] = (blocks, at)
        self._grant_prefill[ticket] = prefill_blocks
        self._granted += max(blocks, self._held.get(ticket, 0))
        if ticket not in self._held:
            self._prefill_since += prefill_blocks
        elif ticket not in self._released:
            self._held_only -= 1

    def drop_grant(self, ticket: str) -> None:
        """The ticket no longer holds a grant here (released, given back, leaked); unknown tickets are ignored."""
        entry = self._grants.pop(ticket, None)
        if entry is not None:
            self._granted -= max(entry[0], self._held.get(ticket, 0))
            if ticket in self._held and ticket not in self._released:
                self._held_only += 1
        prefill = self._grant_prefill.pop(ticket, None)
        if prefill is not None and ticket not in self._held:
            self._prefill_since -= prefill

    def mark_released(self, ticket: str) -> None:
        """The ticket ended here, though the replica's last report may still name it."""
        if ticket in self._released:
            return
        self._released.add(ticket)
        if ticket in self._held and ticket not in self._grants:
            self._held_only -= 1

    def set_held(self, held: Mapping[str, int]) -> None:
        """A report's blocks per ticket: replaces the last one's, keeps only the released tickets it names, and sums
        the totals again."""
        self._held = dict(held)
        self._released.intersection_update(self._held)
        self._granted = sum(max(blocks, self._held.get(ticket, 0)) for ticket, (blocks, _) in self._grants.items())
        self._prefill_since = sum(blocks for ticket, blocks in self._grant_prefill.items() if ticket not in self._held)
        self._held_only = sum(1 for ticket in self._held if ticket not in self._grants and ticket not in self._released)

    @property
    def num_sequences(self) -> int:
        """Requests it runs or was granted: the granted tickets and the ones it reports holding, less those released
        since (a finished turn must not count against its replica when the conversation's next turn comes before
        the replica's next report)."""
        return len(self._grants) + self._held_only

    @property
    def prefill_ahead(self) -> int:
        """Blocks of prompt it has still to compute before a request granted now starts: what its last report
        counted, and the grants since that the report does not name (each its prompt less the cached run it hits)."""
        reported = -(-self.prefill_tokens // max(self.tokens_per_block, 1))
        return reported + self._prefill_since

    @property
    def grantable(self) -> bool:
        """Healthy, routable, and probed again since a caller last found it unreachable."""
        if self.unreachable_at_probe is not None and self.probes <= self.unreachable_at_probe:
            return False
        return self.healthy and self.routable

    @property
    def granted(self) -> int:
        """Blocks of the granted tickets: each the larger of its grant and what the replica holds for it."""
        return self._granted

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


def recompute_s_per_block(replica: ReplicaKv) -> float:
    """Seconds of engine steps that prefilling one block takes there: its measured price of a prompt token
    (KvReport.prefill_s_per_token, on its steps that carry prompt tokens) x the block's tokens; until it has measured
    one, its mean step time over the blocks one step takes (a decode-dominated mean: far below a long prompt's chunks,
    dcpserve/deployments/replica/prefill_rate.py); 0 where it has reported neither."""
    if replica.prefill_s_per_token > 0:
        return replica.prefill_s_per_token * replica.tokens_per_block
    if replica.step_s <= 0 or replica.step_tokens <= 0:
        return 0.0
    return replica.step_s * replica.tokens_per_block / replica.step_tokens


def reload_fraction(replica: ReplicaKv) -> float:
    """A host-tier block's reload there as a share of its recompute: measured (reload_s_per_block over
    recompute_s_per_block, at most 1), else ASSUMED_RELOAD_FRACTION."""
    recompute = recompute_s_per_block(replica)
    if replica.reload_s_per_block > 0 and recompute > 0:
        return min(replica.reload_s_per_block / recompute, 1.0)
    return ASSUMED_RELOAD_FRACTION


def prefix_credit(replica: ReplicaKv, match: PrefixMatch) -> float:
    """What a cached run saves there, in blocks of prefill: a block on device its whole recompute, a block only in the
    host tier its recompute less its reload (seconds saved = this x recompute_s_per_block). A host block still needs
    its device block, like a miss: the KV need counts it (only pinned blocks are shared)."""
    if not match.host_blocks:
        return float(match.hit_blocks)
    host = min(match.host_blocks, match.hit_blocks)
    return (match.hit_blocks - host) + host * (1.0 - reload_fraction(replica))


def start_estimate(replica: ReplicaKv, own_blocks: float, now: float) -> StartEstimate:
    """When a request granted there now would get its first token (ttft_bound.StartEstimate): the prefill queued
    before it (`prefill_ahead`), drained one step per step_s since the replica's last report, and its own blocks; 0
    where the replica has not reported its step time and budget."""
    per_block = recompute_s_per_block(replica)
    if per_block <= 0:
        return StartEstimate(0.0, 0.0)
    elapsed = max(now - replica.last_report, 0.0)
    return StartEstimate(max(replica.prefill_ahead * per_block - elapsed, 0.0), max(own_blocks, 0.0) * per_block)


def drained_at(replica: ReplicaKv) -> float | None:
    """When the prefill queued there (`prefill_ahead`) is done at the estimate's pace: its last report plus the
    backlog's seconds, so that start_estimate's ahead_s is max(drained_at - now, 0). It moves only when the replica
    reports, is granted a request, or a grant its report does not name yet goes back; None where the replica has not
    reported its step time and budget (no estimate: within any bound)."""
    per_block = recompute_s_per_block(replica)
    if per_block <= 0:
        return None
    return replica.last_report + replica.prefill_ahead * per_block


@dataclass(frozen=True)
class Pick:
    """pick_replica's answer: the replica, the blocks counted there (its need less the cached blocks running requests
    there hold), the prompt blocks routing found there, the blocks it has to prefill there (its prompt less the
    prefill its cached run saves), why (messages.DECISION_REASONS), and the TTFT bound's estimate: its first token
    there in start_s; wait_s > 0: no replica would start it within the bound, and it should wait that long instead."""

    need: int
    replica: ReplicaKv
    hit_blocks: int
    prefill_blocks: int
    reason: str
    start_s: float = 0.0
    wait_s: float = 0.0
    within_bound: bool = True
    # A prefix hold (prefix_hold): the replica holding the request's prefix that it waits wait_s for, and its need
    # there; the pick's replica is where it would go now instead.
    hold_for: tuple[str, int] | None = None


def _whole(blocks: float) -> int:
    """Blocks rounded up, a rounding error of the credit's float arithmetic not counting as one more."""
    return max(math.ceil(blocks - 1e-9), 0)


_Option = tuple[ReplicaKv, PrefixMatch, int, int]


def _options(replicas: Iterable[ReplicaKv], need: int, ask: PrefixAsk | None,
             roomless: list[_Option] | None = None) -> list[_Option]:
    """The replicas a request of `need` admission blocks could be granted now: grantable, with room for its need
    there (less the cached blocks running requests there hold), in balance (module doc). Each with its reported
    cached run, the run its grants in flight share, and its need there. `roomless`, when given, gets the grantable
    replicas without room for it now that could hold it once what they hold ends (what a prefix hold waits for)."""
    roomy = []
    for replica in replicas:
        if not replica.grantable:
            continue
        reported, inflight = replica.prefix.match(ask)
        need_here = need - reported.pinned_blocks
        if replica.free >= need_here:
            roomy.append((replica, reported, inflight, need_here))
        elif roomless is not None and replica.capacity - replica.headroom >= need_here:
            roomless.append((replica, reported, inflight, need_here))
    if not roomy:
        return []
    # Load balance first: a replica running many more sequences than the least busy one is passed over, however
    # much of the prefix it holds (otherwise every request sharing a system prompt would pile onto one replica).
    least = min(replica.num_sequences for replica, *_ in roomy)
    limit = max(least + BALANCE_SLACK_SEQUENCES, BALANCE_RATIO * least)
    return [option for option in roomy if option[0].num_sequences <= limit]


def _own_blocks(replica: ReplicaKv, reported: PrefixMatch, inflight: int, need: int, ask: PrefixAsk | None) -> float:
    """The request's own prefill there, in blocks: its prompt less what its cached run saves (the replica uses its
    cache whether routing weighs it or not)."""
    credit = max(prefix_credit(replica, reported), float(inflight))
    return max(prompt_blocks(need, ask) - credit, 0.0)


def option_starts(replicas: Iterable[ReplicaKv], need: int, ask: PrefixAsk | None, now: float
                  ) -> list[tuple[ReplicaKv, StartEstimate]]:
    """Each replica the request could be granted now (pick_replica's options, unranked) with the TTFT bound's
    estimate of its first token there: what the queue's holds watch (dcpserve/deployments/admission/bound_holds.py)."""
    return [(replica, start_estimate(replica, _own_blocks(replica, reported, inflight, need, ask), now))
            for replica, reported, inflight, _ in _options(replicas, need, ask)]


# A ranked option: (its key, the replica, the request's own prefill blocks there, its need there, the run routing
# counts there)
_Ranked = tuple[tuple[bool, float, int, int], ReplicaKv, float, int, int]


class _LazyStarts(Sequence[StartEstimate]):
    """The ranked options' start estimates, each computed when bound_decision first reads it: with the bound off
    it reads none, and a request some replica starts within it reads the ranking only down to that replica, not
    every replica of the cluster at every grant."""

    def __init__(self, ranked: list[_Ranked], now: float) -> None:
        self._ranked = ranked
        self._now = now
        self._done: dict[int, StartEstimate] = {}

    def __len__(self) -> int:
        return len(self._ranked)

    @overload
    def __getitem__(self, index: int) -> StartEstimate: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[StartEstimate]: ...

    def __getitem__(self, index: int | slice) -> StartEstimate | Sequence[StartEstimate]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # bounds and negative indices, as a list's
        estimate = self._done.get(index)
        if estimate is None:
            _, replica, own, _, _ = self._ranked[index]
            estimate = self._done[index] = start_estimate(replica, own, self._now)
        return estimate


def pick_replica(replicas: Iterable[ReplicaKv], need: int, ask: PrefixAsk | None, prefix_routing: bool, *,
                 home: str | None = None, ttft_bound_s: float = 0.0, may_wait_s: float = 0.0,
                 now: float = 0.0, prefix_hold: tuple[float, float] | None = None) -> Pick | None:
    """The grantable replica with room for a request of `need` admission blocks, in balance, ranked by: its session's
    last replica (`home`), the prefill its cached run saves (prefix_credit; neither weighed when prefix_routing is
    off), the fewest steps before its first token, the most KV free after the grant (module doc); then the TTFT
    bound (ttft_bound.bound_decision; 0: off) over that ranking, with `may_wait_s` the wait the request has left for
    it; then the prefix hold (`prefix_hold`: how long the request has been held for a prefix, and how much longer it
    may wait in the queue at all; None: off; module doc). None if no replica has room now.

    It runs at every grant over every replica, so each option costs its key alone: the winner's Pick is built once,
    and the start estimates only as far down the ranking as the bound reads them (`_LazyStarts`)."""
    ranked: list[_Ranked] = []
    roomless: list[_Option] | None = [] if prefix_hold is not None and prefix_routing and ask is not None else None
    prompt = prompt_blocks(need, ask)
    for replica, reported, inflight, need_here in _options(replicas, need, ask, roomless):
        # What routing counts on there: the blocks it reported cached, or those its grants in flight (or
        # finished since its last report) are computing, whichever run is longer.
        credit = max(prefix_credit(replica, reported), float(inflight))
        routed = credit if prefix_routing else 0.0
        key = (prefix_routing and home == replica.replica_id, routed,
               -steps_to_start(replica, _whole(prompt - routed)), replica.free - need_here)
        ranked.append((key, replica, max(prompt - credit, 0.0), need_here, max(reported.hit_blocks, inflight)))
    if not ranked:
        return None
    ranked.sort(key=lambda entry: entry[0], reverse=True)
    if len(ranked) == 1:
        reason = "only_choice"
    else:
        first, second = ranked[0][0], ranked[1][0]
        reason = next((name for name, a, b in zip(RANKING_REASONS, first, second, strict=True) if a != b), "most_free")
    starts = _LazyStarts(ranked, now)
    decision = bound_decision(starts, ttft_bound_s, may_wait_s)
    key, replica, own, need_here, hit_blocks = ranked[decision.index]
    estimate = starts[decision.index]
    within = ttft_bound_s <= 0 or decision.reason in ("preferred", "backlog_rerouted")
    chosen = Pick(need_here, replica, hit_blocks, _whole(own),
                  reason if decision.reason == "preferred" else decision.reason, estimate.start_s, decision.wait_s,
                  within)
    if roomless and prefix_hold is not None and decision.wait_s <= 0:
        held_s, wait_left_s = prefix_hold
        # key[1] is the chosen replica's credit: roomless is only gathered with prefix_routing on
        return _prefix_hold(roomless, chosen, key[1], estimate, need, ask, now, held_s, wait_left_s) or chosen
    return chosen


def _prefix_hold(roomless: list[_Option], chosen: Pick, chosen_credit: float, chosen_start: StartEstimate,
                 need: int, ask: PrefixAsk | None, now: float, held_s: float, wait_left_s: float) -> Pick | None:
    """The prefix hold (module doc): of the replicas without room that cache more of the request's prompt than the
    chosen one, the one whose estimated first token (as if it had room now) comes soonest before the chosen one's;
    the request waits for it the difference, less what it has been held already, at most wait_left_s. None: no hold
    (no such replica, or the hold is used up)."""
    best: tuple[float, ReplicaKv, int] | None = None
    for replica, reported, inflight, need_here in roomless:
        if max(prefix_credit(replica, reported), float(inflight)) <= chosen_credit:
            continue
        own = _own_blocks(replica, reported, inflight, need, ask)
        gain = chosen_start.start_s - start_estimate(replica, own, now).start_s
        if best is None or gain > best[0]:
            best = (gain, replica, need_here)
    if best is None:
        return None
    gain, replica, need_here = best
    wait_s = min(gain - held_s, wait_left_s)
    if wait_s <= BOUND_TOLERANCE_S:
        return None
    return Pick(chosen.need, chosen.replica, chosen.hit_blocks, chosen.prefill_blocks, "prefix_deferred",
                chosen.start_s, wait_s, True, hold_for=(replica.replica_id, need_here))
