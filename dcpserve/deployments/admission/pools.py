"""Layout pools in the admission queue: a request's need on each pool, which pools can ever hold
it, and which pool and replica it is granted now.

An app with several layouts of one model has a pool per layout (dcpserve/deployments/config.py `pools`); the queue knows
each replica's pool from its reports. A request's KV need depends on the pool: its admission blocks are counted
in the pool's tokens_per_block (block_size * dcp) and its prefix hashes are of blocks of that size, so the ingress
sends the queue one `PoolNeed` per pool. An int need (one pool, or every replica alike) is the same need on
every replica: the app without pools.

The choice (`choose`): among the pools open to the request (the queue's per-pool head-of-line rule decides which
are open) each pool's best replica (dcpserve/deployments/replica_choice.pick_replica); of those, the one where the
request costs the fewest GPU-seconds per output token (`gpu_seconds_per_token`: the replica's GPUs x its recent mean
step x the request's share of the replica, the larger of its KV need against the KV still free and one seat of the
step's max_num_seqs), then the most free KV after the grant, as a fraction of the replica's capacity. So a short request
goes to the faster layout (its seat share decides), a request that would take much of a small-KV pool's free KV
goes where it takes a smaller share (a DCP layout counts it in blocks of block_size x dcp tokens) unless that
layout's steps are slower by more than the share saved, and a pool filling up prices itself out before it is full:
short requests overflow into a long pool with room. The reason names which it was. docs/structure.md has why
this rule and not the lowest step alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dcpserve.deployments.admission.replica_choice import Pick, ReplicaKv, pick_replica
from dcpserve.deployments.messages import DEFAULT_POOL, Need, PoolNeed, PrefixAsk
from dcpserve.engine.core.block_manager import admission_blocks


@dataclass(frozen=True)
class PoolChoice:
    """Where the queue grants a request now: the pool, the replica and what it counts there, and why."""

    pool: str
    need: int  # the blocks counted on the replica (less the prefix blocks its running requests hold)
    replica: ReplicaKv
    hit_blocks: int
    ask: PrefixAsk | None
    # only_pool (the one pool that can ever hold it), only_room (the one of its pools with room now, or not closed
    # by a request waiting ahead), cheapest (the fewest GPU-seconds per token: gpu_seconds_per_token), most_free
    # (costs alike: the most KV free after the grant)
    reason: str
    # Why that replica (messages.DECISION_REASONS); the blocks it prefills there; the TTFT bound's estimate of
    # its first token there, and wait_s > 0: no pool's replica would start it within the bound, it should wait.
    decision: str = "only_choice"
    prefill_blocks: int = 0
    start_s: float = 0.0
    wait_s: float = 0.0
    hold_for: tuple[str, int] | None = None  # a prefix hold: the replica it waits wait_s for, its need there


def request_need(layouts: Mapping[str, int], policy: str, prompt_tokens: int, max_tokens: int) -> Need:
    """A request's admission blocks under the app's policy: an int with one pool, else per pool (layouts: pool ->
    its tokens_per_block)."""
    needs = {pool: admission_blocks(policy, prompt_tokens, max_tokens, tokens) for pool, tokens in layouts.items()}
    if len(needs) == 1:
        return next(iter(needs.values()))
    return {pool: PoolNeed(blocks, total_blocks=-(-(prompt_tokens + max_tokens) // layouts[pool]))
            for pool, blocks in needs.items()}


def need_on(need: Need, ask: PrefixAsk | None, pool: str) -> PoolNeed | None:
    """The request's need on that pool; None if it names no need there (it never goes to that pool)."""
    if isinstance(need, int):
        return PoolNeed(need, ask)
    return need.get(pool)


def pools_of(need: Need, replicas: Iterable[ReplicaKv]) -> set[str]:
    """The pools of these replicas that could ever hold the request: it has a need there and the pool's largest
    replica holds that many blocks. Only these are the request's to wait for (and to close to those behind it)."""
    largest: dict[str, int] = {}
    for replica in replicas:
        largest[replica.pool] = max(largest.get(replica.pool, 0), replica.capacity)
    return {pool for pool, capacity in largest.items()
            if (pool_need := need_on(need, None, pool)) is not None and pool_need.ever_blocks <= capacity}


def smallest_blocks(need: Need) -> int:
    return need if isinstance(need, int) else min((n.blocks for n in need.values()), default=0)


def never_fits(need: Need, ask: PrefixAsk | None, replicas: list[ReplicaKv]) -> str | None:
    """Why no known replica could ever hold the request (every pool's largest capacity below its need there), or
    None when one could (or none is known yet)."""
    if not replicas:
        return None
    shortfalls = []
    for pool in sorted({replica.pool for replica in replicas}):
        pool_need = need_on(need, ask, pool)
        if pool_need is None:
            continue
        largest = max((r for r in replicas if r.pool == pool), key=lambda r: r.capacity)
        blocks = pool_need.ever_blocks
        if blocks <= largest.capacity:
            return None
        tokens = largest.tokens_per_block
        where = "" if pool == DEFAULT_POOL else f"pool {pool}: "
        shortfalls.append(f"{where}this request needs {blocks} KV blocks ({blocks * tokens} "
                          f"tokens of {tokens}-token blocks) but a replica holds {largest.capacity} blocks "
                          f"({largest.capacity * tokens} tokens)")
    if not shortfalls:
        named = sorted(need) if not isinstance(need, int) else []
        return f"no pool of this app serves the request (its needs name {named})"
    return "; ".join(shortfalls) + "; shorten the prompt or lower max_tokens"


