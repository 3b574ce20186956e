"""Per-tenant limits, checked by the admission queue before a request takes a place in it: how many sequences a
tenant may have waiting or running at once, and how many tokens (prompt + max_tokens) it may start in any minute.

The queue is the one place that sees every request of the app (every ingress replica asks it), so a limit holds
for the app, not per ingress. Concurrency is counted from the queue's own ledger (the tenant's grants and waiters),
so a grant dropped for any reason (released, leaked, its replica lost) stops counting with it. Tokens are counted in
a sliding 60 s window; a request refused by the queue after the check gives its tokens back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True)
class Limits:
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True)
class Exceeded:
    """Why a request was refused: the limit's name (a metric label), a message naming the limit and the fix, and
    when a retry can pass (None: never, the request alone is past the limit)."""

    limit: str
    message: str
    retry_after_s: float | None


class TenantLimits:
    """The limits of each tenant and the tokens each started in the last WINDOW_S."""

    def __init__(self, limits: dict[str, Limits]) -> None:
        self.limits = {tenant: limit for tenant, limit in limits.items()
                       if limit.max_concurrent_requests is not None or limit.tokens_per_minute is not None}
        self._window: dict[str, deque[tuple[float, int, str]]] = {}  # tenant -> (when, tokens, ticket)

    def _tokens(self, tenant: str, now: float) -> deque[tuple[float, int, str]]:
        window = self._window.setdefault(tenant, deque())
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        return window

    def check(self, tenant: str, tokens: int, count_in_flight: Callable[[], int], now: float) -> Exceeded | None:
        """Whether a request of `tokens` may start now, the tenant having `count_in_flight()` sequences waiting or
        running: counted only for a tenant with a concurrency limit (it walks the queue's grants and waiters)."""
        limit = self.limits.get(tenant)
        if limit is None:
            return None
        in_flight = 0 if limit.max_concurrent_requests is None else count_in_flight()
        if limit.max_concurrent_requests is not None and in_flight >= limit.max_concurrent_requests:
            return Exceeded("max_concurrent_requests", (
                f"tenant {tenant!r} has {in_flight} requests waiting or running, its max_concurrent_requests="
                f"{limit.max_concurrent_requests}; retry when one finishes"), 1.0)
        per_minute = limit.tokens_per_minute
        if per_minute is None:
            return None
        if tokens > per_minute:
            return Exceeded("tokens_per_minute", (
                f"the request counts {tokens} tokens (prompt + max_tokens), more than tenant {tenant!r} may start "
                f"in a minute (tokens_per_minute={per_minute}); lower max_tokens or shorten the prompt"), None)
        window = self._tokens(tenant, now)
        used = sum(t for _, t, _ in window)
        if used + tokens <= per_minute:
            return None
        freed, retry = 0, WINDOW_S
        for when, counted, _ in window:  # oldest first: when enough has left the window, this one fits
            freed += counted
            if used - freed + tokens <= per_minute:
                retry = when + WINDOW_S - now
                break
        return Exceeded("tokens_per_minute", (
            f"tenant {tenant!r} started {used} tokens (prompt + max_tokens) in the last {WINDOW_S:g}s and this "
            f"request counts {tokens}: past its tokens_per_minute={per_minute}; retry in {retry:.0f}s"), retry)

    def charge(self, tenant: str, ticket: str, tokens: int, now: float) -> None:
        if tenant in self.limits and tokens > 0:
            self._tokens(tenant, now).append((now, tokens, ticket))

    def refund(self, tenant: str, ticket: str) -> None:
        """The request did not start (the queue refused it): its tokens leave the window."""
        window = self._window.get(tenant)
        if window:
            self._window[tenant] = deque(entry for entry in window if entry[2] != ticket)
