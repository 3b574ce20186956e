"""What a simulation measures, exactly and in simulated time: per-request TTFT, every inter-token gap, concurrency as
a time integral, refusals by reason, and periodic samples of KV use and replicas; then `summary()`.

Exact, not sampled, wherever the number is a percentile or a mean a user compares against a benchmark: TTFT and ITL
percentiles come from every request's and every gap's value (gaps are counted per distinct value: they are sums
of step durations, so there are far fewer distinct values than tokens), and mean concurrency is the integral of the
number of sequences the replicas hold over time divided by the time. KV utilization and replicas over time are
samples every sample_period_s.

Goodput (`goodput`): the requests that met a latency target on both TTFT and their own mean inter-token latency,
per second and per GPU-second, computed from the records after the run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of sorted values, by linear interpolation between closest ranks (numpy's
    default); 0.0 for no values."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def counted_percentile(counts: Counter[float], q: float) -> float:
    """The q-th percentile of values given as value -> count (the lower closest rank: values are step sums)."""
    total = sum(counts.values())
    if total == 0:
        return 0.0
    target = (total - 1) * q / 100.0
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen > target:
            return value
    return max(counts)


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": percentile(ordered, 50), "p90": percentile(ordered, 90), "p99": percentile(ordered, 99)}


@dataclass(slots=True)
class RequestRecord:
    """One request as its client saw it."""

    arrival: float
    input_length: int
    admitted_at: float | None = None  # when a replica accepted it
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_output_tokens: int = 0
    finished_at: float | None = None
    outcome: str = "pending"  # "finished", or the refusal's kind (queue_full, queue_timeout, never_fits, ...)
    session_id: str | None = None
    replica_id: str | None = None  # the replica that served it
    turn: int = 0  # its index in its session: 0 the first turn (or a request of no session), 1.. a later one


def mean_itl_s(record: RequestRecord) -> float | None:
    """The request's own mean inter-token latency, (last_token_at - first_token_at) / (num_output_tokens - 1); 0.0
    for a request of one token (it has no gap, so it meets any ITL target), None for one with no token."""
    if record.first_token_at is None or record.last_token_at is None or record.num_output_tokens < 1:
        return None
    if record.num_output_tokens == 1:
        return 0.0
    return (record.last_token_at - record.first_token_at) / (record.num_output_tokens - 1)


def meets_slo(record: RequestRecord, ttft_target_s: float, itl_target_s: float) -> bool:
    """Whether the request finished with TTFT <= ttft_target_s and mean ITL <= itl_target_s (a value exactly at its
    target meets it). A refused or timed-out request never does."""
    if record.outcome != "finished" or record.first_token_at is None:
        return False
    itl = mean_itl_s(record)
    return record.first_token_at - record.arrival <= ttft_target_s and itl is not None and itl <= itl_target_s


def span_s(records: Iterable[RequestRecord]) -> float:
    """From the first arrival to the last request's end, finished or refused (0.0 for none). The summary's
    duration_s ends at the last finished request instead, so it leaves out a tail of refusals; a rate of requests
    that met a target is taken over the whole of the run that was asked of the replicas."""
    arrivals, ends = [], []
    for record in records:
        arrivals.append(record.arrival)
        if record.finished_at is not None:
            ends.append(record.finished_at)
    return max(ends) - min(arrivals) if ends else 0.0


@dataclass(frozen=True)
class Goodput:
    """The requests of a run that met both latency targets, counted and as rates."""

    ttft_target_s: float
    itl_target_s: float  # on each request's own mean inter-token latency (mean_itl_s)
    requests: int  # every request sent, refused ones included
    met: int  # finished and met both targets (meets_slo)
    requests_per_s: float  # met per second of the run (span_s)
    requests_per_s_per_gpu: float  # met per GPU-second the replicas were up (summary's gpu_seconds)

    @property
    def fraction_met(self) -> float:
        """Of all requests sent, the share that met both targets (0.0 for no requests)."""
        return self.met / self.requests if self.requests else 0.0


def goodput(records: Iterable[RequestRecord], duration_s: float, gpu_seconds: float, ttft_target_s: float,
            itl_target_s: float) -> Goodput:
    """Goodput of a run from its records (Recorder.records' values), its duration (span_s of the records) and its
    GPU-seconds (the summary's gpu_seconds): the requests meets_slo accepts, per second and per GPU-second."""
    for name, value in (("ttft_target_s", ttft_target_s), ("itl_target_s", itl_target_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    for name, value in (("duration_s", duration_s), ("gpu_seconds", gpu_seconds)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    records = list(records)
    met = sum(meets_slo(record, ttft_target_s, itl_target_s) for record in records)
    # A run of no time (every request refused at its arrival) met nothing: rates of 0, as the summary's are.
    return Goodput(ttft_target_s=ttft_target_s, itl_target_s=itl_target_s, requests=len(records), met=met,
                   requests_per_s=met / duration_s if duration_s else 0.0,
                   requests_per_s_per_gpu=met / gpu_seconds if gpu_seconds else 0.0)


def split_turns(records: Iterable[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """The records by turn: "first" (a session's first turn, and requests of no session) and "later"."""
    turns: dict[str, list[RequestRecord]] = {"first": [], "later": []}
    for record in records:
        turns["later" if record.turn else "first"].append(record)
    return turns


def turn_summary(records: list[RequestRecord]) -> dict[str, Any]:
    """Requests, finished and TTFT percentiles of one part of split_turns."""
    finished = [r for r in records if r.outcome == "finished"]
    return {"requests": len(records), "finished": len(finished),
            "ttft_s": _quantiles([r.first_token_at - r.arrival for r in finished if r.first_token_at is not None])}


def goodput_by_turn(records: Iterable[RequestRecord], duration_s: float, gpu_seconds: float, ttft_target_s: float,
                    itl_target_s: float) -> dict[str, Goodput]:
    """`goodput` of the first and the later turns apart (split_turns), over the same run's duration and GPUs."""
    return {name: goodput(part, duration_s, gpu_seconds, ttft_target_s, itl_target_s)
            for name, part in split_turns(records).items()}


@dataclass
class Recorder:
    """Collects a simulation's measurements as they happen."""

    records: dict[str, RequestRecord] = field(default_factory=dict)
    itl_counts: Counter[float] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    num_output_tokens: int = 0
    # Concurrency: sequences the replicas hold (accepted, not finished), integrated over time.
    sequences: int = 0
    peak_sequences: int = 0
    _sequence_seconds: float = 0.0
    _last_change: float = 0.0
    first_arrival: float | None = None
    last_finish: float = 0.0
    # Periodic samples: (time, replicas, KV utilization of the replicas' pools, sequences, queued).
    samples: list[tuple[float, int, float, int, int]] = field(default_factory=list)
    gpu_seconds: float = 0.0  # replicas' GPUs times the time they were up (autoscaling changes it)
    _gpus: int = 0
    # The steady window's throughput and concurrency (load_ends): before the trace runs out of sessions to start.
    steady: dict[str, float] | None = None
    load_ended: bool = False
    _gpus_since: float = 0.0

    def arrived(self, ticket: str, now: float, input_length: int, session_id: str | None = None,
                turn: int = 0) -> RequestRecord:
        record = self.records[ticket] = RequestRecord(now, input_length, session_id=session_id, turn=turn)
        if self.first_arrival is None:
            self.first_arrival = now
        return record

    def _concurrency(self, now: float, change: int) -> None:
        self._sequence_seconds += self.sequences * (now - self._last_change)
        self._last_change = now
        self.sequences += change
        self.peak_sequences = max(self.peak_sequences, self.sequences)

    def accepted(self, record: RequestRecord, now: float) -> None:
        record.admitted_at = now
        self._concurrency(now, +1)

    def token(self, record: RequestRecord, now: float) -> None:
        if record.first_token_at is None:
            record.first_token_at = now
        else:
            self.itl_counts[now - record.last_token_at] += 1  # type: ignore[operator]  # set with the first token
        record.last_token_at = now
        record.num_output_tokens += 1
        self.num_output_tokens += 1

    def lane_tokens(self, count: int, gap_s: float) -> None:
        """`count` requests of a replica's decode lane each sampled a token, gap_s after their previous one (what
        `token` counts, without their records: `lane_left` brings those up to date)."""
        self.itl_counts[gap_s] += count
        self.num_output_tokens += count

    @staticmethod
    def lane_left(record: RequestRecord, count: int, last_token_at: float) -> None:
        """The request left its replica's decode lane having sampled `count` tokens there, the last at
        last_token_at (each one already counted by lane_tokens)."""
        if count:
            record.num_output_tokens += count
            record.last_token_at = last_token_at

    def finished(self, record: RequestRecord, now: float, held_kv: bool) -> None:
        """The request ended after a replica accepted it (held_kv) or without ever being accepted."""
        if held_kv:
            self._concurrency(now, -1)
        record.finished_at = now
        record.outcome = "finished"
        self.last_finish = max(self.last_finish, now)

    def timed_out(self, record: RequestRecord, now: float) -> None:
        """An accepted request ran past request_timeout_s (its KV was freed)."""
        self._concurrency(now, -1)
        self.refuse(record, "request_timeout", now)

    def refuse(self, record: RequestRecord, kind: str, now: float) -> None:
        record.outcome = kind
        record.finished_at = now
        self.refused[kind] += 1

    def gpus_changed(self, now: float, gpus: int) -> None:
        """The GPUs of the replicas up changed to `gpus` (a replica started or stopped)."""
        self.gpu_seconds += self._gpus * (now - self._gpus_since)
        self._gpus, self._gpus_since = gpus, now

    def load_ends(self, now: float) -> None:
        """The trace has no more sessions to start (the first closed-loop client found none, or the last open-loop
        session arrived): the steady window, from the first arrival to now, ends here (first call only)."""
        if self.load_ended:
            return
        self.load_ended = True
        start = self.first_arrival or 0.0
        window = now - start
        if window <= 0:
            return  # fewer sessions than clients: every client never had work at once
        self.gpus_changed(now, self._gpus)
        integral = self._sequence_seconds + self.sequences * (now - self._last_change)
        self.steady = {
            "window_s": window,
            "output_tokens": self.num_output_tokens,
            "output_tokens_per_s_per_gpu": self.num_output_tokens / self.gpu_seconds if self.gpu_seconds else 0.0,
            "mean_concurrent_sequences": integral / window if window > 0 else 0.0,
        }

    def close(self, now: float) -> None:
        """Ends the GPU-time integral at `now` (the end of the run)."""
        self.gpus_changed(now, self._gpus)

    def mean_sequences(self, now: float) -> float:
        start = self.first_arrival or 0.0
        integral = self._sequence_seconds + self.sequences * (now - self._last_change)
        return integral / (now - start) if now > start else 0.0

    def summary(self, now: float, num_preemptions: int, prefix_queried_tokens: int, prefix_hit_tokens: int,
                replicas_over_time: list[tuple[float, int]]) -> dict[str, Any]:
        """The run's summary.json (docs/simulate.md lists every key)."""
        finished = [r for r in self.records.values() if r.outcome == "finished"]
        start = self.first_arrival or 0.0
        duration = max(self.last_finish - start, 1e-12)
        ttft = [r.first_token_at - r.arrival for r in finished if r.first_token_at is not None]
        itl = {"p50": counted_percentile(self.itl_counts, 50), "p90": counted_percentile(self.itl_counts, 90),
               "p99": counted_percentile(self.itl_counts, 99)}
        kv = [sample[2] for sample in self.samples]
        return {
            "requests": len(self.records),
            "finished": len(finished),
            "duration_s": duration,
            "output_tokens": self.num_output_tokens,
            "gpu_seconds": self.gpu_seconds,
            "output_tokens_per_s": self.num_output_tokens / duration,
            "output_tokens_per_s_per_gpu": self.num_output_tokens / self.gpu_seconds if self.gpu_seconds else 0.0,
            "requests_per_s": len(finished) / duration,
            "ttft_s": _quantiles(ttft),
            "itl_s": itl,
            "e2e_s": _quantiles([r.finished_at - r.arrival for r in finished if r.finished_at is not None]),
            "kv_utilization_mean": sum(kv) / len(kv) if kv else 0.0,
            "peak_concurrent_sequences": self.peak_sequences,
            "mean_concurrent_sequences": self.mean_sequences(self.last_finish if finished else now),
            "refused": dict(sorted(self.refused.items())),
            "preemptions": num_preemptions,
            "prefix_hit_rate": prefix_hit_tokens / prefix_queried_tokens if prefix_queried_tokens else 0.0,
            "replicas_over_time": [[t, n] for t, n in replicas_over_time],
            "steady": self.steady,
            "turns": {name: turn_summary(records) for name, records in split_turns(self.records.values()).items()},
        }
