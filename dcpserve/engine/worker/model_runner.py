"""One rank's model, KV cache shard and persistent batch.

execute() applies a SchedulerOutput (only what changed since the last step) to the rank's persistent batch
(dcpserve/engine/worker/input_batch.py), which builds the step's tensors (token ids, positions, this rank's
AttentionMetadata); it runs the model, and on the driver rank (TP rank 0) samples the rows that reached the end of their
sequence; for requests that asked for prompt logprobs every rank also runs the vocab-parallel LM head over their prompt
rows, and the driver returns their logprobs with the step's tokens (ModelRunnerOutput). Every rank of a worker group
runs execute() with the same SchedulerOutput; only the slot mapping and local lengths differ.
The model runner never changes scheduler state.
"""

from __future__ import annotations

import logging

import torch

from dcpserve.engine.config import EngineConfig
from dcpserve.engine.core.block_manager import blocks_needed, num_blocks_for_budget
from dcpserve.engine.core.outputs import ModelRunnerOutput
from dcpserve.engine.core.step import ScheduledRequest, SchedulerOutput
from dcpserve.engine.protocol import TokenLogprob
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.worker.cuda_graphs import DECODE_GRAPH_SIZES, Capture, DecodeGraphs, cuda_capture
from dcpserve.engine.worker.input_batch import InputBatch
from dcpserve.engine.worker.kv_copies import HostKvPool
from dcpserve.engine.worker.loader import load_model
from dcpserve.engine.worker.parallel import ParallelState
from dcpserve.engine.worker.pcp import PcpSplit, unsplit_rows
from dcpserve.engine.worker.sampler import Sampler, SamplingRow, greedy_tokens, mask_logits, token_logprobs
from dcpserve.engine.worker.step_timer import ExchangeTimer

logger = logging.getLogger(__name__)

# Prompt-logprob rows per pass through the LM head: bounds the vocabulary-wide logits a long chunk materializes.
PROMPT_LOGPROBS_ROWS = 512


