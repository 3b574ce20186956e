"""AdmissionQueue: exact KV accounting, strict FIFO, bounds, timeouts, refusals and reconciliation (no Ray)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from dcpserve.deployments.admission.errors import NeverFits, NoReplica, QueueFull, QueueTimeout
from dcpserve.deployments.admission.ledger import Grant
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import KvReport, PrefixAsk
from dcpserve.engine.core.prefix_cache import (
    PINNED,
    PrefixReporter,
    prompt_hashes,
)


def kv(replica_id: str, capacity: int, **fields: Any) -> KvReport:
    """A replica's KV report in blocks of 32 tokens, holding nothing unless `held` says otherwise."""
    return KvReport(replica_id=replica_id, capacity=capacity, tokens_per_block=32, **fields)


def make_queue(capacities: dict[str, int], max_queued: int = 8) -> AdmissionQueue:
    queue = AdmissionQueue(max_queued=max_queued)
    for replica_id, capacity in capacities.items():
        queue.report(kv(replica_id, capacity))
    return queue


def test_grants_the_replica_with_most_free_kv_and_counts_it() -> None:
    async def run() -> None:
        queue = make_queue({"a": 10, "b": 8})
        assert await queue.acquire("t1", 4, 1.0) == "a"  # a: 6 free, b: 8 free
        assert await queue.acquire("t2", 4, 1.0) == "b"
        assert queue.replicas["a"].free == 6 and queue.replicas["b"].free == 4
        queue.release("t1")
        queue.release("t1")  # idempotent
        assert queue.replicas["a"].free == 10
        # Grants ever made, per replica: what shows that a replica that joined takes traffic.
        assert await queue.acquire("t3", 1, 1.0) == "a"
        queue.release("t3")
        replicas = queue.stats().replicas
        assert (replicas["a"].num_granted, replicas["b"].num_granted) == (2, 1)
        assert (replicas["a"].num_grants, replicas["b"].num_grants) == (0, 1)

    asyncio.run(run())


def test_never_fits_is_refused_at_once_with_numbers() -> None:
    async def run() -> None:
        queue = make_queue({"a": 10})
        with pytest.raises(NeverFits, match=r"needs 11 KV blocks .* holds 10 blocks \(320 tokens\)"):
            await queue.acquire("t", 11, 5.0)

    asyncio.run(run())


def test_strict_fifo_head_is_not_starved_by_small_requests() -> None:
    async def run() -> None:
        queue = make_queue({"a": 10})
        assert await queue.acquire("small0", 6, 1.0) == "a"
        big = asyncio.create_task(queue.acquire("big", 8, 5.0))
        await asyncio.sleep(0)
        small = asyncio.create_task(queue.acquire("small1", 2, 5.0))  # would fit now, but big is ahead
        await asyncio.sleep(0.05)
        assert not big.done() and not small.done()
        queue.release("small0")
        assert await big == "a"
        await asyncio.sleep(0.05)
        assert await small == "a"  # 8 + 2 = 10: fits after big
        assert queue.replicas["a"].free == 0

    asyncio.run(run())


def test_bounded_queue_and_timeout() -> None:
    async def run() -> None:
        queue = make_queue({"a": 4}, max_queued=1)
        await queue.acquire("t0", 4, 1.0)
        waiting = asyncio.create_task(queue.acquire("t1", 2, 0.2))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="max_queued_requests=1"):
            await queue.acquire("t2", 1, 1.0)
        with pytest.raises(QueueTimeout, match=r"waited 0\.\ds in the admission queue"):
            await waiting
        assert queue.stats().num_queued == 0
        queue.release("t0")
        assert await queue.acquire("t3", 4, 1.0) == "a"

    asyncio.run(run())


def test_no_healthy_replica() -> None:
    async def run() -> None:
        empty = AdmissionQueue(max_queued=4)
        with pytest.raises(NoReplica):
            await empty.acquire("t", 1, 0.1)  # nothing ever registered
        queue = make_queue({"a": 4})
        queue.report(kv("a", 4, healthy=False))
        with pytest.raises(NoReplica):
            await queue.acquire("t", 1, 5.0)  # known but failing: at once

    asyncio.run(run())


def test_refusal_requeues_at_head_and_trusts_the_replica() -> None:
    async def run() -> None:
        queue = make_queue({"a": 10, "b": 10})
        first = await queue.acquire("t", 6, 1.0)
        other = "b" if first == "a" else "a"
        queue.refused("t", first, free_blocks=2)  # the replica knows better: only 2 free
        assert queue.replicas[first].free == 2
        assert await queue.acquire("t", 6, 1.0, front=True) == other

    asyncio.run(run())


