"""Capacity planning: for each valid TP x DCP layout, how many KV tokens and long-context sequences fit.

gpu_memory_utilization means what it means to the engine (EngineArgs, CacheConfig) and to vLLM: the fraction of
each GPU's total memory the engine may use for weights, activations and KV cache together. Per rank the budget is
gpu_memory * gpu_memory_utilization; weights come off first, the rest is KV pages of block_size tokens, as the
engine sizes its cache. A replica holds pages_per_rank * block_size * dcp tokens (docs/dcp.md, Accounting).
Activations, CUDA graphs and communication buffers are not counted (the engine does not measure them either: they
live in the 1 - gpu_memory_utilization share), so real capacity is somewhat lower.
What a model caches per token and what it weighs per rank comes from its ModelSpec (dcpserve/cluster/model_specs.py: GQA
through the engine's ModelConfig, MLA for DeepSeek-V2 / V3, any other config through GenericSpec); `plan_layouts` is
the one place capacity is computed. Weights are counted in one dtype, or with weight_dtype "auto" as the checkpoint
ships them (its quantization_config: dcpserve/cluster/weight_formats.py), which the plan names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpserve.cluster.model_specs import ModelSpec, as_model_spec
from dcpserve.cluster.weight_formats import WeightFormat
from dcpserve.engine.config import DTYPES, ModelConfig
from dcpserve.engine.core.block_manager import num_blocks_for_budget

# The engine's dtypes, and float8 (1 byte): vLLM serves fp8 checkpoints (DeepSeek-V3) and an fp8 KV cache.
PLAN_DTYPES: dict[str, torch.dtype] = {**DTYPES, "float8": torch.float8_e4m3fn}
# Weights also "auto": as the checkpoint ships them (its quantization_config; unquantized ones in the plan's dtype).
WEIGHT_DTYPES = ("auto", *PLAN_DTYPES)

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
    dtype: str = "bfloat16"  # of weights and KV cache, unless one of the two below is set
    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # of a GPU's total memory for weights + activations + KV (the engine's)
    weight_dtype: str | None = None  # None: dtype; "auto": as the checkpoint ships them (else in dtype)
    kv_dtype: str | None = None  # None: dtype
    max_pcp: int = 1  # PCP sizes planned: the powers of two up to this (1: no PCP)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if not isinstance(self.max_pcp, int) or self.max_pcp < 1:
            raise ValueError(f"max_pcp must be a positive integer, got {self.max_pcp!r}")
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"gpu_memory_bytes must be positive, got {self.gpu_memory_bytes}")
        if self.context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {self.context_len}")
        for name in ("dtype", "weight_dtype", "kv_dtype"):
            value = getattr(self, name)
            choices = WEIGHT_DTYPES if name == "weight_dtype" else tuple(PLAN_DTYPES)
            if value is not None and value not in choices:
                raise ValueError(f"{name} {value!r} is not supported; choose one of {sorted(choices)}")
        # Frozen: resolve the defaults once, so every reader sees the dtypes the plan is for.
        object.__setattr__(self, "weight_dtype", self.weight_dtype or self.dtype)
        object.__setattr__(self, "kv_dtype", self.kv_dtype or self.dtype)
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
        return powers_of_two(self.gpus_per_node)

    @property
    def pcp_sizes(self) -> list[int]:
        """Powers of two up to max_pcp."""
        return powers_of_two(self.max_pcp)


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to limit."""
    return [1 << i for i in range(limit.bit_length())]


@dataclass(frozen=True)
class PlanRow:
    """Capacity of one TP x DCP (x PCP) layout."""

    tp: int
    dcp: int
    weight_bytes_per_rank: int
    kv_bytes_per_token_per_rank: int
    kv_tokens_per_replica: int  # pages per rank * block_size * dcp; 0 when the weights do not fit
    kv_head_copies: int  # ranks holding each KV head without DCP: (tp / kv_heads when tp > kv_heads, else 1) * pcp
    kv_head_copies_with_dcp: float  # kv_head_copies / dcp: 1 means no KV is duplicated
    seqs_per_replica: int  # sequences of context_len that fit in the KV cache at once
    replicas_per_node: int
    seqs_per_node: int
    weights_fit: bool
    pcp: int = 1  # PCP groups of tp ranks: a replica has tp * pcp GPUs


def count_parameters(model: ModelConfig | ModelSpec) -> int:
    """Parameters of the whole model (ModelSpec.parameters_per_rank at tp=1)."""
    return as_model_spec(model).parameters_per_rank(1)


def weight_format(model: ModelConfig | ModelSpec, weight_dtype: str, dtype: str = "bfloat16") -> WeightFormat:
    """The format a plan counts weights in: "auto" is the checkpoint's quantization (in `dtype` when it has none),
    any other weight_dtype every parameter in that dtype."""
    if weight_dtype == "auto":
        return as_model_spec(model).quantization or WeightFormat.uniform(dtype)
    return WeightFormat.uniform(weight_dtype)


