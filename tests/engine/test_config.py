"""ModelConfig parsing and refusals, with messages that name the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ModelConfig, ParallelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
}


def test_reads_a_llama_config_with_llama3_scaling(tmp_path: Path) -> None:
    raw = {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "eos_token_id": [1, 2]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.head_dim, config.num_key_value_heads, config.eos_token_ids) == (8, 2, (1, 2))
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, r"architectures \['GPT2LMHeadModel'\] are not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"num_key_value_heads": 3}, "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported"),
])
def test_unsupported_configs_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **change})


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


def test_valid_layouts_pass() -> None:
    model = ModelConfig.from_dict(BASE)
    for tp, dcp in [(1, 1), (2, 1), (4, 2), (8, 2), (8, 4)]:
        ParallelConfig(tp, dcp).validate(model)


def test_scheduler_config_names_a_bad_admission_or_headroom() -> None:
    from engine.config import SchedulerConfig

    with pytest.raises(ValueError, match=r"kv_headroom must be a fraction of the KV cache in \[0, 1\), got 1.5"):
        SchedulerConfig(max_model_len=64, kv_headroom=1.5)
    with pytest.raises(ValueError, match=r"admission must be 'full' or 'usage', got 'prompt'"):
        SchedulerConfig(max_model_len=64, admission="prompt")  # type: ignore[arg-type]


def test_gpu_memory_utilization_is_a_share_of_total_memory() -> None:
    """vLLM's meaning: total * utilization for weights, activations and KV; the KV cache gets it less the weights."""
    from engine.config import CacheConfig

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
