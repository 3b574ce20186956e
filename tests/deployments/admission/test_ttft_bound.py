"""Admission that sees compute (dcpserve/deployments/admission/ttft_bound.py): the pure rule, the queue's estimate of a
replica's backlog, and the real AdmissionQueue on the simulated clock (dcpserve/simulator/clock.py), where a held
request's grant time is exact."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import Any

import pytest

from dcpserve.deployments.admission import replica_choice
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.replica_choice import ReplicaKv, recompute_s_per_block, start_estimate
from dcpserve.deployments.admission.ttft_bound import BoundDecision, StartEstimate, bound_decision
from dcpserve.deployments.messages import KvReport, PrefixAsk, ServiceLevel
from dcpserve.engine.core.prefix_cache import CACHED, PrefixReporter, chain_hashes, prompt_hashes
from dcpserve.simulator.clock import run_simulated

TOKENS = 16  # tokens per block
STEP_S = 0.1  # one engine step
STEP_TOKENS = 64  # four blocks a step: a block of prefill takes 0.025 s
BLOCK_S = STEP_S * TOKENS / STEP_TOKENS
SEED = b"bound"


def est(ahead_s: float, own_s: float = 0.1) -> StartEstimate:
    return StartEstimate(ahead_s, own_s)


# ---- the rule -----------------------------------------------------------------------------------------------------

def test_off_or_within_the_bound_the_preferred_replica_gets_it() -> None:
    assert bound_decision([est(9.0), est(0.0)], 0.0, 5.0) == BoundDecision(0, "preferred")  # bound 0: off
    assert bound_decision([est(1.9), est(0.0)], 2.0, 5.0) == BoundDecision(0, "preferred")
    assert bound_decision([est(1.9, 0.1 + 1e-9), est(0.0)], 2.0, 0.0).index == 0  # a rounding error is within it


def test_past_the_bound_the_best_ranked_replica_within_it_gets_it_not_the_soonest() -> None:
    decision = bound_decision([est(3.0), est(1.5), est(0.0)], 2.0, 5.0)
    assert decision == BoundDecision(1, "backlog_rerouted")  # the ranking (prefix, session) still decides among them


def test_with_none_within_the_bound_a_short_wait_holds_it_until_the_soonest_backlog_drains_under_it() -> None:
    decision = bound_decision([est(3.0), est(2.4), est(2.6)], 2.0, 1.0)
    assert decision.index == 1 and decision.reason == "backlog_deferred"
    assert decision.wait_s == pytest.approx(0.5)  # 2.4 + 0.1 - 2.0: then it starts within the bound there


def test_a_wait_longer_than_allowed_goes_where_it_starts_soonest_never_starved() -> None:
    assert bound_decision([est(3.0), est(2.4)], 2.0, 0.4) == BoundDecision(1, "over_bound")
    assert bound_decision([est(30.0), est(20.0)], 2.0, 0.0) == BoundDecision(1, "over_bound")


def test_a_prompt_whose_own_prefill_is_past_the_bound_is_never_held_waiting_does_not_shorten_it() -> None:
    # Its own 2.5 s alone exceed the bound: no backlog drain gets it under, so it goes where it starts soonest now.
    assert bound_decision([est(1.0, 2.5), est(0.5, 2.5)], 2.0, 10.0) == BoundDecision(1, "over_bound")


def test_the_rule_needs_an_option() -> None:
    with pytest.raises(ValueError, match="at least one option"):
        bound_decision([], 2.0, 1.0)


def test_the_estimate_drains_the_backlog_one_step_per_step_time_since_the_report() -> None:
    replica = ReplicaKv("r", capacity=100, tokens_per_block=TOKENS, step_s=STEP_S, step_tokens=STEP_TOKENS,
                        prefill_tokens=40 * TOKENS, last_report=10.0)
    replica.add_grant("since", 8, 10.0, prefill_blocks=8)  # a grant the report does not name yet
    now = start_estimate(replica, 4, 10.0)
    assert (now.ahead_s, now.own_s) == (pytest.approx(48 * BLOCK_S), pytest.approx(4 * BLOCK_S))
    assert start_estimate(replica, 4, 10.5).ahead_s == pytest.approx(48 * BLOCK_S - 0.5)
    assert start_estimate(replica, 4, 99.0).ahead_s == 0.0
    replica.step_s = 0.0  # not reported: no estimate, within any bound
    assert start_estimate(replica, 4, 10.0) == StartEstimate(0.0, 0.0)


# ---- the queue, on the simulated clock ----------------------------------------------------------------------------

def report(queue: AdmissionQueue, replica_id: str, backlog_s: float, capacity: int = 400, **fields: Any) -> None:
    """A replica's report with backlog_s of prefill queued (whole blocks)."""
    blocks = round(backlog_s / BLOCK_S)
    queue.report(KvReport(replica_id=replica_id, capacity=capacity, tokens_per_block=TOKENS, held={},
                          prefill_tokens=blocks * TOKENS, step_s=STEP_S, step_tokens=STEP_TOKENS, **fields))


