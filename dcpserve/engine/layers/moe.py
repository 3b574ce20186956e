"""Mixture-of-experts MLPs on tensor-parallel experts: the router, the routed experts as one grouped computation,
and DeepSeek's layer (Qwen's is dcpserve/engine/models/qwen3_moe.py, on the same router and experts).

Every rank holds 1/tp of every expert, split like a dense MLP: each expert's gate / up projections by output rows
(column parallel), its down projection by input columns (row parallel). Every rank routes every token the same way
(the router and its inputs are replicated), runs the experts its tokens chose on its slice of their intermediate
size, weighs them, adds the shared experts' slice (the same split) and the sum over ranks is one all-reduce per
layer: the exact MoE output. Nothing is dropped or capped, and no rank waits on another's experts. (Expert
parallelism, whole experts per rank with an all-to-all of tokens, is the later step for large expert counts.)

Grouped experts (vLLM's fused_moe and SGLang sort the same way): a step's (token, expert) pairs are sorted by expert
(a stable sort: tokens in order within an expert), the tokens gathered in that order, and every expert touched runs
in one grouped matrix product per projection over its run of rows, the runs' ends found by a binary search of the
sorted ids (`group_by_expert`). Each pair's output is put back in its (token, slot) place and a token's k outputs
are summed in slot order, weighed in fp32 (`combine_pairs`); `grouped_experts` is the whole computation on given
stacked weights (the unquantized experts' own, or FP8 experts' dequantized ones: dcpserve/engine/layers/
fp8_experts.py). No tensor is read back to the host and no shape depends on the routing (T tokens always make
T * k rows): the layer runs on the meta device (tests/engine/layers/test_moe_grouped.py holds it to that, and shows
the old one-expert-at-a-time loop failing there), so decode may be captured in a CUDA graph (not yet run on a GPU).
Two ways to run the grouped product, chosen once per module from dtype, device and shape (`choose_experts_method`):
- "grouped_mm": torch._grouped_mm over the sorted rows with the runs' ends as offsets (CPU; CUDA in bf16 on sm80+);
  it needs every operand's rows 16-byte aligned.
- "padded": each expert's rows scattered into a [num_experts, T, hidden] buffer (T is the static bound: a token
  picks an expert at most once), one batched matmul per projection over it, rows gathered back. num_experts / k
  times the FLOPs of the rows themselves, and buffers of num_experts * T rows: the fallback for shapes and dtypes
  grouped_mm refuses (fp32 / fp16 on CUDA, rows not 16-byte aligned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from dcpserve.engine.deepseek_config import MoeConfig
from dcpserve.engine.layers.linear import split_for_tp
from dcpserve.engine.layers.linear_method import UNQUANTIZED, LinearMethod
from dcpserve.engine.layers.mlp import SwiGluMLP
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.weights import ShardId, ShardSpec, StackedLoader, new_parameter
from dcpserve.engine.worker.parallel import ParallelState

ExpertsMethod = Literal["grouped_mm", "padded"]


class TopKRouter(EngineModule):
    """The gate: scores of every expert per token (softmax or sigmoid of fp32 logits), the num_experts_per_tok chosen
    (greedily, or within the best expert groups), and their weights (dcpserve/engine/deepseek_config.py has the
    rules)."""

    def __init__(self, hidden_size: int, moe: MoeConfig, device: torch.device) -> None:
        super().__init__()
        self.moe = moe
        # fp32 whatever the model dtype, as transformers keeps the gate (routing is sensitive to rounding).
        self.weight = new_parameter((moe.n_routed_experts, hidden_size), torch.float32, device)
        self.e_score_correction_bias = (
            new_parameter((moe.n_routed_experts,), torch.float32, device) if moe.has_correction_bias else None
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        moe = self.moe
        logits = F.linear(hidden.to(torch.float32), self.weight)
        scores = logits.softmax(dim=-1) if moe.scoring_func == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if moe.topk_method != "greedy":
            grouped = choice.view(choice.shape[0], moe.n_group, -1)
            if moe.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            groups = group_scores.topk(moe.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        experts = choice.topk(moe.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, experts


@dataclass(frozen=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert; P = T * k pairs, pair p = token p // k, slot p % k."""

    order: torch.Tensor  # [P] int64: the pair at each sorted position
    expert_ids: torch.Tensor  # [P] int64: the expert of each sorted position (ascending)
    rows: torch.Tensor  # [P] int64: the token (row of x) of each sorted position
    ends: torch.Tensor  # [num_experts] int32: one past the last sorted position of each expert (cumulative counts)


