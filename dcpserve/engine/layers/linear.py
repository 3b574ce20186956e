"""Tensor-parallel linear layers: weights split by output rows (column parallel) or input columns (row parallel).

Weights keep torch's [out_features, in_features] layout, as checkpoints store them. Each parameter carries a
ShardedLoader that reads only this rank's rows or columns of the checkpoint tensor (shard ids: "q" / "k" / "v"
for QKVParallelLinear, the part index for MergedColumnParallelLinear).

- ColumnParallelLinear: rank r holds output rows [r * out/tp, (r+1) * out/tp); its output stays sharded.
- RowParallelLinear: rank r holds input columns [r * in/tp, ...); partial outputs are summed over the TP group
  (the bias is added once, on rank 0, before the sum); reduce_results=False leaves the sum to the caller (a MoE
  layer sums its experts' partials first and reduces once).
- ReplicatedLinear: the whole weight on every rank (MLA's small latent down-projections).
- MergedColumnParallelLinear: several column-parallel outputs in one matmul (gate_proj + up_proj).
- QKVParallelLinear: q, k and v in one matmul. Query heads split over TP; KV heads split when
  tp <= num_kv_heads and are replicated when tp > num_kv_heads (rank r holds ParallelState.first_kv_head).

Every layer takes a LinearMethod (dcpserve/engine/layers/linear_method.py): the weight in the model's dtype
(the default), or FP8 block-quantized with its `weight_scale_inv` loaded by the same shard layout.
"""

from __future__ import annotations

import torch

from dcpserve.engine.layers.linear_method import UNQUANTIZED, LinearMethod
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.weights import ShardedLoader, ShardId, ShardSpec, new_parameter
from dcpserve.engine.worker.parallel import ParallelState


def split_for_tp(size: int, tp_size: int, what: str) -> int:
    """size / tp_size, or an error naming `what` when tp does not divide it."""
    if size % tp_size != 0:
        raise ValueError(f"{what}={size} is not divisible by tp={tp_size}; choose tp among the divisors of {size}")
    return size // tp_size


