"""The real config.json of each model people serve with long context (tests/engine/real_configs/, verbatim; where each
came from: SOURCES.md), read by the native engine: each is either served, parsed to the right fields, or refused at
config time naming what the engine does not compute and the alternative. None is accepted and then wrong, none fails
only at weight load. Every directory there must have its row here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dcpserve.cluster.published_models import DEEPSEEK_V2_LITE
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.rope_config import RopeScaling, YarnScaling

REAL_CONFIGS = Path(__file__).parent / "real_configs"
QWEN3_CARD_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
DEEPSEEK_V3_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                               mscale=1.0, mscale_all_dim=1.0)

# name -> the fields the engine must read (architecture, heads, KV heads, head_dim, layers, max positions, rope,
# MLA / MoE / quantization present, and the layout that shows its KV duplication).
SERVED: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(architecture="LlamaForCausalLM", num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         num_hidden_layers=32, max_position_embeddings=131072, rope_scaling=LLAMA31_ROPE,
                         eos_token_ids=(128001, 128008, 128009)),
    "llama-3.1-70b": dict(architecture="LlamaForCausalLM", num_attention_heads=64, num_key_value_heads=8,
                          head_dim=128, num_hidden_layers=80, max_position_embeddings=131072,
                          rope_scaling=LLAMA31_ROPE),
    "qwen3-8b": dict(architecture="Qwen3ForCausalLM", num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     num_hidden_layers=36, max_position_embeddings=40960, rope_scaling=None, qk_norm=True,
                     rope_theta=1000000.0),
    "qwen3-32b": dict(architecture="Qwen3ForCausalLM", num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      num_hidden_layers=64, max_position_embeddings=40960, qk_norm=True),
    "qwen3-30b-a3b": dict(architecture="Qwen3MoeForCausalLM", num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_hidden_layers=48, qk_norm=True),
    "qwen3-235b-a22b": dict(architecture="Qwen3MoeForCausalLM", num_attention_heads=64, num_key_value_heads=4,
                            head_dim=128, num_hidden_layers=94, qk_norm=True),
    "deepseek-v3": dict(architecture="DeepseekV3ForCausalLM", num_attention_heads=128, num_key_value_heads=1,
                        head_dim=576, num_hidden_layers=61, max_position_embeddings=163840,
                        rope_scaling=DEEPSEEK_V3_YARN),
    "deepseek-r1": dict(architecture="DeepseekV3ForCausalLM", num_attention_heads=128, num_key_value_heads=1,
                        head_dim=576, num_hidden_layers=61, rope_scaling=DEEPSEEK_V3_YARN),
    "kimi-k2": dict(architecture="DeepseekV3ForCausalLM", num_attention_heads=64, num_key_value_heads=1,
                    head_dim=576, num_hidden_layers=61, max_position_embeddings=131072),
}
# MoE and FP8 facts of the served ones: (routed experts, experts per token, FP8 block or None).
EXPERTS: dict[str, tuple[int, int, tuple[int, int] | None]] = {
    "qwen3-30b-a3b": (128, 8, None), "qwen3-235b-a22b": (128, 8, None),
    "deepseek-v3": (256, 8, (128, 128)), "deepseek-r1": (256, 8, (128, 128)), "kimi-k2": (384, 8, (128, 128)),
}
REFUSED: dict[str, str] = {
    "gpt-oss-20b": r"architecture GptOssForCausalLM is not supported by the native engine \(it would need "
                   r"sliding-window layers, attention sinks and MXFP4 experts\).*backend: vllm",
    "gemma-3-27b": r"Gemma3ForConditionalGeneration is a multimodal wrapper whose text model \(gemma3_text, under "
                   r"text_config\).*backend: vllm",
    "llama-4-scout": r"Llama4ForConditionalGeneration is a multimodal wrapper whose text model \(llama4_text, under "
                     r"text_config\).*backend: vllm",
    "glm-4.5": r"architecture Glm4MoeForCausalLM is not supported by the native engine \(it would need partial "
               r"rotary embeddings.*backend: vllm",
    "qwen3-next-80b": r"architecture Qwen3NextForCausalLM is not supported by the native engine \(it would need "
                      r"Gated DeltaNet linear-attention layers.*backend: vllm",
}


def real_config(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((REAL_CONFIGS / name / "config.json").read_text())
    return loaded


def test_every_real_config_has_its_row() -> None:
    names = {path.name for path in REAL_CONFIGS.iterdir() if path.is_dir()}
    assert names == set(SERVED) | set(REFUSED), "classify each config under tests/engine/real_configs/"
    assert not set(SERVED) & set(REFUSED)


@pytest.mark.parametrize("name", sorted(SERVED))
def test_served_configs_parse_to_their_fields(name: str) -> None:
    config = ModelConfig.from_pretrained(REAL_CONFIGS / name)
    for field, expected in SERVED[name].items():
        assert getattr(config, field) == expected, f"{name}: {field}"
    experts, per_token, block = EXPERTS.get(name, (0, 0, None))
    assert (config.moe.n_routed_experts if config.moe else 0, config.moe.num_experts_per_tok if config.moe else 0) \
        == (experts, per_token)
    assert (config.quantization.weight_block_size if config.quantization else None) == block
    # The layout DCP exists for: TP 8 duplicates KV heads, and DCP shards them.
    kv = config.num_key_value_heads
    ParallelConfig(8, 8 // kv if kv < 8 else 1).validate(config)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_configs_name_what_is_missing(name: str) -> None:
    with pytest.raises(ValueError, match=REFUSED[name]):
        ModelConfig.from_pretrained(REAL_CONFIGS / name)


def test_qwen3_model_card_yarn_is_read_for_128k() -> None:
    """Qwen3's card: rope_scaling yarn, factor 4 over 32768, and max_position_embeddings raised to 131072."""
    raw = {**real_config("qwen3-8b"), "rope_scaling": QWEN3_CARD_YARN, "max_position_embeddings": 131072}
    config = ModelConfig.from_dict(raw)
    assert config.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=32768)
    assert config.max_position_embeddings == 131072


def test_deepseek_v2_lite_is_served() -> None:
    config = ModelConfig.from_dict(DEEPSEEK_V2_LITE)
    assert (config.architecture, config.num_key_value_heads, config.mla is not None, config.quantization) == (
        "DeepseekV2ForCausalLM", 1, True, None)
