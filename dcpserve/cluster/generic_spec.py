"""The planner's spec of an attention model from its config.json alone, for the architectures the native engine does
not run (vLLM serves them): `GenericSpec`.

What it reads (a `text_config` is the text model of a multimodal wrapper, as Gemma 3, Mistral 3 and Llama 4 write it:
its fields are read over the wrapper's):

- Attention: num_attention_heads, num_key_value_heads (default: the heads), head_dim (default hidden / heads),
  v_head_dim (default head_dim), attention_bias, attn_output_gate (Qwen3-Next's gated query). A rank holds
  kv_heads / tp KV heads, or one whole head copied when tp > kv_heads; the layout rules are ParallelConfig's.
- Which layers cache what (`layer_kinds`): layer_types, else the family's rule (Qwen3-Next's full_attention_interval,
  Llama 4's chunked layers, Gemma's sliding_window_pattern, Qwen's use_sliding_window / max_window_layers, a plain
  sliding_window on every layer). Full layers cache every token. Sliding (and Llama 4's chunked) layers cache at most
  the window: over a sequence of context_len tokens one such layer holds min(window, context_len) of them, so it is
  counted at min(window, context_len) / context_len of a full layer per token (vLLM also keeps one prefill chunk past
  the window, which is not counted); without a context it counts as a full layer. Linear-attention layers (Qwen3-Next's
  gated delta net) hold a fixed state per sequence and nothing per token.
- Parameters: vocab-parallel embedding and LM head (tied when tie_word_embeddings, which Gemma defaults to), q / k / v
  / o split tp ways by head, gated (3-matrix) MLPs unless the family's MLP has 2, MoE experts (n_routed_experts /
  num_local_experts / num_experts, moe_intermediate_size, shared experts, the family's rule of which layers are MoE)
  split tp ways (1/tp of every expert per rank), routers, norms and biases; a vision encoder (vision_config) as
  layers x (4 hidden^2 + gated-or-not MLP), split tp ways.

Anything the count needs and the config lacks is refused by name; so are layer types it cannot count (Mamba).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dcpserve.cluster.weight_formats import ParameterParts, WeightFormat, check_block_shards, read_weight_format
from dcpserve.engine.config import ParallelConfig

# Families whose MLP is up -> activation -> down (2 matrices) rather than gated (3).
NON_GATED_MLP_MODEL_TYPES = ("gpt2", "gpt_bigcode", "gpt_neox", "gptj", "falcon", "phi", "starcoder2", "bloom", "opt",
                             "nemotron", "mpt")
# Families with norms before and after attention and the MLP (4 per layer).
SANDWICH_NORM_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "gemma3", "gemma3_text", "olmo2")
# Transformers' defaults for fields published configs leave out (Gemma 3's text_config omits them).
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262208, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
                    "tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True}, "gemma": {"tie_word_embeddings": True},
    "qwen3_next": {"attn_output_gate": True},  # its q_proj also gives each head's output gate
}
# Aliases of older configs (transformers' attribute_map).
FIELD_ALIASES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                 "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
                 "num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size"}
LAYER_TYPES = {"full_attention": "full", "attention": "full", "global_attention": "full",
               "sliding_attention": "sliding", "local_attention": "sliding", "chunked_attention": "chunked",
               "linear_attention": "linear"}


def text_model_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with its text_config's fields over the wrapper's (the wrapper keeps architectures and
    quantization_config), and transformers' defaults for fields the family's configs leave out."""
    text = raw.get("text_config")
    merged = {**raw, **text} if isinstance(text, dict) else dict(raw)
    for alias, name in FIELD_ALIASES.items():
        if name not in merged and alias in merged:
            merged[name] = merged[alias]
    for name, value in MODEL_TYPE_DEFAULTS.get(str(merged.get("model_type")), {}).items():
        merged.setdefault(name, value)
    if "quantization_config" in raw:
        merged["quantization_config"] = raw["quantization_config"]
    return merged


