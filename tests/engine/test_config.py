"""ModelConfig parsing and refusals, with messages that name the value."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from dcpserve.engine.args import EngineArgs
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.quantization import Fp8BlockQuantization
from dcpserve.engine.rope_config import LinearScaling, YarnScaling

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
}


def test_reads_a_llama_config_with_llama3_scaling(tmp_path: Path) -> None:
    raw = {**BASE, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
           "eos_token_id": [1, 2]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.head_dim, config.num_key_value_heads, config.eos_token_ids) == (8, 2, (1, 2))
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, r"architecture GPT2LMHeadModel is not supported by the native engine; "
                                             r"it runs LlamaForCausalLM.*serve it with `backend: vllm`"),
    ({"architectures": ["GptOssForCausalLM"]}, "would need sliding-window layers, attention sinks and MXFP4"),
    ({"architectures": ["Mistral3ForConditionalGeneration"],
      "text_config": {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}},
     r"Mistral3ForConditionalGeneration is a multimodal wrapper whose text model \(MistralForCausalLM, under "
     r"text_config\)"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types \['sliding_attention'\] are not"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh' is not supported"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 \(RoPE on part of each head\)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.25"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r"rope_parameters per layer type \(full_attention, sliding_attention\)"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope scaling 'longrope' is not supported"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 \\(logit soft-capping\\)"),
    ({"num_key_value_heads": 3}, "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    ({"num_key_value_heads": [2, 2]}, r"num_key_value_heads=\[2, 2\] must be an integer >= 1"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},
     "quantization method 'awq' is not supported by the native engine.*backend: vllm"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}},
     "fp8 without weight_block_size"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}},
     "activation_scheme='static' is not supported"),
])
def test_unsupported_configs_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **change})


@pytest.mark.parametrize("rope,expected", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     YarnScaling(factor=4.0, original_max_position_embeddings=32768)),
    ({"type": "linear", "factor": 2.0}, LinearScaling(2.0)),
    ({"rope_type": "dynamic", "factor": 2.0}, None),  # plain RoPE up to max_position_embeddings
])
def test_llama_family_rope_scalings(rope: dict, expected: object) -> None:
    assert ModelConfig.from_dict({**BASE, "rope_scaling": rope}).rope_scaling == expected


def test_dual_chunk_attention_is_served_to_its_native_window_only(tmp_path: Path) -> None:
    raw = {**BASE, "architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 1010000,
           "dual_chunk_attention_config": {"chunk_size": 262144, "local_size": 8192,
                                           "original_max_position_embeddings": 262144}}
    config = ModelConfig.from_dict(raw)
    assert config.max_position_embeddings == 262144
    assert "dual chunk attention" in config.context_limit_reason
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"max_model_len=300000 exceeds .*262144.*dual chunk attention"):
        EngineArgs(model=str(tmp_path), max_model_len=300000).create_engine_config()


def test_missing_fields_and_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"missing required fields \['hidden_size'\]"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "hidden_size"})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("tp,dcp,message", [
    (4, 3, "dcp=3 must divide tp=4"),
    (2, 2, "dcp=2 needs tp > kv_heads: model has 2 KV heads, tp=2"),
    (8, 8, r"dcp=8 must be <= tp // kv_heads = 8 // 2 = 4"),
    (3, 1, "tp=3 must divide the model's 8 attention heads"),
])
def test_layout_rules(tp: int, dcp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(tp, dcp).validate(ModelConfig.from_dict(BASE))


@pytest.mark.parametrize("tp,dcp,pcp,message", [
    # BASE: 8 heads, 2 KV heads.
    (2, 3, 2, r"dcp=3 with pcp=2 must be 1 or a multiple of pcp: .*Valid here: dcp in \[1, 2\]"),
    (4, 8, 2, r"dcp=8 with pcp=2 puts dcp / pcp = 4 TP ranks of each PCP group in a DCP group, so 4 must be <= "
              r"tp // kv_heads = 4 // 2 = 2"),
    (2, 4, 2, r"dcp / pcp = 2 TP ranks .* needs tp > kv_heads"),
    (2, 1, 0, r"prefill_context_parallel_size must be a positive integer, got 0"),
])
def test_pcp_layout_rules(tp: int, dcp: int, pcp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(tp, dcp, pcp).validate(ModelConfig.from_dict(BASE))


def test_valid_pcp_layouts_pass() -> None:
    """dcp = 1, dcp = pcp (any KV heads) and dcp = (tp / kv_heads) * pcp."""
    model = ModelConfig.from_dict(BASE)
    for tp, dcp, pcp in [(1, 1, 2), (1, 2, 2), (2, 2, 2), (2, 1, 4), (4, 4, 2), (8, 8, 2), (8, 16, 4)]:
        ParallelConfig(tp, dcp, pcp).validate(model)


def test_valid_layouts_pass() -> None:
    model = ModelConfig.from_dict(BASE)
    for tp, dcp in [(1, 1), (2, 1), (4, 2), (8, 2), (8, 4)]:
        ParallelConfig(tp, dcp).validate(model)


def test_scheduler_config_names_a_bad_admission_or_headroom() -> None:
    from dcpserve.engine.config import SchedulerConfig

    with pytest.raises(ValueError, match=r"kv_headroom must be a fraction of the KV cache in \[0, 1\), got 1.5"):
        SchedulerConfig(max_model_len=64, kv_headroom=1.5)
    with pytest.raises(ValueError, match=r"admission must be 'full' or 'usage', got 'prompt'"):
        SchedulerConfig(max_model_len=64, admission="prompt")  # type: ignore[arg-type]  # no such mode: its error is tested


def test_gpu_memory_utilization_is_a_share_of_total_memory() -> None:
    """vLLM's meaning: total * utilization for weights, activations and KV; the KV cache gets it less the weights."""
    from dcpserve.engine.config import CacheConfig

    gib = 1 << 30
    cache = CacheConfig(gpu_memory_utilization=0.9)
    # 80 GiB device, 16 GiB of weights loaded, 63 GiB free: 72 - 16 = 56 GiB of KV (not 0.9 of the free 63).
    assert cache.cuda_kv_budget(total_bytes=80 * gib, in_use_bytes=16 * gib, free_bytes=63 * gib) == 56 * gib
    with pytest.raises(ValueError, match=r"no GPU memory left for the KV cache: gpu_memory_utilization=0.2 allows "
                                         r"16.00 GiB of the device's 80.00 GiB, and the loaded weights already take "
                                         r"16.00 GiB; raise gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=0.2).cuda_kv_budget(80 * gib, 16 * gib, 63 * gib)
    with pytest.raises(ValueError, match=r"gives the KV cache 56.00 GiB, but only 40.00 GiB of the device's 80.00 GiB "
                                         r"are free .* lower gpu_memory_utilization or set kv_cache_memory_bytes"):
        cache.cuda_kv_budget(80 * gib, 16 * gib, 40 * gib)  # another process holds 24 GiB


# ---- DeepSeek-V2 / V3 (MLA + MoE) ------------------------------------------------------------------------------


def test_reads_deepseek_v2_lite_as_one_latent_kv_head() -> None:
    from dcpserve.cluster.published_models import DEEPSEEK_V2_LITE

    config = ModelConfig.from_dict(DEEPSEEK_V2_LITE)
    assert config.mla is not None and config.moe is not None
    assert (config.num_key_value_heads, config.head_dim) == (1, 512 + 64)
    assert (config.mla.q_lora_rank, config.mla.kv_lora_rank, config.mla.qk_head_dim, config.mla.v_head_dim) == (
        None, 512, 192, 128)
    moe = config.moe
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.n_shared_experts, moe.moe_intermediate_size) == (
        64, 6, 2, 1408)
    assert (moe.scoring_func, moe.topk_method, moe.norm_topk_prob) == ("softmax", "greedy", False)
    assert [moe.is_moe_layer(i) for i in range(3)] == [False, True, True]
    yarn = config.rope_scaling
    assert isinstance(yarn, YarnScaling) and (yarn.factor, yarn.original_max_position_embeddings) == (40.0, 4096)
    assert yarn.cos_sin_factor == 1.0  # mscale == mscale_all_dim
    assert yarn.softmax_scale_factor == pytest.approx((0.1 * 0.707 * math.log(40) + 1) ** 2)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_mla_kv_cache_is_one_latent_head_on_every_rank_and_agrees_with_the_planner(tp: int) -> None:
    from dcpserve.cluster.model_specs import MlaSpec
    from dcpserve.cluster.published_models import DEEPSEEK_V2_LITE

    config = ModelConfig.from_dict(DEEPSEEK_V2_LITE)
    spec = config.kv_cache_spec(tp)
    assert (spec.num_kv_heads, spec.head_dim, spec.has_value_cache) == (1, 576, False)
    assert config.kv_bytes_per_token_per_rank(tp, torch.bfloat16) == 27 * 576 * 2
    planner = MlaSpec.from_dict(DEEPSEEK_V2_LITE)
    assert planner.kv_bytes_per_token_per_rank(tp, torch.bfloat16) == config.kv_bytes_per_token_per_rank(
        tp, torch.bfloat16)
    caches = spec.allocate(3, 4, torch.float32, "cpu")
    assert len(caches) == 27 and all(k is v and k.shape == (3, 4, 1, 576) for k, v in caches)


