"""What one rank's paged KV cache holds for a model, and its allocation: the one place its bytes are counted.

A layer's cache is a (k_cache, v_cache) pair of [num_blocks, block_size, num_kv_heads, head_dim] tensors. A model
whose values are read from its keys (MLA: one [latent | rope key] vector per token, the values are the latent)
allocates the key cache alone and pairs it with itself, so the pairs look the same to every caller and the bytes
are counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KvCacheSpec:
    """The per-rank paged KV cache of a model: num_layers layers of num_kv_heads heads of head_dim values per token,
    as keys and (unless the values are read from the keys) values."""

    num_layers: int
    num_kv_heads: int  # held by one rank
    head_dim: int  # of one cached head (MLA: kv_lora_rank + qk_rope_head_dim)
    has_value_cache: bool  # False: the values are read from the key cache (MLA)

    @property
    def caches_per_layer(self) -> int:
        return 2 if self.has_value_cache else 1

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one cached token takes on one rank, all layers (before DCP shards the sequence)."""
        element = torch.tensor([], dtype=dtype).element_size()
        return self.caches_per_layer * self.num_layers * self.num_kv_heads * self.head_dim * element

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str, fill: float = 0.0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (k_cache, v_cache) pair per layer, filled with `fill`; a key-only cache is its own v_cache."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        caches = []
        for _ in range(self.num_layers):
            keys = torch.full(shape, fill, dtype=dtype, device=device)
            values = torch.full(shape, fill, dtype=dtype, device=device) if self.has_value_cache else keys
            caches.append((keys, values))
        return caches
