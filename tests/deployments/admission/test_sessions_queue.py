"""Sessions in the admission queue (dcpserve/deployments/admission/session_affinity.py): a session's turns stay on the
replica of its last turn unless it is saturated, and within a tenant the sessions share fairly. The real
AdmissionQueue, no Ray; the fairness run on the simulated clock (dcpserve/simulator/clock.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from dcpserve.deployments.admission.fair_share import TenantShares, admission_order
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.session_affinity import SessionHomes, SessionShares
from dcpserve.deployments.messages import KvReport, ServiceLevel
from dcpserve.simulator.clock import run_simulated

TOKENS = 16


def report(queue: AdmissionQueue, replica_id: str, capacity: int, held: dict[str, int] | None = None) -> None:
    queue.report(KvReport(replica_id=replica_id, capacity=capacity, tokens_per_block=TOKENS, held=held or {}))


def turn(session: str | None, tenant: str = "t") -> ServiceLevel:
    return ServiceLevel(tenant=tenant, session=session)


# ---- where a session's turns go -------------------------------------------------------------------------------------

def test_a_sessions_turn_returns_to_its_last_replica_where_the_most_free_kv_would_send_it_elsewhere() -> None:
    """No prefix report says where the history is (the device evicted it to the host tier, or the report lags): the
    session's last replica is what keeps the turn there."""

    async def run() -> None:
        queue = AdmissionQueue(max_queued=8)
        report(queue, "a", capacity=100)
        report(queue, "b", capacity=90)
        assert await queue.acquire("s-1", 4, 1.0, level=turn("agent-7")) == "a"  # the most free
        queue.release("s-1")
        report(queue, "a", capacity=100, held={"x": 20})  # now b has more free
        assert await queue.acquire("s-2", 4, 1.0, level=turn("agent-7")) == "a"
        grant = queue.grant_of("s-2")
        assert grant is not None and grant.decision == "session"
        assert await queue.acquire("other", 4, 1.0, level=turn(None)) == "b"  # no session: the most free
        assert await queue.acquire("same-key", 4, 1.0, level=turn("agent-7", tenant="u")) == "b"  # scoped by tenant
        assert queue.stats().num_sessions == 2

    asyncio.run(run())


@pytest.mark.parametrize("saturation", ["no_room", "out_of_balance"])
def test_a_saturated_last_replica_does_not_keep_the_session(saturation: str) -> None:
    async def run() -> str:
        queue = AdmissionQueue(max_queued=8)
        report(queue, "a", capacity=100)
        report(queue, "b", capacity=90)
        assert await queue.acquire("s-1", 4, 1.0, level=turn("s")) == "a"
        queue.release("s-1")
        if saturation == "no_room":
            report(queue, "a", capacity=100, held={"x": 98})
        else:  # five sequences there against none on b: past max(0 + 2, 1.5 x 0)
            report(queue, "a", capacity=100, held={f"x{i}": 1 for i in range(5)})
        return await queue.acquire("s-2", 4, 1.0, level=turn("s"))

    assert asyncio.run(run()) == "b"


def test_a_lost_replica_takes_its_sessions_homes_with_it() -> None:
    async def run() -> None:
        queue = AdmissionQueue(max_queued=8)
        report(queue, "a", capacity=100)
        assert await queue.acquire("s-1", 4, 1.0, level=turn("s")) == "a"
        queue.release("s-1")
        assert queue.homes.home(("t", "s"), queue.now()) == "a"
        queue.replica_lost("a")
        assert queue.homes.home(("t", "s"), queue.now()) is None

    asyncio.run(run())


def test_session_homes_are_bounded_and_expire() -> None:
    homes = SessionHomes(ttl_s=10.0, max_sessions=2)
    homes.record(("t", "1"), "a", 0.0)
    homes.record(("t", "2"), "b", 1.0)
    homes.record(("t", "1"), "c", 2.0)  # used again: now the most recent
    homes.record(("t", "3"), "d", 3.0)  # past the bound: the least recently used ("2") goes
    assert [homes.home(("t", s), 3.0) for s in "123"] == ["c", None, "d"]
    assert homes.home(("t", "1"), 12.5) is None and len(homes) == 1  # silent for more than 10 s
    assert homes.home(None, 0.0) is None
    with pytest.raises(ValueError, match="session_ttl_s must be > 0"):
        SessionHomes(ttl_s=0.0)


def test_idle_sessions_shares_are_forgotten_after_the_ttl_or_past_the_bound() -> None:
    shares = SessionShares(half_life_s=60.0, quantum_s=1.0, ttl_s=10.0, max_sessions=2)
    for i, session in enumerate("abc"):
        shares.grant(("t", session), 100, float(i))
    assert len(shares) == 3  # holding: never forgotten
    for i, session in enumerate("abc"):
        shares.release(("t", session), 100, 5.0 + i)
    assert len(shares) == 2 and shares.attained(("t", "a"), 7.0) == 0.0  # past the bound: the oldest idle one
    shares.release(("t", "c"), 0, 17.5)  # any release looks at the idle ones: "b" (idle since 6) is past the ttl
    assert shares.attained(("t", "b"), 17.5) == 0.0 and shares.attained(("t", "c"), 17.5) > 0


# ---- fairness within a tenant ---------------------------------------------------------------------------------------

@dataclass(eq=False)
class Waiter:
    level: ServiceLevel
    seq: int
    tokens: int
    front: bool = False
    deadline_at: float | None = None


def test_within_a_tenant_sessions_alternate_and_requests_without_one_keep_their_arrival_order() -> None:
    sessions = SessionShares(half_life_s=60.0, quantum_s=1.0, ttl_s=600.0)
    shares = TenantShares()
    agent = [Waiter(turn("agent"), seq=i, tokens=1000) for i in range(4)]
    chat = Waiter(turn("chat"), seq=4, tokens=100)
    order = admission_order([*agent, chat], shares, 0.0, sessions)
    assert order == [agent[0], chat, *agent[1:]]
    sessions.grant(("t", "agent"), 5000, 0.0)  # the agent already holds KV: the chat goes first
    assert admission_order([*agent, chat], shares, 1.0, sessions)[0] is chat
    plain = [Waiter(turn(None), seq=i, tokens=1000 if i < 4 else 100) for i in range(5)]
    assert admission_order(plain, shares, 0.0, sessions) == plain  # each its own session: arrival order, as before


def test_one_long_agent_does_not_starve_its_tenants_other_session() -> None:
    """One replica that holds one request at a time: an agent queues four turns, then a chat session sends one. With
    session keys the chat is granted as soon as the agent's first turn ends; without, after all four."""

    def grants(with_sessions: bool) -> list[str]:
        async def run() -> list[str]:
            loop = asyncio.get_running_loop()
            queue = AdmissionQueue(max_queued=16, clock=loop.time)
            report(queue, "r", capacity=10)
            order: list[str] = []

            async def request(ticket: str, session: str) -> None:
                await queue.acquire(ticket, 10, 60.0, level=turn(session if with_sessions else None))
                order.append(ticket)
                await asyncio.sleep(1.0)
                queue.release(ticket)

            tasks = [loop.create_task(request(f"agent-{i}", "agent")) for i in range(4)]
            await asyncio.sleep(0.01)
            tasks.append(loop.create_task(request("chat", "chat")))
            await asyncio.gather(*tasks)
            return order

        return run_simulated(run())

    assert grants(with_sessions=True) == ["agent-0", "chat", "agent-1", "agent-2", "agent-3"]
    assert grants(with_sessions=False) == ["agent-0", "agent-1", "agent-2", "agent-3", "chat"]
