"""The two implementations of every kernel, by name, so each test runs against both."""

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
}

TEST_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of NaN, so an element the kernel forgets to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


__all__ = ["IMPLS", "TEST_DTYPES", "paged_decode_attention_split", "poisoned"]
