"""What the capacity planner needs of a model, for each attention kind it plans: KV bytes per token on one TP rank,
parameters on one TP rank, and the TP x DCP layout rules.

Three kinds, read from a model directory's config.json by `load_model_spec`:

- GQA / MQA (Llama, Qwen2, Qwen3): `GqaSpec`, a view of the engine's own `ModelConfig`; KV bytes come from
  `ModelConfig.kv_bytes_per_token_per_rank` and the layout rules from `ParallelConfig.validate`, so the planner and
  the engine never disagree.
- MLA (DeepSeek-V2 / V3, and Kimi K2, which uses the V3 architecture): `MlaSpec`. Each layer caches one latent
  "KV head" of kv_lora_rank + qk_rope_head_dim values per token, from which every query head's K and V are
  expanded. Tensor parallelism cannot split one head, so every TP rank holds the whole latent of every token it
  caches: at dcp=1 each token is held tp times. The layout rules are ParallelConfig's with one KV head: tp divides
  the attention heads, dcp divides tp, and dcp = tp leaves nothing duplicated. The native engine's ModelConfig
  reads the same configs (bf16 / fp32 checkpoints; its KV bytes and layout rules agree with this spec, as
  tests/engine/test_config.py checks); this spec also reads what the engine refuses (fp8 checkpoints, for the vLLM
  backend), and any architecture with kv_lora_rank (counted with DeepSeek's projections).
- Everything else vLLM serves, and the engine's own architectures in a form the engine refuses (a quantization it
  does not load, a sliding window): `GenericSpec` (dcpserve/cluster/generic_spec.py), from config.json's fields
  alone: heads, KV heads, head_dim, sliding-window and linear-attention layers, MoE experts.

Each spec gives its parameters by part (`ParameterParts`) and the checkpoint's quantization (`WeightFormat`,
dcpserve/cluster/weight_formats.py), so the planner counts weight bytes as the checkpoint ships them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dcpserve.cluster.generic_spec import GenericSpec, text_model_fields
from dcpserve.cluster.weight_formats import (
    ParameterParts,
    WeightFormat,
    check_block_shards,
    fp8_block_format,
    read_weight_format,
)
from dcpserve.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig, ParallelConfig, read_config_json
from dcpserve.engine.qwen_moe_config import QwenMoeConfig

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# model_type -> architecture, for configs read by model_type (Kimi K2's "kimi_k2" is the V3 architecture).
MLA_MODEL_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                   "kimi_k2": "DeepseekV3ForCausalLM"}
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class ModelSpec(Protocol):
    """The planner's view of a model: its cache, its weights and its layout rules (one implementation per kind)."""

    @property
    def architecture(self) -> str: ...

    @property
    def attention(self) -> str: ...  # "GQA", "MQA" or "MLA"

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...  # KV heads each layer caches (MLA: its one latent)

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def quantization(self) -> WeightFormat | None: ...  # the checkpoint's quantization_config; None: unquantized

    def kv_bytes_per_token_per_rank(self, tp: int, dtype: torch.dtype, context_len: int | None = None) -> int:
        """KV bytes one cached token takes on one rank, all layers, before DCP shards the sequence; with context_len,
        sliding-window layers count for sequences of that length (dcpserve/cluster/generic_spec.py)."""
        ...

    def parameter_parts(self, tp: int) -> ParameterParts:
        """Parameters one TP rank holds, by part (tp=1: the whole model)."""
        ...

    def parameters_per_rank(self, tp: int) -> int:
        """Parameters one TP rank holds (tp=1: the whole model)."""
        ...

    def validate_layout(self, tp: int, dcp: int, pcp: int = 1) -> None:
        """Raises ValueError naming the values and the fix when (tp, dcp, pcp) is not a valid layout."""
        ...

    def describe_shape(self) -> str:
        """The shape that sizes weights and KV cache, for the plan's header ("32 layers, hidden 4096, ...")."""
        ...

    def notes(self) -> list[str]:
        """Lines the plan prints under its table: assumptions of the count and facts of this kind of cache."""
        ...


def load_model_spec(model: str | Path) -> GqaSpec | MlaSpec | GenericSpec:
    """The spec of a Hugging Face model directory (or its config.json): see model_spec_from_dict."""
    raw, config_path = read_config_json(model)
    return model_spec_from_dict(raw, source=str(config_path))


def as_model_spec(model: ModelConfig | ModelSpec) -> ModelSpec:
    """A spec as it is, or the engine's ModelConfig seen as a GQA spec."""
    return GqaSpec(model) if isinstance(model, ModelConfig) else model


