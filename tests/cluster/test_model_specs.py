"""Model specs from config.json alone (dcpserve/cluster/generic_spec.py) and weight formats
(dcpserve/cluster/weight_formats.py): KV bytes and parameter counts of several architectures against hand arithmetic
and published sizes, quantized weight bytes, the block-FP8 layout rule, DeepSeek-V3 planned and simulated on
8 x H200."""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Any

import pytest
import torch

from dcpserve.cli import main
from dcpserve.cluster.generic_spec import GenericSpec
from dcpserve.cluster.model_specs import GqaSpec, MlaSpec, model_spec_from_dict
from dcpserve.cluster.planner import PlanRequest, plan_layouts, weight_bytes_per_rank
from dcpserve.cluster.published_models import (
    DEEPSEEK_V3,
    GPT_OSS_20B,
    KIMI_K2,
    LLAMA_3_1_70B,
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
    model_spec,
)
from dcpserve.cluster.weight_formats import fp8_block_format, module_matches, read_weight_format
from dcpserve.engine.quantization import read_quantization_config
from dcpserve.simulator.build import build
from dcpserve.simulator.cli import add_commands as add_simulate
from dcpserve.simulator.gpus import gpu_spec
from dcpserve.simulator.step_time import RooflineModel, StepWork, expected_experts_touched

BF16 = torch.bfloat16
H200_GB = 141 * 10**9

# The fields the count reads of published configs (Hugging Face config.json, values as published).
GEMMA_3_27B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                      "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14},
}
MISTRAL_SMALL_3_1: dict[str, Any] = {
    "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "torch_dtype": "bfloat16",
    "text_config": {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                    "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
                    "num_hidden_layers": 40, "num_key_value_heads": 8, "sliding_window": None, "vocab_size": 131072},
    "vision_config": {"hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 4096, "model_type": "pixtral",
                      "num_hidden_layers": 24},
}
QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "intermediate_size": 5120, "vocab_size": 151936, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
LLAMA_4_SCOUT: dict[str, Any] = {
    "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
    "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
                    "intermediate_size_mlp": 16384, "num_attention_heads": 40, "num_key_value_heads": 8,
                    "head_dim": 128, "num_hidden_layers": 48, "num_local_experts": 16, "num_experts_per_tok": 1,
                    "interleave_moe_layer_step": 1, "vocab_size": 202048, "attention_chunk_size": 8192,
                    "max_position_embeddings": 10485760},
    "vision_config": {"hidden_size": 1408, "intermediate_size": 5632, "num_hidden_layers": 34, "hidden_act": "gelu"},
}
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "hidden_size": 4096,
    "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "max_position_embeddings": 40960,
}
QWEN1_5_MOE_A2_7B: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
    "num_experts_per_tok": 4, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 24,
    "vocab_size": 151936, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "max_position_embeddings": 8192,
}
QWEN2_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
}


@pytest.mark.parametrize("raw,published", [
    (DEEPSEEK_V3, 671e9), (LLAMA_3_1_70B, 70.6e9), (QWEN3_30B_A3B, 30.5e9), (QWEN3_235B_A22B, 235e9),
    (GPT_OSS_20B, 20.9e9), (GEMMA_3_27B, 27.4e9), (MISTRAL_SMALL_3_1, 24e9), (QWEN3_NEXT_80B, 80e9),
    (LLAMA_4_SCOUT, 109e9), (QWEN1_5_MOE_A2_7B, 14.3e9),
])
def test_parameter_counts_match_the_published_sizes(raw: dict[str, Any], published: float) -> None:
    spec = model_spec_from_dict(raw)
    assert abs(spec.parameters_per_rank(1) / published - 1) < 0.02