def test_reads_deepseek_v3_routing_and_its_fp8_weights() -> None:
    from dcpserve.cluster.published_models import DEEPSEEK_V3

    assert ModelConfig.from_dict(DEEPSEEK_V3).quantization == Fp8BlockQuantization(128, 128)
    bf16 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
    assert ModelConfig.from_dict(bf16).quantization is None
    config = ModelConfig.from_dict(bf16)
    assert config.moe is not None and config.mla is not None and config.mla.q_lora_rank == 1536
    moe = config.moe
    assert (moe.scoring_func, moe.topk_method, moe.n_group, moe.topk_group) == ("sigmoid", "noaux_tc", 8, 4)
    assert moe.has_correction_bias and moe.norm_topk_prob and moe.routed_scaling_factor == 2.5
    # Left out, the routing is what the architecture's reference code does.
    defaults = {k: v for k, v in bf16.items() if k not in ("scoring_func", "topk_method")}
    assert ModelConfig.from_dict(defaults).moe == moe


def test_mtp_layers_are_accepted_and_said_to_be_unused(caplog: pytest.LogCaptureFixture) -> None:
    from dcpserve.cluster.published_models import DEEPSEEK_V2_LITE

    with caplog.at_level(logging.INFO, logger="dcpserve.engine.deepseek_config"):
        ModelConfig.from_dict({**DEEPSEEK_V2_LITE, "num_nextn_predict_layers": 1})
    assert "num_nextn_predict_layers=1" in caplog.text and "not used" in caplog.text


