"""A request waiting in the admission queue (dcpserve/deployments/admission/queue.py): what the queue's order
(fair_share.py's `Waiting`), its holds (bound_holds.py's `Held`) and its shedding read of it."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from dcpserve.deployments.messages import Need, PrefixAsk, ServiceLevel


@dataclass(eq=False)
class Waiter:
    """One waiting request: its need, its place in the order, and the future its grant (the replica id) is set on."""

    ticket: str
    need: Need
    future: asyncio.Future[str]
    ask: PrefixAsk | None
    level: ServiceLevel
    seq: int  # arrival order
    front: bool  # a replica refused it after a grant: it goes first
    deadline_at: float | None  # when it stops waiting for its deadline (the queue's clock)
    tokens: int  # its KV in tokens (the smallest need over its pools), what the fair order charges it
    arrived: float
    timeout_at: float = math.inf  # when its queue timeout ends its wait (the queue's clock)
    defer_end: float | None = None  # held back by the TTFT bound: the latest it may be held (set at the first time)
    defer_until: float | None = None  # held back until then (the backlog's estimate falls under the bound)
    prefix_held_at: float | None = None  # first held for the replica caching its prompt (replica_choice's prefix hold)
