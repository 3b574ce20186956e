"""Capacity planning: for each valid TP x DCP layout, how many KV tokens and long-context sequences fit.

gpu_memory_utilization means what it means to the engine (EngineArgs, CacheConfig) and to vLLM: the fraction of
each GPU's total memory the engine may use for weights, activations and KV cache together. Per rank the budget is
gpu_memory * gpu_memory_utilization; weights come off first, the rest is KV pages of block_size tokens, as the
engine sizes its cache. A replica holds pages_per_rank * block_size * dcp tokens (docs/dcp.md, Accounting).
Activations, CUDA graphs and communication buffers are not counted (the engine does not measure them either: they
live in the 1 - gpu_memory_utilization share), so real capacity is somewhat lower.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import DTYPES, ModelConfig, ParallelConfig

_GIB = 1 << 30


def format_bytes(size: int) -> str:
    """GiB with two decimals, or MiB / KiB below one GiB so small models do not read as 0.00 GiB."""
    for unit, factor in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor:
            return f"{size / factor:.2f} {unit}"
    return f"{size} B"


def format_count(count: int) -> str:
    for suffix, factor in (("B", 10**9), ("M", 10**6)):
        if count >= factor:
            return f"{count / factor:.2f}{suffix}"
    return f"{count:,}"


@dataclass(frozen=True)
class PlanRequest:
    """The hardware and workload a plan is for."""

    gpus_per_node: int
    gpu_memory_bytes: int  # per GPU
    context_len: int  # tokens of one sequence (prompt + output)
    dtype: str = "bfloat16"  # of weights and KV cache
    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # of a GPU's total memory for weights + activations + KV (the engine's)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"gpu_memory_bytes must be positive, got {self.gpu_memory_bytes}")
        if self.context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {self.context_len}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def budget_bytes_per_rank(self) -> int:
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    @property
    def tp_sizes(self) -> list[int]:
        """Powers of two up to the GPUs of one node (a replica never spans nodes)."""
        sizes, tp = [], 1
        while tp <= self.gpus_per_node:
            sizes.append(tp)
            tp *= 2
        return sizes


@dataclass(frozen=True)
class PlanRow:
    """Capacity of one TP x DCP layout."""

    tp: int
    dcp: int
    weight_bytes_per_rank: int
    kv_bytes_per_token_per_rank: int
    kv_tokens_per_replica: int  # pages per rank * block_size * dcp; 0 when the weights do not fit
    kv_head_copies: int  # ranks holding each KV head without DCP: tp / kv_heads when tp > kv_heads, else 1
    kv_head_copies_with_dcp: float  # kv_head_copies / dcp: 1 means no KV is duplicated
    seqs_per_replica: int  # sequences of context_len that fit in the KV cache at once
    replicas_per_node: int
    seqs_per_node: int
    weights_fit: bool


def count_parameters(model: ModelConfig) -> int:
    """Parameters of the whole model: embeddings, attention, MLP, norms and the LM head unless tied."""
    return _parameters_per_rank(model, tp=1)


def weight_bytes_per_rank(model: ModelConfig, tp: int, dtype: str) -> int:
    """Weight bytes on one TP rank (embedding and LM head vocab-parallel; KV projections copied when tp > kv_heads)."""
    return _parameters_per_rank(model, tp) * DTYPES[dtype].itemsize


def _parameters_per_rank(model: ModelConfig, tp: int) -> int:
    hidden, head_dim = model.hidden_size, model.head_dim
    vocab_shard = -(-model.vocab_size // tp)
    heads = model.num_attention_heads // tp
    kv_heads = max(1, model.num_key_value_heads // tp)  # a rank holds at least one whole KV head
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    if model.attention_bias:
        attention += (heads + 2 * kv_heads) * head_dim
    mlp = 3 * hidden * -(-model.intermediate_size // tp)  # gate, up, down
    norms = 2 * hidden + (2 * head_dim if model.qk_norm else 0)
    embeddings = vocab_shard * hidden * (1 if model.tie_word_embeddings else 2)
    return embeddings + model.num_hidden_layers * (attention + mlp + norms) + hidden


def invalid_tp_sizes(model: ModelConfig, request: PlanRequest) -> list[tuple[int, str]]:
    """TP sizes of the request that the model cannot use at all, with ParallelConfig.validate's reason."""
    invalid = []
    for tp in request.tp_sizes:
        try:
            ParallelConfig(tp, 1).validate(model)
        except ValueError as err:
            invalid.append((tp, str(err)))
    return invalid


