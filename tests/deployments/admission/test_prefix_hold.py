"""The prefix hold (dcpserve/deployments/admission/replica_choice.py): a request whose prompt a replica without room
caches waits for that replica, for as long as it would still start there sooner than where it would go now. The real
AdmissionQueue on the simulated clock (dcpserve/simulator/clock.py), where grant times are exact."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.replica_choice import ReplicaKv, pick_replica
from dcpserve.deployments.messages import KvReport, PrefixAsk
from dcpserve.engine.core.prefix_cache import CACHED, PrefixReporter, chain_hashes, prompt_hashes
from dcpserve.simulator.clock import run_simulated

TOKENS = 16  # tokens per block
STEP_S = 0.1
STEP_TOKENS = 64  # a block of prefill takes 0.025 s
BLOCK_S = STEP_S * TOKENS / STEP_TOKENS
SEED = b"hold"
CAPACITY = 40
HISTORY = list(range(3, 3 + 20 * TOKENS))  # 20 blocks home caches
PROMPT = HISTORY + [1, 2, 3]  # 21 blocks: its history and a new turn
ASK = PrefixAsk(tuple(prompt_hashes(PROMPT, TOKENS, SEED)), TOKENS, SEED, len(PROMPT))
NEED = 21
# Elsewhere the whole prompt is prefilled (21 blocks), at home one block: home starts it 20 blocks sooner.
GAIN_S = 20 * BLOCK_S


def report(queue: AdmissionQueue, replica_id: str, *, full: bool = False, backlog_s: float = 0.0,
           cached: bool = False) -> None:
    """A replica's report: `full` holds all its KV for a request this queue did not grant; `cached` caches HISTORY."""
    prefix = None
    if cached:
        reporter = PrefixReporter(TOKENS, SEED)
        for block in chain_hashes(HISTORY, TOKENS, SEED):
            reporter.set(block, CACHED)
        prefix = reporter.report(None, 0)
    queue.report(KvReport(replica_id=replica_id, capacity=CAPACITY, tokens_per_block=TOKENS,
                          held={"elsewhere": CAPACITY} if full else {},
                          prefill_tokens=round(backlog_s / BLOCK_S) * TOKENS, step_s=STEP_S, step_tokens=STEP_TOKENS,
                          prefix=prefix))


async def turn(queue: AdmissionQueue, timeout_s: float = 30.0) -> tuple[str, float, str]:
    """The turn's grant: (replica, simulated time, the grant's decision reason)."""
    replica_id = await queue.acquire("turn", NEED, timeout_s, ask=ASK)
    grant = queue.grant_of("turn")
    assert grant is not None
    return replica_id, asyncio.get_running_loop().time(), grant.decision


def run(home_room_at: float | None, *, prefix_hold: bool = True, home_backlog_s: float = 0.0,
        timeout_s: float = 30.0) -> tuple[tuple[str, float, str], Mapping[str, int]]:
    """The turn arrives at 0 with its history cached on a full `home` and an idle `other`; home reports room at
    home_room_at (None: never)."""
    async def main() -> tuple[tuple[str, float, str], Mapping[str, int]]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=8, clock=loop.time, prefix_hold=prefix_hold)
        report(queue, "home", full=True, cached=True, backlog_s=home_backlog_s)
        report(queue, "other")
        if home_room_at is not None:
            loop.call_later(home_room_at, lambda: report(queue, "home", cached=True))
        result = await turn(queue, timeout_s)
        return result, queue.stats().decisions

    return run_simulated(main())


def test_a_turn_waits_for_the_full_replica_caching_its_history_and_goes_there_as_soon_as_it_has_room() -> None:
    (replica_id, at, reason), decisions = run(home_room_at=0.3)
    assert (replica_id, at) == ("home", pytest.approx(0.3))  # at once when home has room, within the 0.5 s hold
    assert reason == "prefix"
    assert decisions["prefix_deferred"] == 1  # held once, then granted once
    assert sum(decisions.values()) == 2


def test_when_the_replica_stays_full_the_hold_ends_where_starting_there_would_no_longer_be_sooner() -> None:
    (replica_id, at, _), decisions = run(home_room_at=None)
    assert replica_id == "other" and at == pytest.approx(GAIN_S)  # 0.5 s: the prefill the history would have saved
    assert decisions["prefix_deferred"] == 1
    (replica_id, at, _), _ = run(home_room_at=GAIN_S + 0.2)  # room comes too late: it has gone
    assert replica_id == "other" and at == pytest.approx(GAIN_S)


def test_no_hold_when_the_prefix_replica_would_not_start_it_sooner_or_the_hold_is_off() -> None:
    # Home's 1 s of queued prefill outweighs the 0.5 s its cache saves: the turn goes to other at once.
    (replica_id, at, _), decisions = run(home_room_at=0.3, home_backlog_s=1.0)
    assert (replica_id, at) == ("other", 0.0) and decisions["prefix_deferred"] == 0
    (replica_id, at, _), decisions = run(home_room_at=0.3, prefix_hold=False)
    assert (replica_id, at) == ("other", 0.0) and decisions["prefix_deferred"] == 0


