"""DeepSeek's mixture-of-experts MLP on tensor-parallel experts.

Every rank holds 1/tp of every expert, split like a dense MLP: each expert's gate / up projections by output rows
(column parallel), its down projection by input columns (row parallel). Every rank routes every token the same way
(the router and its inputs are replicated), runs the experts its tokens chose on its slice of their intermediate
size, weighs them, adds the shared experts' slice (the same split) and the sum over ranks is one all-reduce per
layer: the exact MoE output. Nothing is dropped or capped, and no rank waits on another's experts. (Expert
parallelism, whole experts per rank with an all-to-all of tokens, is the later step for large expert counts.)

Experts run one at a time, each on the tokens that chose it (those that received none are skipped), in expert
order as transformers does, so tp = 1 sums in its order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dcpserve.engine.deepseek_config import MoeConfig
from dcpserve.engine.layers.linear import split_for_tp
from dcpserve.engine.layers.mlp import SwiGluMLP
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.weights import ShardSpec, StackedLoader, new_parameter
from dcpserve.engine.worker.parallel import ParallelState


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


class TensorParallelExperts(EngineModule):
    """The routed experts, stacked: w13 [experts, 2 * I / tp, hidden] (gate rows, then up rows, of this rank's
    slice) and w2 [experts, hidden, I / tp]. forward returns this rank's partial sum (not reduced)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, parallel: ParallelState,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__()
        rows = split_for_tp(intermediate_size, parallel.tp_size, "moe_intermediate_size")
        start = parallel.tp_rank * rows
        self.num_experts = num_experts
        self.intermediate_per_rank = rows
        # Shard ids (expert, part): part 0 / 1 the checkpoint's gate_proj / up_proj rows, None its down_proj columns.
        self.w13 = new_parameter((num_experts, 2 * rows, hidden_size), dtype, device, StackedLoader(num_experts, {
            0: ShardSpec((intermediate_size, hidden_size), 0, start, rows, 0),
            1: ShardSpec((intermediate_size, hidden_size), 0, start, rows, rows),
        }))
        self.w2 = new_parameter((num_experts, hidden_size, rows), dtype, device, StackedLoader(num_experts, {
            None: ShardSpec((hidden_size, intermediate_size), 1, start, rows),
        }))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights / experts [T, k] -> sum over each token's experts of weight * expert(x), this rank's
        part, in x's dtype."""
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == expert)
            gate, up = F.linear(x[tokens], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class DeepseekMoE(EngineModule):
    """Router, routed experts and shared experts of one layer; one all-reduce of their summed partials."""

    def __init__(
        self, hidden_size: int, moe: MoeConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.gate = TopKRouter(hidden_size, moe, device)
        self.experts = TensorParallelExperts(
            moe.n_routed_experts, hidden_size, moe.moe_intermediate_size, parallel, dtype, device
        )
        self.shared_experts = (
            SwiGluMLP(hidden_size, moe.moe_intermediate_size * moe.n_shared_experts, parallel, dtype, device,
                      reduce_results=False)
            if moe.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.parallel.all_reduce(out)