@dataclass(frozen=True)
class LinearAttention:
    """Qwen3-Next's gated delta net: its heads and widths (a fixed state per sequence, nothing cached per token)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int


@dataclass(frozen=True)
class GenericSpec:
    """An attention model read from config.json alone (the module docstring says what it reads and how it counts)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    v_head_dim: int
    layer_kinds: tuple[str, ...]  # per layer: "full", "sliding", "chunked" (Llama 4) or "linear"
    window: int  # tokens a sliding (or chunked) layer caches at most; 0 when there is none
    intermediate_size: int  # of the dense MLPs
    gated_mlp: bool
    num_experts: int  # routed; 0: dense
    num_experts_per_tok: int
    moe_intermediate_size: int  # of each routed expert
    shared_expert_intermediate_size: int  # all shared experts together; 0: none
    moe_layers: tuple[bool, ...]
    qkv_bias: bool
    o_bias: bool
    attn_output_gate: bool
    qk_norm: bool
    norms_per_layer: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    linear_attention: LinearAttention | None
    vision_parameters: int  # the vision encoder's, whole (0: none)
    quantization: WeightFormat | None  # the checkpoint's quantization_config (None: unquantized)
    expert_bias: bool = False  # gpt-oss: every expert's gate_up and down carry biases
    router_bias: bool = False
    engine_refusal: str = ""  # why the native engine's ModelConfig refused an architecture it runs, if it did

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config", engine_refusal: str = "") -> GenericSpec:
        text = text_model_fields(raw)
        architectures = raw.get("architectures") or []
        architecture = str(architectures[0]) if architectures else str(text.get("model_type") or "unknown")
        model_type = str(text.get("model_type") or "")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [name for name in required if not text.get(name)]
        if not text.get("intermediate_size") and not text.get("moe_intermediate_size"):
            missing.append("intermediate_size")
        if missing:
            raise ValueError(f"{source}: {architecture} config lacks {missing}, which the planner's count of its "
                             f"KV cache and weights needs")
        for name in ("num_key_value_heads", "num_attention_heads", "intermediate_size"):
            if isinstance(text.get(name), list):
                raise ValueError(f"{source}: {name} is a list (a different value per layer); the planner counts "
                                 f"models with one value for every layer")
        hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        kinds, window = _layer_kinds(text, layers, source)
        experts = int(text.get("n_routed_experts") or text.get("num_local_experts") or text.get("num_experts") or 0)
        dense, expert, shared = _mlp_sizes(text, experts, model_type)
        linear = None
        if "linear" in kinds:
            linear_fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim", "linear_conv_kernel_dim")
            lacking = [name for name in linear_fields if not text.get(name)]
            if lacking:
                raise ValueError(f"{source}: {architecture} has linear-attention layers but lacks {lacking}, which "
                                 f"the planner's count of their weights needs")
            linear = LinearAttention(*(int(text[name]) for name in linear_fields))
        return cls(
            architecture=architecture, model_type=model_type, vocab_size=int(text["vocab_size"]), hidden_size=hidden,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            v_head_dim=int(text.get("v_head_dim") or head_dim), layer_kinds=kinds, window=window,
            intermediate_size=dense, gated_mlp=(model_type not in NON_GATED_MLP_MODEL_TYPES
                                                and text.get("hidden_act") != "relu2"),
            num_experts=experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok") or text.get("experts_per_token") or 0),
            moe_intermediate_size=expert, shared_expert_intermediate_size=shared,
            moe_layers=_moe_layers(text, layers, experts), qkv_bias=bool(text.get("attention_bias")
                                                                         or model_type.startswith("qwen2")),
            o_bias=bool(text.get("attention_bias")) and not model_type.startswith("glm"),
            attn_output_gate=bool(text.get("attn_output_gate")),
            qk_norm=model_type in QK_NORM_MODEL_TYPES or bool(text.get("use_qk_norm") or text.get("qk_norm")),
            norms_per_layer=4 if model_type in SANDWICH_NORM_MODEL_TYPES else 2,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            max_position_embeddings=int(text.get("max_position_embeddings") or 2048),
            linear_attention=linear, vision_parameters=_vision_parameters(raw.get("vision_config")),
            quantization=read_weight_format(text, hidden, source),
            expert_bias=model_type == "gpt_oss", router_bias=model_type == "gpt_oss"
            or text.get("topk_method") == "noaux_tc", engine_refusal=engine_refusal,
        )

    # ---- the ModelSpec protocol (dcpserve/cluster/model_specs.py) ----

    @property
    def attention(self) -> str:
        return "MQA" if self.num_key_value_heads == 1 else "GQA"

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    def kv_bytes_per_token_per_rank(self, tp: int, dtype: torch.dtype, context_len: int | None = None) -> int:
        per_layer = max(1, self.num_key_value_heads // tp) * (self.head_dim + self.v_head_dim) * dtype.itemsize
        full = sum(kind == "full" for kind in self.layer_kinds)
        windowed = sum(kind in ("sliding", "chunked") for kind in self.layer_kinds)
        if context_len is None or self.window >= context_len:
            return (full + windowed) * per_layer
        # A windowed layer holds min(window, context_len) of a context_len sequence's tokens.
        return full * per_layer + -(-windowed * per_layer * self.window // context_len)

    def parameter_parts(self, tp: int) -> ParameterParts:
        hidden = self.hidden_size
        heads, kv = self.num_attention_heads // tp, max(1, self.num_key_value_heads // tp)
        q_width = heads * self.head_dim * (2 if self.attn_output_gate else 1)
        attention_layer = hidden * (q_width + kv * (self.head_dim + self.v_head_dim)) + heads * self.v_head_dim * hidden
        attention_other = ((q_width + kv * (self.head_dim + self.v_head_dim) if self.qkv_bias else 0)
                           + (hidden if self.o_bias else 0) + (2 * self.head_dim if self.qk_norm else 0))
        matrices = 3 if self.gated_mlp else 2
        attention = other = dense = experts = shared = 0
        for kind in self.layer_kinds:
            if kind == "linear" and self.linear_attention is not None:
                projections, state = _linear_attention_parameters(self.linear_attention, hidden, tp)
                attention, other = attention + projections, other + state
            else:
                attention, other = attention + attention_layer, other + attention_other
        for is_moe in self.moe_layers:
            if not is_moe:
                dense += matrices * hidden * -(-self.intermediate_size // tp)
                continue
            expert = -(-self.moe_intermediate_size // tp)
            experts += self.num_experts * matrices * hidden * expert
            shared += matrices * hidden * -(-self.shared_expert_intermediate_size // tp)
            other += self.num_experts * hidden + (self.num_experts if self.router_bias else 0)  # router
            other += hidden if self.shared_expert_intermediate_size else 0  # the shared expert's gate (Qwen)
            other += self.num_experts * (2 * expert + hidden) if self.expert_bias else 0
        other += self.num_hidden_layers * self.norms_per_layer * hidden + hidden  # norms, final norm
        other += -(-self.vision_parameters // tp)
        embedding = -(-self.vocab_size // tp) * hidden
        return ParameterParts(embedding=embedding, lm_head=0 if self.tie_word_embeddings else embedding,
                              attention=attention, dense_mlp=dense, experts=experts, shared_experts=shared,
                              other=other)

    def parameters_per_rank(self, tp: int) -> int:
        return self.parameter_parts(tp).total

    def validate_layout(self, tp: int, dcp: int, pcp: int = 1) -> None:
        ParallelConfig(tp, dcp, pcp).validate(self)
        check_block_shards(self.quantization, tp, {
            "dense_mlp": self.intermediate_size if not all(self.moe_layers) else 0,
            "experts": self.moe_intermediate_size if any(self.moe_layers) else 0,
            "shared_experts": self.shared_expert_intermediate_size if any(self.moe_layers) else 0})
        linear = self.linear_attention
        if linear is not None:
            for what, count in (("linear_num_key_heads", linear.num_key_heads),
                                ("linear_num_value_heads", linear.num_value_heads)):
                if count % tp:
                    raise ValueError(f"tp={tp} must divide the model's {count} linear-attention heads ({what}); "
                                     f"choose tp among its divisors")

    def describe_shape(self) -> str:
        kinds = {kind: self.layer_kinds.count(kind) for kind in ("full", "sliding", "chunked", "linear")}
        layers = ", ".join(f"{count} {kind}" for kind, count in kinds.items() if count)
        window = f" (window {self.window:,})" if kinds["sliding"] or kinds["chunked"] else ""
        moe = sum(self.moe_layers)
        experts = (f", {moe} MoE layers of {self.num_experts} experts of {self.moe_intermediate_size} "
                   f"({self.num_experts_per_tok} per token)" if moe else "")
        kv = self.num_key_value_heads
        return (f"{self.num_hidden_layers} layers ({layers}{window}), hidden {self.hidden_size}, "
                f"{self.num_attention_heads} heads, {kv} KV head{'s' if kv > 1 else ''}, head_dim {self.head_dim}"
                f"{experts}, vocab {self.vocab_size}")

    def notes(self) -> list[str]:
        why = (f"the native engine refuses it as it is: {self.engine_refusal}" if self.engine_refusal
               else "the native engine does not run it; vLLM does")
        notes = [f"{self.architecture} counted from config.json's fields ({why})."]
        if "sliding" in self.layer_kinds or "chunked" in self.layer_kinds:
            notes.append(
                f"Sliding-window layers cache at most {self.window:,} tokens of a sequence: KV bytes per token count "
                f"each at min(window, context) / context of a full layer (vLLM's hybrid KV cache; the prefill chunk "
                f"it keeps past the window is not counted), so the figure holds for sequences of the plan's context.")
        if self.linear_attention is not None:
            notes.append("Linear-attention layers hold a fixed state per sequence, not counted: nothing per token.")
        if self.vision_parameters:
            notes.append(f"Vision encoder: about {self.vision_parameters / 1e9:.2f}B parameters (layers x "
                         f"attention + MLP of vision_config), counted split tp ways.")
        return notes


def _layer_kinds(text: dict[str, Any], layers: int, source: str) -> tuple[tuple[str, ...], int]:
    """Each layer's cache kind and the window of the windowed ones."""
    sliding = int(text.get("sliding_window") or 0)
    chunk = int(text.get("attention_chunk_size") or 0)
    types = text.get("layer_types")
    if types:
        if len(types) != layers:
            raise ValueError(f"{source}: layer_types has {len(types)} entries for {layers} layers")
        unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{source}: layer types {unknown} are not counted by the planner (it counts "
                             f"{', '.join(LAYER_TYPES)}); Mamba-style state layers are not modelled")
        kinds = tuple(LAYER_TYPES[str(t)] for t in types)
    elif text.get("hybrid_override_pattern") or text.get("attn_layer_period"):
        raise ValueError(f"{source}: a hybrid Mamba / attention model (hybrid_override_pattern / attn_layer_period); "
                         f"the planner does not count Mamba layers")
    elif text.get("full_attention_interval"):
        interval = int(text["full_attention_interval"])
        kinds = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(layers))
    elif chunk:
        no_rope = text.get("no_rope_layers") or [int((i + 1) % int(text.get("no_rope_layer_interval") or 4) != 0)
                                                 for i in range(layers)]
        kinds = tuple("chunked" if no_rope[i] else "full" for i in range(layers))  # 1: RoPE, chunked attention
    elif text.get("sliding_window_pattern") and sliding:
        pattern = int(text["sliding_window_pattern"])
        kinds = tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))
    elif str(text.get("model_type")) == "gemma2" and sliding:
        kinds = tuple("sliding" if (i + 1) % 2 else "full" for i in range(layers))
    elif "use_sliding_window" in text:
        first = int(text.get("max_window_layers") or 0)
        on = bool(text["use_sliding_window"]) and sliding > 0
        kinds = tuple("sliding" if on and i >= first else "full" for i in range(layers))
    else:
        kinds = tuple("sliding" if sliding else "full" for _ in range(layers))
    window = chunk if "chunked" in kinds else sliding
    if ("sliding" in kinds or "chunked" in kinds) and window < 1:
        raise ValueError(f"{source}: sliding-window layers without a sliding_window (or attention_chunk_size)")
    return kinds, window


def _mlp_sizes(text: dict[str, Any], experts: int, model_type: str) -> tuple[int, int, int]:
    """(dense MLP width, routed expert width, shared experts' width together)."""
    intermediate = int(text.get("intermediate_size") or 0)
    expert = int(text.get("moe_intermediate_size") or 0) or intermediate
    dense = int(text.get("intermediate_size_mlp") or 0) or intermediate
    shared = int(text.get("shared_expert_intermediate_size") or 0)
    if not shared and text.get("n_shared_experts"):
        shared = int(text["n_shared_experts"]) * expert
    if not shared and experts and model_type.startswith("llama4"):
        shared = intermediate  # Llama 4: one shared expert as wide as a routed one
    return dense, expert, shared


def _moe_layers(text: dict[str, Any], layers: int, experts: int) -> tuple[bool, ...]:
    """Which layers are MoE, by the family's fields (all of them when none is set)."""
    if not experts:
        return (False,) * layers
    if isinstance(text.get("moe_layers"), list):
        chosen = {int(i) for i in text["moe_layers"]}
        return tuple(i in chosen for i in range(layers))
    if "first_k_dense_replace" in text or "moe_layer_freq" in text:
        first, freq = int(text.get("first_k_dense_replace") or 0), int(text.get("moe_layer_freq") or 1)
        return tuple(i >= first and i % freq == 0 for i in range(layers))
    if "decoder_sparse_step" in text or "mlp_only_layers" in text:
        step, dense = int(text.get("decoder_sparse_step") or 1), set(text.get("mlp_only_layers") or [])
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    if text.get("interleave_moe_layer_step"):
        step = int(text["interleave_moe_layer_step"])
        return tuple((i + 1) % step == 0 for i in range(layers))
    return (True,) * layers


def _linear_attention_parameters(linear: LinearAttention, hidden: int, tp: int) -> tuple[int, int]:
    """(projections, the rest) of one gated-delta-net layer on one rank: in_proj_qkvz, in_proj_ba, out_proj split tp
    ways; conv1d, A_log, dt_bias split; the output norm whole."""
    key_dim = linear.num_key_heads * linear.key_head_dim // tp
    value_dim = linear.num_value_heads * linear.value_head_dim // tp
    value_heads = linear.num_value_heads // tp
    projections = hidden * (2 * key_dim + 2 * value_dim) + hidden * 2 * value_heads + value_dim * hidden
    state = (2 * key_dim + value_dim) * linear.conv_kernel_dim + 2 * value_heads + linear.value_head_dim
    return projections, state


def _vision_parameters(vision: Any) -> int:
    """A vision encoder's parameters, about: layers x (q, k, v, o + MLP), from vision_config (0 without one)."""
    if not isinstance(vision, dict):
        return 0
    hidden = int(vision.get("hidden_size") or 0)
    layers = int(vision.get("num_hidden_layers") or vision.get("depth") or 0)
    intermediate = int(vision.get("intermediate_size") or 4 * hidden)
    matrices = 3 if str(vision.get("hidden_act", "")) == "silu" else 2
    return layers * (4 * hidden * hidden + matrices * hidden * intermediate)