def test_a_hold_never_outlasts_the_queue_timeout() -> None:
    (replica_id, at, _), _ = run(home_room_at=None, timeout_s=0.2)
    assert replica_id == "other" and at == pytest.approx(0.15)  # let go 0.05 s before its timeout, granted


def test_a_held_turn_blocks_no_one_behind_it() -> None:
    async def main() -> tuple[tuple[str, float], tuple[str, float, str]]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=8, clock=loop.time)
        report(queue, "home", full=True, cached=True)
        report(queue, "other")
        held = loop.create_task(turn(queue))
        await asyncio.sleep(0.1)
        other = await queue.acquire("next", 4, 30.0)  # arrives while the turn is held: granted at once
        loop.call_later(0.1, lambda: report(queue, "home", cached=True))
        return (other, loop.time()), await held

    (other, other_at), (replica_id, at, _) = run_simulated(main())
    assert (other, other_at) == ("other", pytest.approx(0.1))
    assert (replica_id, at) == ("home", pytest.approx(0.2))


def test_pick_replica_names_the_replica_it_holds_for_and_its_need_there() -> None:
    def replica(replica_id: str, free: bool, **fields: Any) -> ReplicaKv:
        kv = ReplicaKv(replica_id, capacity=CAPACITY, tokens_per_block=TOKENS, step_s=STEP_S,
                       step_tokens=STEP_TOKENS, external=0 if free else CAPACITY, **fields)
        return kv

    home, other = replica("home", free=False), replica("other", free=True)
    reporter = PrefixReporter(TOKENS, SEED)
    for block in chain_hashes(HISTORY, TOKENS, SEED):
        reporter.set(block, CACHED)
    home.prefix.index.apply(reporter.report(None, 0))
    pick = pick_replica([home, other], NEED, ASK, True, prefix_hold=(0.0, 10.0))
    assert pick is not None
    assert (pick.replica.replica_id, pick.reason, pick.hold_for) == ("other", "prefix_deferred", ("home", NEED))
    assert pick.wait_s == pytest.approx(GAIN_S)
    held = pick_replica([home, other], NEED, ASK, True, prefix_hold=(0.2, 10.0))  # held 0.2 s already
    assert held is not None and held.wait_s == pytest.approx(GAIN_S - 0.2)
    assert pick_replica([home, other], NEED, ASK, True, prefix_hold=(GAIN_S, 10.0)).hold_for is None  # type: ignore[union-attr]
    assert pick_replica([home, other], NEED, ASK, True).hold_for is None  # type: ignore[union-attr]  # off
    assert pick_replica([home, other], NEED, ASK, False, prefix_hold=(0.0, 10.0)).hold_for is None  # type: ignore[union-attr]


def test_room_on_the_replica_wakes_the_held_requests_it_can_grant_in_the_order_they_were_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """200 turns held for a full `home`, which frees room for one turn at a time, ten times: each release wakes the
    next turn held (the first held first), not all 200 to find home full again."""
    import dcpserve.deployments.admission.queue as admission_queue
    from dcpserve.deployments.admission.pools import choose as real_choose

    turns = 200
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real_choose(*args, **kwargs)

    monkeypatch.setattr(admission_queue, "choose", counted)

    async def main() -> tuple[list[str], list[str]]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=1000, clock=loop.time)
        report(queue, "home", full=True, cached=True)
        queue.report(KvReport(replica_id="other", capacity=100_000, tokens_per_block=TOKENS, held={},
                              step_s=STEP_S, step_tokens=STEP_TOKENS))
        home_order: list[str] = []

        async def one(ticket: str) -> str:
            replica_id = await queue.acquire(ticket, NEED, 30.0, ask=ASK)
            if replica_id == "home":
                home_order.append(ticket)
            return replica_id

        tasks = [loop.create_task(one(f"t{i:03d}")) for i in range(turns)]
        await asyncio.sleep(0.01)
        assert calls[0] == turns  # each held once, none granted
        report(queue, "home", cached=True)  # room for one
        for _ in range(9):
            await asyncio.sleep(0.04)
            queue.release(home_order[-1])  # its turn ended: room for the next
        return [await task for task in tasks], home_order

    replicas, home_order = run_simulated(main())
    assert home_order == [f"t{i:03d}" for i in range(10)]  # the first held went first
    assert replicas.count("home") == 10 and replicas.count("other") == turns - 10  # the rest when their hold ended
    # held once each, ten woken and granted by the room, the others once more at their hold's end
    assert calls[0] <= turns + 10 + (turns - 10) + 20
