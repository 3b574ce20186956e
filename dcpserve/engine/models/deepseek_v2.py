"""DeepSeek-V2 / V3 decoder (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent attention over a
paged latent cache, with DCP, and the mixture-of-experts MLP, on tensor-parallel layers.

Attention (MLA). Per token: q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with a q_lora_rank latent, split
per head into q_nope (qk_nope_head_dim) and q_rope (qk_rope_head_dim); kv_a_proj_with_mqa(x) = [c | k_rope] with c
the kv_lora_rank latent (then kv_a_layernorm) and k_rope one rope key shared by every head. kv_b_proj up-projects c
to each head's key part k_nope = W_UK c and value v = W_UV c. The cache holds [c | rotated k_rope] once per token:
one KV head of kv_lora_rank + qk_rope_head_dim values, whole on every TP rank (each DCP rank holds its shard of the
sequence). Attention runs absorbed, for decode and prefill alike: q_nope . (W_UK c) = (W_UK^T q_nope) . c, so the
query becomes [W_UK^T q_nope | rotated q_rope] against the cached [c | k_rope], with the softmax scale of the full
qk head (qk_head_dim ** -0.5, times YaRN's mscale_all_dim factor squared); the values are c itself (the cache's
first kv_lora_rank channels) and W_UV maps each head's output back to v_head_dim before o_proj. Exact, and it
never expands the cache per head. Query heads, kv_b_proj and o_proj are split over TP ranks by head; the latent
down-projections and their norms are replicated.

MLP: layers before first_k_dense_replace (and off moe_layer_freq) are dense SwiGLU; the others are DeepseekMoE
(dcpserve/engine/layers/moe.py: tensor-parallel experts, shared experts, one all-reduce).

Checkpoint names are transformers' (which are DeepSeek's); layers at or past num_hidden_layers are the
multi-token-prediction module, not loaded.

FP8 (config.quantization: DeepSeek-V3 / R1 / V3.1 and Kimi-K2 as published): every linear layer of the decoder, the
shared experts and the routed experts hold float8_e4m3fn weights and float32 `weight_scale_inv` block scales
(dcpserve/engine/layers/linear_method.py, dcpserve/engine/layers/fp8_experts.py), except the modules the config's
modules_to_not_convert names; the router, norms, embedding and LM head are not FP8 in these checkpoints. kv_b_proj
is dequantized at load (`dequantize_kv_b_proj`): the absorbed attention uses its weight, not its matmul.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from dcpserve.engine.config import ModelConfig
from dcpserve.engine.deepseek_config import MlaConfig, MoeConfig
from dcpserve.engine.layers.attention import Attention
from dcpserve.engine.layers.fp8_experts import Fp8TensorParallelExperts
from dcpserve.engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, split_for_tp
from dcpserve.engine.layers.linear_method import UNQUANTIZED, LinearMethod, dequantize_weight, linear_method
from dcpserve.engine.layers.mlp import SwiGluMLP
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.moe import DeepseekMoE
from dcpserve.engine.layers.norm import RMSNorm
from dcpserve.engine.layers.rotary import RotaryEmbedding
from dcpserve.engine.layers.weights import ShardId, WeightSource
from dcpserve.engine.models.causal_lm import CausalLM, DecoderLayer, DecoderModel
from dcpserve.engine.models.checkpoint import load_named_weights
from dcpserve.engine.rope_config import YarnScaling
from dcpserve.engine.worker.attention_metadata import AttentionMetadata
from dcpserve.engine.worker.parallel import ParallelState

# DeepSeek's reference code (and transformers) build q_a_layernorm / kv_a_layernorm with the default eps, not
# rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# (our merged module, the checkpoint's module, shard id) of the dense and shared-expert MLPs.
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
# model.layers.{layer}.mlp.experts.{expert}.{gate_proj | up_proj | down_proj}.weight (and FP8's .weight_scale_inv)
EXPERT_NAME = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\."
    r"(?P<tensor>weight|weight_scale_inv)$"
)
# our stacked expert parameter -> the checkpoint tensor of each expert it stacks
EXPERT_TENSORS: dict[str, tuple[tuple[str, ...], str]] = {
    "w13": (("gate_proj", "up_proj"), "weight"), "w2": (("down_proj",), "weight"),
    "w13_scale_inv": (("gate_proj", "up_proj"), "weight_scale_inv"),
    "w2_scale_inv": (("down_proj",), "weight_scale_inv"),
}
# checkpoint projection -> (our stacked parameter, part of its loader)
EXPERT_PARTS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
}
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def mla_softmax_scale(config: ModelConfig, mla: MlaConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared (transformers' yarn_apply_mscale)."""
    scale = mla.qk_head_dim**-0.5
    if isinstance(config.rope_scaling, YarnScaling):
        scale *= config.rope_scaling.softmax_scale_factor
    return scale


