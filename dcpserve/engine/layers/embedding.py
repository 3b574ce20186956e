"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to tp * ceil(vocab_size / tp) rows and rank r holds the contiguous rows
[r * rows_per_rank, (r+1) * rows_per_rank). Padding rows (past vocab_size) are zero and never read: the
embedding masks ids outside the shard, and the LM head drops the padded logits after the gather.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.nn.functional as F

from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.weights import ShardedLoader, ShardSpec, new_parameter
from dcpserve.engine.worker.parallel import ParallelState


class VocabParallelEmbedding(EngineModule):
    """Token embedding with the vocabulary split over TP ranks; ids outside this rank's shard give 0, then a sum."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.parallel = parallel
        self.rows_per_rank = -(-vocab_size // parallel.tp_size)
        # With heavy padding a trailing rank may hold no real rows at all (start == end == vocab_size).
        self.vocab_start = min(parallel.tp_rank * self.rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        real_rows = self.vocab_end - self.vocab_start
        loader = ShardedLoader({None: ShardSpec((vocab_size, hidden_size), 0, self.vocab_start, real_rows)})
        self.weight = new_parameter((self.rows_per_rank, hidden_size), dtype, device, loader)
        with torch.no_grad():
            self.weight.zero_()  # padding rows stay zero: the loader writes rows [0, real_rows) only

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden], identical on every TP rank."""
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        embedded = F.embedding(local_ids, self.weight)
        embedded = embedded.masked_fill(~in_shard[:, None], 0.0)
        return self.parallel.all_reduce(embedded)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocabulary: local logits of this rank's shard, gathered to the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)

    @overload
    def compute_logits(self, hidden: torch.Tensor, driver_only: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def compute_logits(self, hidden: torch.Tensor, driver_only: bool) -> torch.Tensor | None: ...

    def compute_logits(self, hidden: torch.Tensor, driver_only: bool = False) -> torch.Tensor | None:
        """hidden [S, hidden] -> logits [S, vocab_size] float32, the full vocabulary on every rank, or with
        driver_only on the driver (TP rank 0) alone and None elsewhere (every rank must call it: a collective)."""
        local = F.linear(hidden, self.weight)  # [S, rows_per_rank], in the model dtype as HF computes it
        # [S, tp * rows_per_rank], shards in rank order
        full = self.parallel.gather_last_dim_to_driver(local) if driver_only else self.parallel.gather_last_dim(local)
        return full[:, : self.vocab_size].float() if full is not None else None
