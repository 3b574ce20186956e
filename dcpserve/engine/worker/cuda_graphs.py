"""CUDA graphs of decode steps: the model's forward over one token per sequence, captured once per batch size.

A decode step launches a few hundred small kernels whose launch cost, not their work, sets the step time at small
batches. Captured in a CUDA graph, the whole forward is one launch. The graph replays on fixed buffers: each step
copies its token ids, positions, slot mapping, block table rows and local lengths into the first n rows of the
buffers of the smallest captured size >= n, pads the rest (slot -1: nothing is stored; length 0: nothing is read),
replays, and takes the first n rows of the captured output. Everything the forward reads from the host is a shape
(no device value goes back to the host on this path: the Triton decode kernel takes its loop bounds from the lengths
on the device), so one capture serves every step of that size.

What runs eagerly: steps with a prefill chunk, decode batches larger than the largest size, `enforce_eager`, CPU,
tp > 1 (the DCP exchange inside a graph is not validated yet), and models with MoE layers (their expert loop reads
the routing back to the host). Each size is checked against the eager forward once, right after its capture; a
capture that fails or disagrees turns the graphs off with a logged error instead of serving from them.

`capture` is the only part that needs CUDA: `cuda_capture` records a torch.cuda.CUDAGraph; `emulated_capture` keeps
a graph's contract on any device (the output tensor is fixed at capture, a replay rewrites it from the current
buffers), which is how the tests exercise the buffers, padding and slicing on CPU.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dcpserve.engine.worker.attention_metadata import AttentionMetadata, no_prefill_tensors

logger = logging.getLogger(__name__)

# The batch sizes captured (those up to max_num_seqs): vLLM's spacing, coarser (fewer graphs to capture and hold).
DECODE_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# capture(fn) -> (replay, output): fn runs the forward on the fixed buffers and returns its output tensor.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], Any], torch.Tensor]]


def cuda_capture(pool: Any = None) -> Capture:
    """Captures into torch.cuda.CUDAGraphs sharing one memory pool (the largest size is captured first, so the
    smaller ones reuse its memory). A warm-up call before each capture compiles the Triton kernels and lets cuBLAS
    choose its algorithms outside the graph."""
    shared = [pool]

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=shared[0]):
            output = fn()
        if shared[0] is None:
            shared[0] = graph.pool()
        return graph.replay, output

    return capture


def emulated_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
    """A graph's contract without CUDA: the output tensor is the one made at capture; a replay runs fn on the
    buffers as they are now and writes its result into that tensor."""
    output = fn()
    return (lambda: output.copy_(fn())), output


class DecodeGraphs:
    """One captured forward per batch size in `sizes` over fixed input buffers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], vocab_size: int,
                 max_blocks_per_seq: int, device: torch.device, capture: Capture, sizes: Sequence[int]) -> None:
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one batch size to capture")
        self.model = model
        self.vocab_size = vocab_size
        self.kv_caches = kv_caches
        self.sizes = sorted(set(sizes))
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros((largest, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self._no_prefill_loc, self._no_prefill_lens = no_prefill_tensors(device)
        self.graphs: dict[int, tuple[Callable[[], Any], torch.Tensor]] = {}
        self.replays = 0  # steps served by a graph (the tests read it)
        for size in reversed(self.sizes):  # largest first: the others reuse its memory pool
            self.graphs[size] = capture(functools.partial(self._forward, size))
            self._check(size)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decode_tokens=size,
            decode_block_table=self.block_table[:size],
            decode_local_seq_lens=self.seq_lens[:size],
            prefill_block_table=self.block_table[size:size],
            prefill_query_start_loc=self._no_prefill_loc,
            prefill_local_context_lens=self._no_prefill_lens,
            prefill_max_query_len=0,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model.forward(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size))

    def _check(self, size: int) -> None:
        """The replay of `size` against the eager forward on the same inputs: tokens, positions and lengths that
        read the cache's first page, nothing stored (slot -1)."""
        generator = torch.Generator(device="cpu").manual_seed(size)
        self.input_ids[:size].copy_(torch.randint(0, self.vocab_size, (size,), generator=generator))
        lens = torch.randint(1, self.kv_caches[0][0].shape[1] + 1, (size,), generator=generator)
        self.positions[:size].copy_(lens - 1)
        self.seq_lens[:size].copy_(lens)
        self.slot_mapping[:size].fill_(-1)
        self.block_table[:size].zero_()
        replay, output = self.graphs[size]
        replay()
        replayed = output.clone()
        eager = self._forward(size)
        if not torch.allclose(replayed.float(), eager.float(), rtol=1e-2, atol=1e-2):
            error = float((replayed.float() - eager.float()).abs().max())
            raise RuntimeError(f"the decode graph of batch size {size} disagrees with the eager forward (max error "
                               f"{error:.3g})")
        self.seq_lens[:size].zero_()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states from a graph, or None when the step is not one a graph serves (a prefill chunk,
        a batch larger than the largest size, a block table wider than the buffers)."""
        count = metadata.num_decode_tokens
        width = metadata.decode_block_table.shape[1]
        if count == 0 or count != input_ids.shape[0] or count > self.sizes[-1] or width > self.block_table.shape[1]:
            return None
        size = next(s for s in self.sizes if s >= count)
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(positions)
        self.slot_mapping[:count].copy_(metadata.slot_mapping)
        self.block_table[:count, :width].copy_(metadata.decode_block_table)
        self.seq_lens[:count].copy_(metadata.decode_local_seq_lens)
        if size > count:  # padding rows: store nothing, read nothing
            self.input_ids[count:size].zero_()
            self.positions[count:size].zero_()
            self.slot_mapping[count:size].fill_(-1)
            self.seq_lens[count:size].zero_()
        replay, output = self.graphs[size]
        replay()
        self.replays += 1
        return output[:count]
