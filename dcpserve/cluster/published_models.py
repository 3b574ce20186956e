"""config.json of published models: the fields of their Hugging Face configs that the planner and the simulator
read, with their real values, so that `dcpserve simulate --model kimi-k2` (and the tests) need no download. The
native engine's architectures (Llama, DeepSeek, Qwen3-MoE) and others vLLM serves (gpt-oss), which the planner
counts from their fields.

Only configs: no weights, no tokenizer. `PUBLISHED` names them for the command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcpserve.cluster.generic_spec import GenericSpec
from dcpserve.cluster.model_specs import GqaSpec, MlaSpec, load_model_spec, model_spec_from_dict

# deepseek-ai/DeepSeek-V2-Lite(-Chat): 15.7B parameters, 2.4B active; one q_proj (q_lora_rank null).
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "greedy", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400,
}

# deepseek-ai/DeepSeek-V3: 671B parameters in the main model, 37B active, plus a 14B multi-token-prediction module
# (685B on Hugging Face); fp8 weights with 128 x 128 block scales.
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}

# moonshotai/Kimi-K2-Instruct: the DeepSeek-V3 architecture with 64 heads, 384 experts and one dense layer; about 1T
# parameters, 32B active.
KIMI_K2: dict[str, Any] = {
    **DEEPSEEK_V3,
    "model_type": "kimi_k2", "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "max_position_embeddings": 131072, "n_group": 1, "n_routed_experts": 384, "num_attention_heads": 64,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "routed_scaling_factor": 2.827, "topk_group": 1, "vocab_size": 163840,
}

# meta-llama/Llama-3.1-70B-Instruct: 70.6B parameters, GQA with 8 KV heads (so tp = 8 holds one KV head per rank and
# tp > 8 would duplicate them), 128k context with Llama 3's RoPE scaling.
LLAMA_3_1_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu", "hidden_size": 8192,
    "intermediate_size": 28672, "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 64,
    "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}

# Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active; 128 experts of 768, 8 per token, on every layer; GQA with 4 KV
# heads of 128.
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}

# Qwen/Qwen3-235B-A22B: 235B parameters, 22B active; the same family, 94 layers of 128 experts of 1536.
QWEN3_235B_A22B: dict[str, Any] = {
    **QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 94,
    "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_hidden_layers": 94,
}

# openai/gpt-oss-20b: 20.9B parameters, 3.6B active; 32 experts of 2880 (4 per token) in MXFP4, attention in bf16,
# alternating sliding-window (128 tokens) and full-attention layers.
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 201088,
}

PUBLISHED: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    "deepseek-v3": DEEPSEEK_V3,
    "kimi-k2": KIMI_K2,
    "llama-3.1-70b": LLAMA_3_1_70B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
    "gpt-oss-20b": GPT_OSS_20B,
}


def model_spec(value: str) -> GqaSpec | MlaSpec | GenericSpec:
    """The spec of a published config by name (PUBLISHED), or of a model directory or config.json by path."""
    if value in PUBLISHED:
        return model_spec_from_dict(PUBLISHED[value], source=value)
    if not Path(value).exists():
        raise ValueError(f"model {value!r} is neither a model directory or config.json nor a published config "
                         f"({', '.join(PUBLISHED)})")
    return load_model_spec(value)
