"""Request traces in the Mooncake JSONL format: read (every line checked first), write, summarize.

The format is the one of Mooncake's FAST'25 traces (kvcache-ai/Mooncake `FAST25-release/README.md`,
`FAST25-release/traces/*.jsonl`), as NVIDIA AIPerf (ai-dynamo/aiperf `src/aiperf/dataset/loader/models.py`
`MooncakeTrace`, `.../loader/mooncake_trace.py`, `src/aiperf/timing/strategies/fixed_schedule.py`) and Dynamo's
mocker replay (ai-dynamo/dynamo `lib/data-gen/src/mooncake.rs` `MooncakeRow`, `lib/mocker/src/loadgen/trace.rs`
`Trace::from_mooncake`, `lib/mocker/src/loadgen/driver.rs`) read it. One JSON object per line:

- `timestamp`: arrival in ms since the trace start (int or float).
- `input_length`, `output_length`: prompt and answer tokens.
- `hash_ids`: one id per MOONCAKE_BLOCK_TOKENS-token block of the prompt, the last block possibly partial, so
  ceil(input_length / 512) ids; equal leading ids are a shared prefix (an id names its block and everything before).
- `session_id` (AIPerf and Dynamo): rows sharing it are the turns of one closed-loop session, in file order; a row
  without one is a session of its own. A later turn is sent only after the previous turn's answer is complete.
- `delay` (AIPerf and Dynamo): ms to wait after the previous turn's answer before sending a later turn. A later turn
  with neither `delay` nor `timestamp` goes at once (both tools), and is read here as `delay` 0.

Understood besides: Dynamo's aliases `input_tokens`, `output_tokens`, `created_time` (= timestamp) and `delay_ms`;
and `max_tokens`, an extension of ours (what the client asked for; the answer is `output_length` <= it; absent:
exactly `output_length`), which AIPerf and Dynamo ignore. Every other field is ignored (AIPerf's `text_input`,
`messages` and `payload` rows carry no token counts, so they are refused for their missing `input_length`).

Where the tools differ, and what is done here:
- The whole prompt. Each row's `input_length` / `hash_ids` is that turn's whole prompt, earlier turns and answers
  included: Dynamo's default (`PromptMode::Full`). AIPerf by default reads a synthesized session row as the new
  user tokens only and accumulates history (`deltas_without_responses`, its
  docs/reference/conversation-context-mode.md), so a multi-turn file written here counts its context twice there.
- Order. AIPerf sorts sessions by their first turn's timestamp (fixed_schedule.py) and Dynamo keeps a heap by
  ready time, so an unsorted file is sorted here too, stably by session start; a session's turns keep file order.
  Timestamps going backwards inside one session are refused (Dynamo refuses the negative delay they imply).
- A session's first turn needs `timestamp` (AIPerf's fixed schedule and Dynamo's trace mode both refuse one
  without) and no `delay` but 0 (Dynamo refuses one). A later turn may carry a `timestamp`: AIPerf sends it then
  (or when the previous answer arrives, if later), Dynamo's mocker waits the timestamp difference to the previous
  turn after the answer. One with both `timestamp` and `delay` is refused: AIPerf would use the timestamp, Dynamo
  the delay.
- Strictness. `hash_ids` and `output_length` are required (Dynamo requires both; the simulator's prefix cache and
  decode need them), and the id count must be exactly ceil(input_length / block_tokens) (Mooncake's traces hold
  it; Dynamo's mocker cuts input_length down to what too few ids cover, and ignores extra ones).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash_id block in Mooncake's traces

# File field -> the canonical name it stands for (Dynamo's MooncakeRow serde aliases).
_ALIASES = {"input_tokens": "input_length", "output_tokens": "output_length", "created_time": "timestamp",
            "delay_ms": "delay"}
_PROMPT_FIELDS_WITHOUT_COUNTS = ("text_input", "messages", "payload")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float | None  # arrival since the trace start; None for a later session turn that waits delay_ms
    input_length: int  # the whole prompt, earlier turns and answers included
    output_length: int  # tokens of the answer
    hash_ids: tuple[int, ...]  # prefix blocks, MOONCAKE_BLOCK_TOKENS tokens each (the last may be partial)
    session_id: str | None = None  # None: a session of its own
    delay_ms: float | None = None  # for a later turn of a session: the wait after the previous turn's answer
    max_tokens: int | None = None  # what the client asked for (None: output_length); our extension of the format


class TraceError(ValueError):
    """A trace file the simulator cannot replay; the message is "FILE:LINE: what is wrong; how to fix"."""


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Nearest-rank percentiles and mean of a sample."""

    p50: float
    p90: float
    p99: float
    mean: float
    maximum: float


