"""The inner loop of one replica: step() = schedule -> execute -> update.

LLMEngine owns the scheduler (and its block manager), the executor (in-process runner or Ray worker group)
and per-request detokenization with stop strings. It is not thread-safe: exactly one thread drives it, LLM's
(batch) or the engine core's (dcpserve.engine.core.core, under AsyncEngine for serving).
"""

from __future__ import annotations

import itertools
import os
import time

import torch

from dcpserve.engine.config import EngineConfig
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.host_tier import HostTier, tier_layout, with_host_tier
from dcpserve.engine.core.outputs import ModelRunnerOutput
from dcpserve.engine.core.prefix_cache import PrefixReport
from dcpserve.engine.core.request import FinishReason, Request, resolve_prompt_token_ids
from dcpserve.engine.core.scheduler import Scheduler
from dcpserve.engine.core.step import SchedulerOutput
from dcpserve.engine.core.step_trace import StepTraceWriter
from dcpserve.engine.protocol import (
    EngineStats,
    HostTierStats,
    KvLedger,
    RankKvStats,
    RequestDelta,
    RequestError,
    TokenLogprob,
)
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.structured_output import Grammars
from dcpserve.engine.tokenizer import TextStream, Tokenizer, load_tokenizer
from dcpserve.engine.worker.executor import Executor, create_executor
from dcpserve.kernels import dcp_local_seq_lens

# Set (to anything but 0) to keep every cached block's token ids and compare them on each prefix cache hit: a hash
# collision then fails loudly instead of serving another prefix's KV. The tests set it.
VERIFY_PREFIX_HITS_ENV = "DCPSERVE_VERIFY_PREFIX_HITS"