async def granted_at(queue: AdmissionQueue, ticket: str, need: int, **acquire: Any) -> tuple[str, float]:
    """Acquires on the queue's loop: (the replica, the simulated time of the grant)."""
    replica_id = await queue.acquire(ticket, need, acquire.pop("timeout_s", 30.0), **acquire)
    return replica_id, asyncio.get_running_loop().time()


def test_a_turn_goes_to_a_replica_within_the_bound_not_to_its_history_behind_a_long_backlog() -> None:
    history = list(range(3, 3 + 10 * TOKENS))
    prompt = history + [1, 2, 3]
    ask = PrefixAsk(tuple(prompt_hashes(prompt, TOKENS, SEED)), TOKENS, SEED, len(prompt))

    async def run(bound_s: float) -> tuple[str, str]:
        queue = AdmissionQueue(max_queued=8, clock=asyncio.get_running_loop().time, ttft_bound_s=bound_s)
        reporter = PrefixReporter(TOKENS, SEED)
        for block in chain_hashes(history, TOKENS, SEED):
            reporter.set(block, CACHED)
        report(queue, "home", backlog_s=3.0, prefix=reporter.report(None, 0))
        report(queue, "idle", backlog_s=0.0)
        replica_id = await queue.acquire("turn", 11, 5.0, ask=ask)
        grant = queue.grant_of("turn")
        assert grant is not None
        return replica_id, grant.decision

    assert run_simulated(run(0.0)) == ("home", "prefix")  # bound off: the history wins, as before
    # 3 s of prefill queued at home put its first token past 2 s; the idle replica starts all 11 blocks in 0.275 s
    assert run_simulated(run(2.0)) == ("idle", "backlog_rerouted")


def test_with_every_replica_past_the_bound_the_request_waits_in_the_queue_until_one_drains_under_it() -> None:
    async def run() -> tuple[tuple[str, float], Mapping[str, int]]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=8, clock=loop.time, ttft_bound_s=2.0)
        report(queue, "a", backlog_s=3.0)
        report(queue, "b", backlog_s=2.5)
        result = await granted_at(queue, "t", 4)  # its own 4 blocks: 0.1 s
        return result, queue.stats().decisions

    (replica_id, at), decisions = run_simulated(run())
    assert replica_id == "b" and at == pytest.approx(0.6)  # 2.5 + 0.1 - 2.0: then b starts it within the bound
    assert decisions["backlog_deferred"] == 1 and sum(decisions.values()) == 2


def test_when_no_short_wait_helps_it_is_granted_at_once_where_it_starts_soonest() -> None:
    async def run() -> tuple[tuple[str, float], str]:
        queue = AdmissionQueue(max_queued=8, clock=asyncio.get_running_loop().time, ttft_bound_s=2.0)
        report(queue, "a", backlog_s=12.0)
        report(queue, "b", backlog_s=10.0)  # 8 s past the bound: longer than any hold (at most the bound)
        result = await granted_at(queue, "t", 4)
        grant = queue.grant_of("t")
        assert grant is not None
        return result, grant.decision

    assert run_simulated(run()) == (("b", 0.0), "over_bound")


