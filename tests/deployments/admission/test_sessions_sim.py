"""Session affinity under lagging, jittered reports on the simulated clock (dcpserve/simulator/clock.py), with replicas
whose device cache evicts a conversation's history as soon as its turn ends (a replica with a host tier reports it
HOSTED, one whose report lags says nothing yet): prefix routing has nothing to go on, and the free KV swings with
other work. The session key is what keeps each conversation's turns on its replica; without it they scatter."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import KvReport, PrefixAsk, ServiceLevel
from dcpserve.engine.core.block_manager import blocks_needed
from dcpserve.engine.core.prefix_cache import EVICTED, PINNED, PrefixReporter, chain_hashes, prompt_hashes
from dcpserve.simulator.clock import run_simulated

SEED = b"sessions"
TOKENS = 16
CAPACITY = 400


@dataclass
class EvictingReplica:
    """A replica as the queue sees it: its requests, other work's KV (changing at every report), and a prefix cache
    that drops a prompt's blocks from the device when its request ends."""

    replica_id: str
    queue: AdmissionQueue
    rng: random.Random
    held: dict[str, int] = field(default_factory=dict)
    reporter: PrefixReporter = field(default_factory=lambda: PrefixReporter(TOKENS, SEED))

    def report(self) -> None:
        epoch, version = self.queue.prefix_position(self.replica_id)
        other_work = {"other": self.rng.randrange(1, 120)}
        self.queue.report(KvReport(replica_id=self.replica_id, capacity=CAPACITY, tokens_per_block=TOKENS,
                                   held={**self.held, **other_work}, prefix=self.reporter.report(epoch, version)))

    async def report_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5 * self.rng.uniform(0.6, 1.4))
            self.report()

    def start(self, ticket: str, blocks: int, prompt: list[int]) -> None:
        self.held[ticket] = blocks
        for block in chain_hashes(prompt, TOKENS, SEED):
            self.reporter.set(block, PINNED)

    def finish(self, ticket: str, prompt: list[int]) -> None:
        del self.held[ticket]
        for block in chain_hashes(prompt, TOKENS, SEED):
            self.reporter.set(block, EVICTED)


def turns_away(seed: int, with_sessions: bool, conversations: int = 4, turns: int = 5) -> tuple[int, int]:
    """(later turns granted away from the replica of the conversation's previous turn, later turns in all)."""
    rng = random.Random(seed)

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=64, clock=loop.time)
        fakes = {f"r{i}": EvictingReplica(f"r{i}", queue, random.Random(rng.random())) for i in range(2)}
        for fake in fakes.values():
            fake.report()
        reporting = [loop.create_task(fake.report_loop()) for fake in fakes.values()]
        away = later = 0

        async def conversation(c: int) -> None:
            nonlocal away, later
            history = [(97 * c + 7 * i) % 500 + 3 for i in range(200)]
            previous = None
            await asyncio.sleep(rng.uniform(0, 0.05))
            for t in range(turns):
                prompt = history + [(31 * c + 11 * t + i) % 500 + 3 for i in range(32)]
                ask = PrefixAsk(tuple(prompt_hashes(prompt, TOKENS, SEED)), TOKENS, SEED, len(prompt))
                ticket = f"c{c}-t{t}"
                level = ServiceLevel(session=f"conversation-{c}" if with_sessions else None)
                replica_id = await queue.acquire(ticket, blocks_needed(len(prompt) + 40, TOKENS), 30.0, ask=ask,
                                                 level=level)
                grant = queue.grant_of(ticket)
                assert grant is not None
                if previous is not None:
                    later += 1
                    away += replica_id != previous
                fakes[replica_id].start(ticket, grant.need, prompt)
                await asyncio.sleep(rng.uniform(0.1, 0.6))
                fakes[replica_id].finish(ticket, prompt)
                queue.release(ticket)
                previous = replica_id
                history = prompt + [(13 * c + t + i) % 500 + 3 for i in range(24)]
                # The agent's think time (its tools run): longer than two report periods, so the queue has also
                # dropped the finished turn's prompt from its grants in flight (prefix_routing.REPORTS_AFTER_FINISH).
                await asyncio.sleep(rng.uniform(1.5, 3.0))

        await asyncio.gather(*(conversation(c) for c in range(conversations)))
        for task in reporting:
            task.cancel()
        return away, later

    return run_simulated(main())


def test_a_sessions_turns_stay_on_its_replica_when_its_history_left_the_device_and_reports_say_nothing() -> None:
    """20 seeded interleavings: with session keys no later turn leaves its conversation's replica (two conversations
    per replica are always in balance, and the KV always has room); without them, routing has only the free KV."""
    kept = [turns_away(seed, with_sessions=True) for seed in range(20)]
    assert all(away == 0 for away, _ in kept), kept
    scattered = sum(turns_away(seed, with_sessions=False)[0] for seed in range(20))
    later = sum(total for _, total in kept)
    assert scattered > later // 5, (scattered, later)  # the test can tell: without keys many turns move
