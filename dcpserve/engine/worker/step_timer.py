"""Time one step spends in the DCP exchange (query all-gather + partial-attention all-to-all), for metrics.

The model runner makes one ExchangeTimer per step and hands it to every attention layer through the step's
AttentionMetadata; each layer wraps its exchange calls in measure(). On CPU (gloo is synchronous) the host
clock measures the collectives, including the wait for the slowest rank. On CUDA the calls only enqueue work, so
the timer records a pair of CUDA events around each call and sums their elapsed time once, after the step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ExchangeTimer:
    """Accumulates the seconds of one step's DCP exchange calls on one rank."""

    def __init__(self, device: torch.device) -> None:
        self.use_cuda_events = device.type == "cuda"
        self._host_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def measure(self) -> Iterator[None]:
        if self.use_cuda_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            begin = time.perf_counter()
            yield
            self._host_seconds += time.perf_counter() - begin

    def seconds(self) -> float:
        """Total exchange time of the step so far (waits for the last recorded CUDA event)."""
        if not self._events:
            return self._host_seconds
        self._events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