@pytest.mark.parametrize("deadline_s,expected", [(0.3, ("b", 0.0)), (1.0, ("b", 0.6))],
                         ids=["deadline-before-the-drain", "deadline-after-it"])
def test_a_hold_never_runs_past_the_requests_deadline(deadline_s: float, expected: tuple[str, float]) -> None:
    async def run() -> tuple[str, float]:
        queue = AdmissionQueue(max_queued=8, clock=asyncio.get_running_loop().time, ttft_bound_s=2.0)
        report(queue, "a", backlog_s=3.0)
        report(queue, "b", backlog_s=2.5)
        return await granted_at(queue, "t", 4, level=ServiceLevel(deadline_s=deadline_s))

    replica_id, at = run_simulated(run())
    assert (replica_id, at) == (expected[0], pytest.approx(expected[1]))


def test_a_held_request_waits_for_compute_not_kv_so_a_short_one_behind_it_is_granted_meanwhile() -> None:
    async def run() -> list[tuple[str, str, float]]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=8, clock=loop.time, ttft_bound_s=2.0)
        report(queue, "r", backlog_s=1.5)
        grants: list[tuple[str, str, float]] = []

        async def ask(ticket: str, need: int) -> None:
            replica_id = await queue.acquire(ticket, need, 30.0)
            grants.append((ticket, replica_id, loop.time()))

        long_one = loop.create_task(ask("long", 40))  # 1 s of its own: 2.5 s in all, 0.5 s past the bound
        await asyncio.sleep(0.1)
        await ask("short", 2)  # 0.05 s of its own: 1.45 s in all (0.1 s drained), within the bound: at once
        await long_one
        return grants

    grants = run_simulated(run())
    assert [(t, r) for t, r, _ in grants] == [("short", "r"), ("long", "r")]
    assert grants[0][2] == pytest.approx(0.1)
    # The long one's hold ends at 0.5 s; by then the short one's 2 blocks are queued ahead of it: 0.05 s more.
    assert grants[1][2] == pytest.approx(0.55)


# ---- the measured prefill price -----------------------------------------------------------------------------------

def test_a_measured_prefill_price_replaces_the_decode_dominated_step_mean() -> None:
    replica = ReplicaKv("r", capacity=100, tokens_per_block=TOKENS, step_s=STEP_S, step_tokens=STEP_TOKENS,
                        prefill_tokens=40 * TOKENS, last_report=10.0)
    assert recompute_s_per_block(replica) == pytest.approx(BLOCK_S)  # not measured: step_s over the budget's blocks
    replica.prefill_s_per_token = 0.01  # measured on its steps with prompt tokens: 0.16 s a block
    assert recompute_s_per_block(replica) == pytest.approx(0.01 * TOKENS)
    estimate = start_estimate(replica, 4, 10.0)
    assert (estimate.ahead_s, estimate.own_s) == (pytest.approx(40 * 0.16), pytest.approx(4 * 0.16))


def test_the_bound_acts_on_the_replicas_measured_prefill_price_where_the_step_mean_saw_no_backlog() -> None:
    """The same backlog of 30 blocks: priced by the step mean (0.025 s a block) it starts a request within 2 s; at the
    replica's measured 0.1 s a block it would start it at 3.1 s, so the bound holds it until the backlog drains."""
    async def run(price: float) -> tuple[tuple[str, float], str]:
        queue = AdmissionQueue(max_queued=8, clock=asyncio.get_running_loop().time, ttft_bound_s=2.0)
        queue.report(KvReport(replica_id="a", capacity=400, tokens_per_block=TOKENS, held={},
                              prefill_tokens=30 * TOKENS, step_s=STEP_S, step_tokens=STEP_TOKENS,
                              prefill_s_per_token=price))
        result = await granted_at(queue, "t", 1)
        grant = queue.grant_of("t")
        assert grant is not None
        return result, grant.decision

    assert run_simulated(run(0.0)) == (("a", 0.0), "only_choice")
    (replica_id, at), _ = run_simulated(run(0.1 / TOKENS))
    assert replica_id == "a" and at == pytest.approx(30 * 0.1 + 0.1 - 2.0)  # held until 3.1 s - 2 s


