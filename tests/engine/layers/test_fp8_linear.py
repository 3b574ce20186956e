"""FP8 linear layers at DeepSeek's [128, 128] blocks: each TP rank loads its shard of the fp8 weight and of its scales
(column, row, merged and replicated layers, partial last blocks), keeps them 1 byte per parameter, and its output
equals the dequantize-then-matmul reference; TP splits off a block boundary are refused by size, block and tp."""

from __future__ import annotations

import pytest
import torch

from dcpserve.cluster.tiny_fp8 import quantize_fp8_block
from dcpserve.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from dcpserve.engine.layers.linear_method import Fp8LinearMethod, linear_method, scale_spec
from dcpserve.engine.layers.weights import ShardSpec, TensorSource
from dcpserve.engine.quantization import Fp8BlockQuantization
from dcpserve.engine.worker.parallel import ParallelState
from dcpserve.kernels import fp8_block_gemm, fp8_block_gemm_ref

BLOCK = (128, 128)
FP8 = Fp8LinearMethod(Fp8BlockQuantization(*BLOCK))


def parallel(tp: int, rank: int) -> ParallelState:
    return ParallelState(tp_size=tp, tp_rank=rank, dcp_size=1, dcp_rank=0, num_kv_heads=1)


def quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_block(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), BLOCK)


Fp8Layer = ColumnParallelLinear | RowParallelLinear | MergedColumnParallelLinear | ReplicatedLinear


def scales(layer: Fp8Layer) -> torch.nn.Parameter:
    assert layer.weight_scale_inv is not None, "an FP8 layer holds its scales"
    return layer.weight_scale_inv


def load(layer: Fp8Layer, name: str, weight: torch.Tensor, scale: torch.Tensor, shard: int | None = None) -> None:
    layer.weight.weight_loader(layer.weight, TensorSource(weight), name, shard)  # type: ignore[attr-defined]  # new_parameter attached it
    scales(layer).weight_loader(scales(layer), TensorSource(scale), name + "_scale_inv", shard)  # type: ignore[attr-defined]  # new_parameter attached it


def test_column_and_row_parallel_shards_sum_to_the_reference() -> None:
    """A column-parallel layer (out 512 = 2 blocks per rank at tp 2; in 200: a partial block) feeding a row-parallel
    one (in 512, out 130: a partial block): the ranks' outputs concatenated / summed equal the whole layers'."""
    w1, s1 = quantized(512, 200, 1)
    w2, s2 = quantized(130, 512, 2)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(3))
    hidden = fp8_block_gemm_ref(x, w1, s1, BLOCK)
    expected = fp8_block_gemm_ref(hidden, w2, s2, BLOCK)
    partials = []
    for rank in range(2):
        column = ColumnParallelLinear(200, 512, parallel(2, rank), False, torch.float32, torch.device("cpu"), FP8)
        row = RowParallelLinear(512, 130, parallel(2, rank), False, torch.float32, torch.device("cpu"),
                                reduce_results=False, method=FP8)
        load(column, "up.weight", w1, s1)
        load(row, "down.weight", w2, s2)
        assert column.weight.dtype == row.weight.dtype == torch.float8_e4m3fn
        assert column.weight.element_size() == 1 and scales(column).shape == (2, 2)
        assert torch.equal(column.weight.view(torch.uint8), w1[rank * 256:(rank + 1) * 256].view(torch.uint8))
        assert torch.equal(scales(row), s2[:, 2 * rank:2 * rank + 2])
        out = column(x)
        assert torch.allclose(out, hidden[:, rank * 256:(rank + 1) * 256], rtol=1e-5, atol=1e-5)
        partials.append(row(out))
    assert torch.allclose(partials[0] + partials[1], expected, rtol=1e-5, atol=1e-4)