def model_spec_from_dict(raw: dict[str, Any], source: str = "config") -> GqaSpec | MlaSpec | GenericSpec:
    """The spec of a parsed config.json (`source` names it in errors): MLA when the (text) config has kv_lora_rank or
    is a DeepSeek-V2 / V3 architecture; the engine's ModelConfig for the other architectures the engine runs (Llama,
    Qwen2 / Qwen3, Qwen MoE) when it accepts the config as it is; GenericSpec for the rest."""
    architectures = raw.get("architectures") or []
    text = text_model_fields(raw)
    if (text.get("kv_lora_rank") is not None or text.get("model_type") in MLA_MODEL_TYPES
            or any(a in MLA_ARCHITECTURES for a in architectures)):
        return MlaSpec.from_dict(text, source)
    refusal = ""
    if any(a in SUPPORTED_ARCHITECTURES for a in architectures) and "text_config" not in raw:
        try:
            return GqaSpec(ModelConfig.from_dict(raw, source=source))
        except ValueError as err:  # the engine refuses it as it is (vLLM serves it): counted from its fields
            refusal = str(err).removeprefix(f"{source}: ")
    return GenericSpec.from_dict(raw, source, engine_refusal=refusal)


@dataclass(frozen=True)
class GqaSpec:
    """A Llama-family model (GQA / MQA) as the engine reads it: each layer caches K and V of num_key_value_heads
    heads; a rank holds kv_heads / tp of them, or one whole head copied on tp / kv_heads ranks when tp > kv_heads."""

    config: ModelConfig

    @property
    def attention(self) -> str:
        return "MQA" if self.config.num_key_value_heads == 1 else "GQA"

    @property
    def num_attention_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def quantization(self) -> WeightFormat | None:
        quantization = self.config.quantization
        return None if quantization is None else fp8_block_format(quantization, _BYTES[self.config.torch_dtype])

    def kv_bytes_per_token_per_rank(self, tp: int, dtype: torch.dtype, context_len: int | None = None) -> int:
        return self.config.kv_bytes_per_token_per_rank(tp, dtype)  # full attention: no window to count

    def parameter_parts(self, tp: int) -> ParameterParts:
        """Embedding and LM head vocab-parallel, q / o and the MLP split tp ways, KV projections of at least one
        whole head per rank (copied when tp > kv_heads), norms on every rank; Qwen MoE layers: 1/tp of every expert
        (and of Qwen2-MoE's shared expert), the router and the shared expert's gate on every rank."""
        model = self.config
        hidden, head_dim, layers = model.hidden_size, model.head_dim, model.num_hidden_layers
        heads = model.num_attention_heads // tp
        kv_heads = max(1, model.num_key_value_heads // tp)  # a rank holds at least one whole KV head
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
        biases = (heads + 2 * kv_heads) * head_dim if model.attention_bias else 0
        norms = 2 * hidden + (2 * head_dim if model.qk_norm else 0)
        moe, shared_width = model.moe, self._shared_expert_width
        moe_layers = sum(moe.is_moe_layer(i) for i in range(layers)) if moe is not None else 0
        experts = shared = router = 0
        if moe is not None:
            experts = moe_layers * moe.n_routed_experts * 3 * hidden * -(-moe.moe_intermediate_size // tp)
            shared = moe_layers * 3 * hidden * -(-shared_width // tp)
            router = moe_layers * (moe.n_routed_experts * hidden + (hidden if shared_width else 0))
        embedding = -(-model.vocab_size // tp) * hidden
        return ParameterParts(
            embedding=embedding, lm_head=0 if model.tie_word_embeddings else embedding, attention=layers * attention,
            dense_mlp=(layers - moe_layers) * 3 * hidden * -(-model.intermediate_size // tp),  # gate, up, down
            experts=experts, shared_experts=shared, other=layers * (biases + norms) + router + hidden)

    @property
    def _shared_expert_width(self) -> int:
        moe = self.config.moe
        return moe.shared_expert_intermediate_size if isinstance(moe, QwenMoeConfig) else 0

    def parameters_per_rank(self, tp: int) -> int:
        return self.parameter_parts(tp).total

    def validate_layout(self, tp: int, dcp: int, pcp: int = 1) -> None:
        ParallelConfig(tp, dcp, pcp).validate(self.config)
        moe, layers = self.config.moe, range(self.config.num_hidden_layers)
        check_block_shards(self.quantization, tp, {
            "dense_mlp": self.config.intermediate_size if moe is None or not all(map(moe.is_moe_layer, layers)) else 0,
            "experts": moe.moe_intermediate_size if moe is not None else 0,
            "shared_experts": self._shared_expert_width})

    @property
    def architecture(self) -> str:
        return self.config.architecture

    def describe_shape(self) -> str:
        model = self.config
        kv = model.num_key_value_heads
        moe = model.moe
        experts = ""
        if moe is not None:
            moe_layers = sum(moe.is_moe_layer(i) for i in range(model.num_hidden_layers))
            experts = (f", {moe_layers} MoE layers of {moe.n_routed_experts} experts of {moe.moe_intermediate_size} "
                       f"({moe.num_experts_per_tok} per token)")
        return (
            f"{model.num_hidden_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
            f"{kv} KV head{'s' if kv > 1 else ''}, head_dim {model.head_dim}{experts}, vocab {model.vocab_size}"
        )

    def notes(self) -> list[str]:
        return []


@dataclass(frozen=True)
class _OneKvHead:
    """The two numbers ParallelConfig.validate reads, for an MLA model: its heads and its one latent KV head."""

    num_attention_heads: int
    num_key_value_heads: int = 1


@dataclass(frozen=True)
class MlaSpec:
    """A DeepSeek-V2 / V3 architecture model (multi-head latent attention, MoE), from its config.json; any other
    architecture with kv_lora_rank is counted with the same projections.

    Counted like vLLM's DeepseekV2 / V3 model with tensor parallelism and no expert parallelism: the query, kv_b
    and output projections, the dense MLPs, every routed and shared expert split tp ways (1/tp of every expert per
    rank), the embedding and LM head vocab-parallel; the latent down-projections (q_a_proj, kv_a_proj_with_mqa),
    the router and the norms on every rank. With expert parallelism a rank holds n_routed_experts / tp whole
    experts instead: the same bytes when tp divides n_routed_experts. The multi-token-prediction layers
    (num_nextn_predict_layers) are not counted: vLLM loads them only for MTP speculative decoding.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite); else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # of the dense MLP layers
    moe_intermediate_size: int  # of each routed and shared expert
    n_routed_experts: int  # 0: every layer dense
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int  # layers before the first MoE layer
    moe_layer_freq: int
    router_bias: bool  # topk_method "noaux_tc" (V3): the router has an e_score_correction_bias per expert
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_nextn_predict_layers: int
    quantization: WeightFormat | None  # the checkpoint's quantization_config (DeepSeek-V3: fp8 blocks); None: none
    index_head_dim: int = 0  # DeepSeek-V3.2's sparse-attention indexer: its key width per token per layer (0: none)
    index_n_heads: int = 0

    attention = "MLA"
    num_kv_heads = 1  # the latent: one head for every query head of the layer

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> MlaSpec:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in MLA_ARCHITECTURES), None)
        if architecture is None:
            architecture = str(architectures[0]) if architectures else MLA_MODEL_TYPES.get(str(raw.get("model_type")))
        if architecture is None:
            raise ValueError(f"{source}: an MLA config (kv_lora_rank) with neither architectures nor a known "
                             f"model_type ({', '.join(MLA_MODEL_TYPES)}); add its architectures")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")
        missing = [k for k in required if raw.get(k) is None]
        routed = int(raw.get("n_routed_experts") or 0)
        if routed and raw.get("moe_intermediate_size") is None:
            missing.append("moe_intermediate_size")
        if missing:
            raise ValueError(f"{source}: missing required fields {missing} of {architecture}")
        q_lora_rank = raw.get("q_lora_rank")
        return cls(
            architecture=architecture,
            model_type=str(raw.get("model_type", "")),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            q_lora_rank=int(q_lora_rank) if q_lora_rank is not None else None,
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            n_routed_experts=routed,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            router_bias=raw.get("topk_method") == "noaux_tc",
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            quantization=read_weight_format(raw, int(raw["hidden_size"]), source),
            index_head_dim=int(raw.get("index_head_dim") or 0),
            index_n_heads=int(raw.get("index_n_heads") or 0),
        )

    @property
    def kv_values_per_token_per_layer(self) -> int:
        """The cached latent: the compressed KV (kv_lora_rank) and the shared RoPE key (qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_bytes_per_token_per_rank(self, tp: int, dtype: torch.dtype, context_len: int | None = None) -> int:
        # Independent of tp: the one latent head is never split, every rank caches all of it. DeepSeek-V3.2's
        # indexer adds its key per token per layer in fp8 with a float32 scale per 128 values (vLLM's indexer cache).
        indexer = self.index_head_dim + 4 * -(-self.index_head_dim // 128)
        return self.num_hidden_layers * (self.kv_values_per_token_per_layer * dtype.itemsize + indexer)

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's rule: MoE from layer first_k_dense_replace on, every moe_layer_freq-th layer."""
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def parameter_parts(self, tp: int) -> ParameterParts:
        hidden, heads = self.hidden_size, self.num_attention_heads // tp
        q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = self.attention_bias
        # Attention. Split tp ways by head: q_proj / q_b_proj, kv_b_proj, o_proj. On every rank: the down-projections
        # to the latents and their norms.
        if self.q_lora_rank is None:
            attention = hidden * heads * q_head_dim  # q_proj
            other = 0
        else:
            attention = hidden * self.q_lora_rank + self.q_lora_rank * heads * q_head_dim  # q_a_proj, q_b_proj
            other = (self.q_lora_rank if bias else 0) + self.q_lora_rank  # its bias, q_a_layernorm
        latent = self.kv_values_per_token_per_layer
        attention += hidden * latent  # kv_a_proj_with_mqa
        other += (latent if bias else 0) + self.kv_lora_rank  # its bias, kv_a_layernorm
        attention += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b_proj
        attention += heads * self.v_head_dim * hidden  # o_proj
        other += (hidden if bias else 0) + 2 * hidden  # its bias; input_layernorm, post_attention_layernorm
        if self.index_head_dim:  # V3.2's indexer: wq_b, wk, weights_proj (replicated), k_norm
            attention += (self.q_lora_rank or hidden) * self.index_n_heads * self.index_head_dim
            attention += hidden * self.index_head_dim + hidden * self.index_n_heads
            other += 2 * self.index_head_dim
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        expert = 3 * hidden * -(-self.moe_intermediate_size // tp)  # gate, up, down; shared: one MLP n_shared wide
        router = self.n_routed_experts * hidden + (self.n_routed_experts if self.router_bias else 0)
        embedding = -(-self.vocab_size // tp) * hidden
        return ParameterParts(
            embedding=embedding, lm_head=0 if self.tie_word_embeddings else embedding,
            attention=self.num_hidden_layers * attention,
            dense_mlp=(self.num_hidden_layers - moe_layers) * 3 * hidden * -(-self.intermediate_size // tp),
            experts=moe_layers * self.n_routed_experts * expert,
            shared_experts=moe_layers * self.n_shared_experts * expert,
            other=self.num_hidden_layers * other + moe_layers * router + hidden,  # final norm
        )

    def parameters_per_rank(self, tp: int) -> int:
        return self.parameter_parts(tp).total

    def validate_layout(self, tp: int, dcp: int, pcp: int = 1) -> None:
        ParallelConfig(tp, dcp, pcp).validate(_OneKvHead(self.num_attention_heads))
        moe = self.n_routed_experts > 0
        check_block_shards(self.quantization, tp, {
            "dense_mlp": self.intermediate_size if self.first_k_dense_replace or not moe else 0,
            "experts": self.moe_intermediate_size if moe else 0,
            "shared_experts": self.n_shared_experts * self.moe_intermediate_size if moe else 0})

    def describe_shape(self) -> str:
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        experts = (
            f", {moe_layers} MoE layers of {self.n_routed_experts} routed + {self.n_shared_experts} shared experts "
            f"({self.num_experts_per_tok} routed per token)" if moe_layers else ""
        )
        return (
            f"{self.num_hidden_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads, "
            f"MLA: 1 latent KV head of {self.kv_lora_rank} + {self.qk_rope_head_dim} = "
            f"{self.kv_values_per_token_per_layer} values per token per layer{experts}, vocab {self.vocab_size}"
        )

    def notes(self) -> list[str]:
        notes = [
            f"MLA: every TP rank caches the whole {self.kv_values_per_token_per_layer}-value latent of each token it "
            f"holds (tensor parallelism cannot split one KV head), so at dcp=1 a replica holds each token tp times; "
            f"DCP shards the sequence over dcp ranks, so KV tokens per replica grow dcp-fold and dcp = tp holds each "
            f"token once.",
            "Weights: experts split tp ways (1/tp of every expert per rank, vLLM's tensor parallelism without expert "
            "parallelism; with it, the same bytes when tp divides the experts); embedding and LM head vocab-parallel; "
            "latent down-projections, router and norms on every rank.",
        ]
        if self.num_nextn_predict_layers:
            notes.append(
                f"Not counted: the {self.num_nextn_predict_layers} multi-token-prediction layer"
                f"{'s' if self.num_nextn_predict_layers > 1 else ''} (num_nextn_predict_layers), loaded only for MTP "
                f"speculative decoding."
            )
        return notes