class LLMEngine:
    """One replica: scheduler + executor + detokenization."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        """`executor`: ranks already made with `with_host_tier(config)` (the tests' own worker groups); by default
        the engine makes them (create_executor)."""
        config = with_host_tier(config)  # refused here, before any rank starts, when the host lacks the memory
        self.config = config
        self.model_config = config.model_config
        self.tokenizer: Tokenizer | None = load_tokenizer(config.model, self.model_config.eos_token_ids,
                                                          trust_remote_code=config.trust_remote_code)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        # Opened first: a bad path fails before a worker group starts.
        self.step_trace = StepTraceWriter(config.step_trace_path) if config.step_trace_path else None
        try:
            self.executor: Executor = executor if executor is not None else create_executor(config)
        except BaseException:
            if self.step_trace is not None:
                self.step_trace.close()
            raise
        self.block_manager = BlockManager(
            self.executor.num_blocks, config.cache.block_size, config.parallel.dcp,
            enable_prefix_caching=config.cache.enable_prefix_caching, hash_seed=config.cache.prefix_hash_seed,
            verify_hits=os.environ.get(VERIFY_PREFIX_HITS_ENV, "") not in ("", "0"),
            host_tier=(HostTier(config.cache.host_tier_blocks, tier_layout(config))
                       if config.cache.host_tier_blocks else None),
        )
        self.copies = CopyTotals()
        self.scheduler = Scheduler(config.scheduler, self.block_manager, frozenset(eos))
        self._text: dict[str, TextStream] = {}
        self._grammars: Grammars | None = None
        # Prompt logprobs gathered chunk by chunk until the request's first token delivers them.
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self._ids = itertools.count()
        self.num_tokens_computed = 0  # prompt, recompute and decode tokens run through the model
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.last_step_seconds = 0.0
        self.last_exchange_seconds = 0.0  # of last_step_seconds, the time in the DCP exchange
        self.last_step_tokens = 0
        self.last_step_prompt_tokens = 0
        self.last_step_idle = False  # the last step() scheduled nothing

    # ---- requests --------------------------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"the model directory {self.config.model} has no tokenizer: pass prompt_token_ids")
        return self.tokenizer.encode(prompt)

    def prompt_token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None,
                         sampling_params: SamplingParams | None = None) -> list[int]:
        """The request's prompt as token ids (tokenized when given as text), each checked against the vocabulary, as
        are the token ids its sampling params name (logit_bias)."""
        return resolve_prompt_token_ids(prompt, prompt_token_ids, self.tokenize, self.model_config.vocab_size,
                                        sampling_params)

    def add_request(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queues a request; raises (RequestRejected, ValueError) at once if it could never be served."""
        params = sampling_params or SamplingParams()
        prompt_token_ids = self.prompt_token_ids(prompt, prompt_token_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.add(Request(request_id, prompt_token_ids, params, prompt=prompt))
        return request_id

    def add(self, request: Request) -> None:
        """Queues a request whose prompt is already token ids checked against the vocabulary (prompt_token_ids):
        the engine core's path, which keeps the Request it measured (its block hashes) instead of building another."""
        constraint = request.sampling_params.structured_output
        if constraint is not None:
            request.grammar = self.grammars().start(constraint)  # GrammarError (a ValueError): refused, not queued
        self.scheduler.add_request(request)
        if request.sampling_params.detokenize:
            self._text[request.request_id] = TextStream.for_params(self.tokenizer, request.prompt_token_ids,
                                                                   request.sampling_params)

    def grammars(self) -> Grammars:
        """The grammar compiler of this model's vocabulary, made at the first constrained request."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError(f"the model directory {self.config.model} has no tokenizer: structured outputs "
                                 f"need one to know each token's text")
            self._grammars = Grammars.for_tokenizer(self.tokenizer, self.model_config.vocab_size)
        return self._grammars

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees its KV; the next step tells the workers to drop its state."""
        self._text.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        return self.scheduler.abort_request(request_id)

    def admission_need(self, request: Request) -> int:
        """The blocks a new request would add to this replica's ledger now: its admission blocks under the policy,
        less the cached blocks of its prefix that running requests hold (shared, not added)."""
        return self.scheduler.committed_blocks(request)

    def prefix_report(self, reader_epoch: str | None, reader_version: int) -> PrefixReport | None:
        """The cached prefix blocks' changes since the reader's (epoch, version), or the whole state; None when
        prefix caching is off."""
        reporter = self.block_manager.reporter
        return None if reporter is None else reporter.report(reader_epoch, reader_version)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def probe_request(self, prompt_token_ids: list[int], max_tokens: int) -> Request:
        """A request never queued, to ask what a prompt would need here (admission_need)."""
        return Request("", list(prompt_token_ids), SamplingParams(max_tokens=max_tokens))

    def kv_ledger(self) -> KvLedger:
        """The KV ledger over the scheduler's unfinished requests (the scheduler owns it)."""
        return self.scheduler.kv_ledger()

    # ---- one step --------------------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """schedule -> execute -> update. Returns the deltas of requests that produced a token this step."""
        start = time.perf_counter()
        output = self.scheduler.schedule()
        # A step with nothing to compute still makes its copies (swap-outs of blocks an admission that then gave its
        # blocks back had taken).
        self.last_step_idle = output.is_empty and not output.finished_request_ids and not output.has_copies
        if self.last_step_idle:
            if self.step_trace is not None:
                self.step_trace.idle()
            return []  # nothing could run (waiting requests, no KV or seats): only an add or abort changes that
        result = self.executor.execute(output)
        self._gather_prompt_logprobs(output, result)
        updates = self.scheduler.update(output, result.sampled_token_ids)
        self.num_tokens_computed += output.num_tokens
        self.num_generation_tokens += len(updates)
        deltas = [self._delta(u.request, u.token_id, u.finished, result) for u in updates]
        self.num_steps += 1
        end = time.perf_counter()
        self.last_step_seconds = end - start
        self.last_step_tokens, self.last_step_prompt_tokens = output.num_tokens, output.num_prompt_tokens
        self.last_exchange_seconds = self.executor.last_exchange_seconds
        if output.has_copies:
            self.copies.add(output, self.executor.last_copy_seconds)
        if self.step_trace is not None:
            rows = ((entry.start_position, len(entry.token_ids)) for entry in output.scheduled)
            self.step_trace.record(start, end, rows, self.last_exchange_seconds, self.scheduler.has_unfinished)
        return deltas

    def _gather_prompt_logprobs(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Appends this step's prompt logprobs to each asking request's list (a chunk at position 0, the first or a
        recompute after preemption before any token, starts the list again)."""
        if not result.prompt_logprobs:
            return
        for entry in output.scheduled:
            request = self.scheduler.requests.get(entry.request_id)
            if request is None:
                continue  # aborted
            if request.sampling_params.prompt_logprobs is None or entry.num_output_tokens:
                continue
            if entry.start_position == 0:
                self._prompt_logprobs[entry.request_id] = [None]
            gathered = self._prompt_logprobs.get(entry.request_id)
            if gathered is not None:
                gathered.extend(result.prompt_logprobs.get(entry.request_id, ()))

    def _delta(self, request: Request, token: int, finished: bool, result: ModelRunnerOutput) -> RequestDelta:
        request_id = request.request_id
        stream = self._text.get(request_id) if self._text else None
        new_text = ""
        if stream is not None:
            new_text, stopped = stream.push([token], finished)
            if stopped and not finished:
                self.scheduler.finish_request(request_id, FinishReason.STOP)
                finished = True
            if finished:
                del self._text[request_id]
        logprob = result.logprobs.get(request_id) if result.logprobs else None
        num_outputs = len(request.output_token_ids)
        # Positional (request_id, new_token_ids, new_text, finished, finish_reason, num_prompt_tokens,
        # num_output_tokens, logprobs, prompt_logprobs): one delta per request per step.
        return RequestDelta(
            request_id, [token], new_text, finished,
            request.finish_reason.value if finished and request.finish_reason else None,
            len(request.prompt_token_ids), num_outputs,
            [logprob] if logprob is not None else None,
            self._prompt_logprobs.pop(request_id, None) if num_outputs == 1 and self._prompt_logprobs else None,
        )

    # ---- state -----------------------------------------------------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.capacity_tokens

    def stats(self) -> EngineStats:
        """KV blocks (replica and per rank), sequences, and token counters, for the serving layer."""
        usage = self.block_manager.usage()
        dcp = self.config.parallel.dcp
        running = self.scheduler.running
        computed = torch.tensor([r.num_computed_tokens for r in running], dtype=torch.int64)
        block_size = self.config.cache.block_size
        # A prefix block several running requests share is held once: every holder but the charged one took it
        # from the cache whole and computed, block_size of its tokens on each rank.
        shared_tokens = block_size * sum(self.block_manager.shared_blocks(r) for r in running)
        parallel = self.config.parallel
        per_rank = tuple(
            RankKvStats(
                rank=rank,
                dcp_rank=parallel.dcp_rank_of(rank),
                pages_total=usage.total,
                pages_used=usage.used,
                tokens_capacity=usage.total * block_size,
                tokens_used=(int(dcp_local_seq_lens(computed, dcp, parallel.dcp_rank_of(rank)).sum()) - shared_tokens
                             if running else 0),
            )
            for rank in range(parallel.world_size)
        )
        return EngineStats(
            backend="native",
            tp=self.config.parallel.tp,
            dcp=dcp,
            num_kv_heads=self.model_config.num_key_value_heads,
            admission=self.scheduler.config.admission,
            kv_blocks_total=usage.total,
            kv_block_size_tokens=usage.tokens_per_block,
            kv_blocks_used=usage.used,
            kv_blocks_reserved=usage.reserved,
            num_running=len(running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
            tokens_computed=self.num_tokens_computed,
            generation_tokens=self.num_generation_tokens,
            num_steps=self.num_steps,
            last_step_seconds=self.last_step_seconds,
            last_exchange_seconds=self.last_exchange_seconds,
            last_step_tokens=self.last_step_tokens,
            last_step_prompt_tokens=self.last_step_prompt_tokens,
            prefix_caching=self.block_manager.enable_prefix_caching,
            prefix_cache_queries=self.block_manager.num_queried_tokens,
            prefix_cache_hits=self.block_manager.num_hit_tokens,
            kv_blocks_cached=self.block_manager.num_cached_blocks,
            prefix_cache_evictions=self.block_manager.num_evictions,
            per_rank=per_rank,
            host_tier=self.host_tier_stats(),
        )

    def host_tier_stats(self) -> HostTierStats | None:
        """The host KV tier's occupancy, hits and copies (None when it is off). Bytes are over all ranks."""
        tier = self.block_manager.host_tier
        if tier is None:
            return None
        manager, copies = self.block_manager, self.copies
        bytes_per_block = tier.layout.bytes_per_block * self.config.parallel.world_size if tier.layout else 0
        return HostTierStats(
            capacity_blocks=tier.num_slots,
            used_blocks=len(tier),
            hit_tokens_device=manager.num_hit_tokens - manager.num_host_hit_tokens,
            hit_tokens_host=manager.num_host_hit_tokens,
            blocks_out=copies.blocks_out,
            blocks_in=copies.blocks_in,
            bytes_out=copies.blocks_out * bytes_per_block,
            bytes_in=copies.blocks_in * bytes_per_block,
            seconds_out=copies.seconds_out,
            seconds_in=copies.seconds_in,
            evictions_to_host=tier.num_stored,
            host_drops=tier.num_dropped,
            reload_seconds_per_block=copies.seconds_in / copies.blocks_in if copies.blocks_in else 0.0,
        )

    def shutdown(self) -> None:
        if self.step_trace is not None:
            self.step_trace.close()
        self.executor.shutdown()


class CopyTotals:
    """The host KV tier's copies the engine's steps carried, and their seconds (the slowest rank's, each step)."""

    def __init__(self) -> None:
        self.blocks_out = 0
        self.blocks_in = 0
        self.seconds_out = 0.0
        self.seconds_in = 0.0

    def add(self, output: SchedulerOutput, seconds: tuple[float, float]) -> None:
        self.blocks_out += len(output.swap_out)
        self.blocks_in += len(output.swap_in)
        self.seconds_out += seconds[0]
        self.seconds_in += seconds[1]
