"""A rank's persistent batch: the state of every request the ranks are running, kept across steps.

The scheduler sends a request's sampling parameters and whole block table once, in the entry that first schedules
it (again after a preemption); later entries carry only the step's tokens and the blocks allocated since
(dcpserve/engine/core/step.py, ScheduledRequest). This module keeps what the ranks learned: one row per running request
in a block table that lives on the rank's device, the request's parameters, and how many of its blocks are filled in.

Each step costs host work in proportion to the batch and the tokens computed (a decode is one token), never to the
context: the step's block table is an index_select of rows on the device. A decode-only step (the common one)
computes each row's slot and DCP local length on the host from the rank's copy of the row's block ids, a few
integer operations per row, and sends all its per-row values in one tensor; a step with prefill chunks computes
them on the device with the vectorized layout functions (dcpserve/kernels/layout.py).

A row's columns past its blocks repeat its last page, and the pages a step hands out fresh are listed
(fresh_pages) for the model runner to zero on CPU: every slot a decode batch reads past a sequence's length then
holds that sequence's own KV or zeros, never another request's (AttentionMetadata.finite_tail).

`rebuild_step_inputs` builds the same inputs from whole block tables, as the engine did before this module existed;
the tests check that both agree after random add / finish / preempt / abort sequences.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from dcpserve.engine.core.step import ScheduledRequest, SchedulerOutput
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.worker.attention_metadata import AttentionMetadata, no_prefill_tensors
from dcpserve.engine.worker.pcp import PcpSplit
from dcpserve.engine.worker.step_timer import ExchangeTimer
from dcpserve.kernels import dcp_local_seq_lens, dcp_slot_mapping


@dataclass
class CachedRequestState:
    """What a rank keeps of one running request."""

    request_id: str
    row: int  # its row of the device block table
    sampling_params: SamplingParams
    # The block ids filled into its row, also kept on the host: a decode step computes its slot from them.
    block_ids: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class StepInputs:
    """One step's model inputs on one rank."""

    input_ids: torch.Tensor  # [num_tokens] int64, on the device
    positions: torch.Tensor  # [num_tokens] int64, on the device
    metadata: AttentionMetadata
    sample_rows: list[int]  # rows of the hidden states to sample, in scheduled order
    sampling: list[tuple[ScheduledRequest, SamplingParams]]  # the sampled entries with their parameters
    # pcp > 1 with prefill chunks: how the step's rows split across PCP ranks; the tensors above are this rank's rows
    # (sample_rows too, on PCP rank 0, which samples; empty on the others).
    pcp_split: PcpSplit | None = None


