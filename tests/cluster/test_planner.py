"""Capacity planner: parameter counts, valid layouts and KV capacity, checked against hand arithmetic."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dcpserve.cluster.model_specs import GqaSpec, MlaSpec, load_model_spec, model_spec_from_dict
from dcpserve.cluster.planner import (
    PlanRequest,
    count_parameters,
    format_plan,
    plan_layouts,
    weight_bytes_per_rank,
)
from dcpserve.cluster.published_models import DEEPSEEK_V2_LITE, DEEPSEEK_V3, KIMI_K2
from dcpserve.engine.args import parse_bytes, parse_tokens
from dcpserve.engine.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def llama(**overrides: object) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


# The tiny model's shape (dcpserve/cluster/tiny_model.py defaults).
TINY = llama(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=8192)
LLAMA_8B = llama()
LLAMA_70B = llama(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)


def test_parameter_counts() -> None:
    # Llama-3-8B's published count: embed 2 * 128256 * 4096 + 32 * (q,o 2*4096*4096 + k,v 2*4096*1024
    # + mlp 3*4096*14336 + norms 2*4096) + final norm 4096.
    assert count_parameters(LLAMA_8B) == 8_030_261_248
    assert count_parameters(LLAMA_70B) == 70_553_706_496
    # tiny: 2*512*128 + 2 * (2*128*128 + 2*128*32 + 3*128*256 + 2*128) + 128
    assert count_parameters(TINY) == 410_240
    tied = llama(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    assert count_parameters(tied) == 410_240 - 512 * 128


def test_weights_per_rank_are_vocab_parallel_and_copy_kv_heads() -> None:
    # tiny, tp=4: embed+head 2*(512/4)*128 = 32768; per layer q,o 2*128*32 = 8192, k,v 2*128*32 = 8192 (the one
    # KV head is copied on every rank), mlp 3*128*64 = 24576, norms 256 -> 41216; 2 layers + final norm 128.
    assert weight_bytes_per_rank(TINY, 4, "bfloat16") == (32768 + 2 * 41216 + 128) * 2 == 230_656
    assert weight_bytes_per_rank(TINY, 2, "float32") == (65536 + 2 * 73984 + 128) * 4
    # 8B at tp=16: vocab 128256/16 = 8016; per layer q,o 2*4096*2*128, k,v 2*4096*1*128, mlp 3*4096*896, norms 8192.
    per_layer = 2 * 4096 * 256 + 2 * 4096 * 128 + 3 * 4096 * 896 + 8192
    assert weight_bytes_per_rank(LLAMA_8B, 16, "bfloat16") == (2 * 8016 * 4096 + 32 * per_layer + 4096) * 2


def test_tiny_model_rows_by_hand() -> None:
    request = PlanRequest(gpus_per_node=8, gpu_memory_bytes=10_000_000, context_len=1000, gpu_memory_utilization=1.0)
    rows = {(r.tp, r.dcp): r for r in plan_layouts(TINY, request)}
    # 4 heads: tp=8 is invalid; dcp <= tp / 1 KV head and dcp | 4 query heads per KV head.
    assert list(rows) == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]
    row = rows[(4, 4)]
    assert row.weight_bytes_per_rank == 230_656
    assert row.kv_bytes_per_token_per_rank == 2 * 2 * 1 * 32 * 2  # K and V, 2 layers, 1 head, head_dim 32, bf16
    # (10_000_000 - 230_656) // 256 = 38161 tokens per rank -> 2385 pages of 16.
    assert rows[(4, 1)].kv_tokens_per_replica == 2385 * 16 == 38_160
    assert row.kv_tokens_per_replica == 2385 * 16 * 4 == 152_640
    assert (row.kv_head_copies, row.kv_head_copies_with_dcp) == (4, 1)
    assert (rows[(4, 2)].kv_head_copies, rows[(4, 2)].kv_head_copies_with_dcp) == (4, 2)
    assert (rows[(1, 1)].kv_head_copies, rows[(1, 1)].kv_head_copies_with_dcp) == (1, 1)
    assert (row.seqs_per_replica, row.replicas_per_node, row.seqs_per_node) == (152, 2, 304)
    assert (rows[(4, 1)].seqs_per_replica, rows[(4, 1)].seqs_per_node) == (38, 76)
    assert all(r.weights_fit for r in rows.values())


@pytest.mark.parametrize("memory", [10_000_000, 80 << 30, 141 * 10**9])
def test_dcp_multiplies_kv_tokens_exactly_for_one_kv_head(memory: int) -> None:
    rows = {(r.tp, r.dcp): r for r in plan_layouts(TINY, PlanRequest(8, memory, 4096))}
    for tp, dcp in ((4, 4), (4, 2), (2, 2)):
        assert rows[(tp, dcp)].kv_tokens_per_replica == dcp * rows[(tp, 1)].kv_tokens_per_replica
        assert rows[(tp, dcp)].weight_bytes_per_rank == rows[(tp, 1)].weight_bytes_per_rank


def test_valid_layouts_of_an_8_kv_head_model() -> None:
    on_8 = plan_layouts(LLAMA_8B, PlanRequest(8, 80 << 30, 131072))
    assert [(r.tp, r.dcp) for r in on_8] == [(1, 1), (2, 1), (4, 1), (8, 1)]  # tp <= 8 KV heads: no DCP
    on_16 = plan_layouts(LLAMA_8B, PlanRequest(16, 80 << 30, 131072))
    # tp=16 > 8 KV heads: 2 copies per KV head, dcp <= 16 // 8 = 2 and divides the 4 query heads per KV head.
    assert [(r.tp, r.dcp) for r in on_16][-2:] == [(16, 1), (16, 2)]
    assert (on_16[-1].kv_head_copies, on_16[-1].kv_head_copies_with_dcp) == (2, 1)


def test_70b_on_8_x_80gib() -> None:
    request = PlanRequest(8, 80 << 30, 131072)
    rows = {(r.tp, r.dcp): r for r in plan_layouts(LLAMA_70B, request)}
    assert not rows[(1, 1)].weights_fit and rows[(1, 1)].kv_tokens_per_replica == 0
    tp8 = rows[(8, 1)]
    assert tp8.kv_bytes_per_token_per_rank == 2 * 80 * 1 * 128 * 2 == 40960
    budget = int((80 << 30) * 0.9)
    assert tp8.kv_tokens_per_replica == (budget - tp8.weight_bytes_per_rank) // 40960 // 16 * 16
    assert tp8.seqs_per_replica == tp8.kv_tokens_per_replica // 131072 == 11
    text = format_plan(LLAMA_70B, request, list(rows.values()), model_name="llama-70b")
    assert "llama-70b: LlamaForCausalLM, 70.55B parameters" in text
    assert "8 GPUs per node x 80.00 GiB" in text and "72.00 GiB per rank" in text
    assert "131,072 tokens per sequence" in text
    assert next(line for line in text.splitlines() if line.split()[:2] == ["1", "1"]).endswith("weights do not fit")
    assert "dcp=1 only: DCP needs tp > the model's 8 KV heads" in text


def test_format_plan_notes_invalid_tp_and_long_context() -> None:
    request = PlanRequest(8, 80 << 30, 131072)
    text = format_plan(TINY, request, plan_layouts(TINY, request), model_name="tiny")
    assert "tp=8 not shown: tp=8 must divide the model's 4 attention heads" in text
    assert "exceeds the model's max_position_embeddings (8,192)" in text
    header = next(line for line in text.splitlines() if line.lstrip().startswith("tp"))
    row = next(line for line in text.splitlines() if line.split()[:2] == ["4", "4"])
    assert len(row) == len(header)  # aligned columns


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 << 30), ("80GB", 80 * 10**9), ("141G", 141 << 30), ("512MiB", 512 << 20), ("1.5TiB", 3 << 39),
    ("85899345920", 85899345920), ("80 gib", 80 << 30),
])
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text,expected", [("128k", 131072), ("128K", 131072), ("1M", 1 << 20), ("131072", 131072),
                                           ("1.5k", 1536)])
def test_parse_tokens(text: str, expected: int) -> None:
    assert parse_tokens(text) == expected


@pytest.mark.parametrize("parse,text,message", [
    (parse_bytes, "80XB", "unknown unit 'XB'"),
    (parse_bytes, "lots", "cannot parse memory size 'lots'"),
    (parse_bytes, "-1GiB", "cannot parse memory size"),
    (parse_bytes, "0GiB", "must be positive"),
    (parse_tokens, "128q", "unknown unit 'q'"),
    (parse_tokens, "0.3k", "whole number of tokens"),
    (parse_tokens, "", "cannot parse token count"),
])
def test_parse_errors(parse: Callable[[str], int], text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(text)


@pytest.mark.parametrize("kwargs,message", [
    ({"gpus_per_node": 0}, "gpus_per_node must be >= 1"),
    ({"dtype": "int8"}, "dtype 'int8' is not supported"),
    ({"weight_dtype": "int4"}, "weight_dtype 'int4' is not supported"),
    ({"kv_dtype": "fp8"},
     r"kv_dtype 'fp8' is not supported; choose one of \['bfloat16', 'float16', 'float32', 'float8'\]"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"block_size": 0}, "block_size must be >= 1"),
])
def test_plan_request_rejects_bad_values(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"gpus_per_node": 8, "gpu_memory_bytes": 80 << 30, "context_len": 1024, **kwargs}
    with pytest.raises(ValueError, match=message):
        PlanRequest(**args)


# ---- MLA (DeepSeek-V2 / V3 architecture) ----

V2_LITE = MlaSpec.from_dict(DEEPSEEK_V2_LITE)
V3 = MlaSpec.from_dict(DEEPSEEK_V3)
H200 = 141 * 10**9  # NVIDIA's published H200 memory, in bytes


def test_mla_config_is_read_as_mla_and_llama_as_gqa() -> None:
    assert isinstance(model_spec_from_dict(DEEPSEEK_V2_LITE), MlaSpec)
    assert isinstance(model_spec_from_dict(DEEPSEEK_V3), MlaSpec)
    kimi = model_spec_from_dict(KIMI_K2)  # model_type kimi_k2, the V3 architecture
    assert isinstance(kimi, MlaSpec) and kimi.architecture == "DeepseekV3ForCausalLM"
    no_architectures = {k: v for k, v in DEEPSEEK_V2_LITE.items() if k not in ("architectures", "kv_lora_rank")}
    with pytest.raises(ValueError, match="missing required fields \\['kv_lora_rank'\\] of DeepseekV2ForCausalLM"):
        model_spec_from_dict(no_architectures)  # found by model_type deepseek_v2
    llama_raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
                 "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1}
    gqa = model_spec_from_dict(llama_raw)
    assert isinstance(gqa, GqaSpec) and gqa.attention == "MQA"
    assert V2_LITE.q_lora_rank is None and V3.q_lora_rank == 1536
    assert V2_LITE.quantization is None
    assert V3.quantization is not None and V3.quantization.tensor_core_dtype == "float8"
    assert V3.quantization.quantized_bytes == 1 + 4 / (128 * 128)  # a float32 scale per 128 x 128 block


def test_unsupported_configs_are_named() -> None:
    # Any architecture with kv_lora_rank is MLA, counted with DeepSeek's projections.
    other_mla = model_spec_from_dict({**DEEPSEEK_V2_LITE, "architectures": ["MiniCPM3ForCausalLM"]})
    assert isinstance(other_mla, MlaSpec) and other_mla.architecture == "MiniCPM3ForCausalLM"
    assert other_mla.parameters_per_rank(1) == V2_LITE.parameters_per_rank(1)
    with pytest.raises(ValueError, match=r"MistralForCausalLM config lacks \['vocab_size', 'hidden_size', "
                                         r"'num_hidden_layers', 'num_attention_heads', 'intermediate_size'\]"):
        model_spec_from_dict({"architectures": ["MistralForCausalLM"]})
    without = {k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"}
    with pytest.raises(ValueError, match=r"missing required fields \['qk_rope_head_dim'\]"):
        model_spec_from_dict(without)


def test_mla_kv_bytes_per_token_are_one_latent_head_on_every_rank() -> None:
    # One latent of kv_lora_rank + qk_rope_head_dim = 512 + 64 values per token per layer, whatever tp is and whatever
    # num_key_value_heads the config carries (16 and 128: MLA does not use it).
    for tp in (1, 2, 4, 8):
        assert V2_LITE.kv_bytes_per_token_per_rank(tp, torch.bfloat16) == 27 * 576 * 2 == 31_104
        assert V3.kv_bytes_per_token_per_rank(tp, torch.bfloat16) == 61 * 576 * 2 == 70_272
    assert V3.kv_bytes_per_token_per_rank(8, torch.float8_e4m3fn) == 61 * 576
    # GQA at the same size would be 2 * kv_heads * head_dim: DeepSeek-V3 as 128 heads of K 192 + V 128 per layer.
    assert 61 * 128 * (192 + 128) * 2 // 70_272 == 71


def test_mla_parameter_counts_match_the_published_sizes() -> None:
    # DeepSeek-V2-Lite by hand: embed + head 2*102400*2048; per layer q_proj 2048*16*192, kv_a_proj 2048*576,
    # kv_a_layernorm 512, kv_b_proj 512*16*256, o_proj 16*128*2048, norms 2*2048; layer 0 dense 3*2048*10944;
    # 26 MoE layers of (64 routed + 2 shared) * 3*2048*1408 + router 64*2048; final norm 2048.
    attention = 2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048
    moe = 66 * 3 * 2048 * 1408 + 64 * 2048
    v2_lite = 2 * 102400 * 2048 + 27 * (attention + 2 * 2048) + 3 * 2048 * 10944 + 26 * moe + 2048
    assert count_parameters(V2_LITE) == v2_lite == 15_706_484_224
    assert abs(v2_lite / 15.7e9 - 1) < 0.01  # the model card's 15.7B
    # DeepSeek-V3 by hand: q_a_proj 7168*1536 + q_a_layernorm 1536 + q_b_proj 1536*128*192, kv_a_proj 7168*576,
    # kv_a_layernorm 512, kv_b_proj 512*128*256, o_proj 128*128*7168; 3 dense layers of 3*7168*18432; 58 MoE layers of
    # 257 experts of 3*7168*2048 + router 256*7168 + its correction bias 256.
    attention = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    moe = 257 * 3 * 7168 * 2048 + 256 * 7168 + 256
    v3 = 2 * 129280 * 7168 + 61 * (attention + 2 * 7168) + 3 * 3 * 7168 * 18432 + 58 * moe + 7168
    assert count_parameters(V3) == v3 == 671_026_419_200
    # The published 671B is the main model alone: DeepSeek-V3 on Hugging Face is 685B = 671B + the 14B MTP module
    # (one more MoE layer, its projections and its own copy of embedding and head), which the count leaves out.
    assert abs(v3 / 671e9 - 1) < 0.01
    mtp = attention + 2 * 7168 + moe + 2 * 7168 * 7168 + 3 * 7168 + 2 * 129280 * 7168
    assert abs((v3 + mtp) / 685e9 - 1) < 0.01
    # Kimi K2: about 1T (model card: 1T total, tech report: 1.04T).
    assert 1.0e12 < count_parameters(MlaSpec.from_dict(KIMI_K2)) < 1.05e12


def test_mla_weights_per_rank_split_heads_and_experts_and_copy_the_latent_projections() -> None:
    # DeepSeek-V3 at tp=8: 16 heads per rank; q_a_proj, kv_a_proj_with_mqa, their norms, the router and the layer
    # norms whole on every rank; vocab 129280/8 = 16160 rows of embedding and head; 2304 of the dense MLP's 18432
    # and 256 of each expert's 2048.
    attention = 7168 * 1536 + 1536 + 1536 * 16 * 192 + 7168 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 7168
    moe = 257 * 3 * 7168 * 256 + 256 * 7168 + 256
    per_rank = 2 * 16160 * 7168 + 61 * (attention + 2 * 7168) + 3 * 3 * 7168 * 2304 + 58 * moe + 7168
    assert weight_bytes_per_rank(V3, 8, "float8") == per_rank == 84_780_357_120
    assert weight_bytes_per_rank(V3, 8, "bfloat16") == 2 * per_rank
    # Close to total / tp: what is copied is about 1% of a rank's share.
    assert 1 < per_rank / (count_parameters(V3) / 8) < 1.011


def test_mla_layouts_are_every_tp_dividing_the_heads_and_every_dcp_dividing_tp() -> None:
    rows = plan_layouts(V2_LITE, PlanRequest(8, H200, 131072, block_size=64))
    assert [(r.tp, r.dcp) for r in rows] == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4),
                                             (8, 1), (8, 2), (8, 4), (8, 8)]
    copies = {(r.tp, r.dcp): (r.kv_head_copies, r.kv_head_copies_with_dcp) for r in rows}
    assert copies[(8, 1)] == (8, 8) and copies[(8, 4)] == (8, 2) and copies[(8, 8)] == (8, 1)
    assert copies[(1, 1)] == (1, 1)
    V2_LITE.validate_layout(16, 16)  # 16 heads: tp=16 is valid and dcp may equal it
    with pytest.raises(ValueError, match="tp=32 must divide the model's 16 attention heads"):
        V2_LITE.validate_layout(32, 1)
    with pytest.raises(ValueError, match="dcp=3 must divide tp=8"):
        V2_LITE.validate_layout(8, 3)


def test_invalid_mla_tp_sizes_are_named_in_the_plan() -> None:
    request = PlanRequest(32, H200, 131072, block_size=64)
    text = format_plan(V2_LITE, request, plan_layouts(V2_LITE, request), model_name="v2-lite")
    assert "tp=32 not shown: tp=32 must divide the model's 16 attention heads" in text
    assert any(line.split()[:2] == ["16", "16"] for line in text.splitlines())


def test_v2_lite_at_tp8_dcp8_holds_8x_the_kv_of_dcp1() -> None:
    request = PlanRequest(8, H200, 131072, block_size=64)
    rows = {(r.tp, r.dcp): r for r in plan_layouts(V2_LITE, request)}
    budget = int(H200 * 0.9)
    dcp1, dcp8 = rows[(8, 1)], rows[(8, 8)]
    assert dcp1.weight_bytes_per_rank == dcp8.weight_bytes_per_rank == 2 * V2_LITE.parameters_per_rank(8)
    assert dcp1.kv_tokens_per_replica == (budget - dcp1.weight_bytes_per_rank) // 31_104 // 64 * 64 == 3_951_616
    assert dcp8.kv_tokens_per_replica == 8 * dcp1.kv_tokens_per_replica
    assert (dcp1.seqs_per_replica, dcp8.seqs_per_replica) == (30, 241)
    for dcp in (2, 4):
        assert rows[(8, dcp)].kv_tokens_per_replica == dcp * dcp1.kv_tokens_per_replica
    text = format_plan(V2_LITE, request, list(rows.values()), model_name="DeepSeek-V2-Lite-Chat")
    assert "MLA: 1 latent KV head of 512 + 64 = 576 values per token per layer" in text
    assert "DCP at tp=8: dcp=8 holds 31,612,928 KV tokens per replica against 3,951,616 at dcp=1 (8x)" in text
    assert "Not counted" not in text  # V2-Lite has no MTP layer


def test_v3_does_not_fit_8_h200_in_bf16_and_does_in_fp8() -> None:
    bf16 = PlanRequest(8, H200, 131072, block_size=64)
    rows = plan_layouts(V3, bf16)
    assert rows and not any(r.weights_fit for r in rows)
    assert all(r.kv_tokens_per_replica == 0 and r.seqs_per_node == 0 for r in rows)
    text = format_plan(V3, bf16, rows, model_name="DeepSeek-V3")
    table = [line for line in text.splitlines() if line[:3].strip().isdigit()]
    assert len(table) == len(rows) and all(line.endswith("weights do not fit") for line in table)
    assert "no layout fits the weights: at best 157.92 GiB per rank (tp=8, bfloat16) against 118.18 GiB" in text
    assert "The checkpoint's weights are quantized (fp8 e4m3, float32 scale per 128x128 block" in text
    assert "Not counted: the 1 multi-token-prediction layer" in text

    fp8 = PlanRequest(8, H200, 131072, block_size=64, weight_dtype="float8")
    assert (fp8.weight_dtype, fp8.kv_dtype) == ("float8", "bfloat16")
    rows8 = {(r.tp, r.dcp): r for r in plan_layouts(V3, fp8)}
    assert not rows8[(4, 4)].weights_fit  # 157 GiB of fp8 weights per rank at tp=4
    dcp1, dcp8 = rows8[(8, 1)], rows8[(8, 8)]
    assert dcp1.weights_fit and dcp1.kv_bytes_per_token_per_rank == 70_272
    assert dcp8.kv_tokens_per_replica == 8 * dcp1.kv_tokens_per_replica == 8 * 599_360
    assert (dcp1.seqs_per_replica, dcp8.seqs_per_replica) == (4, 36)
    text = format_plan(V3, fp8, list(rows8.values()), model_name="DeepSeek-V3")
    assert "weights float8, KV cache bfloat16" in text and "no layout fits" not in text
    assert "float8 weights: every parameter counted at 1 byte" in text


def test_fp8_kv_cache_doubles_mla_tokens() -> None:
    bf16_kv = PlanRequest(8, H200, 131072, block_size=64, weight_dtype="float8")
    fp8_kv = PlanRequest(8, H200, 131072, block_size=64, dtype="float8")  # weights and KV cache
    base = next(r for r in plan_layouts(V3, bf16_kv) if (r.tp, r.dcp) == (8, 8))
    half = next(r for r in plan_layouts(V3, fp8_kv) if (r.tp, r.dcp) == (8, 8))
    assert half.weight_bytes_per_rank == base.weight_bytes_per_rank
    assert half.kv_bytes_per_token_per_rank == 61 * 576
    pages, base_pages = half.kv_tokens_per_replica // (64 * 8), base.kv_tokens_per_replica // (64 * 8)
    assert pages in (2 * base_pages, 2 * base_pages + 1)  # the same free bytes in pages half the size


def test_load_model_spec_reads_a_deepseek_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    assert load_model_spec(tmp_path) == V2_LITE
    assert load_model_spec(tmp_path / "config.json") == V2_LITE
    with pytest.raises(FileNotFoundError, match="no config.json at"):
        load_model_spec(tmp_path / "missing")


def test_vllm_serve_config_is_a_valid_mla_layout_for_v2_lite() -> None:
    from ray.serve.schema import ServeDeploySchema

    from dcpserve.deployments.config import AppArgs

    config = yaml.safe_load((REPO / "serve_config.vllm.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    assert app["import_path"] == "dcpserve.deployments.app:build_app"
    args = app["args"]
    assert args["backend"] == "vllm"
    # Not AppArgs(**args): `backend` is being added on another branch. Every other key must be one of AppArgs'.
    assert set(args) - {"backend"} <= set(AppArgs.model_fields)
    assert Path(args["model"]).name == "DeepSeek-V2-Lite-Chat"
    tp, dcp = args["tensor_parallel_size"], args["decode_context_parallel_size"]
    assert (tp, dcp) == (8, 8)
    V2_LITE.validate_layout(tp, dcp)
    request = PlanRequest(tp, H200, args["max_model_len"], block_size=args["block_size"])
    row = next(r for r in plan_layouts(V2_LITE, request) if (r.tp, r.dcp) == (tp, dcp))
    assert row.weights_fit and row.kv_head_copies_with_dcp == 1 and row.seqs_per_replica > 0
    assert args["block_size"] == 64  # FlashMLA's page
    assert args["max_model_len"] <= V2_LITE.max_position_embeddings


@pytest.mark.parametrize("spec,name,weight_dtype", [
    (V2_LITE, "DeepSeek-V2-Lite-Chat", "auto"), (V3, "DeepSeek-V3", "auto"), (V3, "DeepSeek-V3", "bfloat16"),
])
def test_operations_doc_shows_the_planners_own_output(spec: MlaSpec, name: str, weight_dtype: str) -> None:
    """docs/operations.md pastes these plans; they must stay what the planner prints."""
    request = PlanRequest(8, H200, 131072, block_size=64, weight_dtype=weight_dtype)
    text = format_plan(spec, request, plan_layouts(spec, request), model_name=name)
    doc = (REPO / "docs" / "operations.md").read_text()
    pasted = "\n".join(f"    {line}" if line else "" for line in text.splitlines())
    assert pasted in doc


@pytest.mark.parametrize("model,kv_heads", [(TINY, 1), (llama(), 8)])
def test_pcp_capacity_is_tp_times_pcp_over_kv_heads_times_the_plain_replicas(model: ModelConfig,
                                                                             kv_heads: int) -> None:
    """With pcp = 2 and dcp = (tp / kv_heads) * pcp (every copy of a KV head sharded), a replica holds exactly
    tp * pcp / kv_heads times the KV of the pcp = 1, dcp = 1 replica at the same tp: the same weights and pages per
    rank, the tokens spread over that many more ranks."""
    request = PlanRequest(gpus_per_node=16, gpu_memory_bytes=parse_bytes("80GiB"), context_len=131072, max_pcp=2)
    rows = {(row.tp, row.pcp, row.dcp): row for row in plan_layouts(model, request)}
    tps = [t for t in request.tp_sizes if t >= kv_heads and t * 2 <= 16 and (t, 1, 1) in rows]
    assert tps
    for tp in tps:
        base, row = rows[(tp, 1, 1)], rows[(tp, 2, (tp // kv_heads) * 2)]
        assert row.kv_tokens_per_replica == base.kv_tokens_per_replica * tp * 2 // kv_heads
        assert row.kv_head_copies_with_dcp == 1 and row.replicas_per_node == 16 // (tp * 2)
    assert all(row.tp * row.pcp <= 16 for row in rows.values())
    text = format_plan(model, request, list(rows.values()), "m")
    assert any(line.split()[:3] == ["tp", "pcp", "dcp"] for line in text.splitlines() if line.strip())
    assert f"PCP at tp={tps[-1]}: pcp=2 dcp={tps[-1] // kv_heads * 2}" in text
