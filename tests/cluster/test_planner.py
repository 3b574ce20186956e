"""Capacity planner: parameter counts, valid layouts and KV capacity, checked against hand arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cluster.planner import (
    PlanRequest,
    count_parameters,
    format_plan,
    plan_layouts,
    weight_bytes_per_rank,
)
from engine.args import parse_bytes, parse_tokens
from engine.config import ModelConfig


def llama(**overrides: object) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


# The tiny model's shape (engine/tiny_model.py defaults).
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
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"block_size": 0}, "block_size must be >= 1"),
])
def test_plan_request_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"gpus_per_node": 8, "gpu_memory_bytes": 80 << 30, "context_len": 1024, **kwargs}
    with pytest.raises(ValueError, match=message):
        PlanRequest(**args)
