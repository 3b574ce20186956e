"""The real AdmissionQueue driven by simulated conversations on a virtual clock (dcpserve/simulator/clock.py).

Rules whose outcome depends on interleaving (which replica a turn goes to, given when reports land) are asserted here,
exactly, for many seeds: the queue takes its clock from the loop, fake replicas report their KV and prefix cache on
a jittered period, turns decode for seeded random times. A run is a function of its seed, whatever the machine does.
The end-to-end tests print the shares they see and assert only what holds whatever the interleaving.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import KvReport, PrefixAsk
from dcpserve.engine.core.block_manager import blocks_needed
from dcpserve.engine.core.prefix_cache import CACHED, PINNED, PrefixReporter, chain_hashes, prompt_hashes
from dcpserve.simulator.clock import run_simulated

SEED = b"sim"
TOKENS_PER_BLOCK = 16
CAPACITY = 400  # blocks per replica: room is never what decides below


@dataclass
class FakeReplica:
    """A replica as the queue sees it: the tickets it holds and its prefix cache, reported every period (jittered)."""

    replica_id: str
    queue: AdmissionQueue
    rng: random.Random
    period_s: float
    jitter: float
    held: dict[str, int] = field(default_factory=dict)
    reporter: PrefixReporter = field(default_factory=lambda: PrefixReporter(TOKENS_PER_BLOCK, SEED))

    def report(self) -> None:
        epoch, version = self.queue.prefix_position(self.replica_id)
        self.queue.report(KvReport(replica_id=self.replica_id, capacity=CAPACITY, tokens_per_block=TOKENS_PER_BLOCK,
                                   held=dict(self.held), prefix=self.reporter.report(epoch, version)))

    async def report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s * self.rng.uniform(1 - self.jitter, 1 + self.jitter))
            self.report()

    def start(self, ticket: str, blocks: int, prompt: list[int]) -> None:
        """The engine admitted the request: it holds its blocks, and its prompt's blocks are pinned."""
        self.held[ticket] = blocks
        for block in chain_hashes(prompt, TOKENS_PER_BLOCK, SEED):
            self.reporter.set(block, PINNED)

    def finish(self, ticket: str, tokens: list[int]) -> None:
        """The request ended: nothing held, its computed full blocks (prompt and answer) stay cached."""
        del self.held[ticket]
        for block in chain_hashes(tokens, TOKENS_PER_BLOCK, SEED):
            self.reporter.set(block, CACHED)


def ask_for(prompt: list[int]) -> PrefixAsk:
    return PrefixAsk(tuple(prompt_hashes(prompt, TOKENS_PER_BLOCK, SEED)), TOKENS_PER_BLOCK, SEED, len(prompt))


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    replica_id: str
    hit_blocks: int
    history_blocks: int  # blocks of the previous turn's prompt: what the replica holding it has at least


def simulate_conversations(seed: int, turn_s: tuple[float, float], conversations: int = 4, turns: int = 4,
                           replicas: int = 2, report_period_s: float = 0.5) -> list[Turn]:
    """`conversations` chats of `turns` turns over `replicas` replicas: each turn sends the whole history (its
    earlier prompts and answers) plus a new user message, decodes for a seeded time in `turn_s`, then the next turn
    comes at once (before the replica's next report, often). Returns every grant."""
    rng = random.Random(seed)

    async def main() -> list[Turn]:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_queued=64, clock=loop.time)
        fakes = {f"r{i}": FakeReplica(f"r{i}", queue, random.Random(rng.random()), report_period_s, 0.4)
                 for i in range(replicas)}
        for fake in fakes.values():
            fake.report()
        reporting = [asyncio.create_task(fake.report_loop()) for fake in fakes.values()]
        grants: list[Turn] = []

        async def conversation(c: int) -> None:
            history = [(97 * c + 7 * i) % 500 + 3 for i in range(400)]  # a context of its own per conversation
            previous_blocks = 0
            await asyncio.sleep(rng.uniform(0, 0.05))
            for t in range(turns):
                prompt = history + [(31 * c + 11 * t + i) % 500 + 3 for i in range(48)]
                answer = [(13 * c + 17 * t + i) % 500 + 3 for i in range(rng.randrange(20, 80))]
                ticket = f"c{c}-t{t}"
                ask = ask_for(prompt)
                need = blocks_needed(len(prompt) + 80, TOKENS_PER_BLOCK)
                replica_id = await queue.acquire(ticket, need, 30.0, ask=ask)
                grant = queue.grant_of(ticket)
                assert grant is not None
                grants.append(Turn(c, t, replica_id, grant.hit_blocks, previous_blocks))
                fakes[replica_id].start(ticket, grant.need, prompt)
                await asyncio.sleep(rng.uniform(*turn_s))
                fakes[replica_id].finish(ticket, prompt + answer)
                queue.release(ticket)
                history = prompt + answer
                previous_blocks = len(ask.hashes)

        await asyncio.gather(*(conversation(c) for c in range(conversations)))
        for task in reporting:
            task.cancel()
        return grants

    return run_simulated(main())


@pytest.mark.parametrize("turn_s", [(0.05, 0.2), (0.1, 0.3), (0.2, 0.8)], ids=["short", "medium", "long"])
def test_every_turn_returns_to_the_replica_holding_its_history_whatever_the_report_timing(
        turn_s: tuple[float, float]) -> None:
    """The exact rule of prefix routing, in 60 seeded interleavings per turn length: each conversation's later turns
    are granted where its first turn ran (that replica holds the history and has room, and two conversations per
    replica are always in balance), and routing counts at least the previous turn's prompt blocks as a hit there.
    A finished turn that still counted as a running sequence until its replica's next report sent turns away
    (about 1 seed in 40 of each range, before the fix in ReplicaKv.num_sequences)."""
    away = []
    for seed in range(60):
        grants = simulate_conversations(seed, turn_s)
        assert len(grants) == 16
        home = {g.conversation: g.replica_id for g in grants if g.turn == 0}
        assert sorted(home.values()) == ["r0", "r0", "r1", "r1"], (seed, home)  # first turns spread by free KV
        for g in grants:
            if g.turn > 0 and g.replica_id != home[g.conversation]:
                away.append((seed, g))
            elif g.turn > 0:
                assert g.hit_blocks >= g.history_blocks, (seed, g)
    assert not away, f"{len(away)} turns sent away from their history, e.g. {away[:3]}"