def test_reports_reconcile_external_and_leaked_grants() -> None:
    now = [0.0]
    queue = AdmissionQueue(max_queued=4, leak_grace_s=10.0, clock=lambda: now[0])
    queue.report(kv("a", 10, held={"direct": 3}))  # a request that did not come through the queue
    assert queue.replicas["a"].free == 7

    async def run() -> None:
        assert await queue.acquire("t", 5, 1.0) == "a"

    asyncio.run(run())
    queue.report(kv("a", 10, held={"direct": 3}))  # not yet arrived at the replica: kept
    assert queue.replicas["a"].free == 2
    now[0] = 20.0
    queue.report(kv("a", 10))  # never arrived, long ago: the caller died, the grant is dropped
    assert queue.replicas["a"].free == 10


def test_random_load_never_over_commits_and_answers_everyone() -> None:
    async def run() -> None:
        rng = random.Random(0)
        queue = make_queue({"a": 16, "b": 12}, max_queued=6)
        outcomes: dict[str, str] = {}

        async def client(i: int) -> None:
            ticket = f"t{i}"
            try:
                await queue.acquire(ticket, rng.randint(1, 12), timeout_s=0.3)
                for replica in queue.replicas.values():
                    assert replica.granted + replica.external <= replica.capacity
                await asyncio.sleep(rng.uniform(0, 0.05))
                outcomes[ticket] = "ok"
            except (QueueFull, QueueTimeout) as err:
                outcomes[ticket] = err.code
            finally:
                queue.release(ticket)

        await asyncio.gather(*(client(i) for i in range(60)))
        assert len(outcomes) == 60  # every client got exactly one answer
        assert sum(v == "ok" for v in outcomes.values()) >= 5
        assert all(r.granted == 0 for r in queue.replicas.values())
        assert queue.stats().num_queued == 0

    asyncio.run(run())


def test_grants_only_routable_replicas_and_not_one_found_unreachable() -> None:
    async def run() -> None:
        queue = AdmissionQueue(max_queued=4)
        queue.report(kv("ready", 8, routable=True, probes=3))
        queue.report(kv("starting", 26, routable=False, probes=0))  # more free KV, but Serve does not route to it
        assert await queue.acquire("t1", 2, 1.0) == "ready"
        # A caller could not reach "ready" (e.g. it is draining but Serve still probed it a moment ago): the grant
        # comes back and "ready" gets nothing until Serve has probed it again.
        queue.unreachable("t1", "ready")
        assert queue.replicas["ready"].granted == 0
        waiting = asyncio.create_task(queue.acquire("t1", 2, 5.0, front=True))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        queue.report(kv("ready", 8, routable=True, probes=3))  # no new probe: still blocked
        await asyncio.sleep(0.05)
        assert not waiting.done()
        queue.report(kv("starting", 9, routable=True, probes=1))  # now RUNNING: routers know it
        assert await waiting == "starting"
        queue.report(kv("ready", 8, routable=True, probes=4))  # probed again: grantable again
        assert queue.replicas["ready"].grantable
        assert await queue.acquire("t2", 8, 1.0) == "ready"  # 8 fit only there ("starting" has 18 free)
        assert queue.stats().num_unreachable == 1

    asyncio.run(run())


def test_a_lost_replica_is_forgotten_at_once_and_comes_back_only_when_it_reports_after_a_new_probe() -> None:
    async def run() -> None:
        queue = AdmissionQueue(max_queued=4)
        queue.report(kv("a", 10, held={"x": 2}, probes=2))  # "x": a request the queue did not grant (external)
        queue.report(kv("b", 6, probes=2))
        assert await queue.acquire("t1", 4, 1.0) == "a"
        queue.replica_lost("a")  # an ingress' stream from "a" failed: its node went, say
        queue.replica_lost("a")  # from every ingress: counted once
        stats = queue.stats()
        assert "a" not in stats.replicas and stats.num_lost == 1  # its capacity, grants and holdings gone
        assert queue.grant_of("t1") is None
        queue.release("t1")  # its request fails and releases: nothing left to release
        assert await queue.acquire("t2", 4, 1.0) == "b"  # "a" had more free KV, but it is lost
        with pytest.raises(NeverFits, match="a replica holds 6 blocks"):  # only "b"'s KV counts now
            await queue.acquire("t3", 8, 1.0)
        queue.report(kv("a", 10, probes=2))  # alive after all, but Serve has not probed it since
        assert not queue.replicas["a"].grantable
        queue.report(kv("a", 10, probes=3))  # probed again: grantable
        assert await queue.acquire("t3", 8, 1.0) == "a"
        queue.replica_lost("unknown")  # a replica the queue never heard of: nothing to do
        assert queue.stats().num_lost == 1

    asyncio.run(run())


