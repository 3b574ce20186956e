"""Synthetic request traces (no downloads): a TraceShape, a seed and a count give the same list, bit for bit.

A trace is a stream of sessions. Sessions arrive by a Poisson process, or a bursty one (gamma inter-arrival gaps
with a coefficient of variation above 1). Each picks one of `num_prefix_groups` shared prefixes (a system prompt /
tool preamble of `shared_prefix_tokens`), and its first prompt (prefix included) is drawn from `input_tokens`.
A multi-turn session then runs `turns_per_session` turns: turn k + 1's prompt is turn k's prompt + turn k's answer
+ `new_tokens_per_turn` new user / tool tokens, sent `think_time_ms` after turn k's answer. A session ends early
when its next prompt would pass `input_tokens.maximum` (the context limit).

Prefix ids follow Mooncake's rule (dcpserve/simulator/trace.py): one hash id per 512-token block, equal ids = equal
content and everything before it. A group's prefix blocks have ids of their own that every session of the group repeats;
a later turn repeats its previous turn's whole blocks and gives new ids to the rest, including the block that was
partial in the previous turn (its content now goes on). Only whole blocks are ever shared.

Each request is its turn's whole prompt, as Dynamo's mocker reads session rows (AIPerf reads them as new tokens
only: dcpserve/simulator/trace.py). A session's first turn has `timestamp_ms`; later turns have `timestamp_ms` None and
`delay_ms` (the think time), so a closed-loop replay sends them when the previous answer is in, as AIPerf and
Dynamo do with `session_id` / `delay` rows. Every session's turns are contiguous, sessions in arrival order.

Randomness comes from one random.Random(seed) only: no global RNG, no numpy, no clock.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from dcpserve.simulator.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, expected_hash_ids, read_trace

ARRIVALS = ("poisson", "bursty")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Whole numbers: lognormal around `median` (sigma 0: always `median`), clipped to [minimum, maximum]."""

    median: int
    sigma: float
    minimum: int
    maximum: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma is {self.sigma}; give a finite sigma >= 0 (0: a constant)")
        if not 0 <= self.minimum <= self.median <= self.maximum:
            raise ValueError(f"LengthDist needs 0 <= minimum ({self.minimum}) <= median ({self.median}) <= maximum "
                             f"({self.maximum}); reorder them")
        if self.median < 1:
            raise ValueError(f"median is {self.median}; a lognormal's median is at least 1")

    @classmethod
    def constant(cls, value: int) -> LengthDist:
        return cls(median=value, sigma=0.0, minimum=value, maximum=value)

    def sample(self, rng: random.Random) -> int:
        """One draw (none from rng for a constant)."""
        if self.sigma == 0:
            return self.median
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(max(value, self.minimum), self.maximum)