def plan_layouts(model: ModelConfig, request: PlanRequest) -> list[PlanRow]:
    """One row per (tp, dcp) that ParallelConfig.validate accepts, tp in request.tp_sizes, in (tp, dcp) order."""
    rows = []
    dtype = DTYPES[request.dtype]
    for tp in request.tp_sizes:
        for dcp in (d for d in range(1, tp + 1) if tp % d == 0):
            try:
                ParallelConfig(tp, dcp).validate(model)
            except ValueError:
                continue
            weights = weight_bytes_per_rank(model, tp, request.dtype)
            kv_per_token = model.kv_bytes_per_token_per_rank(tp, dtype)
            free = request.budget_bytes_per_rank - weights
            pages_per_rank = max(0, free // kv_per_token // request.block_size)
            kv_tokens = pages_per_rank * request.block_size * dcp
            copies = tp // model.num_key_value_heads if tp > model.num_key_value_heads else 1
            seqs = kv_tokens // request.context_len
            replicas = request.gpus_per_node // tp
            rows.append(PlanRow(
                tp=tp,
                dcp=dcp,
                weight_bytes_per_rank=weights,
                kv_bytes_per_token_per_rank=kv_per_token,
                kv_tokens_per_replica=kv_tokens,
                kv_head_copies=copies,
                kv_head_copies_with_dcp=copies / dcp,
                seqs_per_replica=seqs,
                replicas_per_node=replicas,
                seqs_per_node=seqs * replicas,
                weights_fit=free > 0,
            ))
    return rows


def format_plan(model: ModelConfig, request: PlanRequest, rows: list[PlanRow], model_name: str) -> str:
    """The plan as text: a header with the model, memory and context, an aligned table, and notes."""
    params = count_parameters(model)
    lines = [
        f"model    {model_name}: {model.architecture}, {format_count(params)} parameters, {model.num_hidden_layers} "
        f"layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, {model.num_key_value_heads} KV "
        f"head{'s' if model.num_key_value_heads > 1 else ''}, head_dim {model.head_dim}, vocab {model.vocab_size}",
        f"memory   {request.gpus_per_node} GPUs per node x {format_bytes(request.gpu_memory_bytes)}, utilization "
        f"{request.gpu_memory_utilization:g} -> {format_bytes(request.budget_bytes_per_rank)} per rank for weights "
        f"+ KV; dtype {request.dtype}; block size {request.block_size}",
        f"context  {request.context_len:,} tokens per sequence",
    ]
    if request.context_len > model.max_position_embeddings:
        lines.append(
            f"warning  the context exceeds the model's max_position_embeddings ({model.max_position_embeddings:,})"
        )
    header = ("tp", "dcp", "weights/rank", "KV B/token/rank", "KV tokens/replica", "KV head copies",
              "seqs/replica", "replicas/node", "seqs/node", "")
    table = [header]
    for row in rows:
        if not row.weights_fit:
            note = "weights do not fit"
        elif row.seqs_per_replica == 0:
            note = "KV < one context"
        else:
            note = ""
        table.append((
            str(row.tp), str(row.dcp), format_bytes(row.weight_bytes_per_rank), f"{row.kv_bytes_per_token_per_rank:,}",
            f"{row.kv_tokens_per_replica:,}", f"{row.kv_head_copies} -> {row.kv_head_copies_with_dcp:g}",
            f"{row.seqs_per_replica:,}", str(row.replicas_per_node), f"{row.seqs_per_node:,}", note,
        ))
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    lines.append("")
    for cells in table:
        # Right-aligned numbers, left-aligned note.
        text = "  ".join(cell.rjust(width) for cell, width in zip(cells[:-1], widths[:-1]))
        lines.append(f"{text}  {cells[-1]}".rstrip())
    lines.append("")
    lines.append("Weights and KV cache only: activations, CUDA graphs and communication buffers are not counted.")
    largest_tp = max(request.tp_sizes)
    if largest_tp <= model.num_key_value_heads:
        lines.append(
            f"dcp=1 only: DCP needs tp > the model's {model.num_key_value_heads} KV heads, and tp is at most "
            f"{largest_tp} with {request.gpus_per_node} GPUs per node"
        )
    for tp, reason in invalid_tp_sizes(model, request):
        lines.append(f"tp={tp} not shown: {reason}")
    if not rows:
        lines.append(f"no valid layout: the model's heads do not divide across any tp in {request.tp_sizes}")
    return "\n".join(lines)
