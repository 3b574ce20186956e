"""The admission queue keeps each replica's sums as running totals (ReplicaKv: `granted`, `prefill_ahead`,
`num_sequences`), moved by every grant, release, give-back and report instead of summed over the grants at every
choice. Here they are checked against the sums themselves after every change: of a ReplicaKv alone, and of the real
queue under random grants, releases, refusals, lost replicas and reports that lag (no Ray)."""

from __future__ import annotations

import asyncio
import random

import pytest

from dcpserve.deployments.admission.errors import AdmissionError
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.replica_choice import ReplicaKv
from dcpserve.deployments.messages import KvReport

TOKENS = 16


def summed(replica: ReplicaKv) -> tuple[int, int, int]:
    """(granted, prefill_ahead, num_sequences) as the sums they stand for."""
    granted = sum(max(blocks, replica.held.get(ticket, 0)) for ticket, (blocks, _) in replica.grants.items())
    reported = -(-replica.prefill_tokens // replica.tokens_per_block)
    ahead = reported + sum(blocks for ticket, blocks in replica.grant_prefill.items() if ticket not in replica.held)
    sequences = len(replica.grants) + sum(1 for ticket in replica.held
                                          if ticket not in replica.grants and ticket not in replica.released)
    return granted, ahead, sequences


def totals(replica: ReplicaKv) -> tuple[int, int, int]:
    return replica.granted, replica.prefill_ahead, replica.num_sequences


@pytest.mark.parametrize("seed", range(4))
def test_a_replicas_totals_equal_its_sums_after_every_change(seed: int) -> None:
    rng = random.Random(seed)
    replica = ReplicaKv("r", capacity=1000, tokens_per_block=TOKENS, prefill_tokens=3 * TOKENS + 1)
    tickets = [f"t{i}" for i in range(12)]
    for _ in range(600):
        ticket, op = rng.choice(tickets), rng.random()
        if op < 0.35:
            replica.add_grant(ticket, rng.randint(1, 9), 0.0, prefill_blocks=rng.randint(0, 9))
        elif op < 0.6:
            replica.drop_grant(ticket)
        elif op < 0.8:
            replica.mark_released(ticket)
        else:  # a report: some granted tickets, some released ones it has not seen end, some not granted here
            replica.set_held({t: rng.randint(1, 12) for t in tickets if rng.random() < 0.4})
            assert replica.released <= set(replica.held)  # a report keeps only the released tickets it names
        assert totals(replica) == summed(replica)


@pytest.mark.parametrize("seed", range(4))
def test_the_queues_replica_totals_equal_their_sums_under_random_traffic(seed: int) -> None:
    """Grants, releases (before and after the replica's report names them), refusals, unreachable replicas, leaked
    grants, a lost replica that comes back, and reports holding tickets the queue never granted."""
    rng = random.Random(seed)

    async def run() -> None:
        now = [0.0]
        queue = AdmissionQueue(max_queued=64, leak_grace_s=5.0, clock=lambda: now[0])
        held: dict[str, dict[str, int]] = {r: {} for r in ("a", "b", "c")}

        def report(replica_id: str) -> None:
            queue.report(KvReport(replica_id=replica_id, capacity=60, tokens_per_block=TOKENS,
                                  held=dict(held[replica_id]), prefill_tokens=rng.randint(0, 4 * TOKENS),
                                  probes=int(now[0])))

        for replica_id in held:
            report(replica_id)
        live: list[str] = []
        for step in range(400):
            now[0] += rng.uniform(0.0, 0.5)
            op = rng.random()
            if op < 0.35:
                ticket = f"t{step}"
                try:
                    replica_id = await queue.acquire(ticket, rng.randint(1, 8), 0.0)
                except (AdmissionError, TimeoutError):
                    pass
                else:
                    live.append(ticket)
                    if rng.random() < 0.8:  # it arrived (the rest leak unless released)
                        held[replica_id][ticket] = rng.randint(1, 10)
            elif op < 0.55 and live:
                ticket = live.pop(rng.randrange(len(live)))
                grant = queue.grant_of(ticket)
                if rng.random() < 0.1 and grant is not None:
                    queue.refused(ticket, grant.replica_id, rng.randint(0, 30))
                elif rng.random() < 0.1 and grant is not None:
                    queue.unreachable(ticket, grant.replica_id)
                else:
                    queue.release(ticket)
                if rng.random() < 0.7:  # the replica freed it (its next report drops it); else a stale report
                    for tickets in held.values():
                        tickets.pop(ticket, None)
            elif op < 0.6:
                held["b"][f"x{step}"] = rng.randint(1, 5)  # a ticket another queue granted
            elif op < 0.62:
                queue.replica_lost("c")
            else:
                report(rng.choice(list(held)))
            for replica in queue.replicas.values():
                assert totals(replica) == summed(replica), (step, replica.replica_id)
        assert queue.num_granted > 60 and queue.num_leaked + queue.num_refusals + queue.num_lost > 0

    asyncio.run(run())
