"""dcpserve/kernels/launch_configs.py: the configurations the compile test (test_compile_targets.py) compiles are the
engine's choices, specialized as Triton's runtime specializes them."""

from __future__ import annotations

import pytest
import torch

from dcpserve.kernels.decode_attention import decode_tiles
from dcpserve.kernels.launch_configs import (
    DTYPES,
    GQA_MODELS,
    MLA_MODELS,
    Pointer,
    gqa_groups,
    launch_configs,
    mla_groups,
    specialize,
)
from dcpserve.kernels.prefill_attention import prefill_tiles

CONFIGS = launch_configs()


def constexprs(kernel: str) -> list[dict[str, object]]:
    return [dict(config.constexprs) for config in CONFIGS if config.kernel == kernel]


def test_specialization_is_tritons() -> None:
    """Every runtime argument of every configuration gets the type, constant and divisibility Triton's launcher
    gives the same value (a real tensor of the pointer's dtype, 16-byte aligned as torch allocates)."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    from triton.backends.compiler import BaseBackend

    values = {value for config in CONFIGS for _, value in config.args}
    assert any(specialize(value)[0] == "constexpr" for value in values)  # some argument is 1: a constant
    for value in values:
        arg = torch.empty(16, dtype=value.dtype) if isinstance(value, Pointer) else value
        kind, key = libtriton.native_specialize_impl(BaseBackend, arg, False, True, True)
        ours = specialize(value)
        assert (ours[0], ours[1] if kind == "constexpr" else ours[2]) == (
            kind, key if kind == "constexpr" else key == "D"), value


def test_names_are_unique_and_name_kernel_case_dtype() -> None:
    names = [config.name for config in CONFIGS]
    assert len(names) == len(set(names))
    assert {config.kernel for config in CONFIGS} == {"decode", "prefill", "combine", "store_kv", "fp8_gemm"}
    for config in CONFIGS:
        assert config.name.startswith(config.kernel + "-") and config.name.endswith("-" + config.dtype)
    assert {config.dtype for config in CONFIGS if config.kernel != "combine"} == {"bf16", "fp16"}
    assert len(DTYPES) == 2


def test_groups_follow_the_layout_rules() -> None:
    by_name = {model.name: model for model in GQA_MODELS}
    # Qwen3-235B: 64 heads over 4 KV heads: 16 per KV head, 8 per rank at tp=8 (one KV head each), 16 again at dcp 2.
    assert gqa_groups(by_name["qwen3-235b-a22b"]) == {(16, 4), (16, 2), (16, 1), (8, 1)}
    assert max(group for model in GQA_MODELS for group, _ in gqa_groups(model)) == 64
    assert mla_groups(MLA_MODELS[0]) == {16, 32, 64, 128}


def test_the_engines_tile_choices_are_all_compiled() -> None:
    """The decode and prefill tiles of every supported head shape, as the launchers pick them on CUDA, and the
    interpreter's smaller ones nowhere."""
    decode = constexprs("decode")
    for group, head_dim, v_dim in [(64, 128, 128), (3, 128, 128), (4, 64, 64), (128, 576, 512)]:
        tiles = decode_tiles(group, head_dim, v_dim, cuda_tiles=True)
        assert any(c["GROUP"] == group and c["BLOCK_G"] == tiles.block_g and c["HEAD_BLOCKS"] == tiles.head_blocks
                   and c["BLOCK_N"] == tiles.block_n and c["BLOCK_DV"] == tiles.channels.block_dv for c in decode)
    assert {c["BLOCK_G"] for c in decode} == {16, 32, 64}
    assert {(c["BLOCK_N"], c["BLOCK_DV"]) for c in decode} == {(64, 64), (64, 128), (32, 512)}
    prefill = constexprs("prefill")
    assert {(c["BLOCK_M"], c["BLOCK_N"]) for c in prefill} == {
        (prefill_tiles(128, 128, True).block_m, 64), (prefill_tiles(576, 512, True).block_m, 32)}
    assert {c["HAS_NEW"] for c in prefill} == {True, False}
    fp8 = constexprs("fp8_gemm")
    assert {c["BLOCK_M"] for c in fp8} == {16, 32, 64}
    assert {(c["QUANT_BLOCK_N"], c["QUANT_BLOCK_K"], c["BLOCK_K"]) for c in fp8} == {(128, 128, 128)}
    # decode with one split passes num_splits = 1, which Triton makes a constant: a binary of its own.
    assert any(dict(config.args)["num_splits"] == 1 for config in CONFIGS if config.kernel == "decode")
    assert any(dict(config.args)["num_splits"] == 64 for config in CONFIGS if config.kernel == "decode")