class DeepseekV2Attention(EngineModule):
    """Multi-head latent attention of one layer: latent projections, RoPE on the rope parts, absorbed paged DCP
    attention over the latent cache, per-head value up-projection, o_proj."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device,
                 prefix: str = "self_attn") -> None:
        """prefix: the module's checkpoint name (which modules an FP8 checkpoint leaves unquantized)."""
        super().__init__()
        if config.mla is None:
            raise ValueError(f"{config.architecture}: DeepseekV2Attention needs the config's MLA fields")
        mla = self.mla = config.mla
        heads, hidden, bias = config.num_attention_heads, config.hidden_size, config.attention_bias
        self.num_heads = split_for_tp(heads, parallel.tp_size, "num_attention_heads")
        self.quantization, self.model_dtype = config.quantization, dtype

        def method(name: str) -> LinearMethod:
            return linear_method(config.quantization, f"{prefix}.{name}")

        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * mla.qk_head_dim, parallel, False, dtype, device,
                                               method("q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, bias, dtype, device, method("q_a_proj"))
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.qk_head_dim, parallel, False, dtype,
                                                 device, method("q_b_proj"))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.cache_head_dim, bias, dtype, device,
                                                   method("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype, device)
        # Rows head-major ([k_nope | v] of head 0, then head 1, ...), so a column split is a split by head.
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), parallel, False, dtype, device,
            method("kv_b_proj"),
        )
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, parallel, bias, dtype, device,
                                        method=method("o_proj"))
        self.attn = Attention(
            self.num_heads, 1, mla.cache_head_dim, parallel, device, v_head_dim=mla.kv_lora_rank,
            scale=mla_softmax_scale(config, mla),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, hidden.shape[0]
        nope, rope, latent = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        elif self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            raise RuntimeError("DeepseekV2Attention has neither q_proj nor q_a_proj / q_b_proj")
        q_nope, q_rope = q.view(num_tokens, self.num_heads, mla.qk_head_dim).split([nope, rope], dim=-1)
        compressed, k_rope = self.kv_a_proj_with_mqa(hidden).split([latent, rope], dim=-1)
        compressed = self.kv_a_layernorm(compressed)
        q_rope = self._rotate(q_rope, cos, sin)
        k_rope = self._rotate(k_rope[:, None, :], cos, sin)  # [T, 1, rope]
        up = self.kv_b_proj.weight.view(self.num_heads, nope + mla.v_head_dim, latent)
        # Absorb W_UK into the query: [T, h, nope] x [h, nope, latent] -> [T, h, latent].
        q_latent = torch.einsum("thn,hnc->thc", q_nope, up[:, :nope])
        query = torch.cat([q_latent, q_rope], dim=-1)  # [T, h, latent + rope]
        key = torch.cat([compressed[:, None, :], k_rope], dim=-1)  # [T, 1, latent + rope]: what the cache holds
        out = self.attn(query, key, None, kv_cache[0], None, metadata)  # [T, h, latent]
        values = torch.einsum("thc,hvc->thv", out, up[:, nope:])  # W_UV: [T, h, v_head_dim]
        return self.o_proj(values.reshape(num_tokens, self.num_heads * mla.v_head_dim))

    def dequantize_kv_b_proj(self) -> None:
        """After loading: an FP8 kv_b_proj becomes its dequantized weight in the model's dtype (vLLM does the same
        for MLA). The absorbed attention never runs kv_b_proj as a matmul of x: it slices its weight per head into
        W_UK (folded into the query) and W_UV (applied to the attention output), so it needs the dense weight. It is
        the one FP8 weight held in the model's dtype: per layer heads * (qk_nope + v) * kv_lora_rank / tp values."""
        proj = self.kv_b_proj
        if proj.weight_scale_inv is None:
            return
        dense = dequantize_weight(proj.weight, proj.weight_scale_inv, self.quantization, self.model_dtype)
        proj.weight = torch.nn.Parameter(dense, requires_grad=False)
        proj.weight_scale_inv = None
        proj.method = UNQUANTIZED

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on x [T, heads, rope] with the fp32 cos / sin: interleaved pairs in fp32 (transformers' DeepseekV2),
        or the two halves in x's dtype (DeepseekV3 with rope_interleave false)."""
        if self.mla.rope_interleave:
            return RotaryEmbedding.rotate_interleaved(x, cos, sin)
        return RotaryEmbedding.rotate(x, cos.to(x.dtype), sin.to(x.dtype))


class DeepseekV2DecoderLayer(DecoderLayer):
    """Pre-norm block of MLA attention and a dense or MoE mlp (MoE from first_k_dense_replace, every moe_layer_freq)."""

    def __init__(
        self, config: ModelConfig, layer: int, parallel: ParallelState, dtype: torch.dtype, device: torch.device
    ) -> None:
        mlp: DeepseekMoE | SwiGluMLP
        prefix = f"model.layers.{layer}"
        if config.moe is not None and config.moe.is_moe_layer(layer):
            mlp = build_moe(config, config.moe, f"{prefix}.mlp", parallel, dtype, device)
        else:
            method = linear_method(config.quantization, f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj",
                                   f"{prefix}.mlp.down_proj")
            mlp = SwiGluMLP(config.hidden_size, config.intermediate_size, parallel, dtype, device, method=method)
        attention = DeepseekV2Attention(config, parallel, dtype, device, prefix=f"{prefix}.self_attn")
        super().__init__(config, attention, mlp, dtype, device)


def build_moe(config: ModelConfig, moe: MoeConfig, prefix: str, parallel: ParallelState, dtype: torch.dtype,
              device: torch.device) -> DeepseekMoE:
    """An MoE layer; with an FP8 checkpoint, FP8 routed experts (dcpserve/engine/layers/fp8_experts.py) and FP8
    shared experts, unless modules_to_not_convert names them."""
    quantization = config.quantization
    experts = None
    if quantization is not None and quantization.is_quantized(f"{prefix}.experts"):
        experts = Fp8TensorParallelExperts(moe.n_routed_experts, config.hidden_size, moe.moe_intermediate_size,
                                           parallel, dtype, device, quantization)
    shared = linear_method(quantization, *(f"{prefix}.shared_experts.{p}" for p in ("gate_proj", "up_proj",
                                                                                     "down_proj")))
    return DeepseekMoE(config.hidden_size, moe, parallel, dtype, device, experts=experts, shared_method=shared)


class DeepseekV2Model(DecoderModel):
    """Embedding, DeepSeek decoder layers and the final norm (transformers' `model.` prefix). DeepSeek rotates in
    fp32 (transformers' DeepseekV2 does): cos / sin stay fp32 whatever the model dtype."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device) -> None:
        if config.mla is None:
            raise ValueError(f"{config.architecture}: DeepseekV2Model needs the config's MLA fields")
        rotary = RotaryEmbedding(config.mla.qk_rope_head_dim, config.rope_theta, config.rope_scaling, device,
                                 interleaved=config.mla.rope_interleave)
        layers = [DeepseekV2DecoderLayer(config, i, parallel, dtype, device) for i in range(config.num_hidden_layers)]
        super().__init__(config, parallel, rotary, layers, dtype, device, rope_dtype=torch.float32)


class DeepseekV2ForCausalLM(CausalLM):
    """The decoder plus a vocabulary-parallel LM head; what the model runner drives (same surface as
    LlamaForCausalLM)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device) -> None:
        if config.mla is None:
            raise ValueError(
                f"{config.architecture} is not an MLA config (no kv_lora_rank): DeepseekV2ForCausalLM runs "
                f"DeepseekV2ForCausalLM / DeepseekV3ForCausalLM checkpoints"
            )
        if parallel.num_kv_heads != 1:
            raise ValueError(
                f"ParallelState was built for {parallel.num_kv_heads} KV heads but an MLA model caches one latent "
                f"head: pass config.num_key_value_heads (1) to init_parallel_state"
            )
        super().__init__(config, parallel, DeepseekV2Model(config, parallel, dtype, device), dtype, device)

    def checkpoint_names(self) -> set[str]:
        """The Hugging Face tensor names this model loads (experts one by one, gate/up unmerged, no lm_head when
        tied)."""
        names: set[str] = set()
        for name, _ in self.named_parameters():  # a tied lm_head.weight is listed once, as the embedding
            prefix, stacked = name.rsplit(".", 1)
            if prefix.endswith(".mlp.experts") and stacked in EXPERT_TENSORS:
                projections, tensor = EXPERT_TENSORS[stacked]
                experts = self.config.moe.n_routed_experts if self.config.moe is not None else 0
                names.update(f"{prefix}.{e}.{p}.{tensor}" for e in range(experts) for p in projections)
                continue
            unmerged = [name.replace(ours, theirs) for ours, theirs, _ in STACKED_PARAMS if ours in name]
            names.update(unmerged or [name])
        return names

    def load_weights(self, weights: Iterable[tuple[str, WeightSource | torch.Tensor]]) -> None:
        """Copies this rank's shard of every checkpoint tensor (Hugging Face names) into the parameters; skips the
        multi-token-prediction layers (model.layers.{i} with i >= num_hidden_layers).

        Raises ValueError naming the tensors when some are missing or unexpected, or a shape does not match."""
        config = self.config

        def skip(name: str) -> bool:
            layer = LAYER_INDEX.match(name)
            if layer is not None and int(layer.group(1)) >= config.num_hidden_layers:
                return True  # the MTP module: used only for speculative decoding, which the engine does not run
            return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)

        moe = config.moe
        experts = f"{moe.n_routed_experts} routed experts from layer {moe.first_k_dense_replace}" if moe else "dense"
        load_named_weights(
            dict(self.named_parameters()), weights, self.checkpoint_names(), resolve_name, skip,
            f"{config.architecture} as config.json describes it ({config.num_hidden_layers} layers, q_lora_rank="
            f"{config.mla.q_lora_rank if config.mla else None}, {experts}, attention_bias={config.attention_bias}, "
            f"tie_word_embeddings={config.tie_word_embeddings})",
        )
        for module in self.modules():
            if isinstance(module, DeepseekV2Attention):
                module.dequantize_kv_b_proj()


def resolve_name(name: str) -> tuple[str, ShardId]:
    """A checkpoint name -> (our parameter, shard id): experts into the stacked w13 / w2, gate/up into
    gate_up_proj."""
    expert = EXPERT_NAME.match(name)
    if expert is not None:
        stacked, part = EXPERT_PARTS[expert.group("proj")]
        suffix = "_scale_inv" if expert.group("tensor") == "weight_scale_inv" else ""
        return f"{expert.group('prefix')}.{stacked}{suffix}", (int(expert.group("expert")), part)
    for ours, theirs, shard in STACKED_PARAMS:
        if theirs in name:
            return name.replace(theirs, ours), shard
    return name, None