def group_by_expert(experts: torch.Tensor, expert_ends: torch.Tensor) -> ExpertGroups:
    """experts [T, k] int64 ids, expert_ends = arange(1, num_experts + 1) on their device -> the pairs sorted by
    expert; nothing read back to the host."""
    expert_ids, order = experts.reshape(-1).sort(stable=True)
    ends = torch.searchsorted(expert_ids, expert_ends, out_int32=True)
    return ExpertGroups(order, expert_ids, order // experts.shape[1], ends)


def combine_pairs(pairs: torch.Tensor, groups: ExpertGroups, weights: torch.Tensor) -> torch.Tensor:
    """pairs [P, hidden] in sorted order, weights [T, k] -> [T, hidden] in pairs' dtype: each token's k outputs put
    back in slot order, weighed and summed in fp32 (deterministic: no atomics, the same order on every device)."""
    tokens, k = weights.shape
    unsorted = torch.empty_like(pairs).index_copy_(0, groups.order, pairs)
    hidden = pairs.shape[1]
    summed = torch.bmm(weights.to(torch.float32)[:, None, :], unsorted.view(tokens, k, hidden).to(torch.float32))
    return summed.view(tokens, hidden).to(pairs.dtype)


def choose_experts_method(dtype: torch.dtype, device: torch.device, hidden_size: int, rows: int) -> ExpertsMethod:
    """"grouped_mm" where torch._grouped_mm runs these operands (hidden_size and the per-rank intermediate `rows`
    whole multiples of 16 bytes; CPU in any float dtype, CUDA / meta in bf16 on sm80+), else "padded"."""
    aligned = hidden_size * dtype.itemsize % 16 == 0 and rows * dtype.itemsize % 16 == 0
    if not aligned or not hasattr(torch, "_grouped_mm"):
        return "padded"
    if device.type == "cpu":
        return "grouped_mm"
    if device.type == "meta":
        return "grouped_mm" if dtype == torch.bfloat16 else "padded"
    if device.type == "cuda" and dtype == torch.bfloat16:
        return "grouped_mm" if torch.cuda.get_device_capability(device) >= (8, 0) else "padded"
    return "padded"


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    method: ExpertsMethod, expert_ends: torch.Tensor,
) -> torch.Tensor:
    """The grouped SwiGLU experts (module docstring): x [T, hidden], weights [T, k] fp32, experts [T, k] int64,
    w13 [E, 2 * rows, hidden] (gate rows, then up rows), w2 [E, hidden, rows] in x's dtype, expert_ends =
    arange(1, E + 1) on x's device -> sum over each token's experts of weight * expert(x) [T, hidden], x's dtype."""
    groups = group_by_expert(experts, expert_ends)
    sorted_x = x.index_select(0, groups.rows)
    if method == "grouped_mm":
        gate, up = torch._grouped_mm(sorted_x, w13.transpose(1, 2), offs=groups.ends).chunk(2, dim=-1)
        pairs = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=groups.ends)
    else:
        pairs = _padded_products(sorted_x, groups, w13, w2, x.shape[0])
    return combine_pairs(pairs, groups, weights)


def _padded_products(sorted_x: torch.Tensor, groups: ExpertGroups, w13: torch.Tensor, w2: torch.Tensor,
                     tokens: int) -> torch.Tensor:
    """The "padded" method: sorted rows [P, hidden] -> expert outputs [P, hidden] through [E, T, .] buffers (a
    token's pairs are with distinct experts, so T rows per expert always suffice)."""
    num_experts, hidden = w13.shape[0], sorted_x.shape[1]
    starts = torch.searchsorted(groups.expert_ids, groups.expert_ids)  # each run's first sorted position
    place = groups.expert_ids * tokens + (torch.arange(len(starts), device=starts.device) - starts)
    padded = sorted_x.new_zeros(num_experts * tokens, hidden).index_copy_(0, place, sorted_x)
    gate, up = torch.bmm(padded.view(num_experts, tokens, hidden), w13.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))
    return out.view(num_experts * tokens, hidden).index_select(0, place)


