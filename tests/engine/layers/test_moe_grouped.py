"""The grouped routed experts (dcpserve/engine/layers/moe.py) against a float64 per-token reference, by method and
dtype, including the hostile routings (one token, no token, every token on one expert, k = num_experts); and the
layer's forward free of host synchronisation: it runs on the meta device, where reading a value back (.item(),
.tolist(), nonzero, torch.unique, boolean indexing) raises, as the old one-expert-at-a-time loop does there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.moe import ExpertLoop
from dcpserve.engine.deepseek_config import MoeConfig
from dcpserve.engine.layers.moe import (
    DeepseekMoE,
    ExpertsMethod,
    TensorParallelExperts,
    choose_experts_method,
    group_by_expert,
)
from dcpserve.engine.worker.parallel import ParallelState

HIDDEN, INTERMEDIATE, EXPERTS = 64, 32, 8
CPU = torch.device("cpu")


def make_experts(method: ExpertsMethod | None, dtype: torch.dtype, tp: int = 1, rank: int = 0,
                 device: torch.device = CPU, seed: int = 0) -> TensorParallelExperts:
    parallel = ParallelState(tp_size=tp, tp_rank=rank, dcp_size=1, dcp_rank=0, num_kv_heads=1)
    experts = TensorParallelExperts(EXPERTS, HIDDEN, INTERMEDIATE, parallel, dtype, device, method=method)
    if device.type != "meta":
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in (experts.w13, experts.w2):
                param.copy_((torch.randn(param.shape, generator=generator) * 0.2).to(dtype))
    return experts


def reference(experts: TensorParallelExperts, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """Each token's chosen experts one by one, in float64."""
    w13, w2 = experts.w13.double(), experts.w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot])
            gate, up = (w13[expert] @ x[token].double()).chunk(2)
            out[token] += float(weights[token, slot]) * (w2[expert] @ (F.silu(gate) * up))
    return out


def routing(tokens: int, k: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64, distinct per token)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "same":  # every token on experts 3, 4, ...: one run per expert, the others empty
        ids = (torch.arange(k) + 3).remainder(EXPERTS).expand(tokens, k).clone()
    else:
        ids = torch.rand(tokens, EXPERTS, generator=generator).argsort(dim=-1)[:, :k]
    return torch.rand(tokens, k, generator=generator), ids


CASES = [(1, 2, "random"), (0, 2, "random"), (37, 2, "random"), (16, 1, "random"), (9, EXPERTS, "random"),
         (12, 3, "same")]


@pytest.mark.parametrize("method", ["grouped_mm", "padded"])
@pytest.mark.parametrize("tokens,k,kind", CASES)
def test_grouped_experts_match_per_token_reference(method: ExpertsMethod, tokens: int, k: int, kind: str) -> None:
    experts = make_experts(method, torch.float32)
    weights, ids = routing(tokens, k, kind, seed=tokens + k)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    out = experts(x, weights, ids)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(experts, x, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_methods_agree_in_low_precision(dtype: torch.dtype, tol: float) -> None:
    """Both methods in bf16 / fp16 against the float64 reference of the same rounded weights (STYLE.md's relative
    bounds, on the scale of the largest output)."""
    weights, ids = routing(21, 2, "random", seed=5)
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    for method in ("grouped_mm", "padded"):
        experts = make_experts(method, dtype)
        expected = reference(experts, x, weights, ids)
        scale = float(expected.abs().max())
        torch.testing.assert_close(experts(x, weights, ids).double(), expected, rtol=tol, atol=tol * scale)


def test_tensor_parallel_slices_sum_to_the_whole() -> None:
    """Each rank's slice of every expert gives its partial sum; the sum over ranks is the tp = 1 output."""
    whole = make_experts("grouped_mm", torch.float32)
    weights, ids = routing(13, 2, "random", seed=7)
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(3))
    tp, rows = 4, INTERMEDIATE // 4
    total = torch.zeros_like(x)
    for rank in range(tp):
        part = make_experts(None, torch.float32, tp, rank)
        with torch.no_grad():
            gate = whole.w13[:, :INTERMEDIATE][:, rank * rows:(rank + 1) * rows]
            up = whole.w13[:, INTERMEDIATE:][:, rank * rows:(rank + 1) * rows]
            part.w13.copy_(torch.cat([gate, up], dim=1))
            part.w2.copy_(whole.w2[:, :, rank * rows:(rank + 1) * rows])
        total += part(x, weights, ids)
    torch.testing.assert_close(total, whole(x, weights, ids), rtol=1e-5, atol=1e-6)


def test_group_by_expert_sorts_pairs_and_counts_runs() -> None:
    ids = torch.tensor([[5, 1], [1, 7], [0, 5]])
    groups = group_by_expert(ids, torch.arange(1, EXPERTS + 1))
    assert groups.expert_ids.tolist() == [0, 1, 1, 5, 5, 7]
    assert groups.rows.tolist() == [2, 0, 1, 0, 2, 1]  # tokens in order within an expert
    assert groups.ends.tolist() == [1, 3, 3, 3, 3, 5, 5, 6] and groups.ends.dtype == torch.int32


def test_method_choice_follows_alignment_and_device() -> None:
    assert choose_experts_method(torch.float32, CPU, 64, 4) == "grouped_mm"
    assert choose_experts_method(torch.bfloat16, CPU, 64, 4) == "padded"  # 8-byte rows
    assert choose_experts_method(torch.float32, torch.device("meta"), 64, 16) == "padded"  # grouped_mm: bf16 only
    assert choose_experts_method(torch.bfloat16, torch.device("meta"), 64, 16) == "grouped_mm"


# ---- no host synchronisation ------------------------------------------------------------------------------------




MOE = MoeConfig(n_routed_experts=EXPERTS, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=INTERMEDIATE,
                first_k_dense_replace=0, moe_layer_freq=1, routed_scaling_factor=1.0, scoring_func="softmax",
                topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=True)


@pytest.mark.parametrize("method,dtype", [("grouped_mm", torch.bfloat16), ("padded", torch.float32)])
def test_moe_layer_forward_never_reads_the_routing_back(method: ExpertsMethod, dtype: torch.dtype) -> None:
    """The whole layer (router, grouped experts, shared expert) on the meta device: any host read of a routing
    value, or a shape that depends on one, raises there; the output's shape is the input's."""
    meta = torch.device("meta")
    layer = DeepseekMoE(HIDDEN, MOE, ParallelState.single(1), dtype, meta)
    layer.experts = make_experts(method, dtype, device=meta)
    out = layer(torch.empty(32, HIDDEN, dtype=dtype, device=meta))
    assert out.shape == (32, HIDDEN) and out.device == meta


def test_the_old_expert_loop_fails_the_meta_check() -> None:
    """The check can fail: the loop it replaced reads the experts back to the host, which meta cannot do."""
    meta = torch.device("meta")
    layer = DeepseekMoE(HIDDEN, MOE, ParallelState.single(1), torch.float32, meta)
    layer.experts = ExpertLoop(EXPERTS, HIDDEN, INTERMEDIATE, ParallelState.single(1), torch.float32, meta)
    with pytest.raises((RuntimeError, NotImplementedError), match="(?i)meta"):
        layer(torch.empty(32, HIDDEN, device=meta))
