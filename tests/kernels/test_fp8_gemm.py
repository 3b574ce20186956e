"""fp8_block_gemm (Triton) and fp8_block_gemm_ref against a float64 dense reference: M = 1, odd M, N and K that cut
the last scale block, DeepSeek's 128 x 128 block and small non-square ones, fp32 and fp16 activations, with and
without a bias; a poisoned output shows unwritten elements; and the argument errors."""

from __future__ import annotations

import pytest
import torch

from dcpserve.kernels import dequantize_fp8_block, fp8_block_gemm, fp8_block_gemm_ref

# Relative error bounds (STYLE.md): of the max |error| over the max |expected|. The engine's FP8-vs-dequantized
# model tests hold the logits to these.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
# (M, N, K, block_size): K and N not multiples of the block (partial last blocks), N < one tile, M = 1 and odd.
SHAPES = [
    (1, 200, 300, (128, 128)),  # a decode row; both dims end in a partial 128 block
    (3, 130, 129, (128, 128)),  # one row and one column past a block
    (17, 40, 50, (8, 16)),  # non-square small blocks, odd M past a 16-row tile
    (5, 33, 96, (16, 32)),
]


def random_fp8_weight(n: int, k: int, block: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """e4m3 values over most of the format's range and per-block scales a few decades apart."""
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = 10 ** (-3 * torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen)) / 64
    return weight, scales.to(torch.float32)


def expected64(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
    """The dense float64 reference, scales expanded element by element (independent of dequantize_fp8_block)."""
    n, k = weight.shape
    dense = torch.empty(n, k, dtype=torch.float64)
    for i in range(n):
        for j in range(0, k, block[1]):
            dense[i, j : j + block[1]] = weight[i, j : j + block[1]].double() * float(scale_inv[i // block[0],
                                                                                                j // block[1]])
    out = x.double().cpu() @ dense.T
    return out + bias.double().cpu() if bias is not None else out


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the output"
    return float((got.double().cpu() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k,block", SHAPES)
def test_fp8_block_gemm_matches_float64_dense(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype,
                                             device: torch.device) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight, scale_inv = random_fp8_weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m % 2 else None
    expected = expected64(x, weight, scale_inv, block, bias)
    ref = fp8_block_gemm_ref(x, weight, scale_inv, block, bias)
    assert ref.dtype == dtype and ref.shape == (m, n)
    assert relative_error(ref, expected) <= TOLERANCE[dtype]
    got = fp8_block_gemm(x.to(device), weight.to(device), scale_inv.to(device), block,
                         bias.to(device) if bias is not None else None)
    assert got.dtype == dtype and got.shape == (m, n)
    assert relative_error(got, expected) <= TOLERANCE[dtype]


def test_fp8_block_gemm_keeps_leading_dims_and_reads_strided_rows(device: torch.device) -> None:
    """x [2, 3, K] out of a wider buffer (row stride > K): the output is [2, 3, N], every element written."""
    gen = torch.Generator().manual_seed(7)
    block = (16, 16)
    weight, scale_inv = random_fp8_weight(24, 32, block, gen)
    wide = torch.randn(2, 3, 48, generator=gen)
    x = wide[..., :32]
    expected = expected64(x.reshape(6, 32), weight, scale_inv, block, None).reshape(2, 3, 24)
    got = fp8_block_gemm(x.to(device), weight.to(device), scale_inv.to(device), block)
    assert got.shape == (2, 3, 24)
    assert relative_error(got, expected) <= TOLERANCE[torch.float32]


def test_a_wrong_scale_block_changes_the_result(device: torch.device) -> None:
    """Each block's scale lands on exactly its block: doubling one scale doubles only that block's contribution."""
    gen = torch.Generator().manual_seed(3)
    block = (16, 16)
    weight, scale_inv = random_fp8_weight(40, 48, block, gen)
    x = torch.randn(2, 48, generator=gen)
    base = fp8_block_gemm(x.to(device), weight.to(device), scale_inv.to(device), block).cpu()
    scaled = scale_inv.clone()
    scaled[1, 2] *= 2  # rows 16..31, columns 32..47
    got = fp8_block_gemm(x.to(device), weight.to(device), scaled.to(device), block).cpu()
    extra = x[:, 32:48].double() @ (weight[16:32, 32:48].double() * float(scale_inv[1, 2])).T
    assert torch.allclose(got[:, :16], base[:, :16]) and torch.allclose(got[:, 32:], base[:, 32:])
    assert torch.allclose(got[:, 16:32].double(), base[:, 16:32].double() + extra, rtol=1e-5, atol=1e-5)


def test_dequantize_fp8_block_is_value_times_block_scale() -> None:
    weight = torch.tensor([[1.0, 2.0, 3.0], [4.0, -0.5, 448.0], [0.0, 1.5, -2.0]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[2.0, 10.0], [0.5, 0.25]])
    dense = dequantize_fp8_block(weight, scale_inv, (2, 2), torch.float32)
    assert dense.tolist() == [[2.0, 4.0, 30.0], [8.0, -1.0, 4480.0], [0.0, 0.75, -0.5]]


def test_dequantize_is_torchs_cast_times_scale_bit_for_bit_for_every_byte() -> None:
    """All 254 non-NaN e4m3fn bytes, in partial blocks, stacked [2, 16, 16] (a MoE layer's experts): the bit-moving
    widening equals weight.float() * scale exactly."""
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    weight = torch.cat([every, every[:2]]).view(2, 16, 8).repeat(1, 1, 2)  # [2, 16, 16]
    scale_inv = torch.tensor([[[0.5, 3.0e-3], [7.0, 1.0e-5]], [[1.0, 2.0], [3.0, 4.0]]])  # blocks of (9, 10)
    dense = dequantize_fp8_block(weight, scale_inv, (9, 10), torch.float32)
    scales = scale_inv.repeat_interleave(9, dim=1)[:, :16].repeat_interleave(10, dim=2)[:, :, :16]
    assert torch.equal(dense, weight.to(torch.float32) * scales)


@pytest.mark.parametrize("gemm", [fp8_block_gemm, fp8_block_gemm_ref])
def test_fp8_block_gemm_rejects_mismatched_arguments(gemm, device: torch.device) -> None:
    weight = torch.zeros(40, 48, device=device).to(torch.float8_e4m3fn)
    scale = torch.ones(3, 3, device=device)
    x = torch.zeros(2, 48, device=device)
    with pytest.raises(ValueError, match=r"scale_inv of a \[40, 48\] weight in blocks of \[16, 16\] must be \[3, 3\]"):
        gemm(x, weight, torch.ones(3, 2, device=device), (16, 16))
    with pytest.raises(TypeError, match="weight must be torch.float8_e4m3fn"):
        gemm(x, weight.float(), scale, (16, 16))
    with pytest.raises(ValueError, match="must end in in_features=48"):
        gemm(torch.zeros(2, 40, device=device), weight, scale, (16, 16))
    with pytest.raises(ValueError, match="block_size must be two positive integers"):
        gemm(x, weight, scale, (16, 0))
    with pytest.raises(ValueError, match="bias must be"):
        gemm(x, weight, scale, (16, 16), torch.zeros(41, device=device))


def test_fp8_block_gemm_names_a_block_k_it_cannot_tile(device: torch.device) -> None:
    weight = torch.zeros(8, 24, device=device).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block_k to be a multiple of 16.*got 8"):
        fp8_block_gemm(torch.zeros(1, 24, device=device), weight, torch.ones(1, 3, device=device), (8, 8))
