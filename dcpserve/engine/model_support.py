"""What the native engine computes, checked on config.json before any rank starts: an architecture it runs, and no
field that would change the model's output in a way the engine ignores.

`supported_architecture` picks the architecture or refuses, by name, with the reason and the alternative: a
multimodal wrapper (its text model under `text_config`) named with the text model inside; an architecture the
engine does not run, with what it would need (`UNSUPPORTED_FEATURES`). `check_fields` refuses what a supported
architecture's config may carry but the engine does not compute (activations other than silu, sliding-window or other
non-full attention layers, logit soft-capping, no-RoPE layers). `context_limit` is how far the engine serves a
model: max_position_embeddings, or less where the config's long-context method is one the engine does not compute
but equals plain attention up to a length (dual chunk attention within one chunk).
"""

from __future__ import annotations

from typing import Any

from dcpserve.engine.quantization import VLLM_ALTERNATIVE

# Architectures people serve that the native engine does not run, and what each would need.
UNSUPPORTED_FEATURES: dict[str, str] = {
    "GptOssForCausalLM": "sliding-window layers, attention sinks and MXFP4 experts",
    "Gemma3ForCausalLM": "sliding-window layers, logit soft-capping and Gemma's norms",
    "Gemma2ForCausalLM": "sliding-window layers, logit soft-capping and Gemma's norms",
    "Glm4MoeForCausalLM": "partial rotary embeddings (partial_rotary_factor) and GLM's MoE routing",
    "Llama4ForCausalLM": "chunked attention, no-RoPE layers and Llama 4's MoE",
    "Qwen3NextForCausalLM": "Gated DeltaNet linear-attention layers (a hybrid model) and partial rotary embeddings",
    "MistralForCausalLM": "Mistral's sliding window",
    "MixtralForCausalLM": "Mixtral's mixture of experts",
    "Phi3ForCausalLM": "longrope scaling",
}


def _architectures(raw: dict[str, Any], source: str) -> list[str]:
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ValueError(f"{source}: architectures must be a list of names, got {architectures!r}")
    return architectures


def supported_architecture(raw: dict[str, Any], supported: tuple[str, ...], source: str) -> str:
    """The first of the config's architectures the engine runs, or a ValueError naming why not."""
    architectures = _architectures(raw, source)
    architecture = next((a for a in architectures if a in supported), None)
    if architecture is not None:
        return architecture
    named = ", ".join(architectures) or "none"
    text = raw.get("text_config")
    if isinstance(text, dict):
        inner = ", ".join(_architectures(text, source)) or text.get("model_type") or "unknown"
        raise ValueError(
            f"{source}: {named} is a multimodal wrapper whose text model ({inner}, under text_config) the native "
            f"engine does not load: it runs text-only checkpoints of {', '.join(supported)}; {VLLM_ALTERNATIVE}"
        )
    needs = next((UNSUPPORTED_FEATURES[a] for a in architectures if a in UNSUPPORTED_FEATURES), None)
    because = f" (it would need {needs})" if needs else ""
    raise ValueError(
        f"{source}: architecture {named} is not supported by the native engine{because}; it runs "
        f"{', '.join(supported)}; {VLLM_ALTERNATIVE}"
    )


def check_fields(raw: dict[str, Any], architecture: str, source: str) -> None:
    """Refuses, naming the field, what a config of a supported architecture may say that the engine ignores."""
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(
            f"{source}: hidden_act={act!r} is not supported by the native engine ({architecture}'s MLP runs silu); "
            f"{VLLM_ALTERNATIVE}"
        )
    layer_types = raw.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(
            f"{source}: layer_types {other} are not supported by the native engine (full attention in every layer); "
            f"{VLLM_ALTERNATIVE}"
        )
    if raw.get("use_sliding_window"):
        raise ValueError(
            f"{source}: use_sliding_window=true is not supported (the native engine runs full attention); set it to "
            f"false only if the model was trained without a window, or {VLLM_ALTERNATIVE}"
        )
    for name in ("final_logit_softcapping", "attn_logit_softcapping", "logits_soft_cap"):
        if raw.get(name) is not None:
            raise ValueError(f"{source}: {name}={raw[name]} (logit soft-capping) is not supported by the native "
                             f"engine; {VLLM_ALTERNATIVE}")
    no_rope = raw.get("no_rope_layers")
    if no_rope and not all(no_rope):
        raise ValueError(f"{source}: no_rope_layers (layers without RoPE) are not supported by the native engine; "
                         f"{VLLM_ALTERNATIVE}")
    if raw.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported (MLPs without bias only); {VLLM_ALTERNATIVE}")


def context_limit(raw: dict[str, Any], source: str) -> tuple[int, str]:
    """The longest context the engine serves this model to, and why when it is less than max_position_embeddings
    ('' otherwise)."""
    limit = int(raw.get("max_position_embeddings", 2048))
    chunked = raw.get("dual_chunk_attention_config")
    if chunked:
        if not isinstance(chunked, dict):
            raise ValueError(f"{source}: dual_chunk_attention_config must be an object, got {chunked!r}")
        window = chunked.get("original_max_position_embeddings") or chunked.get("chunk_size")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"{source}: dual_chunk_attention_config needs original_max_position_embeddings or "
                             f"chunk_size, got {chunked!r}")
        if window < limit:
            return window, (
                f"dual chunk attention (dual_chunk_attention_config) is not computed by the native engine; up to "
                f"{window} tokens it equals full attention, so the engine serves the model to {window} of its "
                f"max_position_embeddings={limit} tokens; {VLLM_ALTERNATIVE} for longer contexts"
            )
    return limit, ""