class InputBatch:
    """The requests a rank is running and their block table rows on the device."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, dcp_size: int, dcp_rank: int,
                 device: torch.device, pcp_size: int = 1, pcp_rank: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.dcp_rank = dcp_rank
        self.pcp_size = pcp_size
        self.pcp_rank = pcp_rank
        self.device = device
        self.block_table = torch.zeros((max_num_seqs, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.requests: dict[str, CachedRequestState] = {}
        # The few requests that need per-step work beyond sampling, so that the common step skips them in O(1).
        self.penalized: set[str] = set()  # repetition / frequency / presence penalties: token history kept
        self.wants_prompt_logprobs: set[str] = set()
        self.not_plain_greedy: set[str] = set()  # anything but argmax: sampling, logprobs, bias, min_tokens, grammar
        self.masked_greedy: set[str] = set()  # of those, greedy with a grammar and nothing else: masked argmax
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() takes the lowest row
        # The pages the last apply() handed out fresh (blocks wholly past each request's computed tokens): they may
        # hold a finished request's KV; the model runner zeroes them on CPU (AttentionMetadata.finite_tail).
        self.fresh_pages: list[int] = []
        self._no_prefill = no_prefill_tensors(device)

    def __len__(self) -> int:
        return len(self.requests)

    def sampling_params(self, request_id: str) -> SamplingParams | None:
        state = self.requests.get(request_id)
        return state.sampling_params if state is not None else None

    # ---- what changed --------------------------------------------------------------------------------------------

    def drop(self, request_ids: Iterable[str]) -> None:
        """Finished, aborted or preempted requests: their rows are free again (ids never sent are ignored)."""
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            self.penalized.discard(request_id)
            self.wants_prompt_logprobs.discard(request_id)
            self.not_plain_greedy.discard(request_id)
            self.masked_greedy.discard(request_id)
            if state is not None:
                # The row keeps its stale pages: the next request in it rewrites every column when it is learned.
                self._free_rows.append(state.row)

    def apply(self, output: SchedulerOutput) -> None:
        """Drops what finished or was preempted since the last step, then learns new requests and new blocks."""
        self.drop(output.finished_request_ids)
        self.drop(output.preempted_request_ids)
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        grown: list[CachedRequestState] = []
        fresh: list[int] = []
        tokens_per_block = self.block_size * self.dcp_size
        for entry in output.scheduled:
            state = self._learn(entry)
            if entry.new_block_ids:
                count = len(entry.new_block_ids)
                if state.num_blocks + count > self.max_blocks_per_seq:
                    raise RuntimeError(
                        f"request {entry.request_id!r} would hold {state.num_blocks + count} blocks but a sequence "
                        f"holds at most {self.max_blocks_per_seq} (max_model_len): the scheduler over-allocated"
                    )
                rows.extend([state.row] * count)
                cols.extend(range(state.num_blocks, state.num_blocks + count))
                values.extend(entry.new_block_ids)
                # Blocks wholly past the computed tokens are freshly allocated; those before start_position hold
                # computed KV (a cached prefix, or a running request's earlier blocks) and must be kept.
                first_fresh = -(-entry.start_position // tokens_per_block) - state.num_blocks
                fresh.extend(entry.new_block_ids[max(first_fresh, 0):])
                state.block_ids.extend(entry.new_block_ids)
                grown.append(state)
        self.fresh_pages = fresh
        if values:
            index = (torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64))
            self.block_table.index_put_(
                tuple(i.to(self.device, non_blocking=True) for i in index),
                torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True),
            )
            # Padding columns repeat the row's last page: a decode batch reads every row up to its longest row's
            # pages, and a row's own pages hold only its own KV or zeros (fresh_pages), never another request's.
            for state in grown:
                if state.num_blocks < self.max_blocks_per_seq:
                    self.block_table[state.row, state.num_blocks:].fill_(state.block_ids[-1])

    def _learn(self, entry: ScheduledRequest) -> CachedRequestState:
        state = self.requests.get(entry.request_id)
        if entry.sampling_params is not None:  # new to the ranks (first scheduled, or readmitted after preemption)
            if state is not None:
                raise RuntimeError(f"request {entry.request_id!r} is sent as new but this rank already runs it")
            if not self._free_rows:
                raise RuntimeError(f"more than max_num_seqs={self.max_num_seqs} requests scheduled at once")
            params = entry.sampling_params
            state = CachedRequestState(entry.request_id, self._free_rows.pop(), params)
            self.requests[entry.request_id] = state
            if params.has_penalties:
                self.penalized.add(entry.request_id)
            if params.prompt_logprobs is not None:
                self.wants_prompt_logprobs.add(entry.request_id)
            plain = params.greedy and params.logprobs is None and not params.logit_bias and not params.has_penalties
            if not (plain and params.min_tokens == 0 and params.structured_output is None):
                self.not_plain_greedy.add(entry.request_id)
            if plain and params.structured_output is not None:
                # min_tokens too: a constrained row's stop tokens are folded into its bitmask by the scheduler.
                self.masked_greedy.add(entry.request_id)
        elif state is None:
            raise RuntimeError(
                f"request {entry.request_id!r} is scheduled as running but this rank never learned it (a step was "
                f"lost between the driver and this rank)"
            )
        return state

    # ---- this step's inputs --------------------------------------------------------------------------------------

    def prepare(self, output: SchedulerOutput, exchange_timer: ExchangeTimer | None = None) -> StepInputs:
        """Applies the step's changes and builds its inputs. Rows: decodes first, then prefill chunks (the
        scheduler's order)."""
        self.apply(output)
        scheduled = output.scheduled
        states = [self.requests[entry.request_id] for entry in scheduled]
        sampling = [(entry, state.sampling_params) for entry, state in zip(scheduled, states, strict=True)
                    if entry.sample]
        if scheduled and len(scheduled[-1].token_ids) == 1:  # decodes come first: the last row decides
            return self._decode_inputs(scheduled, states, exchange_timer, sampling)
        rows = torch.tensor([state.row for state in states], dtype=torch.int64)
        width = max((state.num_blocks for state in states), default=0)
        table = self.block_table.index_select(0, rows.to(self.device, non_blocking=True))[:, : max(width, 1)]
        inputs = build_step_inputs(scheduled, table, self.block_size, self.dcp_size, self.dcp_rank, self.device,
                                   exchange_timer, sampling)
        return inputs if self.pcp_size == 1 else self._pcp_rows(inputs, scheduled)

    def _pcp_rows(self, inputs: StepInputs, scheduled: Sequence[ScheduledRequest]) -> StepInputs:
        """The step's inputs cut to this PCP rank's rows: every decode and its segments of each prefill chunk
        (dcpserve/engine/worker/pcp.py). The last token of every chunk is PCP rank 0's, so its rows include every
        sampled one."""
        num_decodes = inputs.metadata.num_decode_tokens
        prefills = scheduled[num_decodes:]
        metadata, split = inputs.metadata.for_pcp_rank(
            [len(e.token_ids) for e in prefills], [e.start_position for e in prefills], self.pcp_size,
            self.pcp_rank, self.dcp_size, self.dcp_rank)
        own_rows = split.own_rows()
        index = torch.tensor(own_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        sample_rows: list[int] = []
        if self.pcp_rank == 0:
            own_index = {row: i for i, row in enumerate(own_rows)}
            sample_rows = [own_index[row] for row in inputs.sample_rows]
        return StepInputs(inputs.input_ids[index], inputs.positions[index], metadata, sample_rows, inputs.sampling,
                          split)

    def _decode_inputs(self, scheduled: Sequence[ScheduledRequest], states: list[CachedRequestState],
                       exchange_timer: ExchangeTimer | None,
                       sampling: list[tuple[ScheduledRequest, SamplingParams]]) -> StepInputs:
        """The common step, one token per sequence: build_step_inputs' results, with each row's slot and local
        length computed here from the host's copy of its block ids (a few integer operations per row), and every
        per-row value sent to the device in one tensor. The general path's index math is a dozen tensor ops, which
        on CPU cost more than the decode step's whole Python work (and on CUDA are a dozen launches).
        The layout is dcpserve/kernels/layout.py's with interleave 1: position p is on DCP rank (p % tokens_per_block) %
        dcp, at slot offset // dcp of its block's page, and a rank holds (p + dcp - rank) // dcp of the positions
        0..p. The tests hold this to build_step_inputs after random add / finish / preempt / abort sequences."""
        block_size, dcp, rank = self.block_size, self.dcp_size, self.dcp_rank
        tokens_per_block = block_size * dcp
        count = len(scheduled)
        positions = [entry.start_position for entry in scheduled]
        slots = []
        for position, state in zip(positions, states, strict=True):
            block, offset = divmod(position, tokens_per_block)
            slots.append(state.block_ids[block] * block_size + offset // dcp if offset % dcp == rank else -1)
        values = [state.row for state in states] + positions + [entry.token_ids[0] for entry in scheduled] + slots
        values += [position + 1 for position in positions] if dcp == 1 else [
            (position + dcp - rank) // dcp for position in positions]
        packed = torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)
        rows, positions_t, input_ids, slot_mapping, local_lens = packed.split(count)
        width = max(state.num_blocks for state in states)
        table = self.block_table.index_select(0, rows)[:, :width]
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=count,
            decode_block_table=table,
            decode_local_seq_lens=local_lens.to(torch.int32),
            prefill_block_table=table[count:],
            prefill_query_start_loc=self._no_prefill[0],
            prefill_local_context_lens=self._no_prefill[1],
            prefill_max_query_len=0,
            exchange_timer=exchange_timer,
            all_slots_owned=dcp == 1,
        )
        sample_rows = [i for i, entry in enumerate(scheduled) if entry.sample]
        return StepInputs(input_ids, positions_t, metadata, sample_rows, sampling)


def build_step_inputs(scheduled: Sequence[ScheduledRequest], table: torch.Tensor, block_size: int, dcp_size: int,
                      dcp_rank: int, device: torch.device, exchange_timer: ExchangeTimer | None,
                      sampling: list[tuple[ScheduledRequest, SamplingParams]]) -> StepInputs:
    """Token ids, positions and this rank's AttentionMetadata for `scheduled` given its block table rows `table`
    ([len(scheduled), width] int32 on the device). Python work: one pass over the entries plus the chunks' tokens;
    per-token index math runs vectorized on the device."""
    input_ids: list[int] = []
    starts: list[int] = []
    counts: list[int] = []
    sample_rows: list[int] = []
    num_decodes = 0
    for entry in scheduled:
        input_ids.extend(entry.token_ids)
        starts.append(entry.start_position)
        counts.append(len(entry.token_ids))
        if entry.sample:
            sample_rows.append(len(input_ids) - 1)
        if len(entry.token_ids) == 1 and num_decodes == len(starts) - 1:
            num_decodes += 1  # the scheduler puts single-token rows first

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    num_seqs, num_tokens = len(starts), len(input_ids)
    packed = to_device(torch.tensor(starts + input_ids, dtype=torch.int64))  # one copy to the device, not two
    starts_t, ids = packed[:num_seqs], packed[num_seqs:]
    # The persistent batch keeps the table right: no value checks (on CUDA they would read the device back).
    counts_t = to_device(torch.tensor(counts, dtype=torch.int64))
    seq_index = torch.repeat_interleave(torch.arange(len(scheduled), device=device), counts_t, output_size=num_tokens)
    first_row = torch.cumsum(counts_t, 0) - counts_t  # each entry's first row in the token batch
    positions = starts_t[seq_index] + torch.arange(num_tokens, device=device) - first_row[seq_index]
    slot_mapping = dcp_slot_mapping(table, seq_index, positions, block_size, dcp_size, dcp_rank, validate=False)
    query_start_loc = torch.cat([counts_t.new_zeros(1), torch.cumsum(counts_t[num_decodes:], 0)]).to(torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decode_tokens=num_decodes,
        decode_block_table=table[:num_decodes],
        decode_local_seq_lens=dcp_local_seq_lens(starts_t[:num_decodes] + 1, dcp_size, dcp_rank),
        prefill_block_table=table[num_decodes:],
        prefill_query_start_loc=query_start_loc,
        prefill_local_context_lens=dcp_local_seq_lens(starts_t[num_decodes:], dcp_size, dcp_rank),
        prefill_max_query_len=max(counts[num_decodes:], default=0),
        exchange_timer=exchange_timer,
        all_slots_owned=dcp_size == 1,
    )
    return StepInputs(ids, positions, metadata, sample_rows, sampling)


def rebuild_step_inputs(scheduled: Sequence[ScheduledRequest], block_tables: dict[str, list[int]], block_size: int,
                        dcp_size: int, dcp_rank: int) -> StepInputs:
    """The same inputs from each request's whole block table (on the CPU, no persistent state): what InputBatch
    must reproduce. Used by the tests."""
    width = max((len(block_tables[e.request_id]) for e in scheduled), default=0)
    table = torch.zeros((len(scheduled), max(width, 1)), dtype=torch.int32)
    for i, entry in enumerate(scheduled):
        blocks = block_tables[entry.request_id]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        if blocks:
            table[i, len(blocks):] = blocks[-1]  # padding repeats the row's last page, as InputBatch keeps it
    return build_step_inputs(scheduled, table, block_size, dcp_size, dcp_rank, torch.device("cpu"), None, [])
