"""The implementations of every kernel, by name, so each test runs against all of them.

"cpu" is the engine's CPU path: the fused-SDPA attention kernels with the (vectorized) store and combine
references; its tests run on CPU tensors whatever the test device (tests/kernels/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import dcpserve.kernels as kernels
from dcpserve.kernels.decode_attention import paged_decode_attention_split

IMPLS: dict[str, dict[str, Callable[..., Any]]] = {
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

# Without a GPU, "triton" runs in Triton's CPU interpreter: every program instance simulated in Python, seconds per
# case. There the attention tests run float16 through Triton only where DCP is 1 or 2 ranks: the half-precision path
# (loads, float32 accumulation, stores) is the same code at every geometry, and the sharding geometry (3, 4 and 8
# ranks, every block size and interleave) is covered by float32 on Triton and by every dtype on "ref" and "cpu".
# That takes a minute off the fast tier on 2 cores; on a GPU every case runs in every dtype.
INTERPRETED_HALF_MAX_DCP = 2


def attention_params(cases: Sequence[tuple[int, ...]], impls: list[str]) -> list[object]:
    """pytest parameters (case, dtype, impl) for an attention test whose case starts with its DCP size; ids as
    "N{dcp}-B{block}-I{interleave}-kv{heads}-g{group}-d{head_dim}-{dtype}-{impl}"."""
    params: list[object] = []
    for case in cases:
        for dtype in TEST_DTYPES:
            for impl in impls:
                if (impl == "triton" and dtype == torch.float16 and not torch.cuda.is_available()
                        and case[0] > INTERPRETED_HALF_MAX_DCP):
                    continue
                case_id = "N{}-B{}-I{}-kv{}-g{}-d{}".format(*case)
                params.append(pytest.param(case, dtype, impl, id=f"{case_id}-{dtype}-{impl}"))
    return params


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of NaN, so an element the kernel forgets to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


__all__ = ["ATTENTION_IMPLS", "IMPLS", "TEST_DTYPES", "attention_params", "paged_decode_attention_split", "poisoned"]