@pytest.mark.parametrize("read", [model_spec_from_dict, GenericSpec.from_dict])
def test_qwen3_moe_by_hand(read: Any) -> None:
    """The engine's ModelConfig (Qwen3-MoE is a native architecture) and the fields alone count the same."""
    spec = read(QWEN3_30B_A3B)
    assert isinstance(spec, GqaSpec if read is model_spec_from_dict else GenericSpec)
    # Per layer: q 2048 x 32*128, k and v 2048 x 4*128, o 32*128 x 2048, q / k norms 2*128, two norms; 128 experts of
    # gate, up, down 2048 x 768 and the router 2048 x 128. Untied embedding and head, final norm.
    layer = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 256 + 2 * 2048 + 128 * 3 * 2048 * 768 + 128 * 2048
    assert spec.parameters_per_rank(1) == 48 * layer + 2 * 151936 * 2048 + 2048 == 30_532_122_624
    # tp=4: 8 heads and one KV head per rank, 192 of each expert's 768.
    layer4 = 2048 * 1024 + 2 * 2048 * 128 + 1024 * 2048 + 256 + 2 * 2048 + 128 * 3 * 2048 * 192 + 128 * 2048
    assert spec.parameters_per_rank(4) == 48 * layer4 + 2 * 37984 * 2048 + 2048
    # KV: 48 layers x 4 KV heads x (K 128 + V 128) x 2 bytes; a rank holds 4 / tp heads, at least one whole one.
    assert [spec.kv_bytes_per_token_per_rank(tp, BF16) for tp in (1, 2, 4, 8)] == [
        48 * 4 * 256 * 2, 48 * 2 * 256 * 2, 48 * 256 * 2, 48 * 256 * 2]
    # tp=8 duplicates each KV head twice: dcp=2 shards the copies (ParallelConfig's rules), dcp=4 is refused.
    spec.validate_layout(8, 2)
    with pytest.raises(ValueError, match=r"dcp=4 must be <= tp // kv_heads = 8 // 4 = 2"):
        spec.validate_layout(8, 4)
    with pytest.raises(ValueError, match="dcp=2 needs tp > kv_heads"):
        spec.validate_layout(4, 2)


FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("raw", [LLAMA_3_1_70B, QWEN3_8B, QWEN2_7B, QWEN3_30B_A3B, QWEN1_5_MOE_A2_7B,
                                 {**QWEN3_8B, "quantization_config": FP8_BLOCKS}])
def test_the_generic_count_agrees_with_the_engines_for_its_architectures(raw: dict[str, Any]) -> None:
    """The engine's ModelConfig stays the source for its architectures; read from fields alone they count the same."""
    engine, generic = model_spec_from_dict(raw), GenericSpec.from_dict(raw)
    assert isinstance(engine, GqaSpec)
    for tp in (1, 2, 4, 8, 16, 32):
        for dcp in (1, 2, 4, 8):
            outcomes = []
            for spec in (engine, generic):
                try:
                    spec.validate_layout(tp, dcp)
                    outcomes.append("ok")
                except ValueError as err:
                    outcomes.append(str(err))
            assert outcomes[0] == outcomes[1]
        if outcomes[0] == "ok" or tp <= 8:
            assert generic.parameter_parts(tp) == engine.parameter_parts(tp)
            assert generic.kv_bytes_per_token_per_rank(tp, BF16, 131072) == engine.kv_bytes_per_token_per_rank(tp, BF16)
            assert weight_bytes_per_rank(generic, tp, "auto") == weight_bytes_per_rank(engine, tp, "auto")
    assert generic.quantization == engine.quantization


