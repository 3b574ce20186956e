"""Model definitions; every supported architecture (config.SUPPORTED_ARCHITECTURES) maps to one class."""

from __future__ import annotations

from engine.models.causal_lm import CausalLM  # what the model runner drives
from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
}

__all__ = ["MODEL_CLASSES", "CausalLM", "DeepseekV2ForCausalLM", "LlamaForCausalLM"]
