"""The DeepSeek-V2 / V3 part of a model config: multi-head latent attention, YaRN RoPE and the mixture of experts.

`read_deepseek_fields(raw, architecture, source)` reads them from a DeepseekV2ForCausalLM / DeepseekV3ForCausalLM
config.json (as the checkpoints ship it: rope_theta + rope_scaling, or transformers' rope_parameters) and refuses,
naming the field and the value, what the engine does not implement. ModelConfig (dcpserve/engine/config.py) holds the
result.

Routing follows DeepSeek's reference code and vLLM: scores = softmax or sigmoid of the router logits (scoring_func);
topk_method "greedy" takes the top num_experts_per_tok, "group_limited_greedy" first keeps the topk_group of n_group
expert groups with the highest best score, "noaux_tc" (V3) adds e_score_correction_bias to the scores for the choice
only and ranks groups by the sum of their two best; the weights are the chosen experts' scores, renormalized when
norm_topk_prob, times routed_scaling_factor. (transformers' DeepseekV2 ignores norm_topk_prob; DeepSeek-V2 and
V2-Lite ship it false.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, get_args

logger = logging.getLogger(__name__)

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
ScoringFunc = Literal["softmax", "sigmoid"]
TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
# What each architecture's reference code does when its config.json leaves the field out.
DEFAULT_ROUTING: dict[str, tuple[ScoringFunc, TopkMethod]] = {
    "DeepseekV2ForCausalLM": ("softmax", "greedy"),
    "DeepseekV3ForCausalLM": ("sigmoid", "noaux_tc"),
}


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention: queries (optionally through a q_lora_rank latent), one cached KV latent of
    kv_lora_rank values plus a shared rope key of qk_rope_head_dim per token, up-projected per head."""

    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope on pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), else on the two halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """The one cached KV head: [latent | rope key]."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """DeepSeek's mixture of experts: routed experts chosen per token by the gate, shared experts for every token."""

    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    scoring_func: ScoringFunc
    topk_method: TopkMethod
    n_group: int  # 1 unless the method is group-limited
    topk_group: int
    norm_topk_prob: bool

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's rule: MoE from layer first_k_dense_replace on, every moe_layer_freq-th layer."""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def has_correction_bias(self) -> bool:
        """noaux_tc routes with a learned per-expert bias (the checkpoint's gate.e_score_correction_bias)."""
        return self.topk_method == "noaux_tc"


def read_int(raw: dict[str, Any], name: str, source: str, default: int | None = None, minimum: int = 1) -> int:
    """config.json's integer `name` (default when absent), or a ValueError naming it: missing, not an integer, or
    below minimum."""
    value = raw.get(name)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"{source}: missing required field {name!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{source}: {name}={value!r} must be an integer >= {minimum}")
    return value


def read_deepseek_fields(
    raw: dict[str, Any], architecture: str, source: str
) -> tuple[MlaConfig, MoeConfig | None]:
    """The attention and MoE fields of a DeepSeek-V2 / V3 config.json, checked; refuses what is not implemented."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={raw['hidden_act']!r} is not supported (DeepSeek's MLPs use silu)")
    if raw.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported (DeepSeek's MLPs have no bias)")
    q_lora_rank = raw.get("q_lora_rank")
    mla = MlaConfig(
        q_lora_rank=read_int(raw, "q_lora_rank", source) if q_lora_rank is not None else None,
        kv_lora_rank=read_int(raw, "kv_lora_rank", source),
        qk_nope_head_dim=read_int(raw, "qk_nope_head_dim", source),
        qk_rope_head_dim=read_int(raw, "qk_rope_head_dim", source),
        v_head_dim=read_int(raw, "v_head_dim", source),
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"{source}: qk_rope_head_dim={mla.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    nextn = raw.get("num_nextn_predict_layers") or 0
    if nextn:
        logger.info(
            "%s: num_nextn_predict_layers=%s: the multi-token-prediction layers are not used (plain decoding, no "
            "MTP speculative decoding); their weights are skipped at load", source, nextn,
        )
    return mla, _read_moe(raw, architecture, source)


def _read_moe(raw: dict[str, Any], architecture: str, source: str) -> MoeConfig | None:
    routed = raw.get("n_routed_experts") or 0
    if not routed:
        return None
    routed = read_int(raw, "n_routed_experts", source)
    default_scoring, default_method = DEFAULT_ROUTING[architecture]
    scoring = raw.get("scoring_func") or default_scoring
    if scoring not in get_args(ScoringFunc):
        raise ValueError(
            f"{source}: scoring_func={scoring!r} is not supported; the engine routes with {list(get_args(ScoringFunc))}"
        )
    method = raw.get("topk_method") or default_method
    if method not in get_args(TopkMethod):
        raise ValueError(
            f"{source}: topk_method={method!r} is not supported; the engine routes with {list(get_args(TopkMethod))}"
        )
    top_k = read_int(raw, "num_experts_per_tok", source)
    if top_k > routed:
        raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds n_routed_experts={routed}")
    n_group, topk_group = 1, 1
    if method != "greedy":
        n_group = read_int(raw, "n_group", source)
        topk_group = read_int(raw, "topk_group", source)
        if routed % n_group:
            raise ValueError(f"{source}: n_group={n_group} must divide n_routed_experts={routed} ({method})")
        per_group = routed // n_group
        if topk_group > n_group or topk_group * per_group < top_k:
            raise ValueError(
                f"{source}: topk_group={topk_group} of n_group={n_group} groups ({per_group} experts each) cannot "
                f"hold num_experts_per_tok={top_k} experts ({method})"
            )
        if method == "noaux_tc" and per_group < 2:
            raise ValueError(
                f"{source}: topk_method 'noaux_tc' ranks groups by their two best experts, but n_group={n_group} "
                f"leaves {per_group} expert per group"
            )
    scale = raw.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"{source}: routed_scaling_factor={scale!r} must be a positive number")
    return MoeConfig(
        n_routed_experts=routed,
        num_experts_per_tok=top_k,
        n_shared_experts=read_int(raw, "n_shared_experts", source, default=0, minimum=0),
        moe_intermediate_size=read_int(raw, "moe_intermediate_size", source),
        first_k_dense_replace=read_int(raw, "first_k_dense_replace", source, default=0, minimum=0),
        moe_layer_freq=read_int(raw, "moe_layer_freq", source, default=1),
        routed_scaling_factor=float(scale),
        scoring_func=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