def test_timeout_without_a_grantable_replica_says_so() -> None:
    async def run() -> None:
        queue = AdmissionQueue(max_queued=4)
        queue.report(kv("draining", 8, routable=False, probes=9))
        with pytest.raises(NoReplica, match=r"draining: starting or draining"):
            await queue.acquire("t", 2, 0.2)
        queue.report(kv("a", 4, routable=True, probes=1))
        await queue.acquire("big", 4, 1.0)
        with pytest.raises(QueueTimeout, match=r"waited 0\.\ds in the admission queue and no replica had 2 free"):
            await queue.acquire("t", 2, 0.2)

    asyncio.run(run())


# ---- prefix-aware routing ----------------------------------------------------------------------------------------

SEED = b"seed"


def ask_for(tokens: list[int]) -> PrefixAsk:
    return PrefixAsk(tuple(prompt_hashes(tokens, 32, SEED)), 32, SEED, len(tokens))


def grant_of(queue: AdmissionQueue, ticket: str) -> Grant:
    grant = queue.grant_of(ticket)
    assert grant is not None, f"{ticket} holds no grant"
    return grant


def cache_report(reporter: PrefixReporter, queue: AdmissionQueue, replica_id: str, capacity: int,
                 held: dict[str, int] | None = None) -> None:
    """The replica's periodic report, with its prefix changes since the queue's copy."""
    epoch, version = queue.prefix_position(replica_id)
    queue.report(kv(replica_id, capacity, held=held or {}, prefix=reporter.report(epoch, version)))


def test_a_report_made_before_a_release_does_not_count_the_released_blocks_again() -> None:
    """A finished request's blocks are free on its replica when its ticket is released (an unfinished one's abort
    completes first), so a report computed before the release that still names the ticket is stale for it: the
    blocks are neither external nor kept from the next grant. Counted as external, they showed 45 of 32 blocks in use
    for a report period (tests/e2e/test_serve_deploy.py's burst, under load)."""
    async def run() -> None:
        queue = make_queue({"a": 32})
        assert await queue.acquire("held", 19, 1.0) == "a"
        assert await queue.acquire("head", 13, 1.0) == "a"
        queue.report(kv("a", 32, held={"held": 19, "head": 13}))
        queue.release("head")  # it finished: its 13 blocks are free on a
        assert await queue.acquire("next", 13, 1.0) == "a"
        queue.report(kv("a", 32, held={"held": 19, "head": 13}))  # made before the release, delivered after it
        replica = queue.replicas["a"]
        assert replica.external == 0 and replica.granted + replica.external <= replica.capacity
        queue.report(kv("a", 32, held={"held": 19, "next": 13}))
        assert replica.external == 0 and replica.granted == 32 and replica.released == set()

    asyncio.run(run())


def test_a_released_ticket_stops_counting_as_a_sequence_before_the_replica_reports_again() -> None:
    async def run() -> None:
        # a runs two conversations (c1, c3), b two others; b's are between turns. c1's and c3's last turns ended
        # (released) after a's last report, which still names them; c3's next turn is already granted on a.
        queue = make_queue({"a": 100, "b": 100})
        history = list(range(300))
        assert await queue.acquire("c1-turn1", 10, 1.0, ask=ask_for(history)) == "a"
        assert await queue.acquire("c3-turn1", 10, 1.0, ask=ask_for(list(range(1000, 1300)))) == "b"
        queue.report(kv("b", 100, held={"c3-turn1": 10}))
        queue.release("c3-turn1")
        queue.report(kv("b", 100))
        writer = PrefixReporter(32, SEED)
        for block in prompt_hashes(history, 32, SEED):
            writer.set(block, PINNED)
        cache_report(writer, queue, "a", 100, {"c1-turn1": 10, "c3-old": 10, "c3-next": 10})
        queue.release("c1-turn1")  # the answer ended; its next turn comes before a's next report
        queue.release("c3-old")  # never granted here (a queue restart): released all the same
        assert queue.replicas["a"].num_sequences == 1  # c3-next, which a reported holding
        assert await queue.acquire("c1-turn2", 10, 1.0, ask=ask_for(history + [1, 2])) == "a"
        # A report computed before the release still names the ticket: it does not count again.
        cache_report(writer, queue, "a", 100, {"c1-turn1": 10, "c3-next": 10})
        assert queue.replicas["a"].num_sequences == 2
        # Once a report leaves it out, the queue forgets the release (a set that does not grow).
        cache_report(writer, queue, "a", 100, {"c3-next": 10})
        assert queue.replicas["a"].released == set()

    asyncio.run(run())


