"""The admission queue weighs the prefill a replica has queued (no Ray): among replicas holding equally long cached
runs of a request's prompt, the one where the fewest whole engine steps of prefill come before its first token."""

from __future__ import annotations

import asyncio

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.replica_choice import ReplicaKv, steps_to_start
from dcpserve.deployments.messages import KvReport, PrefixAsk
from dcpserve.engine.core.prefix_cache import CACHED, PrefixReport, PrefixReporter, chain_hashes, prompt_hashes

TOKENS = 16  # tokens per block
STEP = 64  # tokens one engine step takes: 4 blocks
SEED = b"backlog"


def report(queue: AdmissionQueue, replica_id: str, prefill_tokens: int, held: dict[str, int] | None = None,
           capacity: int = 100, prefix: PrefixReport | None = None) -> None:
    queue.report(KvReport(replica_id=replica_id, capacity=capacity, tokens_per_block=TOKENS, held=held or {},
                          prefix=prefix, prefill_tokens=prefill_tokens, step_tokens=STEP))


def test_steps_to_start_counts_whole_steps_of_what_is_queued_and_the_request_itself() -> None:
    replica = ReplicaKv("r", capacity=100, tokens_per_block=TOKENS, prefill_tokens=5 * TOKENS, step_tokens=STEP)
    assert steps_to_start(replica, 2) == 1  # 5 + 2 blocks over 4 a step
    assert steps_to_start(replica, 3) == 2
    replica.step_tokens = 0  # not reported: no step count, the other keys decide
    assert steps_to_start(replica, 3) == 0


def test_a_request_goes_where_fewer_steps_of_prefill_are_queued_not_to_the_most_free_kv() -> None:
    async def run() -> None:
        queue = AdmissionQueue(max_queued=8)
        report(queue, "busy", prefill_tokens=3 * STEP, capacity=200)  # three steps of prompts to compute
        report(queue, "idle", prefill_tokens=0)
        assert await queue.acquire("t", 2, 1.0) == "idle"
        # Less than a step apart counts alike: then the most free KV, as without the report.
        report(queue, "busy", prefill_tokens=TOKENS, capacity=200)  # one block: with its own two, under a step
        report(queue, "idle", prefill_tokens=0, held={"t": 2})
        assert await queue.acquire("u", 2, 1.0) == "busy"

    asyncio.run(run())


def test_grants_count_as_queued_prefill_until_a_report_names_them() -> None:
    async def run() -> None:
        queue = AdmissionQueue(max_queued=8)
        report(queue, "a", prefill_tokens=0, capacity=200)
        report(queue, "b", prefill_tokens=0)
        assert await queue.acquire("t1", 8, 1.0) == "a"  # most free; its 8 blocks are two steps of prefill there
        assert queue.replicas["a"].prefill_ahead == 8
        assert await queue.acquire("t2", 1, 1.0) == "b"  # though a has more KV free
        report(queue, "a", prefill_tokens=0, held={"t1": 8}, capacity=200)  # t1 computed its prompt
        assert queue.replicas["a"].prefill_ahead == 0
        assert await queue.acquire("t3", 1, 1.0) == "a"
        queue.release("t3")
        assert queue.replicas["a"].grant_prefill == {"t1": 8}  # t1: named by the report, so not counted again

    asyncio.run(run())


def test_the_replica_holding_the_prompt_keeps_it_over_one_with_less_prefill_queued() -> None:
    """Prefix affinity first: a conversation's turn goes back to its history even behind queued prefill (computing
    the history again elsewhere costs more than the wait, and the queue's view of the backlog lags its reports)."""

    async def run() -> None:
        queue = AdmissionQueue(max_queued=8)
        history = list(range(3, 3 + 10 * TOKENS))
        reporter = PrefixReporter(TOKENS, SEED)
        for block in chain_hashes(history, TOKENS, SEED):
            reporter.set(block, CACHED)
        report(queue, "home", prefill_tokens=6 * STEP, prefix=reporter.report(None, 0))
        report(queue, "other", prefill_tokens=0)
        prompt = history + [1, 2, 3]
        ask = PrefixAsk(tuple(prompt_hashes(prompt, TOKENS, SEED)), TOKENS, SEED, len(prompt))
        assert await queue.acquire("turn", 11, 1.0, ask=ask) == "home"
        grant = queue.grant_of("turn")
        assert grant is not None and grant.hit_blocks == 10
        assert queue.replicas["home"].grant_prefill == {"turn": 1}  # only its uncached block is prefill there

    asyncio.run(run())