@dataclass(frozen=True)
class TraceShape:
    """How a synthetic trace is generated."""

    name: str
    arrival: str  # "poisson", or "bursty": gamma gaps with coefficient of variation arrival_cv > 1
    rate_per_s: float  # mean arrival rate of sessions (a single-turn session is one request)
    input_tokens: LengthDist  # a session's first prompt, shared prefix included; maximum: the context limit
    output_tokens: LengthDist  # every turn's answer
    shared_prefix_tokens: int = 0  # a system prompt / tool preamble shared by the sessions of a group
    num_prefix_groups: int = 0  # how many different shared prefixes (0 exactly when shared_prefix_tokens is 0)
    turns_per_session: LengthDist | None = None  # None: single-turn requests without session_id
    think_time_ms: LengthDist | None = None  # wait between a turn's answer and the next turn (multi-turn only)
    new_tokens_per_turn: LengthDist | None = None  # user / tool tokens a later turn adds (multi-turn only)
    arrival_cv: float = 1.0  # coefficient of variation of session inter-arrival gaps: 1 for poisson
    max_tokens: int | None = None  # what each request asks for (None: exactly its answer's length)

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival is {self.arrival!r}; choose one of {', '.join(ARRIVALS)}")
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise ValueError(f"rate_per_s is {self.rate_per_s}; give a positive number of sessions per second")
        if self.arrival == "poisson" and self.arrival_cv != 1.0:
            raise ValueError(f"arrival_cv is {self.arrival_cv} with poisson arrivals (whose CV is 1); use "
                             f"arrival='bursty' for another CV")
        if self.arrival == "bursty" and not (math.isfinite(self.arrival_cv) and self.arrival_cv > 1):
            raise ValueError(f"arrival_cv is {self.arrival_cv}; bursty arrivals need a CV above 1")
        if self.shared_prefix_tokens < 0 or self.num_prefix_groups < 0 or (
                (self.shared_prefix_tokens == 0) != (self.num_prefix_groups == 0)):
            raise ValueError(f"shared_prefix_tokens {self.shared_prefix_tokens} and num_prefix_groups "
                             f"{self.num_prefix_groups}: give both positive, or both 0 for no shared prefix")
        if self.input_tokens.minimum <= self.shared_prefix_tokens:
            raise ValueError(f"input_tokens.minimum ({self.input_tokens.minimum}) must exceed shared_prefix_tokens "
                             f"({self.shared_prefix_tokens}): a prompt is its prefix and something more")
        if self.output_tokens.minimum < 1:
            raise ValueError(f"output_tokens.minimum is {self.output_tokens.minimum}; an answer has at least 1 "
                             f"token")
        if self.max_tokens is not None and self.max_tokens < self.output_tokens.maximum:
            raise ValueError(f"max_tokens ({self.max_tokens}) is below output_tokens.maximum "
                             f"({self.output_tokens.maximum}); an answer cannot pass what was asked for")
        multi_turn = (self.turns_per_session, self.think_time_ms, self.new_tokens_per_turn)
        if any(dist is None for dist in multi_turn) != all(dist is None for dist in multi_turn):
            raise ValueError("turns_per_session, think_time_ms and new_tokens_per_turn go together: give all three "
                             "(multi-turn sessions) or none (single-turn requests)")
        if self.turns_per_session is not None and self.turns_per_session.minimum < 1:
            raise ValueError(f"turns_per_session.minimum is {self.turns_per_session.minimum}; a session has at "
                             f"least 1 turn")

    def multi_turn(self) -> tuple[LengthDist, LengthDist, LengthDist] | None:
        """(turns_per_session, think_time_ms, new_tokens_per_turn), or None for single-turn requests."""
        if self.turns_per_session is None or self.think_time_ms is None or self.new_tokens_per_turn is None:
            return None
        return self.turns_per_session, self.think_time_ms, self.new_tokens_per_turn


PRESETS: dict[str, TraceShape] = {
    # Shaped like the agentic coding trace behind vLLM's DCP blog post of 2026-07-27 (median input ~67k tokens,
    # median output ~400): coding-agent sessions of many turns (median 20, up to 300) whose prompts grow each turn
    # by the previous answer and a tool result (median 1k tokens, heavy tail to 40k), 0.1-300 s of tool time
    # between turns (median 2 s), on top of a 12k-token tool / system preamble shared by each of 4 groups; first
    # prompts median 26k; a session stops at the 200k context limit. Bursty session arrivals (CV 2). Over 10,000
    # requests (seed 0): input p50 ~68k, p90 ~148k, p99 ~192k; output p50 ~400; 95% of hash blocks seen before.
    "agentic": TraceShape(
        name="agentic",
        arrival="bursty",
        arrival_cv=2.0,
        rate_per_s=0.1,
        input_tokens=LengthDist(median=26_000, sigma=0.4, minimum=13_000, maximum=200_000),
        output_tokens=LengthDist(median=400, sigma=1.0, minimum=1, maximum=16_384),
        shared_prefix_tokens=12_288,
        num_prefix_groups=4,
        turns_per_session=LengthDist(median=20, sigma=0.9, minimum=1, maximum=300),
        think_time_ms=LengthDist(median=2_000, sigma=1.2, minimum=100, maximum=300_000),
        new_tokens_per_turn=LengthDist(median=1_000, sigma=1.2, minimum=20, maximum=40_000),
    ),
    # Short chat: first prompts median 1k tokens (a 512-token system prompt, one of 8, included), answers median
    # 250, 1-5 turns mostly (median 2), each adding a user message of median 120 tokens after ~20 s of reading and
    # typing. Poisson sessions. Over 10,000 requests (seed 0): input p50 ~1.6k, output p50 ~250.
    "chat": TraceShape(
        name="chat",
        arrival="poisson",
        rate_per_s=1.0,
        input_tokens=LengthDist(median=1_000, sigma=0.5, minimum=520, maximum=32_768),
        output_tokens=LengthDist(median=250, sigma=0.8, minimum=1, maximum=4_096),
        shared_prefix_tokens=512,
        num_prefix_groups=8,
        turns_per_session=LengthDist(median=2, sigma=0.7, minimum=1, maximum=16),
        think_time_ms=LengthDist(median=20_000, sigma=0.8, minimum=1_000, maximum=600_000),
        new_tokens_per_turn=LengthDist(median=120, sigma=0.9, minimum=5, maximum=8_192),
    ),
    # Fixed shapes of published comparisons (input-output tokens): constant lengths, single turns, no sharing,
    # Poisson arrivals at a nominal rate; scale it with dataclasses.replace(shape, rate_per_s=...).
    "1k-1k": TraceShape(name="1k-1k", arrival="poisson", rate_per_s=8.0,
                        input_tokens=LengthDist.constant(1024), output_tokens=LengthDist.constant(1024)),
    "8k-1k": TraceShape(name="8k-1k", arrival="poisson", rate_per_s=2.0,
                        input_tokens=LengthDist.constant(8192), output_tokens=LengthDist.constant(1024)),
    "8k-8k": TraceShape(name="8k-8k", arrival="poisson", rate_per_s=0.5,
                        input_tokens=LengthDist.constant(8192), output_tokens=LengthDist.constant(8192)),
}


