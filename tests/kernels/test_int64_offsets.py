"""Offsets past 2^31 elements: the kernels compute them in 64 bits (dcpserve/kernels/launch_configs.py's
OFFSET_AUDIT), shown on the interpreter without the memory such offsets need.

Each case hands a kernel a view whose row stride fits an int32 argument while a row's offset, row x stride, does not.
The view lies in a sparse file mapped into memory (8 GiB of address space, a few pages of it ever touched), starting
in its middle; where an int32 product would wrap (2^32 elements lower) the file holds a poison value, so a kernel that
wrapped reads it and fails the comparison with the torch reference instead of faulting.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dcpserve.kernels import (
    combine_lse,
    combine_lse_ref,
    fp8_block_gemm,
    fp8_block_gemm_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from dcpserve.kernels.launch_configs import INT32_MAX, OFFSET_AUDIT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's int32 wrap, on CPU tensors")

BASE = 2**31  # where the view starts in the file, in elements
ROW_STRIDE = 2**30 + 64  # an int32 argument; row 2 starts 2^31 + 128 elements past the view
POISON = 1000.0


def sparse_rows(tmp_path: Path, rows: torch.Tensor) -> torch.Tensor:
    """rows [R, *row] copied into a view of stride ROW_STRIDE at element BASE of a sparse file, poisoned where each
    row's int32-wrapped offset would land."""
    width = rows[0].numel()
    size = BASE + (rows.shape[0] - 1) * ROW_STRIDE + width
    path = tmp_path / "sparse.bin"
    with path.open("wb") as f:
        f.truncate(size * rows.element_size())
    store = torch.from_file(str(path), shared=True, size=size, dtype=rows.dtype)
    view = store.as_strided(rows.shape, (ROW_STRIDE, *rows[0].stride()), BASE)
    for i in range(rows.shape[0]):
        view[i].copy_(rows[i])
        if i * ROW_STRIDE > INT32_MAX:
            wrapped = BASE + i * ROW_STRIDE - 2**32
            store[wrapped:wrapped + width].fill_(POISON)
    return view


def test_the_audit_finds_offsets_past_int32() -> None:
    past = {bound.kernel for bound in OFFSET_AUDIT if bound.elements > INT32_MAX}
    assert {"combine", "prefill", "fp8_gemm"} <= past  # 128 heads x a 128k-token chunk, and the like
    assert all(bound.int64_by for bound in OFFSET_AUDIT)


def test_combine_reaches_parts_past_int32(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    outs = torch.randn(3, 2, 4, 16, generator=gen).to(torch.float16)
    lses = torch.randn(3, 2, 4, generator=gen)
    out, lse = combine_lse(sparse_rows(tmp_path, outs), lses)
    expected, expected_lse = combine_lse_ref(outs, lses)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, expected_lse)


def test_decode_reads_query_rows_past_int32(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    seqs, heads, dim, block = 3, 2, 16, 16
    q = torch.randn(seqs, heads, dim, generator=gen).to(torch.float16)
    k_cache = torch.randn(4, block, 1, dim, generator=gen).to(torch.float16)
    v_cache = torch.randn(4, block, 1, dim, generator=gen).to(torch.float16)
    table = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    lens = torch.tensor([20, 9, 31], dtype=torch.int32)
    scale = 1 / math.sqrt(dim)
    out, lse = paged_decode_attention(sparse_rows(tmp_path, q), k_cache, v_cache, table, lens, scale)
    expected, expected_lse = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, expected_lse, atol=2e-3, rtol=2e-3)


def test_fp8_gemm_reads_rows_past_int32(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 128, generator=gen).to(torch.float16)
    weight = (torch.randn(32, 128, generator=gen) * 4).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(1, 1, generator=gen) + 0.5
    out = fp8_block_gemm(sparse_rows(tmp_path, x), weight, scale_inv, (128, 128))
    torch.testing.assert_close(out, fp8_block_gemm_ref(x, weight, scale_inv, (128, 128)), atol=0.1, rtol=1e-2)