# ---- the estimates read lazily ------------------------------------------------------------------------------------

def _cluster(rng: random.Random, size: int) -> list[ReplicaKv]:
    """Replicas of random free KV, sequences, backlog and cached runs of LAZY_PROMPT's blocks."""
    replicas = []
    for r in range(size):
        replica = ReplicaKv(f"r{r}", capacity=200, tokens_per_block=TOKENS, step_s=STEP_S, step_tokens=STEP_TOKENS,
                            prefill_tokens=rng.randrange(0, 200) * TOKENS, last_report=rng.uniform(0.0, 1.0))
        for g in range(rng.randrange(0, 4)):
            replica.add_grant(f"r{r}g{g}", rng.randrange(1, 60), 0.0, rng.randrange(0, 20))
        cached = rng.randrange(0, len(LAZY_HASHES) + 1)
        reporter = PrefixReporter(TOKENS, SEED)
        for block in LAZY_HASHES[:cached]:
            reporter.set(block, CACHED)
        replica.prefix.index.apply(reporter.report(None, 0))
        replicas.append(replica)
    return replicas


LAZY_PROMPT = list(range(3, 3 + 12 * TOKENS)) + [1, 2]
LAZY_HASHES = chain_hashes(LAZY_PROMPT, TOKENS, SEED)
LAZY_ASK = PrefixAsk(tuple(prompt_hashes(LAZY_PROMPT, TOKENS, SEED)), TOKENS, SEED, len(LAZY_PROMPT))


@pytest.mark.parametrize("bound_s", [0.0, 0.5, 2.0, 6.0])
def test_the_choice_reads_start_estimates_only_as_far_down_the_ranking_as_the_bound_needs(
        bound_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """pick_replica computes the start estimates lazily, as bound_decision reads them: its answer is the one every
    estimate computed up front gives, and with the bound off it computes only the chosen replica's."""
    rng = random.Random(51)
    calls: list[str] = []

    def counted(replica: ReplicaKv, own_blocks: float, now: float) -> StartEstimate:
        calls.append(replica.replica_id)
        return start_estimate(replica, own_blocks, now)

    class Eager(list):  # every estimate computed up front: what the choice did before it read them lazily
        def __init__(self, ranked: list[Any], now: float) -> None:
            super().__init__(start_estimate(replica, own, now) for _, replica, own, _, _ in ranked)

    reads = []
    for case in range(40):
        replicas = _cluster(rng, 16)
        now = rng.uniform(0.0, 3.0)
        kwargs: dict[str, Any] = dict(ttft_bound_s=bound_s, may_wait_s=rng.choice([0.0, 1.0, 10.0]), now=now,
                                      home=rng.choice([None, "r3"]))
        need = rng.randrange(5, 40)
        with monkeypatch.context() as patch:
            patch.setattr(replica_choice, "_LazyStarts", Eager)
            eager = replica_choice.pick_replica(replicas, need, LAZY_ASK, True, **kwargs)
        calls.clear()
        with monkeypatch.context() as patch:
            patch.setattr(replica_choice, "start_estimate", counted)
            lazy = replica_choice.pick_replica(replicas, need, LAZY_ASK, True, **kwargs)
        assert lazy == eager, case
        if lazy is None:
            continue
        assert len(calls) == len(set(calls)), "an estimate computed twice"
        if bound_s == 0.0:
            assert calls == [lazy.replica.replica_id]
        reads.append(len(calls))
    if bound_s == 0.0:
        assert max(reads) == 1
    else:  # some choice found a replica within the bound before reading every option's estimate
        assert min(reads) < 16