@dataclass(frozen=True, slots=True)
class TraceStats:
    """What a trace holds, as trace_stats() counts it."""

    count: int  # requests
    sessions: int  # a row without session_id is a session of its own
    duration_ms: float  # first to last known arrival (session starts; later turns' times depend on the replay)
    input_tokens: Percentiles
    output_tokens: Percentiles
    turns_per_session: Percentiles
    hash_blocks: int  # hash ids over all requests
    prefix_sharing_ratio: float  # fraction of hash_ids already seen in an earlier request (list order) or earlier


def expected_hash_ids(input_length: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> int:
    """How many hash_ids a prompt of input_length tokens has: one per block, the last possibly partial."""
    return -(-input_length // block_tokens)


def _request_problem(request: TraceRequest, block_tokens: int) -> str | None:
    """What is wrong with one request on its own (None: nothing); shared by read_trace and write_trace."""
    if request.input_length < 1:
        return f"'input_length' is {request.input_length}; a prompt has at least 1 token"
    if request.output_length < 1:
        return f"'output_length' is {request.output_length}; an answer has at least 1 token"
    expected = expected_hash_ids(request.input_length, block_tokens)
    if len(request.hash_ids) != expected:
        return (f"'hash_ids' has {len(request.hash_ids)} ids for input_length {request.input_length}; expected "
                f"ceil({request.input_length} / {block_tokens}) = {expected}, one per {block_tokens}-token block "
                f"(the last may be partial)")
    if any(hash_id < 0 for hash_id in request.hash_ids):
        return "'hash_ids' holds a negative id; ids are non-negative integers (Dynamo reads them as u64)"
    for name, value in (("timestamp", request.timestamp_ms), ("delay", request.delay_ms)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            return f"'{name}' is {value}; give a finite number of ms >= 0"
    if request.max_tokens is not None and request.max_tokens < request.output_length:
        return (f"'max_tokens' {request.max_tokens} is below output_length {request.output_length}; an answer "
                f"cannot pass what the client asked for: raise max_tokens or drop it")
    return None


class _SessionCheck:
    """The per-session rules: a first turn starts at its timestamp, later turns' timestamps never go back."""

    def __init__(self) -> None:
        self._last_timestamp: dict[str, float | None] = {}  # session -> its latest known timestamp
        self.start_ms: dict[str, float] = {}  # session -> its first turn's timestamp

    def start_of(self, request: TraceRequest) -> float:
        """When the session of a checked request starts."""
        if request.session_id is not None:
            return self.start_ms[request.session_id]
        if request.timestamp_ms is None:
            raise RuntimeError(f"start_of({request}) before problem() checked it")
        return request.timestamp_ms

    def problem(self, request: TraceRequest) -> str | None:
        session = request.session_id
        if session is None or session not in self._last_timestamp:
            where = "a row without session_id" if session is None else f"the first turn of session {session!r}"
            if request.timestamp_ms is None:
                return f"missing 'timestamp'; {where} needs one, its arrival in ms since the trace start"
            if request.delay_ms is not None:
                return f"'delay' on {where}; a session starts at its timestamp: drop the delay"
            if session is not None:
                self._last_timestamp[session] = self.start_ms[session] = request.timestamp_ms
            return None
        if request.timestamp_ms is not None and request.delay_ms is not None:
            return (f"both 'timestamp' and 'delay' on a later turn of session {session!r}: AIPerf sends at the "
                    f"timestamp, Dynamo's mocker waits the delay; keep one")
        previous = self._last_timestamp[session]
        if request.timestamp_ms is not None:
            if previous is not None and request.timestamp_ms < previous:
                return (f"'timestamp' {request.timestamp_ms:g} goes back within session {session!r} (an earlier "
                        f"turn has {previous:g}); order the session's turns by time")
            self._last_timestamp[session] = request.timestamp_ms
        return None


def _get(row: dict[str, object], name: str, fail: _Fail) -> object | None:
    """The value of a field under its name or its Dynamo alias (None when absent)."""
    aliases = [alias for alias, canonical in _ALIASES.items() if canonical == name and alias in row]
    if name in row and aliases:
        fail(f"both '{name}' and its alias '{aliases[0]}' are set; keep one")
    if name in row:
        return row[name]
    return row[aliases[0]] if aliases else None


class _Fail:
    """Raises TraceError at one line of one file."""

    def __init__(self, path: str, line: int) -> None:
        self.path = path
        self.line = line

    def __call__(self, message: str) -> NoReturn:
        raise TraceError(f"{self.path}:{self.line}: {message}")


def _optional_int(row: dict[str, object], name: str, fail: _Fail) -> int | None:
    value = _get(row, name, fail)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        fail(f"'{name}' is {json.dumps(value)}; it must be an integer")
    return value


def _required_int(row: dict[str, object], name: str, fail: _Fail) -> int:
    value = _optional_int(row, name, fail)
    if value is None:
        hint = ""
        if name == "input_length" and any(field in row for field in _PROMPT_FIELDS_WITHOUT_COUNTS):
            hint = " (text_input / messages / payload rows carry no token counts the simulator can use)"
        fail(f"missing '{name}'{hint}; every request needs input_length, output_length and hash_ids")
    return value


def _milliseconds(row: dict[str, object], name: str, fail: _Fail) -> float | None:
    value = _get(row, name, fail)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(f"'{name}' is {json.dumps(value)}; it must be a number of ms")
    return float(value)


def _parse_row(text: str, block_tokens: int, fail: _Fail) -> TraceRequest:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        fail(f"not valid JSON ({error.msg} at column {error.colno}); each line is one JSON object")
    if not isinstance(row, dict):
        fail(f"a JSON {type(row).__name__}, not an object; each line is one JSON object like "
             '{"timestamp": 0, "input_length": 600, "output_length": 50, "hash_ids": [0, 1]}')
    input_length = _required_int(row, "input_length", fail)
    output_length = _required_int(row, "output_length", fail)
    hash_ids = _get(row, "hash_ids", fail)
    if hash_ids is None:
        fail(f"missing 'hash_ids'; give one id per {block_tokens}-token block of the prompt")
    if not isinstance(hash_ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hash_ids):
        fail(f"'hash_ids' is {json.dumps(hash_ids)[:80]}; it must be a list of integers, one per block")
    session_id = _get(row, "session_id", fail)
    if session_id is not None and not isinstance(session_id, str):
        fail(f"'session_id' is {json.dumps(session_id)}; it must be a string")
    return TraceRequest(
        timestamp_ms=_milliseconds(row, "timestamp", fail),
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(hash_ids),
        session_id=session_id,
        delay_ms=_milliseconds(row, "delay", fail),
        max_tokens=_optional_int(row, "max_tokens", fail),
    )


def read_trace(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Every request of a Mooncake JSONL trace, sorted stably by session start; TraceError at the first bad line.

    Blank lines are skipped. A later session turn with neither delay nor timestamp is returned with delay_ms 0; a
    first turn's `delay: 0` is dropped.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens is {block_tokens}; a hash block holds at least 1 token")
    name = str(path)
    sessions = _SessionCheck()
    requests: list[TraceRequest] = []
    with open(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            fail = _Fail(name, line_number)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                fail("not UTF-8 text; a trace is JSON lines in UTF-8")
            if not text.strip():
                continue
            request = _parse_row(text, block_tokens, fail)
            first_of_session = request.session_id is None or request.session_id not in sessions.start_ms
            if request.delay_ms == 0 and first_of_session:
                request = replace(request, delay_ms=None)  # Dynamo's first-turn `delay: 0`
            if request.delay_ms is None and request.timestamp_ms is None and not first_of_session:
                request = replace(request, delay_ms=0.0)  # both tools send it as soon as the answer is in
            problem = _request_problem(request, block_tokens) or sessions.problem(request)
            if problem is not None:
                fail(problem)
            requests.append(request)
    if not requests:
        raise TraceError(f"{name}:1: the trace holds no requests; give one JSON object per line")
    return sorted(requests, key=sessions.start_of)  # stable: a session's turns keep their order


def _json_number(value: float) -> float | int:
    """Whole numbers of ms as integers, the way Mooncake's traces write them."""
    return int(value) if float(value).is_integer() else value


def write_trace(path: str | Path, requests: Iterable[TraceRequest],
                block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
    """Writes requests as Mooncake JSONL; ValueError (naming the request) for one read_trace would refuse."""
    sessions = _SessionCheck()
    lines = []
    for index, request in enumerate(requests):
        problem = _request_problem(request, block_tokens) or sessions.problem(request)
        if problem is not None:
            raise ValueError(f"request {index} (session {request.session_id}): {problem}")
        row: dict[str, object] = {}
        if request.timestamp_ms is not None:
            row["timestamp"] = _json_number(request.timestamp_ms)
        if request.session_id is not None:
            row["session_id"] = request.session_id
        if request.delay_ms is not None:
            row["delay"] = _json_number(request.delay_ms)
        row["input_length"] = request.input_length
        row["output_length"] = request.output_length
        row["hash_ids"] = list(request.hash_ids)
        if request.max_tokens is not None:
            row["max_tokens"] = request.max_tokens
        lines.append(json.dumps(row) + "\n")
    with open(path, "w", encoding="utf-8") as file:
        file.writelines(lines)


def _percentiles(values: Sequence[float]) -> Percentiles:
    ordered = sorted(float(value) for value in values)

    def rank(quantile: float) -> float:
        return ordered[max(0, math.ceil(quantile * len(ordered)) - 1)]

    return Percentiles(p50=rank(0.50), p90=rank(0.90), p99=rank(0.99), mean=sum(ordered) / len(ordered),
                       maximum=ordered[-1])


def trace_stats(requests: Sequence[TraceRequest]) -> TraceStats:
    """Counts, length percentiles, sessions and prefix sharing of a trace (ValueError when it is empty)."""
    if not requests:
        raise ValueError("trace_stats of no requests; give a trace with at least one request")
    turns: dict[str, int] = {}
    single_sessions = 0
    seen: set[int] = set()
    hash_blocks = 0
    shared_blocks = 0
    for request in requests:
        if request.session_id is None:
            single_sessions += 1
        else:
            turns[request.session_id] = turns.get(request.session_id, 0) + 1
        before = len(seen)
        seen.update(request.hash_ids)
        hash_blocks += len(request.hash_ids)
        shared_blocks += len(request.hash_ids) - (len(seen) - before)
    timestamps = [r.timestamp_ms for r in requests if r.timestamp_ms is not None]
    return TraceStats(
        count=len(requests),
        sessions=len(turns) + single_sessions,
        duration_ms=max(timestamps) - min(timestamps) if timestamps else 0.0,
        input_tokens=_percentiles([r.input_length for r in requests]),
        output_tokens=_percentiles([r.output_length for r in requests]),
        turns_per_session=_percentiles(list(turns.values()) + [1] * single_sessions),
        hash_blocks=hash_blocks,
        prefix_sharing_ratio=shared_blocks / hash_blocks if hash_blocks else 0.0,
    )
