"""Admission that sees compute: the TTFT bound (issue 51 item 4), as a pure rule over estimates.

The queue's KV accounting alone let a replica take prompts faster than it could prefill them: in the layout-pools
study (bench/simulate_pools.py) agentic requests waited 0 s in the queue and then 4.6-4.9 s inside their replica,
behind the prompts it was prefilling. The rule keeps that wait in the queue, where the order (priorities, tenants'
and sessions' shares) still applies and the request binds late to whichever replica drains first:

- each replica the request could be granted now (room for it, in balance: replica_choice.pick_replica) is an
  option with its estimated seconds to the request's first token there, as two parts: `ahead_s`, the prefill queued
  before it (what the replica reported still to compute and the grants made since, draining one engine step per
  step_s from the report), and `own_s`, the request's own uncached prompt;
- the preferred option (session, prefix, fewest steps, most free KV: the order pick_replica ranks in) is granted
  when its estimate is within the bound;
- else the best-ranked option within the bound (`backlog_rerouted`);
- else, when no option is within it, the request waits in the queue (`backlog_deferred`) for as long as the
  soonest option's backlog needs to drain under the bound (`ahead_s + own_s - bound`; possible only where its own
  prompt fits the bound), if that wait is allowed: at most the bound itself from its first deferral and never past
  its deadline or queue timeout (the queue passes what is left as `may_wait_s`). Its first token then comes no later
  than if it were granted now (the same backlog drains either way), the prefill already queued is not shared with
  one more prompt meanwhile, and the request goes to whichever replica the reports then show ready;
- else it is granted where it starts soonest (`over_bound`): the bound never starves a request.

Bound 0: the rule is off (every option counts as within it). An option whose replica has not reported its step
time or budget has estimate 0: within any bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Estimates within this of the bound count as within it (a deferral that ends when the backlog drains to the bound
# must then grant, not wait again for a rounding error).
BOUND_TOLERANCE_S = 1e-6


@dataclass(frozen=True)
class StartEstimate:
    """When a request granted to one replica now would get its first token: the prefill queued before it, and its
    own."""

    ahead_s: float
    own_s: float

    @property
    def start_s(self) -> float:
        return self.ahead_s + self.own_s


@dataclass(frozen=True)
class BoundDecision:
    """What the TTFT bound makes of a request's options: the one to grant (an index into them), why (`preferred`,
    `backlog_rerouted`, `over_bound`, or `backlog_deferred` with wait_s > 0: grant nothing now, ask again then)."""

    index: int
    reason: str
    wait_s: float = 0.0


def bound_decision(options: Sequence[StartEstimate], bound_s: float, may_wait_s: float) -> BoundDecision:
    """The rule (module doc). `options` in the queue's order of preference (the first is the one it would grant
    without the bound); `may_wait_s`: how much longer the request may wait in the queue for the bound."""
    if not options:
        raise ValueError("bound_decision needs at least one option")
    if bound_s <= 0 or options[0].start_s <= bound_s + BOUND_TOLERANCE_S:
        return BoundDecision(0, "preferred")
    for index, option in enumerate(options):
        if option.start_s <= bound_s + BOUND_TOLERANCE_S:
            return BoundDecision(index, "backlog_rerouted")
    # Waiting drains only what is queued ahead: an option whose own prompt alone takes longer than the bound never
    # gets under it.
    waits = [(option.start_s - bound_s, index) for index, option in enumerate(options) if option.own_s < bound_s]
    if waits:
        wait_s, index = min(waits)
        if wait_s <= may_wait_s:
            return BoundDecision(index, "backlog_deferred", wait_s)
    soonest = min(range(len(options)), key=lambda i: (options[i].start_s, i))
    return BoundDecision(soonest, "over_bound")