def test_gpt_oss_sliding_layers_and_mxfp4_experts() -> None:
    spec = model_spec_from_dict(GPT_OSS_20B)
    assert isinstance(spec, GenericSpec) and spec.layer_kinds == ("sliding", "full") * 12 and spec.window == 128
    # One layer's K and V: 8 KV heads x (64 + 64) x 2 bytes = 2048. Full layers hold every token; a sliding layer
    # holds 128 of a sequence's tokens, so over 128k tokens it costs 128 / 131072 of a full layer per token.
    assert spec.kv_bytes_per_token_per_rank(1, BF16) == 24 * 2048
    assert spec.kv_bytes_per_token_per_rank(1, BF16, 131072) == 12 * 2048 + -(-12 * 2048 * 128 // 131072) == 24_600
    assert spec.kv_bytes_per_token_per_rank(1, BF16, 100) == 24 * 2048  # shorter than the window: all of it
    # Parameters by hand: attention with q/k/v/o biases, 32 gated experts of 2880 with biases, a router with bias.
    experts = 32 * 3 * 2880 * 2880
    layer = (2880 * 4096 + 2 * 2880 * 512 + 4096 * 2880 + (4096 + 1024 + 2880) + 2 * 2880 + experts
             + 32 * 2880 + 32 + 32 * 3 * 2880)
    total = 24 * layer + 2 * 201088 * 2880 + 2880
    assert spec.parameters_per_rank(1) == total
    # mxfp4: the experts at 4 bits + an 8-bit scale per 32 values; attention, embedding, head, router in bf16.
    assert spec.quantization is not None and spec.quantization.quantized_parts == ("experts",)
    assert weight_bytes_per_rank(spec, 1, "auto") == round(24 * experts * 4.25 / 8) + (total - 24 * experts) * 2
    assert 12.5 < weight_bytes_per_rank(spec, 1, "auto") / 2**30 < 13  # fits a 16 GB GPU, as published


def test_text_config_wrappers_and_windowed_layers() -> None:
    gemma = model_spec_from_dict(GEMMA_3_27B)
    assert isinstance(gemma, GenericSpec) and gemma.architecture == "Gemma3ForConditionalGeneration"
    # Every 6th layer global (transformers' sliding_window_pattern default 6): 10 of 62; vocab and tied embeddings are
    # Gemma 3's defaults, which its text_config leaves out.
    assert gemma.layer_kinds.count("full") == 10 and gemma.layer_kinds[5] == "full"
    assert gemma.layer_kinds[0] == "sliding"
    assert gemma.vocab_size == 262208 and gemma.tie_word_embeddings and gemma.parameter_parts(1).lm_head == 0
    per_layer = 16 * 256 * 2
    assert gemma.kv_bytes_per_token_per_rank(1, BF16, 131072) == 10 * per_layer + 52 * per_layer * 1024 // 131072
    mistral = model_spec_from_dict(MISTRAL_SMALL_3_1)
    assert mistral.kv_bytes_per_token_per_rank(1, BF16, 131072) == 40 * 8 * 256 * 2  # no window: all full
    llama4 = model_spec_from_dict(LLAMA_4_SCOUT)
    assert isinstance(llama4, GenericSpec) and llama4.layer_kinds.count("chunked") == 36  # RoPE layers: chunks of 8k
    assert llama4.layer_kinds[3::4] == ("full",) * 12  # every 4th layer global, without RoPE
    assert llama4.shared_expert_intermediate_size == 8192 and llama4.intermediate_size == 16384


def test_hybrid_linear_attention_caches_only_its_full_layers() -> None:
    spec = model_spec_from_dict(QWEN3_NEXT_80B)
    assert isinstance(spec, GenericSpec) and spec.layer_kinds.count("full") == 12  # every 4th layer
    assert spec.kv_bytes_per_token_per_rank(1, BF16) == 12 * 2 * (256 + 256) * 2
    assert spec.kv_bytes_per_token_per_rank(4, BF16) == 12 * 1 * (256 + 256) * 2  # 2 KV heads: one copied per rank
    odd = model_spec_from_dict({**QWEN3_NEXT_80B, "linear_num_value_heads": 24})
    odd.validate_layout(8, 1)
    with pytest.raises(ValueError, match=r"tp=16 must divide the model's 24 linear-attention heads"):
        odd.validate_layout(16, 1)


@pytest.mark.parametrize("change,message", [
    ({"num_hidden_layers": None}, r"GptOssForCausalLM config lacks \['num_hidden_layers'\]"),
    ({"layer_types": ["mamba"] * 24}, r"layer types \['mamba'\] are not counted by the planner"),
    ({"layer_types": ["full_attention"] * 23}, "layer_types has 23 entries for 24 layers"),
    ({"num_key_value_heads": [8] * 24}, "num_key_value_heads is a list"),
    ({"quantization_config": {"quant_method": "hqq"}}, r"quantization method 'hqq' is not counted by the planner"),
    ({"full_attention_interval": 4, "layer_types": None}, r"has linear-attention layers but lacks \['linear_num_key"),
])
def test_configs_the_count_cannot_read_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_spec_from_dict({**GPT_OSS_20B, **change})


def test_fp8_block_weights_are_one_byte_and_a_scale_per_block() -> None:
    v3 = model_spec_from_dict(DEEPSEEK_V3)
    assert isinstance(v3, MlaSpec) and v3.quantization is not None
    native = read_quantization_config(DEEPSEEK_V3, "v3")  # the engine's reader gives the same format
    assert native is not None and fp8_block_format(native) == v3.quantization
    parts = v3.parameter_parts(8)
    quantized = parts.attention + parts.dense_mlp + parts.experts + parts.shared_experts
    kept = parts.embedding + parts.lm_head + parts.other  # embedding, head, norms, router in bf16
    fp8 = weight_bytes_per_rank(v3, 8, "auto")
    assert fp8 == round(quantized * (1 + 4 / (128 * 128))) + kept * 2
    assert fp8 - weight_bytes_per_rank(v3, 8, "float8") == pytest.approx(kept + quantized * 4 / 16384, abs=1)
    assert 79 < fp8 / 2**30 < 80 and weight_bytes_per_rank(v3, 8, "bfloat16") / 2**30 > 157


@pytest.mark.parametrize("quantization,bytes_per_parameter,rate", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, 0.5 + 2.5 / 128, "bfloat16"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 64}, 1 + 3 / 64, "bfloat16"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, 1.0, "float8"),
    ({"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     1 + 4 / 8192, "float8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}}}, 0.5625, "nvfp4"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, 0.5625, "nvfp4"),
])
def test_methods_the_native_engine_refuses_are_counted_from_their_fields(quantization: dict[str, Any],
                                                                         bytes_per_parameter: float, rate: str) -> None:
    spec = model_spec_from_dict({**LLAMA_3_1_70B, "quantization_config": quantization})
    # The engine refuses the checkpoint as it is (vLLM serves it): counted from its fields, and the plan says why.
    assert isinstance(spec, GenericSpec) and "native engine" in spec.engine_refusal
    assert spec.parameter_parts(8) == model_spec_from_dict(LLAMA_3_1_70B).parameter_parts(8)
    assert spec.quantization is not None and spec.quantization.tensor_core_dtype == rate
    assert spec.quantization.quantized_bytes == pytest.approx(bytes_per_parameter)
    parts = spec.parameter_parts(8)
    linear = parts.attention + parts.dense_mlp
    assert weight_bytes_per_rank(spec, 8, "auto") == round(linear * bytes_per_parameter) + (parts.total - linear) * 2
    assert "the native engine refuses it as it is" in spec.notes()[0]


