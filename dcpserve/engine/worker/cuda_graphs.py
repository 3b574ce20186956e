"""CUDA graphs of decode steps: the model's forward over one token per sequence, captured once per batch size.

A decode step launches a few hundred small kernels whose launch cost, not their work, sets the step time at small
batches. Captured in a CUDA graph, the whole forward is one launch. The graph replays on fixed buffers: each step
copies its token ids, positions, slot mapping, block table rows and local lengths into the first n rows of the
buffers of the smallest captured size >= n, pads the rest (slot -1: nothing is stored; length 0: nothing is read),
replays, and takes the first n rows of the captured output. Everything the forward reads from the host is a shape
(no device value goes back to the host on this path: the Triton decode kernel takes its loop bounds from the lengths
on the device), so one capture serves every step of that size.

What runs eagerly: steps with a prefill chunk, decode batches larger than the largest size, `enforce_eager`, and
CPU (unless a test hands in a capture). At tp * pcp > 1 every rank of the group captures the same sizes in the same
order (all ranks get the same steps, so run() picks the same size on each), and the forward's TP / DCP / PCP
collectives are captured with it (NCCL on CUDA; the CPU groups' shared-memory transport copies through the host and
is not capturable); MoE layers run their experts grouped, with no host sync (dcpserve/engine/layers/moe.py).
Each size is captured on seeded inputs that read random pages filled with random values, under the capture-safety
check when asked (dcpserve/engine/worker/capture_safety.py: no host reads, data-dependent shapes or host copies,
each reported with the model's file:line), then its replay is compared with the eager forward on other seeded inputs
over other random pages (a zero cache would hide a graph that reads the wrong pages or lengths); the pages are
restored afterwards (to zeros, in a cache just allocated). A capture that fails, or disagrees, turns the graphs off
with a logged error instead of serving from them. Every rank runs the same forwards in the same order whatever its
comparison finds (a disagreement is raised after the last size), so the collectives of a group's ranks pair up.

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
from dcpserve.engine.worker.capture_safety import check_capture_safety

logger = logging.getLogger(__name__)

# The batch sizes captured (those up to max_num_seqs): vLLM's spacing, coarser (fewer graphs to capture and hold).
DECODE_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# The self-check's inputs: pages read per row, drawn from at most CHECK_PAGES random pages (what they held is kept
# aside meanwhile: a few MiB per layer at most), filled with random values of this scale.
CHECK_PAGES_PER_ROW = 4
CHECK_PAGES = 32
CHECK_CACHE_SCALE = 0.5

# capture(fn) -> (replay, output): fn runs the forward on the fixed buffers and returns its output tensor.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], Any], torch.Tensor]]


def cuda_capture(pool: Any = None) -> Capture:
    """Captures into torch.cuda.CUDAGraphs sharing one memory pool (the largest size is captured first, so the
    smaller ones reuse its memory). A warm-up call before each capture compiles the Triton kernels, lets cuBLAS
    choose its algorithms and sets up NCCL's communicators outside the graph; it runs on the capture's own side
    stream (torch's recipe for capturing NCCL collectives and libraries that cache a handle per stream)."""
    shared = [pool]
    stream = torch.cuda.Stream()

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=shared[0], stream=stream):
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
                 max_blocks_per_seq: int, device: torch.device, capture: Capture, sizes: Sequence[int],
                 safety_check: bool = False) -> None:
        """safety_check: each size's capture runs under the capture-safety check (capture_safety.py), and a violation
        raises CaptureSafetyError naming every host read, data-dependent shape and host copy with its file:line."""
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one batch size to capture")
        self.model = model
        self.vocab_size = vocab_size
        self.kv_caches = kv_caches
        self.sizes = sorted(set(sizes))
        self.safety_check = safety_check
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros((largest, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self._no_prefill_loc, self._no_prefill_lens = no_prefill_tensors(device)
        self.graphs: dict[int, tuple[Callable[[], Any], torch.Tensor]] = {}
        self.replays = 0  # steps served by a graph (the tests read it)
        # Every rank of a group runs this same sequence (capture, eager forward, replay per size, largest first),
        # so the forwards' collectives pair up; a size whose replay disagrees is reported after the last one, not
        # by stopping early (a rank that stopped would leave its peers waiting in the next size's collectives).
        disagreements = []
        for size in reversed(self.sizes):  # largest first: the others reuse its memory pool
            error = self._capture_checked(size, capture)
            if error is not None:
                disagreements.append(error)
        if disagreements:
            raise RuntimeError("; ".join(disagreements))

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

    def _capture_checked(self, size: int, capture: Capture) -> str | None:
        """Captures `size` and compares its replay with the eager forward on the same inputs: None when they agree,
        else the error. The capture runs on other inputs than the comparison (a replay that does not recompute
        fails it), both seeded (`_check_inputs`); with safety_check the capture (its warm-up and captured forwards)
        runs under the capture-safety check. The cache pages the inputs read are restored afterwards, whatever
        happens."""
        filled: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        try:
            filled.append(self._check_inputs(size, seed=2 * size))
            captured = functools.partial(capture, functools.partial(self._forward, size))
            self.graphs[size] = (check_capture_safety(captured, f"the decode forward of batch size {size}")
                                 if self.safety_check else captured())
            filled.append(self._check_inputs(size, seed=2 * size + 1))
            eager = self._forward(size)
            replay, output = self.graphs[size]
            replay()
            replayed = output.clone()
        finally:
            for pages, saved in reversed(filled):
                self._restore_pages(pages, saved)
            self.seq_lens[:size].zero_()
            self.block_table[:size].zero_()
        if not torch.allclose(replayed.float(), eager.float(), rtol=1e-2, atol=1e-2):
            error = float((replayed.float() - eager.float()).abs().max())
            return f"the decode graph of batch size {size} disagrees with the eager forward (max error {error:.3g})"
        return None

    def _caches(self) -> list[torch.Tensor]:
        """Every layer's K and V cache (a key-only cache once)."""
        return [cache for k, v in self.kv_caches for cache in ((k, v) if v is not k else (k,))]

    def _check_inputs(self, size: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Seeded inputs of the self-check (the same on every rank): random tokens and lengths over up to
        CHECK_PAGES_PER_ROW pages per row, of at most CHECK_PAGES random ones, which every layer's cache has filled
        with seeded random values (a zero cache would hide a graph that reads the wrong pages or lengths); nothing
        stored (slot -1). Returns the pages filled and what they held."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        k_cache = self.kv_caches[0][0]
        num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
        width = min(CHECK_PAGES_PER_ROW, self.block_table.shape[1], num_blocks)
        pages = torch.randperm(num_blocks, generator=generator)[:min(num_blocks, size * width, CHECK_PAGES)]
        table = pages[torch.randint(0, len(pages), (size, width), generator=generator)]
        lens = torch.randint(1, width * block_size + 1, (size,), generator=generator)
        self.input_ids[:size].copy_(torch.randint(0, self.vocab_size, (size,), generator=generator))
        self.positions[:size].copy_(lens - 1)
        self.seq_lens[:size].copy_(lens)
        self.slot_mapping[:size].fill_(-1)
        self.block_table[:size].zero_()
        self.block_table[:size, :width].copy_(table)
        device_pages = pages.to(k_cache.device)
        saved = []
        for cache in self._caches():
            saved.append(cache.index_select(0, device_pages))
            values = torch.randn((len(pages), *cache.shape[1:]), generator=generator) * CHECK_CACHE_SCALE
            cache.index_copy_(0, device_pages, values.to(device=cache.device, dtype=cache.dtype))
        return device_pages, saved

    def _restore_pages(self, pages: torch.Tensor, saved: list[torch.Tensor]) -> None:
        """Puts back what the self-check's pages held (zeros, in a cache just allocated)."""
        for cache, contents in zip(self._caches(), saved, strict=True):
            cache.index_copy_(0, pages, contents)

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
