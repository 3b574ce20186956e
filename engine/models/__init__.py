"""Model definitions; every supported architecture (config.SUPPORTED_ARCHITECTURES) maps to one class."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import ModelConfig
from engine.models.causal_lm import CausalLM  # what the model runner drives
from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.worker.parallel import ParallelState

# A model class: built from (config, parallel, dtype, device).
ModelClass = Callable[[ModelConfig, ParallelState, torch.dtype, torch.device], CausalLM]

MODEL_CLASSES: dict[str, ModelClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
}

__all__ = ["MODEL_CLASSES", "CausalLM", "DeepseekV2ForCausalLM", "LlamaForCausalLM"]