def preset(name: str) -> TraceShape:
    """The preset of that name; ValueError naming the choices."""
    if name not in PRESETS:
        raise ValueError(f"no trace preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def _gap_ms(shape: TraceShape, rng: random.Random) -> float:
    """The wait from one session's arrival to the next one's."""
    if shape.arrival == "poisson":
        return rng.expovariate(shape.rate_per_s) * 1000.0
    gamma_shape = 1.0 / shape.arrival_cv**2  # gamma's CV is 1 / sqrt(shape); mean shape * scale = 1 / rate
    return rng.gammavariate(gamma_shape, 1.0 / (shape.rate_per_s * gamma_shape)) * 1000.0


def generate(shape: TraceShape, num_requests: int, seed: int) -> list[TraceRequest]:
    """num_requests requests of that shape (the last session cut short if need be); the same seed, the same list."""
    if num_requests < 1:
        raise ValueError(f"num_requests is {num_requests}; generate at least 1 request")
    rng = random.Random(seed)
    multi_turn = shape.multi_turn()
    block = MOONCAKE_BLOCK_TOKENS
    prefix_blocks = shape.shared_prefix_tokens // block  # only whole blocks are shared
    next_id = shape.num_prefix_groups * prefix_blocks  # ids below belong to the groups' prefixes
    requests: list[TraceRequest] = []
    clock_ms = 0.0
    session = 0
    while len(requests) < num_requests:
        if session:
            clock_ms += _gap_ms(shape, rng)
        group = rng.randrange(shape.num_prefix_groups) if shape.num_prefix_groups else 0
        turns = multi_turn[0].sample(rng) if multi_turn is not None else 1
        session_id = f"{shape.name}-{session}" if multi_turn is not None else None
        input_length = shape.input_tokens.sample(rng)
        ids = list(range(group * prefix_blocks, (group + 1) * prefix_blocks))
        fresh = expected_hash_ids(input_length) - len(ids)
        ids.extend(range(next_id, next_id + fresh))
        next_id += fresh
        output_length = 0
        delay_ms: float | None = None
        for turn in range(turns):
            if turn and multi_turn is not None:  # turn > 0 only in multi-turn sessions; None: for mypy
                delay_ms = float(multi_turn[1].sample(rng))
                grown = input_length + output_length + multi_turn[2].sample(rng)
                if grown > shape.input_tokens.maximum:
                    break  # the context limit: the session ends here
                kept = input_length // block  # whole blocks of the previous prompt; its partial block goes on
                del ids[kept:]
                input_length = grown
                fresh = expected_hash_ids(input_length) - kept
                ids.extend(range(next_id, next_id + fresh))
                next_id += fresh
            output_length = shape.output_tokens.sample(rng)
            requests.append(TraceRequest(
                timestamp_ms=None if turn else round(clock_ms, 3),
                input_length=input_length,
                output_length=output_length,
                hash_ids=tuple(ids),
                session_id=session_id,
                delay_ms=delay_ms,
                max_tokens=shape.max_tokens,
            ))
            if len(requests) == num_requests:
                break
        session += 1
    return requests


def mix(traces: list[list[TraceRequest]]) -> list[TraceRequest]:
    """One trace of several, each keeping its own timing: their sessions merged by arrival (a session's turns stay
    together, ties in the order given), the hash ids of each trace after the last one's so that no block is shared
    across them. Session ids must differ between the traces (generated ones carry their preset's name)."""
    sessions: list[tuple[float, int, list[TraceRequest]]] = []
    offset = 0
    seen: dict[str, int] = {}
    for index, trace in enumerate(traces):
        top = -1
        for request in trace:
            if request.session_id is not None and seen.setdefault(request.session_id, index) != index:
                raise ValueError(f"session {request.session_id!r} is in traces {seen[request.session_id]} and "
                                 f"{index}; mix traces whose session ids differ")
            shifted = replace(request, hash_ids=tuple(i + offset for i in request.hash_ids))
            top = max(top, *shifted.hash_ids) if shifted.hash_ids else top
            if request.timestamp_ms is not None or not sessions:
                sessions.append((request.timestamp_ms or 0.0, index, [shifted]))
            else:
                sessions[-1][2].append(shifted)
        offset = top + 1 if top >= 0 else offset
    sessions.sort(key=lambda session: (session[0], session[1]))
    return [request for _, _, turns in sessions for request in turns]


def parse_preset_or_path(value: str, num_requests: int, seed: int, rate_per_s: float | None = None,
                         block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """A trace file's requests (read_trace), or num_requests generated from the preset of that name (a file of
    that name wins), or a mix of presets joined by "+" ("chat+agentic": `mix` of num_requests split evenly, the
    first taking the remainder, the k-th generated with seed + k).

    rate_per_s, when given, replaces the preset's session arrival rate (of every preset of a mix); a trace file
    carries its own timing. block_tokens: the tokens of a file's hash id (Mooncake's 512; AIPerf's converters and
    AgentX write 64); presets are generated in 512-token blocks.
    """
    path = Path(value)
    if path.is_file():
        if rate_per_s is not None:
            raise ValueError(f"a rate ({rate_per_s}/s) was given with the trace file {value}, whose timestamps are "
                             f"its timing; drop the rate, or name a preset ({', '.join(PRESETS)})")
        return read_trace(path, block_tokens)
    if block_tokens != MOONCAKE_BLOCK_TOKENS:
        raise ValueError(f"a trace block size of {block_tokens} tokens was given with {value!r}, which is no file: "
                         f"presets are generated in {MOONCAKE_BLOCK_TOKENS}-token blocks; drop the block size or "
                         f"give a trace file")
    names = value.split("+")
    if len(names) > 1 and all(name in PRESETS for name in names):
        if len(set(names)) < len(names):
            raise ValueError(f"{value!r} names a preset twice; a mix takes each preset once")
        if num_requests < len(names):
            raise ValueError(f"{num_requests} requests cannot be split over {len(names)} presets; ask for at "
                             f"least {len(names)}")
        share, extra = divmod(num_requests, len(names))
        return mix([parse_preset_or_path(name, share + (extra if k == 0 else 0), seed + k, rate_per_s)
                    for k, name in enumerate(names)])
    if value in PRESETS:
        shape = PRESETS[value] if rate_per_s is None else replace(PRESETS[value], rate_per_s=rate_per_s)
        return generate(shape, num_requests, seed)
    what = "is a directory, not a trace file" if path.exists() else "is no file"
    raise ValueError(f"{value!r} {what} and no preset; give the path of a Mooncake JSONL trace, one of "
                     f"{', '.join(PRESETS)}, or presets joined by + (chat+agentic)")