@pytest.mark.parametrize("change,message", [
    ({"scoring_func": "tanh"}, r"scoring_func='tanh' is not supported"),
    ({"topk_method": "random"}, r"topk_method='random' is not supported"),
    ({"topk_method": "group_limited_greedy", "n_group": 5}, r"n_group=5 must divide n_routed_experts=64"),
    ({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 0}, r"topk_group=0 must be an integer"),
    ({"topk_method": "group_limited_greedy", "n_group": 32, "topk_group": 2},
     r"topk_group=2 of n_group=32 groups \(2 experts each\) cannot hold num_experts_per_tok=6"),
    ({"num_experts_per_tok": 65}, r"num_experts_per_tok=65 exceeds n_routed_experts=64"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, r"rope scaling 'longrope' is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"qk_rope_head_dim": 63}, r"qk_rope_head_dim=63 must be even"),
    ({"kv_lora_rank": None}, r"missing required field 'kv_lora_rank'"),
    ({"moe_intermediate_size": None}, r"missing required field 'moe_intermediate_size'"),
])
def test_unsupported_deepseek_configs_are_refused_by_name(change: dict, message: str) -> None:
    from dcpserve.cluster.published_models import DEEPSEEK_V2_LITE

    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**DEEPSEEK_V2_LITE, **change})


def test_mla_layouts_are_every_dcp_dividing_tp() -> None:
    """One latent KV head: dcp may be any divisor of tp (dcp = tp removes all duplication), tp divides the heads."""
    from dcpserve.cluster.published_models import DEEPSEEK_V2_LITE

    model = ModelConfig.from_dict(DEEPSEEK_V2_LITE)  # 16 heads
    for tp, dcp in [(1, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 8), (16, 16)]:
        ParallelConfig(tp, dcp).validate(model)
    with pytest.raises(ValueError, match="dcp=3 must divide tp=4"):
        ParallelConfig(4, 3).validate(model)
    with pytest.raises(ValueError, match="tp=32 must divide the model's 16 attention heads"):
        ParallelConfig(32, 1).validate(model)
