"""What vLLM's stat-logger hook reports, kept for the vLLM backend's EngineStats
(dcpserve/engine/backends/vllm/engine.py): running and waiting requests, KV usage, preemptions, token and prefix-cache
counters, the step time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class StatsRecorder:
    """The latest scheduler figures and cumulative counters from vLLM's stat-logger hook (runs on the event loop
    of the process that owns the AsyncLLM)."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_records = 0
        self.last_record_at: float | None = None
        self.step_seconds = 0.0
        # vLLM's prefix cache lookups of new requests (preempted ones resuming not counted, as natively): prompt tokens
        # looked up and, of those, served from the cache, since start (each record carries the step's).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        now = time.perf_counter()
        # A step's time is the gap since the last record only while vLLM was busy in between (not an idle pause).
        busy = self.num_running > 0 or self.num_waiting > 0
        if scheduler_stats is not None:
            self.num_running = scheduler_stats.num_running_reqs
            skipped = getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
            self.num_waiting = scheduler_stats.num_waiting_reqs + skipped
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                self.prefix_cache_queries += int(prefix.queries)
                self.prefix_cache_hits += int(prefix.hits)
        if iteration_stats is not None:
            self.num_preemptions += iteration_stats.num_preempted_reqs
            self.num_generation_tokens += iteration_stats.num_generation_tokens
            prompt = getattr(iteration_stats, "prompt_token_stats", None)
            self.num_prompt_tokens += int(getattr(prompt, "computed", 0) or getattr(iteration_stats,
                                                                                    "num_prompt_tokens", 0) or 0)
        if self.last_record_at is not None and busy:
            self.step_seconds = now - self.last_record_at
        self.last_record_at = now
        self.num_records += 1


def stat_logger_factory(recorder: StatsRecorder, on_record: Callable[[], None]) -> Any:
    """A vLLM StatLoggerFactory whose loggers feed `recorder` (the base class is vLLM's, imported here)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class DcpserveStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            recorder.record(scheduler_stats, iteration_stats)
            on_record()

        def log_engine_initialized(self) -> None:
            return None

    return DcpserveStatLogger
