"""One rank's model, KV cache shard and per-step inputs.

execute() turns a SchedulerOutput into tensors (token ids, positions, this rank's AttentionMetadata), runs the
model, and on the driver rank (TP rank 0) samples the rows that reached the end of their sequence; for requests
that asked for prompt logprobs every rank also runs the vocab-parallel LM head over their prompt rows, and the
driver returns their logprobs with the step's tokens (ModelRunnerOutput). Every rank of a worker group runs
execute() with the same SchedulerOutput; only the slot mapping and local lengths differ.
The model runner never changes scheduler state.
"""

from __future__ import annotations

import torch

from engine.attention_metadata import AttentionMetadata
from engine.block_manager import num_blocks_for_budget
from engine.config import EngineConfig
from engine.loader import load_model
from engine.outputs import ModelRunnerOutput
from engine.parallel import ParallelState
from engine.protocol import TokenLogprob
from engine.sampler import Sampler, SamplingRow, token_logprobs
from engine.scheduler import SchedulerOutput
from engine.step_timer import ExchangeTimer
from kernels import dcp_local_seq_lens, dcp_slot_mapping

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
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self._exchange_timer: ExchangeTimer | None = None  # the last execute()'s, read after the step

    # ---- KV cache --------------------------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take on this rank across all layers."""
        mc = self.config.model_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_hidden_layers * self.parallel.kv_heads_per_rank * mc.head_dim * element

    def kv_budget_bytes(self) -> int:
        """This rank's KV bytes: kv_cache_memory_bytes when set; on CUDA gpu_memory_utilization of the device's
        total memory less what this process holds after loading (CacheConfig.cuda_kv_budget); on CPU a fixed
        default."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand back loading's temporary blocks so only the weights count
            free, total = torch.cuda.mem_get_info(self.device)
            return cache.cuda_kv_budget(total, torch.cuda.memory_reserved(self.device), free)
        return cache.cpu_default_kv_bytes

    def available_blocks(self) -> int:
        """Pages this rank could hold; the worker group takes the minimum over its ranks."""
        return num_blocks_for_budget(self.kv_budget_bytes(), self.block_size, self.kv_bytes_per_token)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        mc = self.config.model_config
        shape = (num_blocks, self.block_size, self.parallel.kv_heads_per_rank, mc.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(mc.num_hidden_layers)
        ]
        self.num_blocks = num_blocks

    @property
    def last_exchange_seconds(self) -> float:
        """DCP exchange time of the last execute() on this rank (0 without DCP). Read it after the step: on CUDA it
        waits for the step's last exchange to finish."""
        return self._exchange_timer.seconds() if self._exchange_timer is not None else 0.0

    # ---- one step --------------------------------------------------------------------------------------------

    def prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(input_ids [T], positions [T], metadata, rows of the hidden states to sample)."""
        scheduled = output.scheduled
        dcp, dcp_rank = self.parallel.dcp_size, self.parallel.dcp_rank
        input_ids: list[int] = []
        positions: list[int] = []
        seq_index: list[int] = []
        sample_rows: list[int] = []
        for i, entry in enumerate(scheduled):
            count = len(entry.token_ids)
            input_ids.extend(entry.token_ids)
            positions.extend(range(entry.start_position, entry.start_position + count))
            seq_index.extend([i] * count)
            if entry.sample:
                sample_rows.append(len(input_ids) - 1)
        width = max((len(e.block_ids) for e in scheduled), default=0)
        table = torch.zeros((len(scheduled), max(width, 1)), dtype=torch.int32)
        for i, entry in enumerate(scheduled):
            table[i, : len(entry.block_ids)] = torch.tensor(entry.block_ids, dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        slot_mapping = dcp_slot_mapping(
            table, torch.tensor(seq_index, dtype=torch.int64), positions_t, self.block_size, dcp, dcp_rank
        )
        num_decodes = sum(1 for e in scheduled if e.is_decode)  # the scheduler puts them first
        decode_lens = torch.tensor([e.start_position + 1 for e in scheduled[:num_decodes]], dtype=torch.int32)
        prefills = scheduled[num_decodes:]
        chunk_lens = [len(e.token_ids) for e in prefills]
        query_start_loc = torch.tensor([0] + chunk_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        context = torch.tensor([e.start_position for e in prefills], dtype=torch.int32)
        to_device = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            num_decode_tokens=num_decodes,
            decode_block_table=to_device(table[:num_decodes]),
            decode_local_seq_lens=to_device(dcp_local_seq_lens(decode_lens, dcp, dcp_rank)),
            prefill_block_table=to_device(table[num_decodes:]),
            prefill_query_start_loc=to_device(query_start_loc),
            prefill_local_context_lens=to_device(dcp_local_seq_lens(context, dcp, dcp_rank)),
            prefill_max_query_len=max(chunk_lens, default=0),
            exchange_timer=ExchangeTimer(self.device) if dcp > 1 else None,
        )
        ids = to_device(torch.tensor(input_ids, dtype=torch.int64))
        return ids, to_device(positions_t), metadata, sample_rows

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Runs one step. The driver returns the sampled tokens (and the logprobs requests asked for); other ranks
        return None."""
        if self.sampler is not None and output.finished_request_ids:
            self.sampler.forget(output.finished_request_ids)
        self._exchange_timer = None
        if output.is_empty:
            return ModelRunnerOutput() if self.parallel.is_driver else None
        if self.sampler is not None:
            for entry in output.scheduled:
                if entry.sampling_params.has_penalties:
                    self.sampler.record(entry.request_id, entry.start_position, entry.token_ids)
        input_ids, positions, metadata, sample_rows = self.prepare(output)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, metadata)
        self._exchange_timer = metadata.exchange_timer
        result = ModelRunnerOutput() if self.parallel.is_driver else None
        if sample_rows:
            # Every rank takes part in the vocab-parallel gather; only the driver samples.
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
            if self.sampler is not None and result is not None:
                sampling = [e for e in output.scheduled if e.sample]
                sampled = self.sampler.sample(logits, [
                    SamplingRow(e.request_id, e.sampling_params, e.num_output_tokens, e.blocked_token_ids)
                    for e in sampling
                ])
                result.sampled_token_ids = {e.request_id: t for e, t in zip(sampling, sampled.token_ids)}
                result.logprobs = {e.request_id: lp for e, lp in zip(sampling, sampled.logprobs) if lp is not None}
        prompt_logprobs = self._prompt_logprobs(output, hidden)
        if result is not None:
            result.prompt_logprobs = prompt_logprobs
        return result

    def _prompt_logprobs(self, output: SchedulerOutput, hidden: torch.Tensor) -> dict[str, list[TokenLogprob]]:
        """The prompt logprobs this step's chunks complete, for the requests that asked and have not yet sampled a
        token (a recompute after preemption does not repeat them). Every rank computes the full-vocabulary logits
        of those rows (a collective); the driver turns them into TokenLogprob lists. Rows go through the LM head in
        slices of PROMPT_LOGPROBS_ROWS so a long chunk never holds more than that many vocabulary-wide rows."""
        rows: list[int] = []  # rows of `hidden`
        targets: list[int] = []  # the prompt token each row predicts
        num_top: list[int] = []  # the alternatives each row reports
        owners: list[tuple[str, int, int]] = []  # (request id, its first index in rows, how many)
        offset = 0
        for entry in output.scheduled:
            num_top_k = entry.sampling_params.prompt_logprobs
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
        entries: list[TokenLogprob] = []
        for start in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            index = torch.tensor(rows[start:start + PROMPT_LOGPROBS_ROWS], device=hidden.device)
            logits = self.model.compute_logits(hidden[index])
            if self.parallel.is_driver:
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                stop = start + len(index)
                entries.extend(token_logprobs(logprobs, targets[start:stop], num_top[start:stop]))
        if not self.parallel.is_driver:
            return {}
        return {request_id: entries[first:first + count] for request_id, first, count in owners}
