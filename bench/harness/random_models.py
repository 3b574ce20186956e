"""The random tiny checkpoints of the model tests and the long-context benchmark: their common shape (COMMON, with a
vocabulary no TP size divides), the init that makes norms and biases matter, and the logits tolerance against
transformers in fp32."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 301  # not divisible by 2 or 4: the vocabulary-parallel layers pad
LOGITS_ATOL = 1e-4

COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
    initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)


def randomize_norms_and_biases(model: torch.nn.Module, buffers: bool = False) -> None:
    """Norm weights 1 + 0.2 N(0, 1) and biases 0.2 N(0, 1) (default init leaves them 1 and 0, which would hide a
    wrong norm or a missing bias); with buffers, the named buffers too (a router's correction bias)."""
    named = [*model.named_parameters(), *(model.named_buffers() if buffers else ())]
    with torch.no_grad():
        for name, tensor in named:
            if "norm" in name:
                tensor.copy_(1.0 + 0.2 * torch.randn_like(tensor))
            elif name.endswith("bias"):
                tensor.copy_(0.2 * torch.randn_like(tensor))
