"""Sessions in the admission queue (issue 51 item 3): where a session's last turn ran, and each session's share of
its tenant.

A request's session is its ServiceLevel.session: OpenAI's `prompt_cache_key`, or the X-Session-Id header
(dcpserve/deployments/api/protocol.py), scoped by its tenant (two tenants' keys never meet). A request without one is a
session of its own, as before sessions.

- `SessionHomes`: session -> the replica that served its last turn. The queue prefers that replica for the next
  turn while it has room and is in balance (dcpserve/deployments/admission/replica_choice.py): prefix routing
  already finds a history the replica still caches on device, and the home keeps the turn there when the device
  evicted it to the replica's host tier, or when the replica's reports lag. Bounded (the least recently used
  session goes first) and expiring (a session silent for ttl_s is forgotten).
- `SessionShares`: each session's attained KV token-seconds, decayed, as TenantShares counts tenants
  (dcpserve/deployments/admission/fair_share.py), so that within a tenant the session that used least goes next: one
  agent with many queued turns or long prompts cannot starve the tenant's other sessions. Sessions that hold nothing
  are forgotten after ttl_s idle, or the least recently idle first past the bound.
"""

from __future__ import annotations

from collections import OrderedDict

from dcpserve.deployments.admission.fair_share import TenantShares
from dcpserve.deployments.messages import ServiceLevel

# Sessions remembered at most (each entry is a few hundred bytes): past it the least recently used goes first.
MAX_SESSIONS = 100_000

SessionId = tuple[str, str]  # (tenant, session key)


def session_of(level: ServiceLevel) -> SessionId | None:
    """The request's session, scoped by its tenant; None when it names none."""
    return None if level.session is None else (level.tenant, level.session)


class SessionHomes:
    """Each session's last replica, bounded and expiring."""

    def __init__(self, ttl_s: float, max_sessions: int = MAX_SESSIONS) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be > 0, got {ttl_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._homes: OrderedDict[SessionId, tuple[str, float]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, session: SessionId | None, now: float) -> str | None:
        """The replica that served the session's last turn, unless it was longer ago than ttl_s."""
        if session is None:
            return None
        self._expire(now)
        entry = self._homes.get(session)
        return None if entry is None else entry[0]

    def record(self, session: SessionId | None, replica_id: str, now: float) -> None:
        """The session's turn was granted to replica_id now."""
        if session is None:
            return
        self._homes[session] = (replica_id, now)
        self._homes.move_to_end(session)
        self._expire(now)

    def forget_replica(self, replica_id: str) -> None:
        """The replica is gone: its sessions have no home (their next turns go where the normal choice sends them)."""
        for session in [s for s, (r, _) in self._homes.items() if r == replica_id]:
            del self._homes[session]

    def _expire(self, now: float) -> None:
        while self._homes:
            session, (_, at) = next(iter(self._homes.items()))
            if now - at <= self.ttl_s and len(self._homes) <= self.max_sessions:
                break
            del self._homes[session]


class SessionShares:
    """Each session's attained KV token-seconds (TenantShares' measure, keyed by session), with the idle ones
    forgotten after ttl_s or past the bound."""

    def __init__(self, half_life_s: float, quantum_s: float, ttl_s: float, max_sessions: int = MAX_SESSIONS) -> None:
        self._shares = TenantShares(half_life_s, quantum_s)
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._idle: OrderedDict[str, float] = OrderedDict()  # sessions holding nothing -> since when, oldest first

    @staticmethod
    def _key(session: SessionId) -> str:
        return f"{session[0]}\x00{session[1]}"

    @property
    def quantum_s(self) -> float:
        return self._shares.quantum_s

    def __len__(self) -> int:
        return len(self._shares.tenants())

    def attained(self, session: SessionId, now: float) -> float:
        return self._shares.attained(self._key(session), now)

    def grant(self, session: SessionId | None, tokens: int, now: float) -> None:
        if session is None:
            return
        key = self._key(session)
        self._idle.pop(key, None)
        self._shares.grant(key, tokens, now)

    def release(self, session: SessionId | None, tokens: int, now: float) -> None:
        if session is None:
            return
        key = self._key(session)
        self._shares.release(key, tokens, now)
        if key not in self._shares.holding:
            self._idle[key] = now
            self._idle.move_to_end(key)
        while self._idle:
            oldest, since = next(iter(self._idle.items()))
            if now - since <= self.ttl_s and len(self._idle) <= self.max_sessions:
                break
            del self._idle[oldest]
            self._shares.forget(oldest)
