"""The agentic benchmark's trace (bench/agentic.py): seeded multi-turn sessions whose context grows each turn, and the
device KV that makes their total KV a chosen multiple of it.

A session is one agent working on one task: a system prompt every session shares (the agent's instructions and
tools), the task, then turns; each turn re-sends the whole history (system prompt, every earlier turn's chunk and the
reply the server actually gave) plus a new chunk (a tool's output or the user's next message), so the context grows
by the chunk and the reply every turn. Between a reply and the next turn the agent thinks (a seeded exponential
time). Replies are sampled at temperature 1 with a seed of their own and a bounded random max_tokens, and may end
early on EOS. The plan fixes everything but the replies' tokens, which the run fills in from the server.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

FIRST_TOKEN_ID = 5  # ids below are the tiny tokenizer's special tokens (bench/capacity_layouts.py's rule)
TIER_MARGIN = 1.25  # the host tier (unless --tier sets it) holds the sessions' planned KV with this margin


@dataclass(frozen=True)
class Workload:
    """The trace's shape: sessions x turns, chunk and reply lengths (inclusive ranges), times, and the target ratio of
    the sessions' total KV to the replica's device KV."""

    sessions: int
    turns: int
    system_tokens: int  # shared by every session
    task_tokens: int  # each session's first chunk
    chunk_tokens: tuple[int, int]  # each later turn's new chunk (tool output / user message), uniform
    reply_tokens: tuple[int, int]  # max_tokens of each turn, uniform
    think_mean_s: float  # mean think time between a reply and the session's next turn (exponential)
    arrival_mean_s: float  # mean gap between sessions' starts (exponential; the first starts at 0)
    kv_ratio: float = 6.0  # sessions' total KV / the replica's device KV (the issue asks 4-8x)
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.system_tokens, self.task_tokens) < 1:
            raise ValueError(f"sessions, turns, system_tokens and task_tokens must be >= 1: {self}")
        for name in ("chunk_tokens", "reply_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {(low, high)}")
        if self.think_mean_s < 0 or self.arrival_mean_s < 0:
            raise ValueError(f"think_mean_s and arrival_mean_s must be >= 0: {self}")
        if not 1.0 <= self.kv_ratio <= 64.0:
            raise ValueError(f"kv_ratio must be in [1, 64] (the issue asks 4-8), got {self.kv_ratio}")

    def describe(self) -> str:
        return (f"{self.sessions} sessions x {self.turns} turns (seed {self.seed}); a {self.system_tokens}-token "
                f"system prompt shared by all, a {self.task_tokens}-token task, then per turn a new chunk of "
                f"{self.chunk_tokens[0]}-{self.chunk_tokens[1]} tokens on the whole history; replies max_tokens "
                f"{self.reply_tokens[0]}-{self.reply_tokens[1]} at temperature 1 (seeded, may end on EOS); think "
                f"time exponential, mean {self.think_mean_s:g}s; sessions start with exponential gaps, mean "
                f"{self.arrival_mean_s:g}s")


@dataclass(frozen=True)
class TurnPlan:
    """One turn of a session: the chunk it adds, its reply's bound and seed, and the think time before it is sent
    (after the previous turn's reply; for the first turn, after the session's start)."""

    chunk: tuple[int, ...]
    max_tokens: int
    seed: int
    think_s: float


@dataclass(frozen=True)
class SessionPlan:
    """One agent's session: its key (sent as OpenAI's prompt_cache_key), its start, and its turns."""

    key: str
    start_s: float
    turns: tuple[TurnPlan, ...]

    def max_context_tokens(self, system_tokens: int) -> int:
        """The session's history after its last reply if every reply runs to max_tokens: its KV at the end."""
        return system_tokens + sum(len(t.chunk) + t.max_tokens for t in self.turns)


@dataclass(frozen=True)
class Trace:
    """The whole plan: the shared system prompt and the sessions."""

    workload: Workload
    system: tuple[int, ...]
    sessions: tuple[SessionPlan, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def planned_kv_tokens(self) -> int:
        """The sessions' total KV at their ends, replies at max_tokens: every session's own history, and the shared
        system prompt once (a prefix cache holds it once)."""
        own = sum(s.max_context_tokens(len(self.system)) - len(self.system) for s in self.sessions)
        return own + len(self.system)

    @property
    def longest_request_tokens(self) -> int:
        """prompt + max_tokens of the largest request: the last turn of the longest session."""
        return max(s.max_context_tokens(len(self.system)) for s in self.sessions)


def make_trace(workload: Workload, vocab_size: int) -> Trace:
    """The seeded plan: the same workload and vocabulary give the same trace, token for token."""
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {FIRST_TOKEN_ID} (the special tokens), got {vocab_size}")
    rng = random.Random(workload.seed)

    def tokens(count: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count))

    def exponential(mean: float) -> float:
        return rng.expovariate(1.0 / mean) if mean > 0 else 0.0

    system = tokens(workload.system_tokens)
    sessions = []
    start = 0.0
    for index in range(workload.sessions):
        if index:
            start += exponential(workload.arrival_mean_s)
        turns = []
        for turn in range(workload.turns):
            chunk = tokens(workload.task_tokens if turn == 0 else rng.randint(*workload.chunk_tokens))
            turns.append(TurnPlan(chunk=chunk, max_tokens=rng.randint(*workload.reply_tokens),
                                  seed=rng.randrange(1 << 31), think_s=0.0 if turn == 0 else
                                  exponential(workload.think_mean_s)))
        sessions.append(SessionPlan(key=f"agent-{workload.seed}-{index}", start_s=start, turns=tuple(turns)))
    return Trace(workload, system, tuple(sessions))


def device_kv_tokens(trace: Trace, tokens_per_block: int) -> int:
    """The replica's device KV, in tokens, a whole number of logical blocks: the sessions' planned total KV over the
    workload's kv_ratio, but never less than two blocks more than the largest request (it must fit on its own)."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    wanted = trace.planned_kv_tokens / trace.workload.kv_ratio
    floor = trace.longest_request_tokens + 2 * tokens_per_block
    return math.ceil(max(wanted, floor) / tokens_per_block) * tokens_per_block


def kv_ratio(total_kv_tokens: int, device_kv_tokens: int) -> float:
    """Sessions' KV over the replica's device KV."""
    if device_kv_tokens <= 0:
        raise ValueError(f"the replica reported {device_kv_tokens} KV tokens: no device KV to compare with")
    return total_kv_tokens / device_kv_tokens
