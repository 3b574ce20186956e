"""Qwen3-MoE and Qwen2-MoE vs Hugging Face transformers on the same random weights, at tp = 1: greedy tokens equal,
logits within the Llama tests' 1e-4 (tests/engine/models/hf_compare.py: prompts holding token 0, transformers called
with an explicit attention mask).

Tiny checkpoints from dcpserve/cluster/tiny_moe.py: Qwen3-MoE with Qwen3-30B-A3B's 8 query heads per KV head (16 and
2), q / k norm, 8 experts with 2 per token renormalized, a dense layer listed in mlp_only_layers; Qwen2-MoE with its
q / k / v bias, the gated shared expert, unnormalized top-k weights and decoder_sparse_step 2. The tp = 2 / 4 layouts
run on Ray: tests/engine/models/test_qwen_moe_ray.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.harness.model_harness import Job, run_job
from dcpserve.cluster.tiny_moe import TinyQwenMoeSpec, write_tiny_qwen_moe_model
from dcpserve.engine.config import ModelConfig
from dcpserve.engine.layers.moe import TopKRouter
from dcpserve.engine.models import Qwen3MoeForCausalLM
from dcpserve.engine.models.qwen3_moe import QwenSparseMoE
from dcpserve.engine.qwen_moe_config import QwenMoeConfig, read_qwen_moe_fields
from dcpserve.engine.worker.loader import load_model
from dcpserve.engine.worker.parallel import ParallelState
from tests.engine.models.hf_compare import BLOCK_SIZE, check_against_hf, scenarios
from tests.engine.models.test_model_vs_hf import one_torch_thread  # noqa: F401 - its autouse fixture, here too

SPECS: dict[str, TinyQwenMoeSpec] = {
    "qwen3_moe": TinyQwenMoeSpec(),
    "qwen2_moe_shared_expert": TinyQwenMoeSpec(
        architecture="Qwen2MoeForCausalLM", num_attention_heads=8, num_key_value_heads=1, norm_topk_prob=False,
        decoder_sparse_step=2, mlp_only_layers=(), num_experts_per_tok=3,
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen_moe_checkpoints")
    return {name: write_tiny_qwen_moe_model(root / name, seed=len(name), spec=spec) for name, spec in SPECS.items()}


@pytest.mark.parametrize("name", list(SPECS))
def test_single_rank_matches_transformers(name: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), scenarios(1))
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    check_against_hf(job, results)


def test_sparse_layers_and_attention_read_as_transformers_builds_them(checkpoints: dict[str, Path]) -> None:
    """Which layers are MoE (mlp_only_layers, decoder_sparse_step), the attention flags and the routing fields."""
    from transformers import AutoModelForCausalLM

    for name, path in checkpoints.items():
        config = ModelConfig.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ours = Qwen3MoeForCausalLM(config, ParallelState.single(config.num_key_value_heads), torch.float32,
                                   torch.device("meta"))
        theirs = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
        assert [isinstance(layer.mlp, QwenSparseMoE) for layer in ours.model.layers] == theirs, name
        assert isinstance(config.moe, QwenMoeConfig)
        spec = SPECS[name]
        assert (config.moe.n_routed_experts, config.moe.num_experts_per_tok, config.moe.norm_topk_prob) == (
            spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob)
        qwen2 = spec.architecture == "Qwen2MoeForCausalLM"
        assert (config.attention_bias, config.qk_norm) == (qwen2, not qwen2), name
        assert config.moe.shared_expert_intermediate_size == (spec.shared_expert_intermediate_size if qwen2 else 0)
    assert theirs == [False, True, False]  # the Qwen2-MoE one: decoder_sparse_step 2


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_chooses_and_weighs_as_transformers(norm_topk_prob: bool) -> None:
    """The shared gate with Qwen's routing on many random tokens: transformers' experts and weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    raw: dict[str, Any] = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=8,
                               norm_topk_prob=norm_topk_prob, num_hidden_layers=2)
    moe = read_qwen_moe_fields(raw, "Qwen3MoeForCausalLM", "test")
    assert moe is not None
    hf_router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, **raw))
    torch.nn.init.normal_(hf_router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    router = TopKRouter(32, moe, torch.device("cpu"))
    router.weight.copy_(hf_router.weight)
    hidden = torch.randn(500, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_weights, hf_experts = hf_router(hidden)
        weights, experts = router(hidden)
    order, hf_order = experts.argsort(dim=-1), hf_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), hf_experts.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-6, atol=1e-7)


BASE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=3)


@pytest.mark.parametrize("architecture,change,message", [
    ("Qwen3MoeForCausalLM", dict(num_experts_per_tok=9), r"num_experts_per_tok=9 exceeds num_experts=8"),
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[0, 3]), r"mlp_only_layers \[3\] are not layers"),
    ("Qwen3MoeForCausalLM", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    ("Qwen3MoeForCausalLM", dict(shared_expert_intermediate_size=32), r"Qwen3-MoE has no shared expert"),
    ("Qwen3MoeForCausalLM", dict(decoder_sparse_step=0), r"decoder_sparse_step=0 must be an integer >= 1"),
    ("Qwen2MoeForCausalLM", {}, r"missing required field 'shared_expert_intermediate_size'"),
])
def test_config_refuses_by_name(architecture: str, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_qwen_moe_fields({**BASE, **change}, architecture, "config.json")


def test_config_reads_transformers_num_local_experts_and_no_experts() -> None:
    """transformers saves Qwen3-MoE's count as num_local_experts; num_experts 0 makes every layer dense."""
    moe = read_qwen_moe_fields({**{k: v for k, v in BASE.items() if k != "num_experts"}, "num_local_experts": 8},
                               "Qwen3MoeForCausalLM", "config.json")
    assert moe is not None and moe.n_routed_experts == 8 and moe.is_moe_layer(0)
    assert read_qwen_moe_fields({**BASE, "num_experts": 0}, "Qwen3MoeForCausalLM", "config.json") is None


def test_loader_names_a_missing_expert(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    source = checkpoints["qwen3_moe"]
    tensors = load_file(source / "model.safetensors")
    gone = "model.layers.2.mlp.experts.6.down_proj.weight"
    del tensors[gone]
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    config = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"missing 1 tensors: {gone}"):
        load_model(tmp_path, config, ParallelState.single(config.num_key_value_heads), torch.float32,
                   torch.device("cpu"))
