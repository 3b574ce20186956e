"""Model definitions; every supported architecture (config.SUPPORTED_ARCHITECTURES) maps to one class."""

from __future__ import annotations

from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.models.llama import LlamaForCausalLM

# What the model runner drives: forward, compute_logits, kv_cache_spec, load_weights.
CausalLM = LlamaForCausalLM | DeepseekV2ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
}

__all__ = ["MODEL_CLASSES", "CausalLM", "DeepseekV2ForCausalLM", "LlamaForCausalLM"]
