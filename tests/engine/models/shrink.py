"""Shrunk twins of real model configs: the same architecture and every structural flag (query-to-KV-head ratio,
biases, q/k norms, tied embeddings, rope scaling and its type, MLA's q latent or none, the MoE's routing, shared
experts and dense first layers), at sizes a CPU test runs in a second, saved as a transformers checkpoint of random
weights (norms and biases random too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bench.harness.random_models import VOCAB, randomize_norms_and_biases

# Fields the shrunk twin sets whatever the real config says: sizes only.
SIZES: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             max_position_embeddings=256, initializer_range=0.15, bos_token_id=None,
                             eos_token_id=None, pad_token_id=None, torch_dtype="float32")
ORIGINAL_CONTEXT = 16  # a scaled rope's original context, shrunk: every test prompt runs past it
DROPPED = ("quantization_config", "auto_map", "num_nextn_predict_layers", "transformers_version")


def shrink_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A shrunk config.json of the same architecture and flags (see the module docstring)."""
    small = {k: v for k, v in raw.items() if k not in DROPPED}
    small.update(SIZES)
    heads, kv_heads = int(raw["num_attention_heads"]), int(raw.get("num_key_value_heads") or raw["num_attention_heads"])
    ratio = heads // kv_heads
    small_kv = 2 if ratio <= 8 else 1
    small.update(num_attention_heads=ratio * small_kv, num_key_value_heads=small_kv, head_dim=16)
    if raw.get("kv_lora_rank"):  # MLA: heads are not grouped; the latent and its rope key, shrunk
        small.update(num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                     q_lora_rank=24 if raw.get("q_lora_rank") else None)
        if raw.get("model_type") == "kimi_k2":
            small["model_type"] = "deepseek_v3"  # Kimi K2 is the V3 architecture; transformers knows it by that name
    experts = raw.get("n_routed_experts") or raw.get("num_experts")
    if experts:
        groups = min(int(raw.get("n_group") or 1), 4)
        small.update(moe_intermediate_size=32, num_experts_per_tok=min(int(raw["num_experts_per_tok"]), 2))
        if "n_routed_experts" in raw:
            small.update(n_routed_experts=4 * groups if groups > 1 else 8, n_group=groups,
                         topk_group=min(int(raw.get("topk_group") or 1), max(1, groups // 2)),
                         first_k_dense_replace=min(int(raw.get("first_k_dense_replace") or 0), 1))
        else:
            small.update(num_experts=8)
    rope = raw.get("rope_scaling")
    if rope:
        small["rope_scaling"] = {**rope, "original_max_position_embeddings": ORIGINAL_CONTEXT}
        # The scaled context keeps the real one's ratio to the original (what transformers expects of the factor).
        small["max_position_embeddings"] = max(SIZES["max_position_embeddings"],
                                               int(float(rope.get("factor") or 1) * ORIGINAL_CONTEXT))
    return small


def write_shrunk_checkpoint(raw: dict[str, Any], directory: Path, seed: int) -> Path:
    """The shrunk twin of `raw` with random weights, saved by transformers into `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = shrink_config(raw)
    fields = {k: v for k, v in small.items() if k not in ("architectures", "model_type")}
    rope = fields.pop("rope_scaling", None)
    if rope:  # transformers 5 reads the scaling as rope_parameters, theta included
        fields["rope_parameters"] = {**rope, "rope_theta": fields.pop("rope_theta", 10000.0)}
    config = AutoConfig.for_model(small["model_type"], **fields)
    config.architectures = small["architectures"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_norms_and_biases(model, buffers=True)
    model.save_pretrained(directory)
    written = json.loads((directory / "config.json").read_text())
    if written.get("architectures") != small["architectures"]:
        raise AssertionError(f"transformers saved {written.get('architectures')}, not {small['architectures']}")
    return directory