class ModelRunner:
    """Runs the model for one TP rank and owns that rank's paged KV cache."""

    def __init__(self, config: EngineConfig, parallel: ParallelState, device: torch.device) -> None:
        self.config = config
        self.parallel = parallel
        self.device = device
        self.block_size = config.cache.block_size
        self.dtype = config.torch_dtype
        self.model = load_model(config.model, config.model_config, parallel, self.dtype, device)
        self.sampler = Sampler(config.seed) if parallel.is_driver else None
        self.batch = InputBatch(
            max_num_seqs=config.scheduler.max_num_seqs,
            max_blocks_per_seq=blocks_needed(config.scheduler.max_model_len, self.block_size * parallel.dcp_size),
            block_size=self.block_size, dcp_size=parallel.dcp_size, dcp_rank=parallel.dcp_rank, device=device,
            pcp_size=parallel.pcp_size, pcp_rank=parallel.pcp_rank,
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.decode_graphs: DecodeGraphs | None = None  # capture_decode_graphs(), after the KV cache is allocated
        self.activation_peak_bytes = 0  # measured by profile_run() on CUDA before the KV cache is sized
        self._exchange_timer: ExchangeTimer | None = None  # the last execute()'s, read after the step
        self.host_pool: HostKvPool | None = None  # allocate_host_tier(): the host KV tier's pages of this rank
        self._copied = False  # the last execute() made host tier copies

    # ---- KV cache --------------------------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's KV takes on this rank across all layers, as the model caches it (K and V of its KV
        heads; MLA: the one latent head)."""
        return self.model.kv_cache_spec.bytes_per_token(self.dtype)

    def kv_budget_bytes(self) -> int:
        """This rank's KV bytes: kv_cache_memory_bytes when set; on CUDA gpu_memory_utilization of the device's
        total memory less what this process holds after loading (CacheConfig.cuda_kv_budget); on CPU a fixed
        default."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand back loading's temporary blocks so only the weights count
            weights = torch.cuda.memory_reserved(self.device)
            activations = self.profile_run()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            self.activation_peak_bytes = activations
            return cache.cuda_kv_budget(total, weights + activations, free - activations)
        return cache.cpu_default_kv_bytes

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Runs the largest step the scheduler can send (max_num_batched_tokens new tokens in sequences of at most
        max_model_len, at most max_num_seqs of them, every one sampled) on a scratch KV cache just large enough, and
        returns the activation peak in bytes above what was allocated before (0 off CUDA, where the run only proves
        the step builds). The KV cache is sized after this, so a step's activations never run the device out of
        memory. Every rank of a group must call it together (the forward has collectives)."""
        scheduler = self.config.scheduler
        tokens_per_block = self.block_size * self.parallel.dcp_size
        lengths: list[int] = []
        remaining = scheduler.max_num_batched_tokens
        while remaining > 0 and len(lengths) < scheduler.max_num_seqs:
            lengths.append(min(remaining, scheduler.max_model_len))
            remaining -= lengths[-1]
        entries = []
        next_block = 0
        for i, length in enumerate(lengths):
            count = blocks_needed(length, tokens_per_block)
            entries.append(ScheduledRequest(
                request_id=f"profile-{i}", token_ids=[0] * length, start_position=0,
                new_block_ids=list(range(next_block, next_block + count)), sample=True, num_output_tokens=0,
                sampling_params=SamplingParams(temperature=0, max_tokens=1),
            ))
            next_block += count
        saved_caches, saved_blocks = self.kv_caches, self.num_blocks
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        try:
            self.allocate_kv_cache(next_block)
            scratch = torch.cuda.memory_allocated(self.device) - before if cuda else 0
            self.execute(SchedulerOutput(entries))
            if cuda:
                torch.cuda.synchronize(self.device)
                return max(0, torch.cuda.max_memory_allocated(self.device) - before - scratch)
            return 0
        finally:
            self.batch.drop(e.request_id for e in entries)
            if self.sampler is not None:
                self.sampler.forget([e.request_id for e in entries])
            self.kv_caches, self.num_blocks = saved_caches, saved_blocks

    def available_blocks(self) -> int:
        """Pages this rank could hold; the worker group takes the minimum over its ranks."""
        return num_blocks_for_budget(self.kv_budget_bytes(), self.block_size, self.kv_bytes_per_token)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One (k_cache, v_cache) pair per layer of the model's cache (a key-only cache is its own v_cache)."""
        self.kv_caches = self.model.kv_cache_spec.allocate(num_blocks, self.block_size, self.dtype, self.device)
        self.num_blocks = num_blocks

    def allocate_host_tier(self, num_slots: int) -> None:
        """This rank's host KV pool of num_slots pages in the device cache's layout (after allocate_kv_cache); 0:
        none (the tier is off)."""
        self.host_pool = HostKvPool(num_slots, self.kv_caches) if num_slots > 0 else None

    @property
    def last_copy_seconds(self) -> tuple[float, float]:
        """(swap-out, swap-in) seconds of the last execute() on this rank (0 without copies); read after the step."""
        return self.host_pool.last_seconds() if self.host_pool is not None and self._copied else (0.0, 0.0)

    def capture_decode_graphs(self, capture: Capture | None = None, safety_check: bool | None = None) -> None:
        """Captures the decode forward in CUDA graphs (dcpserve/engine/worker/cuda_graphs.py), once the final KV cache
        is allocated (the graphs hold its addresses). Off with enforce_eager and off CUDA (unless a `capture` is
        given: the tests emulate one on CPU). At tp * pcp > 1 every rank of the group must call it together, right
        after allocate_kv_cache (the captures run the forward's collectives, in the same order on every rank: the
        sizes are the config's, the same on every rank). safety_check (None: on CUDA) runs each size's capture
        under the capture-safety check (dcpserve/engine/worker/capture_safety.py; on CPU only the Triton kernels pass
        it, the fused CPU ones read lengths back by design). A capture that fails, or whose replay disagrees with
        the eager forward, logs the error and leaves decode eager, on every rank of the group (they agree at the
        end, `_every_rank_captured`)."""
        self.decode_graphs = None
        why_not = None
        if self.config.enforce_eager:
            why_not = "enforce_eager is set"
        elif self.device.type != "cuda" and capture is None:
            why_not = f"the device is {self.device.type}"
        if why_not is not None:
            # On CPU eager is the only mode: not worth an INFO line at every start.
            logger.log(logging.DEBUG if self.device.type != "cuda" else logging.INFO, "decode runs eagerly: %s",
                       why_not)
            return
        sizes = [size for size in DECODE_GRAPH_SIZES if size <= self.config.scheduler.max_num_seqs]
        graphs: DecodeGraphs | None = None
        failure: Exception | None = None
        try:
            with torch.inference_mode():
                graphs = DecodeGraphs(
                    self.model, self.kv_caches, self.config.model_config.vocab_size, self.batch.max_blocks_per_seq,
                    self.device, capture if capture is not None else cuda_capture(), sizes or [1],
                    safety_check=self.device.type == "cuda" if safety_check is None else safety_check,
                )
        except Exception as err:  # noqa: BLE001 - eager decode is always right; the error is logged
            failure = err
        if failure is not None:
            logger.error("CUDA graph capture of decode failed on rank %d, decode runs eagerly (set enforce_eager to "
                         "skip the capture): %s", self.parallel.world_rank, failure)
        if not self._every_rank_captured(failure is None):
            if failure is None:
                logger.error("CUDA graph capture of decode failed on another rank of the group: decode runs eagerly "
                             "on every rank")
            return
        self.decode_graphs = graphs
        logger.info("decode CUDA graphs captured for batch sizes %s", sizes or [1])

    def _every_rank_captured(self, captured: bool) -> bool:
        """Whether every rank of the group captured (one sum over the TP group, then over the PCP peers): a graph
        holding a collective may only be replayed while every rank of that collective replays its own (NCCL's
        rule), so the group serves from graphs on all ranks or on none. True at tp = pcp = 1 without a collective."""
        if self.parallel.world_size == 1:
            return captured
        failed = torch.tensor([0.0 if captured else 1.0], device=self.device)
        failed = self.parallel.all_reduce(failed)
        if self.parallel.pcp_comm is not None:
            failed = self.parallel.pcp_comm.all_reduce(failed)
        return float(failed) == 0.0

    def _zero_pages(self, pages: list[int]) -> None:
        """Zeroes these pages of every layer's K and V cache (on this rank)."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_fill_(0, index, 0)
            if v_cache is not k_cache:  # a key-only cache (MLA) is its own v_cache
                v_cache.index_fill_(0, index, 0)

    @property
    def last_exchange_seconds(self) -> float:
        """DCP exchange time of the last execute() on this rank (0 without DCP). Read it after the step: on CUDA it
        waits for the step's last exchange to finish."""
        return self._exchange_timer.seconds() if self._exchange_timer is not None else 0.0

    # ---- one step --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Runs one step. The driver returns the sampled tokens (and the logprobs requests asked for); other ranks
        return None."""
        if self.sampler is not None and output.finished_request_ids:
            self.sampler.forget(output.finished_request_ids)
        self._exchange_timer = None
        self._copied = bool(output.swap_out or output.swap_in)
        if self._copied:
            # Before anything of the step touches a page (the batch's fresh pages are zeroed on CPU): module docstring
            # of dcpserve/engine/worker/kv_copies.py.
            if self.host_pool is None:
                raise RuntimeError("a step carries host KV tier copies but this rank has no host pool")
            self.host_pool.apply(output.swap_out, output.swap_in)
        if output.is_empty:
            if self.host_pool is not None:
                self.host_pool.wait()
            self.batch.apply(output)
            return ModelRunnerOutput() if self.parallel.is_driver else None
        timer = ExchangeTimer(self.device) if self.parallel.dcp_size > 1 else None
        inputs = self.batch.prepare(output, timer)
        if self.device.type == "cpu":
            # Zeroed before this step stores into them: a fresh page may hold a finished request's KV (NaN, even),
            # which the CPU decode kernel would otherwise have to zero in every layer's gather (finite_tail).
            if self.batch.fresh_pages:
                self._zero_pages(self.batch.fresh_pages)
            inputs.metadata.finite_tail = True
        if self.sampler is not None and self.batch.penalized:
            for entry in output.scheduled:
                if entry.request_id in self.batch.penalized:
                    if entry.prefix_token_ids is not None:  # it starts after a cached prefix
                        self.sampler.record(entry.request_id, 0, entry.prefix_token_ids)
                    self.sampler.record(entry.request_id, entry.start_position, entry.token_ids)
        if self.host_pool is not None:
            self.host_pool.wait()  # the forward reads the pages this step's swap-ins fill (CUDA: a side stream)
        hidden = (self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
                  if self.decode_graphs is not None else None)
        if hidden is None:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        self._exchange_timer = timer
        result = ModelRunnerOutput() if self.parallel.is_driver else None
        if inputs.sample_rows and self.parallel.samples:
            # Every rank of the TP group takes part in the vocab-parallel gather (with PCP, PCP group 0's: the other
            # groups skip it: their logits would go unused); only the driver receives the logits and samples.
            rows = (hidden if len(inputs.sample_rows) == hidden.shape[0]  # every row samples: a decode-only step
                    else hidden[torch.tensor(inputs.sample_rows, device=hidden.device)])
            logits = self.model.compute_logits(rows, driver_only=True)
            if result is not None and logits is not None and self.batch.not_plain_greedy <= self.batch.masked_greedy:
                # Every row greedy with nothing else asked but a grammar: the argmax of the masked logits is the whole
                # sampler.
                masked = [(i, e.allowed_token_bitmask) for i, (e, _) in enumerate(inputs.sampling)
                          if e.allowed_token_bitmask is not None]
                tokens = greedy_tokens(mask_logits(logits, masked) if masked else logits).tolist()
                result.sampled_token_ids = {e.request_id: t for (e, _), t in zip(inputs.sampling, tokens, strict=True)}
            elif self.sampler is not None and result is not None and logits is not None:
                sampled = self.sampler.sample(logits, [
                    SamplingRow(entry.request_id, params, entry.num_output_tokens, entry.blocked_token_ids,
                                entry.allowed_token_bitmask)
                    for entry, params in inputs.sampling
                ])
                result.sampled_token_ids = {
                    e.request_id: t for (e, _), t in zip(inputs.sampling, sampled.token_ids, strict=True)}
                result.logprobs = {e.request_id: lp
                                   for (e, _), lp in zip(inputs.sampling, sampled.logprobs, strict=True)
                                   if lp is not None}
        prompt_logprobs = self._prompt_logprobs(output, hidden, inputs.pcp_split)
        if result is not None:
            result.prompt_logprobs = prompt_logprobs
        return result

    def _prompt_logprobs(self, output: SchedulerOutput, hidden: torch.Tensor,
                         split: PcpSplit | None) -> dict[str, list[TokenLogprob]]:
        """The prompt logprobs this step's chunks complete, for the requests that asked and have not yet sampled a
        token (a recompute after preemption does not repeat them). Every rank computes the full-vocabulary logits
        of those rows (a collective); the driver turns them into TokenLogprob lists. Rows go through the LM head in
        slices of PROMPT_LOGPROBS_ROWS so a long chunk never holds more than that many vocabulary-wide rows.
        With PCP (`split`) the PCP groups first trade their rows' hidden states, and PCP group 0 runs the LM head."""
        rows: list[int] = []  # rows of `hidden`
        targets: list[int] = []  # the prompt token each row predicts
        num_top: list[int] = []  # the alternatives each row reports
        owners: list[tuple[str, int, int]] = []  # (request id, its first index in rows, how many)
        if not self.batch.wants_prompt_logprobs:
            return {}
        offset = 0
        for entry in output.scheduled:
            params = self.batch.sampling_params(entry.request_id)
            num_top_k = params.prompt_logprobs if params is not None else None
            if num_top_k is not None and entry.num_output_tokens == 0:
                # Row j predicts the token at position start + j + 1: the chunk's next token, or (last row) the
                # token after the chunk; a chunk that ends the prompt samples from its last row instead.
                chunk_targets = entry.token_ids[1:]
                if not entry.sample and entry.next_token_id is not None:
                    chunk_targets = chunk_targets + [entry.next_token_id]
                owners.append((entry.request_id, len(rows), len(chunk_targets)))
                rows.extend(range(offset, offset + len(chunk_targets)))
                targets.extend(chunk_targets)
                num_top.extend([num_top_k] * len(chunk_targets))
            offset += len(entry.token_ids)
        if not owners:
            return {}
        if split is not None:
            hidden = unsplit_rows(hidden, split, self.parallel.pcp_comm)
        if not self.parallel.samples:
            return {}
        entries: list[TokenLogprob] = []
        for start in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            index = torch.tensor(rows[start:start + PROMPT_LOGPROBS_ROWS], device=hidden.device)
            logits = self.model.compute_logits(hidden[index], driver_only=True)
            if logits is not None:
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                stop = start + len(index)
                entries.extend(token_logprobs(logprobs, targets[start:stop], num_top[start:stop]))
        if not self.parallel.is_driver:
            return {}
        return {request_id: entries[first:first + count] for request_id, first, count in owners}
