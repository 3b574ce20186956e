"""Model definitions; every supported architecture (config.SUPPORTED_ARCHITECTURES) maps to one class."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dcpserve.engine.config import ModelConfig
from dcpserve.engine.models.causal_lm import CausalLM  # what the model runner drives
from dcpserve.engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from dcpserve.engine.models.llama import LlamaForCausalLM
from dcpserve.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from dcpserve.engine.worker.parallel import ParallelState

# A model class: built from (config, parallel, dtype, device).
ModelClass = Callable[[ModelConfig, ParallelState, torch.dtype, torch.device], CausalLM]

MODEL_CLASSES: dict[str, ModelClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen3MoeForCausalLM,
}

__all__ = ["MODEL_CLASSES", "CausalLM", "DeepseekV2ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"]