def test_merged_and_replicated_layers_load_each_part_at_its_offset() -> None:
    gate, gate_scale = quantized(256, 130, 4)
    up, up_scale = quantized(256, 130, 5)
    x = torch.randn(2, 130, generator=torch.Generator().manual_seed(6))
    merged = MergedColumnParallelLinear(130, [256, 256], parallel(2, 1), False, torch.float32,
                                        torch.device("cpu"), FP8)
    load(merged, "gate_proj.weight", gate, gate_scale, 0)
    load(merged, "up_proj.weight", up, up_scale, 1)
    out = merged(x)
    assert torch.allclose(out[:, :128], fp8_block_gemm_ref(x, gate, gate_scale, BLOCK)[:, 128:], atol=1e-5)
    assert torch.allclose(out[:, 128:], fp8_block_gemm_ref(x, up, up_scale, BLOCK)[:, 128:], atol=1e-5)
    latent, latent_scale = quantized(576, 130, 7)  # DeepSeek-V3's kv_a_proj_with_mqa: 512 + 64 rows
    replicated = ReplicatedLinear(130, 576, False, torch.float32, torch.device("cpu"), FP8)
    load(replicated, "kv_a_proj_with_mqa.weight", latent, latent_scale)
    assert scales(replicated).shape == (5, 2)
    assert torch.allclose(replicated(x), fp8_block_gemm_ref(x, latent, latent_scale, BLOCK), atol=1e-5)


def test_a_float_checkpoint_weight_is_refused_where_fp8_is_expected() -> None:
    layer = ReplicatedLinear(128, 128, False, torch.float32, torch.device("cpu"), FP8)
    with pytest.raises(ValueError, match="'w.weight' is torch.float32 but the model holds it as torch.float8_e4m3fn"):
        layer.weight.weight_loader(layer.weight, TensorSource(torch.zeros(128, 128)), "w.weight", None)  # type: ignore[attr-defined]  # new_parameter attached it


@pytest.mark.parametrize("size,tp,ok", [
    (24576, 8, True),  # DeepSeek-V3's q_b_proj: 128 heads * 192
    (2048, 16, True),  # an expert's intermediate size: 128 rows per rank
    (2048, 32, False),  # 64 rows per rank: half a block
    (18432, 32, False),  # the dense MLP's intermediate: 576 rows per rank
])
def test_deepseek_v3_shards_on_128_blocks(size: int, tp: int, ok: bool) -> None:
    rows = size // tp
    spec = ShardSpec((size, 7168), 0, rows, rows)  # rank 1
    if ok:
        assert scale_spec(spec, BLOCK, "q_b_proj") == ShardSpec((size // 128, 56), 0, rows // 128, rows // 128)
    else:
        with pytest.raises(ValueError, match=rf"{rows} rows \(output features\) from {rows} of {size}.*blocks of 128"):
            scale_spec(spec, BLOCK, "q_b_proj")


def test_layer_split_off_block_boundary_names_size_block_and_tp() -> None:
    with pytest.raises(ValueError, match=r"RowParallelLinear\(input_size=2048\) at tp=32.*blocks of 128"):
        RowParallelLinear(2048, 7168, parallel(32, 1), False, torch.float32, torch.device("cpu"), method=FP8)


def test_modules_to_not_convert_keep_their_dtype_and_a_half_quantized_merge_is_refused() -> None:
    quantization = Fp8BlockQuantization(*BLOCK, ignored_modules=("self_attn.o_proj", "mlp.up_proj"))
    assert isinstance(linear_method(quantization, "model.layers.0.self_attn.q_proj"), Fp8LinearMethod)
    assert not isinstance(linear_method(quantization, "model.layers.3.self_attn.o_proj"), Fp8LinearMethod)
    with pytest.raises(ValueError, match="quantizes some of"):
        linear_method(quantization, "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")


def test_a_loaded_shard_runs_on_the_triton_gemm_as_on_the_cpu_path(device: torch.device) -> None:
    """What Fp8LinearMethod runs on CUDA (the Triton GEMM; here CUDA or its interpreter) on a rank's loaded shard
    equals the CPU path's dequantize + F.linear."""
    weight, scale = quantized(512, 200, 8)
    layer = ColumnParallelLinear(200, 512, parallel(2, 1), False, torch.float32, torch.device("cpu"), FP8)
    load(layer, "up.weight", weight, scale)
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(9))
    expected = layer(x)
    got = fp8_block_gemm(x.to(device), layer.weight.to(device), scales(layer).to(device), BLOCK).cpu()
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
