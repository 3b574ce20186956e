"""The app's own latencies over a sliding window, per layout pool: what the service-level autoscaling policy reads.

Every request that ends hands its TTFT (from arrival, admission wait included) and its mean inter-token latency to
the admission queue with its release (`AdmissionQueue.release`); the queue keeps them here with the time they
arrived and the pool of the replica that served them. A replica's KV report asks for its pool's percentile over a
window (the pool's autoscaling policy names both) and passes the answer on in its autoscaling stats.

Exact over the kept samples: a percentile is the nearest-rank value of the samples inside the window. At most
`max_samples` per pool are kept (the oldest dropped first), so memory stays bounded under any load.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowLatency:
    """A pool's latencies over a window: the percentile of TTFT and of mean ITL (None without samples)."""

    ttft_s: float | None
    itl_s: float | None
    samples: int


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) by nearest rank: the smallest value with at least q of the values at or below."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


class LatencyWindow:
    """(time, ttft, itl) samples per pool, newest last."""

    def __init__(self, max_samples: int = 20_000) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.max_samples = max_samples
        self._samples: dict[str, deque[tuple[float, float | None, float | None]]] = {}

    def add(self, now: float, pool: str, ttft_s: float | None, itl_s: float | None) -> None:
        if ttft_s is None and itl_s is None:
            return
        self._samples.setdefault(pool, deque(maxlen=self.max_samples)).append((now, ttft_s, itl_s))

    def percentile(self, now: float, pool: str, q: float, window_s: float) -> WindowLatency:
        """The q-quantile of the pool's TTFT and ITL samples of the last window_s seconds."""
        if not 0 < q <= 1:
            raise ValueError(f"percentile must be in (0, 1], got {q}")
        samples = self._samples.get(pool)
        if not samples:
            return WindowLatency(None, None, 0)
        while samples and samples[0][0] < now - max(window_s, 0.0):
            samples.popleft()  # older than any window asked for so far is older than this one too (one window/pool)
        ttfts = [s[1] for s in samples if s[1] is not None]
        itls = [s[2] for s in samples if s[2] is not None]
        return WindowLatency(nearest_rank(ttfts, q) if ttfts else None, nearest_rank(itls, q) if itls else None,
                             len(samples))
