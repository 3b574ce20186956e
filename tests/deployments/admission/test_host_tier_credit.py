"""The admission queue's credit for prefixes in a replica's host tier (issue 51 item 2, the queue's side): a HOSTED
block saves its recompute less its reload, and needs its device block like a miss (no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.replica_choice import (
    ASSUMED_RELOAD_FRACTION,
    ReplicaKv,
    prefix_credit,
    recompute_s_per_block,
    reload_fraction,
)
from dcpserve.deployments.messages import KvReport, PrefixAsk
from dcpserve.engine.core.prefix_cache import (
    CACHED,
    HOSTED,
    PINNED,
    PrefixMatch,
    PrefixReporter,
    chain_hashes,
    prompt_hashes,
)

TOKENS = 16
STEP_S = 0.1
STEP_TOKENS = 64  # a block's prefill: 0.025 s
SEED = b"host"
HISTORY = list(range(3, 3 + 10 * TOKENS))  # ten full blocks
PROMPT = HISTORY + [1, 2, 3]  # eleven blocks, the last one partial
ASK = PrefixAsk(tuple(prompt_hashes(PROMPT, TOKENS, SEED)), TOKENS, SEED, len(PROMPT))


def test_a_host_block_saves_its_recompute_less_its_reload() -> None:
    replica = ReplicaKv("r", capacity=100, tokens_per_block=TOKENS, step_s=STEP_S, step_tokens=STEP_TOKENS)
    assert recompute_s_per_block(replica) == pytest.approx(0.025)
    assert reload_fraction(replica) == ASSUMED_RELOAD_FRACTION  # not measured: the stated assumption
    match = PrefixMatch(hit_blocks=10, pinned_blocks=2, host_blocks=4)
    assert prefix_credit(replica, match) == pytest.approx(6 + 4 * (1 - ASSUMED_RELOAD_FRACTION))
    replica.reload_s_per_block = 0.005  # measured: a fifth of the recompute
    assert prefix_credit(replica, match) == pytest.approx(6 + 4 * 0.8)
    replica.reload_s_per_block = 0.05  # slower than recomputing: the host run saves nothing
    assert prefix_credit(replica, match) == pytest.approx(6)
    replica.step_s = 0.0  # no step model: the measurement has nothing to compare with, the assumption holds
    assert prefix_credit(replica, match) == pytest.approx(6 + 4 * (1 - ASSUMED_RELOAD_FRACTION))


def cache(states: dict[int, int]) -> PrefixReporter:
    """A replica's prefix cache: HISTORY's first blocks, the i-th in states.get(i, nothing)."""
    reporter = PrefixReporter(TOKENS, SEED)
    for i, block in enumerate(chain_hashes(HISTORY, TOKENS, SEED)):
        if i in states:
            reporter.set(block, states[i])
    return reporter


def report(queue: AdmissionQueue, replica_id: str, reporter: PrefixReporter, capacity: int = 100,
           reload_s_per_block: float = 0.0) -> None:
    queue.report(KvReport(replica_id=replica_id, capacity=capacity, tokens_per_block=TOKENS, held={},
                          prefix=reporter.report(None, 0), step_s=STEP_S, step_tokens=STEP_TOKENS,
                          reload_s_per_block=reload_s_per_block))


@pytest.mark.parametrize("reload_s,expected", [(0.0, "hosted"), (0.0125, "device")],
                         ids=["assumed-reload", "measured-slow-reload"])
def test_routing_weighs_a_host_run_by_what_it_saves(reload_s: float, expected: str) -> None:
    """Ten blocks in the host tier against eight on device: worth 9 blocks of prefill at the assumed reload (a tenth
    of the recompute), 5 when the replica measured a reload at half of it."""

    async def run() -> str:
        queue = AdmissionQueue(max_queued=8)
        report(queue, "hosted", cache(dict.fromkeys(range(10), HOSTED)), reload_s_per_block=reload_s)
        report(queue, "device", cache(dict.fromkeys(range(8), CACHED)))
        return await queue.acquire("t", 11, 1.0, ask=ASK)

    assert asyncio.run(run()) == expected


def test_host_blocks_need_their_device_blocks_and_are_prefilled_only_for_their_reload() -> None:
    async def run() -> None:
        queue = AdmissionQueue(max_queued=8)
        report(queue, "r", cache({**dict.fromkeys(range(4), PINNED), **dict.fromkeys(range(4, 10), HOSTED)}))
        assert await queue.acquire("t", 11, 1.0, ask=ASK) == "r"
        grant = queue.grant_of("t")
        assert grant is not None and grant.hit_blocks == 10
        assert grant.need == 11 - 4  # only the pinned blocks are shared: each host block takes a device block
        # Its prefill there: 11 blocks less 4 on device and 6 x 0.9 reloaded = 1.6, rounded up.
        assert queue.replicas["r"].grant_prefill == {"t": 2}

    asyncio.run(run())


def test_a_replica_without_room_for_the_host_blocks_is_passed_over() -> None:
    async def run() -> None:
        queue = AdmissionQueue(max_queued=8)
        report(queue, "hosted", cache(dict.fromkeys(range(10), HOSTED)), capacity=10)  # a miss would not fit
        report(queue, "cold", cache({}), capacity=12)
        assert await queue.acquire("t", 11, 1.0, ask=ASK) == "cold"

    asyncio.run(run())
