"""What vLLM's stat-logger hook reports, kept for the vLLM backend's EngineStats
(dcpserve/engine/backends/vllm/engine.py): running and waiting requests, KV usage, preemptions, token and prefix-cache
counters, the step time; and the host tier's figures (vLLM's CPU offloading) from those and its KV events."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dcpserve.engine.protocol import HostTierStats

if TYPE_CHECKING:
    from dcpserve.engine.backends.vllm.prefix import VllmPrefixCache


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
        self.step_tokens = 0  # the last record's tokens computed (prompt and generated) and, of those, prompt tokens
        self.step_prompt_tokens = 0
        # vLLM's prefix cache lookups of new requests (preempted ones resuming not counted, as natively): prompt tokens
        # looked up and, of those, served from the cache, since start (each record carries the step's).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Of the tokens its own cache missed, those its KV connector (the CPU offloading of kv_host_tier) loaded
        # instead of computing, since start: the host tier's hits.
        self.host_hit_tokens = 0

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
            connector = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
            if connector is not None:
                self.host_hit_tokens += int(connector.hits)
        if iteration_stats is not None:
            self.num_preemptions += iteration_stats.num_preempted_reqs
            self.num_generation_tokens += iteration_stats.num_generation_tokens
            prompt = getattr(iteration_stats, "prompt_token_stats", None)
            self.step_prompt_tokens = int(getattr(prompt, "computed", 0) or getattr(iteration_stats,
                                                                                    "num_prompt_tokens", 0) or 0)
            self.num_prompt_tokens += self.step_prompt_tokens
            self.step_tokens = self.step_prompt_tokens + int(iteration_stats.num_generation_tokens)
        if self.last_record_at is not None and busy:
            self.step_seconds = now - self.last_record_at
        self.last_record_at = now
        self.num_records += 1


class VllmHostTier:
    """The host tier of a vLLM replica (kv_host_tier: vLLM's CPU offloading) as HostTierStats, from what vLLM tells:
    its KV events with medium CPU (VllmPrefixCache: copies stored in and removed from the tier), its connector's
    prefix hits (StatsRecorder.host_hit_tokens) and the size it was given.

    - capacity: the offloading size over the bytes of one logical block (every rank's page: layers x K and V (MLA: its
      one latent) x kv heads x head size x block_size, in the KV cache's dtype), as vLLM sizes its CPU blocks; 0 if
      the config does not say.
    - blocks to host: the copies its events stored (vLLM offloads a block as it is computed, not when its pool evicts
      it, so these are also the tier's `evictions_to_host`); blocks to device: the connector's hit tokens in whole
      blocks; bytes: blocks x bytes per block.
    - drops: the copies its events removed.
    - Left 0, vLLM does not tell them (its connector's transfer stats change shape from release to release): the
      seconds spent copying each way, and so the measured reload seconds per block.
    """

    def __init__(self, offload_bytes: int, block_bytes: int, tokens_per_block: int) -> None:
        self.capacity_blocks = offload_bytes // block_bytes if block_bytes > 0 else 0
        self.block_bytes = block_bytes
        self.tokens_per_block = tokens_per_block
        # Copies stored so far, never lower: events lost make the prefix cache forget its copies uncounted.
        self.stored = 0

    def stats(self, prefix: VllmPrefixCache | None, recorder: StatsRecorder) -> HostTierStats:
        used = prefix.num_host_blocks if prefix is not None else 0
        drops = prefix.num_host_evictions if prefix is not None else 0
        self.stored = max(self.stored, used + drops)
        blocks_in = recorder.host_hit_tokens // self.tokens_per_block if self.tokens_per_block else 0
        return HostTierStats(
            capacity_blocks=self.capacity_blocks, used_blocks=used,
            hit_tokens_device=recorder.prefix_cache_hits, hit_tokens_host=recorder.host_hit_tokens,
            blocks_out=self.stored, blocks_in=blocks_in,
            bytes_out=self.stored * self.block_bytes, bytes_in=blocks_in * self.block_bytes,
            seconds_out=0.0, seconds_in=0.0,  # not told by vLLM (class docstring)
            evictions_to_host=self.stored, host_drops=drops, reload_seconds_per_block=0.0,
        )


def offloaded_block_bytes(vllm_config: Any) -> int:
    """Bytes of one logical block over all of a vLLM replica's ranks (VllmHostTier); 0 where its config lacks what it
    takes."""
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    try:
        per_token = (1 if model.use_mla else 2) * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * (
            model.get_head_size())
        element = 1 if str(cache.cache_dtype).startswith("fp8") else int(model.dtype.itemsize)
        return int(per_token * element * cache.block_size * parallel.tensor_parallel_size)
    except (AttributeError, TypeError, ValueError):
        return 0


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