def weight_bytes_per_rank(model: ModelConfig | ModelSpec, tp: int, dtype: str | WeightFormat) -> int:
    """Weight bytes on one TP rank (what a rank holds: ModelSpec.parameter_parts), every parameter in `dtype`, or by
    part in a WeightFormat ("auto": the checkpoint's)."""
    spec = as_model_spec(model)
    return (dtype if isinstance(dtype, WeightFormat) else weight_format(spec, dtype)).bytes_of(spec.parameter_parts(tp))


def invalid_tp_sizes(model: ModelConfig | ModelSpec, request: PlanRequest) -> list[tuple[int, str]]:
    """TP sizes of the request that the model cannot use at all, with the layout rules' reason."""
    spec = as_model_spec(model)
    invalid = []
    for tp in request.tp_sizes:
        try:
            spec.validate_layout(tp, 1)
        except ValueError as err:
            invalid.append((tp, str(err)))
    return invalid


def plan_layouts(model: ModelConfig | ModelSpec, request: PlanRequest) -> list[PlanRow]:
    """One row per (tp, dcp, pcp) the model's layout rules accept, tp * pcp GPUs on one node (tp in request.tp_sizes,
    pcp in request.pcp_sizes), in (pcp, tp, dcp) order."""
    spec = as_model_spec(model)
    kv_dtype = PLAN_DTYPES[request.kv_dtype or request.dtype]  # (resolved so by __post_init__)
    weights_format = weight_format(spec, request.weight_dtype or request.dtype, request.dtype)
    rows = []
    for pcp in request.pcp_sizes:
        for tp in request.tp_sizes:
            ranks = tp * pcp
            if ranks > request.gpus_per_node:
                continue
            for dcp in (d for d in range(1, ranks + 1) if ranks % d == 0):
                try:
                    spec.validate_layout(tp, dcp, pcp)
                except ValueError:
                    continue
                weights = weight_bytes_per_rank(spec, tp, weights_format)
                kv_per_token = spec.kv_bytes_per_token_per_rank(tp, kv_dtype, request.context_len)
                free = request.budget_bytes_per_rank - weights
                pages_per_rank = num_blocks_for_budget(max(0, free), request.block_size, kv_per_token)
                kv_tokens = pages_per_rank * request.block_size * dcp
                copies = (tp // spec.num_kv_heads if tp > spec.num_kv_heads else 1) * pcp
                seqs = kv_tokens // request.context_len
                replicas = request.gpus_per_node // ranks
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
                    pcp=pcp,
                ))
    return rows


def format_plan(model: ModelConfig | ModelSpec, request: PlanRequest, rows: list[PlanRow], model_name: str) -> str:
    """The plan as text: a header with the model, memory and context, an aligned table, and notes."""
    spec = as_model_spec(model)
    weights = weight_format(spec, request.weight_dtype or request.dtype, request.dtype).name
    if weights == request.kv_dtype:
        dtypes = f"dtype {weights}"
    else:
        dtypes = f"weights {weights}, KV cache {request.kv_dtype}"
    lines = [
        f"model    {model_name}: {spec.architecture}, {format_count(count_parameters(spec))} parameters, "
        f"{spec.describe_shape()}",
        f"memory   {request.gpus_per_node} GPUs per node x {format_bytes(request.gpu_memory_bytes)}, utilization "
        f"{request.gpu_memory_utilization:g} -> {format_bytes(request.budget_bytes_per_rank)} per rank for weights "
        f"+ KV; {dtypes}; block size {request.block_size}",
        f"context  {request.context_len:,} tokens per sequence",
    ]
    if request.context_len > spec.max_position_embeddings:
        lines.append(
            f"warning  the context exceeds the model's max_position_embeddings ({spec.max_position_embeddings:,})"
        )
    with_pcp = request.max_pcp > 1  # the pcp column only when PCP is planned
    header = ("tp", *(("pcp",) if with_pcp else ()), "dcp", "weights/rank", "KV B/token/rank", "KV tokens/replica",
              "KV head copies", "seqs/replica", "replicas/node", "seqs/node", "")
    table = [header]
    for row in rows:
        if not row.weights_fit:
            note = "weights do not fit"
        elif row.seqs_per_replica == 0:
            note = "KV < one context"
        else:
            note = ""
        table.append((
            str(row.tp), *((str(row.pcp),) if with_pcp else ()), str(row.dcp), format_bytes(row.weight_bytes_per_rank),
            f"{row.kv_bytes_per_token_per_rank:,}",
            f"{row.kv_tokens_per_replica:,}", f"{row.kv_head_copies} -> {row.kv_head_copies_with_dcp:g}",
            f"{row.seqs_per_replica:,}", str(row.replicas_per_node), f"{row.seqs_per_node:,}", note,
        ))
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    lines.append("")
    for cells in table:
        # Right-aligned numbers, left-aligned note.
        text = "  ".join(cell.rjust(width) for cell, width in zip(cells[:-1], widths[:-1], strict=True))
        lines.append(f"{text}  {cells[-1]}".rstrip())
    lines.append("")
    lines.append("Weights and KV cache only: activations, CUDA graphs and communication buffers are not counted.")
    if rows and not any(row.weights_fit for row in rows):
        smallest = min(rows, key=lambda row: row.weight_bytes_per_rank)
        lines.append(
            f"no layout fits the weights: at best {format_bytes(smallest.weight_bytes_per_rank)} per rank "
            f"(tp={smallest.tp}, {weights}) against {format_bytes(request.budget_bytes_per_rank)} per "
            f"rank; use a smaller --weight-dtype, GPUs with more memory, or more GPUs per node"
        )
    lines += _dcp_gain(rows, request)
    lines += _pcp_gain(rows, spec.num_kv_heads)
    lines += spec.notes()
    lines += _weight_dtype_notes(spec, request)
    largest_tp = max(request.tp_sizes)
    kv_heads = spec.num_kv_heads
    if largest_tp <= kv_heads:
        lines.append(
            f"dcp=1 only: DCP needs tp > the model's {kv_heads} KV head{'s' if kv_heads > 1 else ''}, and tp is at "
            f"most {largest_tp} with {request.gpus_per_node} GPUs per node"
        )
    for tp, reason in invalid_tp_sizes(spec, request):
        lines.append(f"tp={tp} not shown: {reason}")
    if not rows:
        lines.append(f"no valid layout: the model's heads do not divide across any tp in {request.tp_sizes}")
    return "\n".join(lines)