def test_ignored_modules_stay_unquantized() -> None:
    assert module_matches("model.layers.0.self_attn.o_proj", "model.layers.*.self_attn")
    assert module_matches("lm_head", "lm_head") and module_matches("model.layers.0.mlp.experts.0.down_proj", "experts")
    assert module_matches("model.layers.0.mlp.experts", "re:.*mlp\\.experts")
    assert not module_matches("model.layers.0.mlp.gate_proj", "mlp.gate")
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["self_attn"]}
    quantization = read_weight_format({"quantization_config": fp8}, 4096, "c")
    assert quantization is not None and quantization.quantized_parts == ("dense_mlp", "experts", "shared_experts")


def test_block_fp8_checkpoints_need_whole_blocks_per_rank() -> None:
    """vLLM refuses a block-FP8 checkpoint whose tp-way split leaves a rank part of a block (vllm-project/vllm#25292:
    Qwen3-30B-A3B-FP8 at tp=4, 768 / 4 = 192)."""
    spec = model_spec_from_dict({**QWEN3_30B_A3B, "quantization_config": FP8_BLOCKS})
    request = PlanRequest(8, 80 << 30, 32768, weight_dtype="auto")
    assert [(row.tp, row.dcp) for row in plan_layouts(spec, request)] == [(1, 1), (2, 1)]
    with pytest.raises(ValueError, match=r"tp=4 splits the experts width 768 into 192 per rank.*tp in \[1, 2\] "):
        spec.validate_layout(4, 1)
    for tp in (1, 2, 4, 8):  # DeepSeek-V3: 2048 / 8 = 256 and 18432 / 8 = 2304, whole blocks
        model_spec_from_dict(DEEPSEEK_V3).validate_layout(tp, 1)


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
            print(exit_.code, file=err)
    return code, out.getvalue(), err.getvalue()


