"""The implementations of every kernel, by name, so each test runs against all of them.

"cpu" is the engine's CPU path: the fused-SDPA attention kernels, the store with its per-step plan and the lean
combine (combine_lse_cpu, bit for bit the reference's); its tests run on CPU tensors whatever the test device
(tests/kernels/conftest.py)."""

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
        "store_kv": lambda key, value, k_cache, v_cache, slot_mapping, all_owned=False: kernels.store_kv_planned(
            key, value, k_cache, v_cache, slot_mapping, kernels.StorePlan(slot_mapping, all_owned)),
        "decode": kernels.paged_decode_attention_cpu,
        "prefill": kernels.paged_prefill_attention_cpu,
        "combine": kernels.combine_lse_cpu,
    },
}
# The implementations with attention kernels of their own (store_kv: "ref" and "triton" only).
ATTENTION_IMPLS = ["ref", "triton", "cpu"]

TEST_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])

# Without a GPU, "triton" runs in Triton's CPU interpreter: every program instance simulated in Python, seconds per
# case. There an attention case runs through Triton only where it covers a path of the kernel no other case does:
# - every case of 1 or 2 DCP ranks in float32, and the first case also in float16 (the half-precision path: loads,
#   float32 accumulation, stores, is the same code at every geometry);
# - a case of more ranks only in float32, and only when its page size and head width (what decides how a key tile
#   maps to pages and how wide the channel tile is) are not run already: the rank count and interleave only change
#   each rank's local lengths, which the hostile lengths of every case exercise, and the exact sharding geometry of
#   3, 4 and 8 ranks runs in every dtype on "ref" and "cpu".
# That takes about two and a half minutes of CPU off the fast tier; on a GPU every case runs in every dtype.
INTERPRETED_MAX_DCP = 2


def _interpreted_triton_cases(cases: Sequence[tuple[int, ...]]) -> set[tuple[int, ...]]:
    """The cases the interpreter runs through Triton (the rule above): (dcp, block_size, ..., head_dim) tuples."""
    chosen = {case for case in cases if case[0] <= INTERPRETED_MAX_DCP}
    seen = {(case[1], case[-1]) for case in chosen}
    for case in cases:
        if case[0] > INTERPRETED_MAX_DCP and (case[1], case[-1]) not in seen:
            chosen.add(case)
            seen.add((case[1], case[-1]))
    return chosen


def attention_params(cases: Sequence[tuple[int, ...]], impls: list[str]) -> list[object]:
    """pytest parameters (case, dtype, impl) for an attention test whose case starts with its DCP size and ends with
    its head width; ids as "N{dcp}-B{block}-I{interleave}-kv{heads}-g{group}-d{head_dim}-{dtype}-{impl}"."""
    interpreted = not torch.cuda.is_available()
    triton_cases = _interpreted_triton_cases(cases) if interpreted else set(cases)
    params: list[object] = []
    for case in cases:
        for dtype in TEST_DTYPES:
            for impl in impls:
                if impl == "triton" and interpreted and (
                        case not in triton_cases
                        or (dtype == torch.float16 and case != cases[0])):
                    continue
                case_id = "N{}-B{}-I{}-kv{}-g{}-d{}".format(*case)
                params.append(pytest.param(case, dtype, impl, id=f"{case_id}-{dtype}-{impl}"))
    return params


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of NaN, so an element the kernel forgets to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


__all__ = ["ATTENTION_IMPLS", "IMPLS", "TEST_DTYPES", "attention_params", "paged_decode_attention_split", "poisoned"]