def test_a_refusing_replica_reports_first_or_the_queue_grants_it_again() -> None:
    """Why EngineReplica.generate reports its KV before it answers Refused. The queue's copy of a replica's prefix
    cache says a prompt's blocks are pinned (shared by a running request, so the new request adds few blocks); the
    request holding them has finished since, so on the replica the same blocks cost as much as free ones. The
    replica refuses; the refusal's free-block count alone leaves the queue's stale need in place and it grants the
    same replica again at once, a loop that lasts until the next periodic report. After a fresh report the queue
    counts what the replica counts, and the request waits."""
    from dcpserve.engine.config import SchedulerConfig
    from dcpserve.engine.core.block_manager import BlockManager
    from dcpserve.engine.core.request import Request
    from dcpserve.engine.core.scheduler import Scheduler
    from dcpserve.engine.protocol import KvFull
    from dcpserve.engine.sampling_params import SamplingParams

    manager = BlockManager(num_blocks=24, block_size=4, dcp_size=1, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_model_len=256, max_num_batched_tokens=256), manager, frozenset({0}))
    queue = AdmissionQueue(max_queued=4)
    position: list[tuple[str | None, int]] = [(None, 0)]

    def report() -> None:
        ledger = scheduler.kv_ledger()
        assert manager.reporter is not None
        queue.report(KvReport(replica_id="r", capacity=ledger.capacity_blocks, tokens_per_block=ledger.tokens_per_block,
                              held=ledger.per_request, headroom=ledger.headroom_blocks,
                              prefix=manager.reporter.report(*position[0])))
        position[0] = queue.prefix_position("r")

    def step() -> None:
        output = scheduler.schedule()
        scheduler.update(output, {entry.request_id: 5 for entry in output.scheduled if entry.sample})

    prompt = list(range(1, 33))  # 8 full blocks of 4 tokens
    scheduler.add_request(Request("a", [*prompt, 99], SamplingParams(max_tokens=2)))
    scheduler.add_request(Request("c", list(range(100, 148)), SamplingParams(max_tokens=50)))  # 12 blocks, growing
    step()
    report()  # the queue's copy: a's 8 prompt blocks pinned, a and c held
    while len(scheduler.requests["c"].block_ids) < 14:  # a finishes (its blocks stay cached, unpinned); c grows
        step()
    assert "a" not in scheduler.requests

    new = Request("b", [*prompt, 77], SamplingParams(max_tokens=2))
    need = 9  # admission_blocks("usage", 33 tokens, ...) at 4 tokens per block
    ask = PrefixAsk(tuple(prompt_hashes(new.prompt_token_ids, 4, b"")), 4, b"", len(new.prompt_token_ids))

    async def grant() -> str | None:
        try:
            return await queue.acquire("b", need, 0.01, front=True, ask=ask)
        except QueueTimeout:
            return None

    assert asyncio.run(grant()) == "r"  # the stale copy: 9 - 8 pinned = 1 block, and the queue sees 1 free
    replica_need = scheduler.committed_blocks(new)
    with pytest.raises(KvFull) as full:
        scheduler.kv_ledger().require(replica_need)  # the replica: 9 blocks, 8 free
    queue.refused("b", "r", full.value.free_blocks)
    assert asyncio.run(grant()) == "r"  # granted again: the loop
    queue.refused("b", "r", full.value.free_blocks)
    report()  # what the replica does before it answers Refused
    assert asyncio.run(grant()) is None  # now the queue counts 9 blocks against 8 free: the request waits


def test_every_method_of_the_admission_deployment_runs_on_its_event_loop() -> None:
    """Ray Serve runs a deployment's sync methods in a thread pool (RAY_SERVE_RUN_SYNC_IN_THREADPOOL, on by
    default): a sync release or report raced acquire over the queue's state from another thread and set its waiters'
    futures off the loop ("deque mutated during iteration" under load). Every method the ingress and the replicas
    call must be async, so they all run on the one loop."""
    import inspect

    from dcpserve.deployments.admission.kv_admission import KvAdmission

    cls = KvAdmission.func_or_class  # type: ignore[attr-defined]  # mypy ignores class decorators: @serve.deployment made it a Deployment
    public = {name: member for name, member in vars(cls).items()
              if callable(member) and not name.startswith("_")}
    assert {"acquire", "release", "refused", "unreachable", "replica_lost", "report", "remove_replica",
            "stats"} <= set(public)
    assert [name for name, member in public.items() if not inspect.iscoroutinefunction(member)] == []