def mean_step_s(replicas: list[ReplicaKv]) -> float:
    reported = [r.step_s for r in replicas if r.step_s > 0]
    return sum(reported) / len(reported) if reported else 0.0


def gpu_seconds_per_token(replica: ReplicaKv, blocks: int, step_s: float) -> float:
    """What one output token of the request costs on that replica, in GPU-seconds: the replica's GPUs for one of its
    steps, times the request's share of the replica, which is the larger of its share of the KV still free (need
    against free: a request that takes much of what is left shuts others out for its whole life) and its share of
    the step's sequences (1 / max_num_seqs: a short request on a roomy replica still takes a seat)."""
    kv_share = blocks / max(replica.free, 1)
    seat_share = 1.0 / replica.max_seqs if replica.max_seqs > 0 else 0.0
    return replica.gpus * step_s * max(kv_share, seat_share)


def choose(replicas: Iterable[ReplicaKv], need: Need, ask: PrefixAsk | None, prefix_routing: bool,
           open_pools: set[str] | None = None, *, home: str | None = None, ttft_bound_s: float = 0.0,
           may_wait_s: float = 0.0, now: float = 0.0, prefix_hold: tuple[float, float] | None = None,
           holding: set[str] | None = None) -> PoolChoice | None:
    """The pool and replica to grant now (module doc), among open_pools (None: every pool); None if no open pool
    has room for the request. home, ttft_bound_s, may_wait_s, now, prefix_hold: pick_replica's (the session's last
    replica, the TTFT bound, the prefix hold). Pools whose pick starts the request within the bound go first (a
    prefix hold's pick counts as within it); when none does, the pool whose backlog drains under the bound soonest
    (a wait), else the one where it starts soonest. `holding`: pools_of(need, replicas) when the caller has it."""
    by_pool: dict[str, list[ReplicaKv]] = {}
    for replica in replicas:
        by_pool.setdefault(replica.pool, []).append(replica)
    if holding is None:
        holding = pools_of(need, (r for members in by_pool.values() for r in members))
    candidates = []
    for pool, members in sorted(by_pool.items()):
        pool_need = need_on(need, ask, pool)
        if pool_need is None or pool not in holding or (open_pools is not None and pool not in open_pools):
            continue
        picked = pick_replica(members, pool_need.blocks, pool_need.ask, prefix_routing, home=home,
                              ttft_bound_s=ttft_bound_s, may_wait_s=may_wait_s, now=now, prefix_hold=prefix_hold)
        if picked is not None:
            candidates.append((pool, picked, pool_need.ask, mean_step_s(members)))
    if not candidates:
        return None
    only = "only_pool" if len(holding) == 1 else "only_room"
    within = [c for c in candidates if c[1].within_bound]
    if not within:  # none within the bound: the soonest wait, else the soonest start (never starved)
        waits = [c for c in candidates if c[1].wait_s > 0]
        pool, pick, pool_ask, _ = (min(waits, key=lambda c: c[1].wait_s) if waits
                                   else min(candidates, key=lambda c: c[1].start_s))
        return _choice(pool, pick, pool_ask, only)
    if len(within) == 1:
        pool, pick, pool_ask, _ = within[0]
        return _choice(pool, pick, pool_ask, only)
    # A replica that has not stepped yet is priced at its pool's mean step, or at the fastest step any candidate
    # reports (a pool that has not run yet gets tried), or alike when none has run.
    fastest = min((step for *_, step in within if step > 0), default=1.0)

    def cost(candidate: tuple[str, Pick, PrefixAsk | None, float]) -> float:
        _, pick, _, pool_step = candidate
        return gpu_seconds_per_token(pick.replica, pick.need, pick.replica.step_s or pool_step or fastest)

    def key(candidate: tuple[str, Pick, PrefixAsk | None, float]) -> tuple[float, float]:
        _, pick, _, _ = candidate
        return (cost(candidate), -(pick.replica.free - pick.need) / max(pick.replica.capacity, 1))

    best = min(within, key=key)
    costs = {cost(c) for c in within}
    pool, pick, pool_ask, _ = best
    return _choice(pool, pick, pool_ask, "cheapest" if len(costs) > 1 else "most_free")


def _choice(pool: str, pick: Pick, ask: PrefixAsk | None, reason: str) -> PoolChoice:
    return PoolChoice(pool, pick.need, pick.replica, pick.hit_blocks, ask, reason, decision=pick.reason,
                      prefill_blocks=pick.prefill_blocks, start_s=pick.start_s, wait_s=pick.wait_s,
                      hold_for=pick.hold_for)
