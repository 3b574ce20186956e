"""The Triton kernels at the tile sizes CUDA runs them with (cuda_tiles=True), on the interpreter: BLOCK_N 64 and
64-row prefill tiles for GQA, 64 context splits, the 64 gathered query heads of one KV head in one program (DCP's
gathered-head decode) and MLA's 128 heads on its one latent head (eight 16-head blocks of 512 + 64 channels), against
the torch references in fp32 and fp16 (the interpreter's bf16 is broken). Small contexts: the interpreter is slow."""

from __future__ import annotations

import math

import pytest
import torch

from dcpserve.kernels import (
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from dcpserve.kernels.decode_attention import MAX_SPLITS, decode_tiles, paged_decode_attention_split
from dcpserve.kernels.prefill_attention import prefill_tiles

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA every kernel test runs at these tiles")

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3}
BLOCK_SIZE = 16


def paged_cache(lengths: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache [pages, BLOCK_SIZE, kv_heads, head_dim] with each sequence's pages shuffled, and its block table."""
    per_seq = max(-(-n // BLOCK_SIZE) for n in lengths)
    pages = torch.randperm(len(lengths) * per_seq + 1, generator=gen)[: len(lengths) * per_seq]
    cache = torch.randn(len(lengths) * per_seq + 1, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    return cache, pages.view(len(lengths), per_seq).to(torch.int32)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# case: (query heads, KV heads, head_dim, v_head_dim, splits, lengths, expected (BLOCK_G, head blocks, BLOCK_N))
DECODE_CASES = {
    "gqa-g64": (64, 1, 128, 128, 2, [150, 40], (64, 1, 64)),  # DCP's 64 gathered heads of one KV head
    "gqa-splits64": (8, 2, 128, 128, MAX_SPLITS, [300], (16, 1, 64)),  # one long sequence, the most splits
    "mla-h128": (128, 1, 576, 512, 2, [70], (16, 8, 32)),  # the latent cache holds values and keys: [512 | 64]
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_at_cuda_tiles(case: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, v_dim, splits, lengths, expected_tiles = DECODE_CASES[case]
    tiles = decode_tiles(heads // kv_heads, head_dim, v_dim, cuda_tiles=True)
    assert (tiles.block_g, tiles.head_blocks, tiles.block_n) == expected_tiles
    k_cache, table = paged_cache(lengths, kv_heads, head_dim, dtype, gen)
    v_cache = None if case == "mla-h128" else torch.randn(k_cache.shape, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    out, lse = paged_decode_attention_split(q, k_cache, v_cache, table, lens, scale, splits, v_head_dim=v_dim,
                                            cuda_tiles=True)
    expected, expected_lse = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale, v_head_dim=v_dim)
    close(out, expected, dtype)
    close(lse, expected_lse, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["gqa-d128", "mla-h128"])
def test_prefill_at_cuda_tiles(case: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    if case == "mla-h128":
        heads, kv_heads, head_dim, v_dim, chunks, contexts = 128, 1, 576, 512, [9], [20]
    else:
        heads, kv_heads, head_dim, v_dim, chunks, contexts = 4, 2, 128, 128, [66, 5], [70, 0]
    tiles = prefill_tiles(head_dim, v_dim, cuda_tiles=True)
    assert (tiles.block_m, tiles.block_n) == ((16, 32) if case == "mla-h128" else (64, 64))
    k_cache, table = paged_cache([max(n, 1) for n in contexts], kv_heads, head_dim, dtype, gen)
    shared = case == "mla-h128"
    v_cache = None if shared else torch.randn(k_cache.shape, generator=gen).to(dtype)
    tokens = sum(chunks)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    value = None if shared else torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    context_lens = torch.tensor(contexts, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    args = (q, key, value, k_cache, v_cache, table, starts, context_lens, scale, max(chunks))
    out, lse = paged_prefill_attention(*args, v_head_dim=v_dim, cuda_tiles=True)
    expected, expected_lse = paged_prefill_attention_ref(*args, v_head_dim=v_dim)
    close(out, expected, dtype)
    close(lse, expected_lse, dtype)
