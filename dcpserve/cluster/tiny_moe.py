"""Tiny random-weight Qwen3-MoE / Qwen2-MoE models, written offline for tests and benchmarks.

`write_tiny_qwen_moe_model(DIR, seed, spec=TinyQwenMoeSpec(...))` builds transformers' Qwen3MoeForCausalLM (or
Qwen2MoeForCausalLM) from the spec with random weights (norms and biases random too, so a load that swaps or drops
one shows), and saves it with save_pretrained: config.json, model.safetensors with one tensor per expert and
projection (the checkpoints' layout), generation_config.json. No tokenizer: drive it with token ids. Nothing is
downloaded; the weights are the same for the same seed and torch / transformers versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

QwenMoeArchitecture = Literal["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"]


@dataclass(frozen=True)
class TinyQwenMoeSpec:
    """Shape of a tiny Qwen MoE model. The defaults keep Qwen3-30B-A3B's 8 query heads per KV head (16 and 2), a
    dense layer among the sparse ones (mlp_only_layers), 8 experts with 2 per token, renormalized, and weights large
    enough (initializer_range 0.15) that attention and routing are far from uniform."""

    architecture: QwenMoeArchitecture = "Qwen3MoeForCausalLM"
    vocab_size: int = 301  # no TP size divides it: the vocabulary-parallel layers pad
    hidden_size: int = 64
    intermediate_size: int = 96  # the dense layers'
    num_hidden_layers: int = 3
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = (1,)
    shared_expert_intermediate_size: int = 48  # Qwen2-MoE only
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.15
    tie_word_embeddings: bool = False

    def transformers_config(self) -> dict[str, Any]:
        """The keyword arguments of transformers' Qwen3MoeConfig / Qwen2MoeConfig."""
        config: dict[str, Any] = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
            mlp_only_layers=list(self.mlp_only_layers), max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta}, rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.initializer_range, tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        if self.architecture == "Qwen3MoeForCausalLM":
            config["head_dim"] = self.head_dim
        else:  # Qwen2-MoE's head width is hidden_size / num_attention_heads
            config["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return config


def write_tiny_qwen_moe_model(directory: str | Path, seed: int = 0, *, spec: TinyQwenMoeSpec | None = None) -> Path:
    """Writes the tiny model into `directory` (created; an existing model there is overwritten) and returns it."""
    import torch
    import transformers

    spec = spec or TinyQwenMoeSpec()
    family = spec.architecture.removesuffix("ForCausalLM")
    config = getattr(transformers, f"{family}Config")(**spec.transformers_config())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, spec.architecture)(config).to(torch.float32).eval()
        with torch.no_grad():  # default init leaves norms 1 and biases 0, which would hide a wrong norm or bias
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                elif name.endswith("bias"):
                    param.copy_(0.2 * torch.randn_like(param))
    out = Path(directory).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out