def _dcp_gain(rows: list[PlanRow], request: PlanRequest) -> list[str]:
    """The largest DCP of the largest tp that has one, against dcp=1 at that tp (same GPUs, same weights)."""
    by_layout = {(row.tp, row.dcp): row for row in rows if row.weights_fit and row.pcp == 1}
    sharded = [row for row in by_layout.values() if row.dcp > 1 and (row.tp, 1) in by_layout]
    if not sharded:
        return []
    best = max(sharded, key=lambda row: (row.tp, row.dcp))
    base = by_layout[(best.tp, 1)]
    if base.kv_tokens_per_replica == 0:
        return []
    return [
        f"DCP at tp={best.tp}: dcp={best.dcp} holds {best.kv_tokens_per_replica:,} KV tokens per replica against "
        f"{base.kv_tokens_per_replica:,} at dcp=1 ({best.kv_tokens_per_replica / base.kv_tokens_per_replica:g}x), "
        f"{best.seqs_per_replica:,} sequences of {request.context_len:,} tokens against {base.seqs_per_replica:,}, "
        f"on the same {best.tp} GPUs"
    ]


def _pcp_gain(rows: list[PlanRow], kv_heads: int) -> list[str]:
    """Per tp with a PCP row: the largest pcp at its largest dcp against pcp = 1, dcp = 1 at that tp."""
    by_layout = {(row.tp, row.pcp, row.dcp): row for row in rows if row.weights_fit}
    notes = []
    for tp in sorted({row.tp for row in rows if row.pcp > 1}):
        base = by_layout.get((tp, 1, 1))
        candidates = [row for (t, p, _), row in by_layout.items() if t == tp and p > 1]
        if base is None or not candidates or base.kv_tokens_per_replica == 0:
            continue
        best = max(candidates, key=lambda row: (row.pcp, row.dcp))
        notes.append(
            f"PCP at tp={tp}: pcp={best.pcp} dcp={best.dcp} ({tp * best.pcp} GPUs) holds "
            f"{best.kv_tokens_per_replica:,} KV tokens per replica against {base.kv_tokens_per_replica:,} at pcp=1 "
            f"dcp=1 ({best.kv_tokens_per_replica / base.kv_tokens_per_replica:g}x; tp x pcp / kv heads = "
            f"{tp * best.pcp / kv_heads:g} when dcp shards every copy), and splits each prefill chunk {best.pcp} ways"
        )
    return notes


def _weight_dtype_notes(spec: ModelSpec, request: PlanRequest) -> list[str]:
    """What the weight count assumed: the checkpoint's quantization, or the one dtype it was overridden with."""
    notes = []
    quantization = spec.quantization
    if quantization is not None and request.weight_dtype != "auto":
        notes.append(
            f"The checkpoint's weights are quantized ({quantization.name}, quantization_config); this plan counts them "
            f"as {request.weight_dtype}. --weight-dtype auto plans them as shipped."
        )
    if request.weight_dtype == "auto" and quantization is not None:  # unquantized: the header's dtype says it all
        notes.append(f"Weights as the checkpoint ships them (quantization_config): "
                     f"{quantization.describe(spec.parameter_parts(1))}.")
    if request.weight_dtype == "float8":
        notes.append(
            "float8 weights: every parameter counted at 1 byte; fp8 checkpoints keep the embedding, LM head, norms "
            "and router in bf16 and add block scales, so real weights are slightly larger (--weight-dtype auto "
            "counts an fp8 checkpoint's as shipped)."
        )
    return notes
