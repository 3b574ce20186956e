"""The implementations of every kernel, by name, so each test runs against all of them.

"cpu" is the engine's CPU path: the fused-SDPA attention kernels with the (vectorized) store and combine
references; its tests run on CPU tensors whatever the test device (tests/kernels/conftest.py)."""

from __future__ import annotations

import torch

import kernels
from kernels.decode_attention import paged_decode_attention_split

IMPLS: dict[str, dict[str, object]] = {
    "ref": {
        "store_kv": kernels.store_kv_ref,
        "decode": kernels.paged_decode_attention_ref,
        "prefill": kernels.paged_prefill_attention_ref,
        "combine": kernels.combine_lse_ref,
    },
    "triton": {
        "store_kv": kernels.store_kv,
        "decode": kernels.paged_decode_attention,
        "prefill": kernels.paged_prefill_attention,
        "combine": kernels.combine_lse,
    },
    "cpu": {
        "store_kv": kernels.store_kv_ref,
        "decode": kernels.paged_decode_attention_cpu,
        "prefill": kernels.paged_prefill_attention_cpu,
        "combine": kernels.combine_lse_ref,
    },
}
# The implementations with attention kernels of their own (store_kv and combine: "ref" and "triton" only).
ATTENTION_IMPLS = ["ref", "triton", "cpu"]

TEST_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of NaN, so an element the kernel forgets to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


__all__ = ["ATTENTION_IMPLS", "IMPLS", "TEST_DTYPES", "paged_decode_attention_split", "poisoned"]
