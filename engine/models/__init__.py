"""Model definitions; every supported architecture (config.SUPPORTED_ARCHITECTURES) maps to one class."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

__all__ = ["MODEL_CLASSES", "LlamaForCausalLM"]