class ColumnParallelLinear(EngineModule):
    """y_local = x @ W_local^T + b_local, W split by output rows; the output stays sharded over TP."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelState,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        method: LinearMethod = UNQUANTIZED,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.parallel = parallel
        self.method = method
        self.output_size_per_rank = rows = split_for_tp(output_size, parallel.tp_size, "output_size")
        start = parallel.tp_rank * rows
        weight_rows = ShardSpec((output_size, input_size), 0, start, rows)
        bias_rows = ShardSpec((output_size,), 0, start, rows)
        self.weight, self.weight_scale_inv = method.create_weights(
            (rows, input_size), {None: weight_rows}, dtype, device,
            f"ColumnParallelLinear(output_size={output_size}) at tp={parallel.tp_size}",
        )
        self.bias = new_parameter((rows,), dtype, device, ShardedLoader({None: bias_rows})) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.weight, self.weight_scale_inv, self.bias)


class ReplicatedLinear(EngineModule):
    """y = x @ W^T + b with the whole weight on every rank (identical outputs, no collective)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 method: LinearMethod = UNQUANTIZED) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.method = method
        shape = (output_size, input_size)
        self.weight, self.weight_scale_inv = method.create_weights(
            shape, {None: ShardSpec(shape)}, dtype, device, f"ReplicatedLinear(output_size={output_size})"
        )
        self.bias = new_parameter((output_size,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.weight, self.weight_scale_inv, self.bias)


class RowParallelLinear(EngineModule):
    """y = sum over TP ranks of x_local @ W_local^T (+ b once), W split by input columns."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelState,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        reduce_results: bool = True,
        method: LinearMethod = UNQUANTIZED,
    ) -> None:
        """reduce_results=False: forward returns this rank's partial sum; the caller all-reduces."""
        super().__init__()
        self.reduce_results = reduce_results
        self.input_size = input_size
        self.output_size = output_size
        self.parallel = parallel
        self.method = method
        self.input_size_per_rank = cols = split_for_tp(input_size, parallel.tp_size, "input_size")
        columns = ShardSpec((output_size, input_size), 1, parallel.tp_rank * cols, cols)
        self.weight, self.weight_scale_inv = method.create_weights(
            (output_size, cols), {None: columns}, dtype, device,
            f"RowParallelLinear(input_size={input_size}) at tp={parallel.tp_size}",
        )
        # The bias is replicated (every rank holds it; only rank 0 adds it).
        self.bias = new_parameter((output_size,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Adding the bias on rank 0 inside the sum keeps tp = 1 identical to a plain nn.Linear.
        bias = self.bias if self.parallel.tp_rank == 0 else None
        partial = self.method.apply(x, self.weight, self.weight_scale_inv, bias)
        return self.parallel.all_reduce(partial) if self.reduce_results else partial


class MergedColumnParallelLinear(EngineModule):
    """Several column-parallel projections of the same input in one matmul; shard_id is the index of the part."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        parallel: ParallelState,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        method: LinearMethod = UNQUANTIZED,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.parallel = parallel
        self.method = method
        self.output_sizes_per_rank = [split_for_tp(size, parallel.tp_size, "output_size") for size in output_sizes]
        weight_specs: dict[ShardId, ShardSpec] = {}
        bias_specs: dict[ShardId, ShardSpec] = {}
        offset = 0
        for index, (size, rows) in enumerate(zip(self.output_sizes, self.output_sizes_per_rank, strict=True)):
            start = parallel.tp_rank * rows
            weight_specs[index] = ShardSpec((size, input_size), 0, start, rows, offset)
            bias_specs[index] = ShardSpec((size,), 0, start, rows, offset)
            offset += rows
        self.weight, self.weight_scale_inv = method.create_weights(
            (offset, input_size), weight_specs, dtype, device,
            f"MergedColumnParallelLinear(output_sizes={self.output_sizes}) at tp={parallel.tp_size}",
        )
        self.bias = new_parameter((offset,), dtype, device, ShardedLoader(bias_specs)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.weight, self.weight_scale_inv, self.bias)


class QKVParallelLinear(EngineModule):
    """q, k, v projections in one matmul; output rows are [this rank's q heads | its KV heads (k) | (v)]."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        parallel: ParallelState,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        method: LinearMethod = UNQUANTIZED,
    ) -> None:
        super().__init__()
        self.method = method
        if num_kv_heads != parallel.num_kv_heads:
            raise ValueError(
                f"QKVParallelLinear got num_kv_heads={num_kv_heads} but ParallelState was built for "
                f"{parallel.num_kv_heads}: pass the model's num_key_value_heads to init_parallel_state"
            )
        tp = parallel.tp_size
        if tp < num_kv_heads and num_kv_heads % tp != 0:
            raise ValueError(f"tp={tp} must divide num_kv_heads={num_kv_heads} when it is smaller")
        if tp > num_kv_heads and tp % num_kv_heads != 0:
            raise ValueError(f"tp={tp} must be a multiple of num_kv_heads={num_kv_heads} when it is larger")
        self.hidden_size = hidden_size
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.parallel = parallel
        self.num_heads_per_rank = split_for_tp(num_heads, tp, "num_attention_heads")
        self.num_kv_heads_per_rank = parallel.kv_heads_per_rank
        self.first_head = parallel.tp_rank * self.num_heads_per_rank
        self.first_kv_head = parallel.first_kv_head
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.num_kv_heads_per_rank * head_dim
        total = self.q_size + 2 * self.kv_size
        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        q_start, kv_start = self.first_head * head_dim, self.first_kv_head * head_dim
        # shard "q": this rank's query heads; "k" / "v": the KV heads it holds (split or replicated).
        parts = {
            "q": (q_rows, q_start, self.q_size, 0),
            "k": (kv_rows, kv_start, self.kv_size, self.q_size),
            "v": (kv_rows, kv_start, self.kv_size, self.q_size + self.kv_size),
        }
        weight_specs: dict[ShardId, ShardSpec] = {
            shard: ShardSpec((full, hidden_size), 0, start, rows, offset)
            for shard, (full, start, rows, offset) in parts.items()
        }
        bias_specs: dict[ShardId, ShardSpec] = {
            shard: ShardSpec((full,), 0, start, rows, offset) for shard, (full, start, rows, offset) in parts.items()
        }
        self.weight, self.weight_scale_inv = method.create_weights(
            (total, hidden_size), weight_specs, dtype, device,
            f"QKVParallelLinear(num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}) at "
            f"tp={tp}",
        )
        self.bias = new_parameter((total,), dtype, device, ShardedLoader(bias_specs)) if bias else None

    def forward_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (qk [T, heads_per_rank + kv_heads_per_rank, D]: the query heads, then the keys; v
        [T, kv_heads_per_rank, D]), views of one matmul: what rotates alike (RoPE) rotates in one pass."""
        qkv = self.method.apply(x, self.weight, self.weight_scale_inv, self.bias)
        num_tokens = x.shape[0]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        return (qk.view(num_tokens, self.num_heads_per_rank + self.num_kv_heads_per_rank, self.head_dim),
                v.view(num_tokens, self.num_kv_heads_per_rank, self.head_dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, heads_per_rank, D], k and v [T, kv_heads_per_rank, D] (views of one matmul)."""
        qk, v = self.forward_qk(x)
        q, k = qk.split([self.num_heads_per_rank, self.num_kv_heads_per_rank], dim=1)
        return q, k, v