def test_deepseek_v3_plan_on_8_x_141gb_fits_as_shipped() -> None:
    code, out, err = run_cli("plan", "--model", "deepseek-v3", "--gpus-per-node", "8", "--gpu-memory", "141GB")
    assert code == 0, err
    assert "weights fp8 e4m3, float32 scale per 128x128 block, KV cache bfloat16" in out
    assert "163,840 tokens per sequence" in out  # --context defaults to max_position_embeddings
    rows = {(int(line.split()[0]), int(line.split()[1])): line
            for line in out.splitlines() if line[:3].strip().isdigit()}
    assert all(line.endswith("weights do not fit") for (tp, _), line in rows.items() if tp < 8)
    weights = weight_bytes_per_rank(model_spec("deepseek-v3"), 8, "auto")
    pages = (int(H200_GB * 0.9) - weights) // (70_272 * 16)
    for dcp in (1, 2, 4, 8):
        assert f"{pages * 16 * dcp:,}" in rows[(8, dcp)].split() and "fit" not in rows[(8, dcp)]
    assert "Weights as the checkpoint ships them (quantization_config): fp8 e4m3" in out


def simulate_args(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate(parser.add_subparsers())
    return parser.parse_args(["simulate", *args])


@pytest.mark.parametrize("name,dcp", [("deepseek-v3", 8), ("kimi-k2", 8), ("deepseek-v3", 1)])
def test_simulate_takes_fp8_checkpoints_on_h200(name: str, dcp: int) -> None:
    args = simulate_args("--trace", "chat", "--model", name, "--gpu", "h200", "--layout", f"tp=8,dcp={dcp}")
    assert args.weight_dtype == "auto"
    _, facts = build(args)
    assert "weights fp8 e4m3" in facts["step_model"] and facts["kv_tokens_per_replica"] > 0
    with pytest.raises(ValueError, match=r"weights need \d+\.\d\d GiB per rank at tp=8 \(bfloat16\) but an H200"):
        RooflineModel(model_spec(name), gpu_spec("h200"), 8, dcp, weight_dtype="bfloat16")


@pytest.mark.parametrize("read", [model_spec_from_dict, GenericSpec.from_dict])
def test_roofline_reads_moe_specs(read: Any) -> None:
    spec = read(QWEN3_30B_A3B)
    model = RooflineModel(spec, gpu_spec("h200"), 4, weight_dtype="auto")
    assert model.weight_dtype == "bfloat16"  # unquantized: auto is bf16
    parts = spec.parameter_parts(4)
    one_token = model.breakdown(StepWork.from_rows([(1000, 1)]))
    many = model.breakdown(StepWork.from_rows([(1000, 1)] * 256))
    # One decode token reads 8 of the 128 experts, 256 tokens most of them (the roofline's uniform routing); the
    # input embedding is a lookup, never streamed.
    dense, hbm = parts.total - parts.embedding - parts.experts, 4.8e12 * 0.8
    assert one_token["weights"] == pytest.approx((dense + parts.experts * 8 / 128) * 2 / hbm, rel=1e-6)
    touched = expected_experts_touched(256, 8, 128)
    assert touched > 120 and many["weights"] == pytest.approx((dense + parts.experts * touched / 128) * 2 / hbm,
                                                                rel=1e-6)
    assert model_spec_from_dict(KIMI_K2).quantization is not None