class RoutedExperts(Protocol):
    """What an MoE layer asks of its routed experts (TensorParallelExperts; another storage, such as FP8 experts,
    implements the same): built from (num_experts, hidden_size, intermediate_size, parallel, dtype, device) and what
    its storage needs (FP8: the quantization), holding stacked parameters whose loaders take the checkpoint's shard
    ids (expert, 0 | 1) for gate_proj / up_proj and (expert, None) for down_proj, and called as below. An
    implementation that dequantizes can hand its weights to `grouped_experts`."""

    num_experts: int

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights [T, k] fp32, experts [T, k] int64 -> this rank's partial sum [T, hidden] in x's
        dtype (not reduced over TP ranks), with no host synchronisation."""
        ...


def expert_shard_specs(hidden_size: int, intermediate_size: int, parallel: ParallelState
                       ) -> tuple[int, dict[ShardId, ShardSpec], dict[ShardId, ShardSpec]]:
    """This rank's slice of every routed expert, as stacked experts (unquantized or FP8) load it: (rows, the w13
    specs by part: 0 / 1 the checkpoint's gate_proj / up_proj rows, the w2 spec: None, down_proj's columns)."""
    rows = split_for_tp(intermediate_size, parallel.tp_size, "moe_intermediate_size")
    start = parallel.tp_rank * rows
    w13_specs: dict[ShardId, ShardSpec] = {
        0: ShardSpec((intermediate_size, hidden_size), 0, start, rows, 0),
        1: ShardSpec((intermediate_size, hidden_size), 0, start, rows, rows),
    }
    return rows, w13_specs, {None: ShardSpec((hidden_size, intermediate_size), 1, start, rows)}


class TensorParallelExperts(EngineModule):
    """The routed experts, stacked and run grouped (module docstring): w13 [experts, 2 * I / tp, hidden] (gate rows,
    then up rows, of this rank's slice) and w2 [experts, hidden, I / tp]; checkpoint shard ids (expert, 0 | 1) for
    gate_proj / up_proj, (expert, None) for down_proj. forward returns this rank's partial sum (not reduced)."""

    expert_ends: torch.Tensor  # [experts] int64, arange(1, experts + 1): a buffer, so it moves with the module

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, parallel: ParallelState,
        dtype: torch.dtype, device: torch.device, method: ExpertsMethod | None = None,
    ) -> None:
        """method None: choose_experts_method's choice for this dtype, device and shape."""
        super().__init__()
        rows, w13_specs, w2_specs = expert_shard_specs(hidden_size, intermediate_size, parallel)
        self.num_experts = num_experts
        self.intermediate_per_rank = rows
        self.method: ExpertsMethod = method or choose_experts_method(dtype, device, hidden_size, rows)
        self.w13 = new_parameter((num_experts, 2 * rows, hidden_size), dtype, device,
                                 StackedLoader(num_experts, w13_specs))
        self.w2 = new_parameter((num_experts, hidden_size, rows), dtype, device, StackedLoader(num_experts, w2_specs))
        self.register_buffer("expert_ends", torch.arange(1, num_experts + 1, device=device), persistent=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights [T, k] fp32, experts [T, k] int64 -> sum over each token's experts of
        weight * expert(x), this rank's part, in x's dtype."""
        return grouped_experts(x, weights, experts, self.w13, self.w2, self.method, self.expert_ends)


class DeepseekMoE(EngineModule):
    """Router, routed experts and shared experts of one layer; one all-reduce of their summed partials."""

    def __init__(
        self, hidden_size: int, moe: MoeConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device,
        experts: RoutedExperts | None = None, shared_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        """experts: the routed experts, when not TensorParallelExperts in dtype (an FP8 checkpoint's); shared_method:
        the shared experts' weight storage (dcpserve/engine/layers/linear_method.py)."""
        super().__init__()
        self.parallel = parallel
        self.gate = TopKRouter(hidden_size, moe, device)
        self.experts: RoutedExperts = experts if experts is not None else TensorParallelExperts(
            moe.n_routed_experts, hidden_size, moe.moe_intermediate_size, parallel, dtype, device
        )
        self.shared_experts = (
            SwiGluMLP(hidden_size, moe.moe_intermediate_size * moe.n_shared_experts, parallel, dtype, device,
                      reduce_results=False, method=shared_method)
            if moe.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.parallel.all_reduce(out)
