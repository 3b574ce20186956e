"""DeepSeek-V2 / V3 (MLA + MoE) vs Hugging Face transformers on the same random weights: greedy tokens equal, logits
within the Llama tests' 1e-4, at (tp, dcp) = (1, 1), (2, 1), (2, 2), (4, 4).

Tiny random checkpoints (the project's write_tiny_mla_model for V2; tests/engine/models/test_model_vs_hf.py's harness
and tolerances): q_lora_rank unset (V2-Lite) and
set, a dense first layer then MoE layers, greedy / group-limited softmax routing (V2) and sigmoid noaux_tc routing
with a correction bias and renormalized weights (V3), YaRN with mscale != mscale_all_dim (so both the cos / sin
factor and the softmax-scale factor count), head widths that are not powers of two (the cached latent is 24 + 6).
Every batch mixes prompts of 1 token, one logical block, a short one and two of several logical blocks, prefilled
in chunks that cut blocks, then decodes 24 tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.harness.model_harness import Job, Scenario, free_port, run_job, run_rank
from bench.harness.random_models import VOCAB, randomize_norms_and_biases
from dcpserve.cluster.tiny_model import TinyMlaSpec, write_tiny_mla_model
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.layers.attention import KernelBackend
from dcpserve.engine.layers.moe import TopKRouter
from dcpserve.engine.models import DeepseekV2ForCausalLM
from dcpserve.engine.worker.loader import load_model
from dcpserve.engine.worker.parallel import ParallelState
from tests.engine.models.hf_compare import BLOCK_SIZE, check_against_hf, prompt
from tests.engine.models.test_model_vs_hf import one_torch_thread  # noqa: F401 - its autouse fixture, here too
from tests.spawn_pool import SpawnPool

MAX_NEW_TOKENS = 24
# The shape every model shares: 4 heads (tp 4 leaves one per rank), a latent of 24 + 6 (no power of two), a dense
# first layer then two MoE layers of 8 experts and a shared one, weights large enough (0.15) that attention and
# routing are far from uniform.
SHAPE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=24,
    qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1, max_position_embeddings=256,
    initializer_range=0.15,
)
YARN: dict[str, Any] = dict(yarn_factor=4.0, yarn_original_max_position_embeddings=64, yarn_mscale=0.9,
                            yarn_mscale_all_dim=0.7)
# DeepSeek-V2 checkpoints from the project's generator (dcpserve/cluster/tiny_model.py), and the (tp, dcp) layouts run
# as processes.
TINY_MLA: dict[str, tuple[TinyMlaSpec, list[tuple[int, int]]]] = {
    "v2_no_q_lora_yarn_greedy": (TinyMlaSpec(**SHAPE, q_lora_rank=None, **YARN), [(2, 1), (2, 2), (4, 4)]),
    "v2_q_lora_bias_group_limited": (
        TinyMlaSpec(**{**SHAPE, "num_experts_per_tok": 3}, q_lora_rank=32, attention_bias=True,
                    topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
                    yarn_factor=None, rope_theta=5000.0),
        [(2, 2), (4, 4)],
    ),
}
# DeepSeek-V3 routing (sigmoid scores, noaux_tc with a correction bias, renormalized weights), which the generator
# does not write: a transformers DeepseekV3ForCausalLM saved as it is.
V3_NAME = "v3_sigmoid_noaux_tc"
V3_LAYOUTS = [(4, 4)]
V3_CONFIG: dict[str, Any] = dict(
    {**SHAPE, "num_experts_per_tok": 3}, vocab_size=VOCAB, q_lora_rank=32, n_group=4, topk_group=2,
    norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
    tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7},
)
MODELS = [*TINY_MLA, V3_NAME]
MULTI_RANK_LAYOUTS = [(2, 1), (2, 2), (4, 4)]


def layouts(name: str) -> list[tuple[int, int]]:
    return V3_LAYOUTS if name == V3_NAME else TINY_MLA[name][1]


def make_v3_checkpoint(directory: Path) -> Path:
    """A random tiny transformers DeepseekV3ForCausalLM saved with safetensors; norms and the router's correction
    bias random too."""
    import transformers

    config = transformers.DeepseekV3Config(**V3_CONFIG)
    torch.manual_seed(3)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    randomize_norms_and_biases(model, buffers=True)
    path = directory / V3_NAME
    model.save_pretrained(path)
    return path




@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla_checkpoints")
    paths = {name: write_tiny_mla_model(root / name, seed=len(name), spec=spec) for name, (spec, _) in TINY_MLA.items()}
    paths[V3_NAME] = make_v3_checkpoint(root)
    return paths


def scenarios(dcp: int) -> tuple[Scenario, ...]:
    """One batch: prompts of 1 token, exactly one logical block, 3 tokens and two of several logical blocks,
    prefilled in chunks of block + 1 tokens (which cut blocks, and run beside the short prompts' decodes)."""
    block = BLOCK_SIZE * dcp
    prompts = (prompt(1), prompt(block), prompt(3), prompt(2 * block + 3), prompt(3 * block + 1))
    return (Scenario(prompts, prefill_chunk=block + 1, max_new_tokens=MAX_NEW_TOKENS),)


def test_configs_read_as_the_models_were_built(checkpoints: dict[str, Path]) -> None:
    v2 = ModelConfig.from_pretrained(checkpoints["v2_no_q_lora_yarn_greedy"])
    assert v2.mla is not None and v2.mla.q_lora_rank is None and v2.moe is not None
    assert (v2.num_key_value_heads, v2.head_dim) == (1, 24 + 6)
    assert v2.eos_token_ids == (1, 4) and v2.vocab_size == 512  # the generator's tokenizer
    v3 = ModelConfig.from_pretrained(checkpoints["v3_sigmoid_noaux_tc"])
    assert v3.architecture == "DeepseekV3ForCausalLM" and v3.moe is not None
    assert (v3.moe.scoring_func, v3.moe.topk_method, v3.moe.norm_topk_prob) == ("sigmoid", "noaux_tc", True)


@pytest.mark.parametrize("name", MODELS)
def test_single_rank_matches_transformers(name: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The layer's own kernel choice on CPU: the fused CPU kernels."""
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), scenarios(1))
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    assert results["kernels"] == ["cpu"]
    check_against_hf(job, results)


@pytest.mark.parametrize("kernels", ["ref", "triton"])
def test_single_rank_reference_and_triton_kernels_match_transformers(
    kernels: KernelBackend, checkpoints: dict[str, Path], device: torch.device, tmp_path: Path
) -> None:
    """The Attention layer's MLA call sites on the exact references and on Triton (CUDA, or its interpreter)."""
    name = "v2_q_lora_bias_group_limited"
    config = ModelConfig.from_pretrained(checkpoints[name])
    scenario = scenarios(1) if kernels == "ref" else (Scenario((prompt(9), prompt(2)), 5, 4),)
    job = Job(name, str(checkpoints[name]), scenario, kernels=kernels,
              device=str(device) if kernels == "triton" else "cpu")
    results = run_job(job, config, ParallelState.single(1), 1, tmp_path, BLOCK_SIZE)
    assert results["kernels"] == [kernels]
    check_against_hf(job, results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dcp", MULTI_RANK_LAYOUTS)
def test_multi_rank_matches_transformers(tp: int, dcp: int, checkpoints: dict[str, Path], tmp_path: Path,
                                        spawn_pool: SpawnPool) -> None:
    names = [name for name in MODELS if (tp, dcp) in layouts(name)]
    for name in names:
        ParallelConfig(tp, dcp).validate(ModelConfig.from_pretrained(checkpoints[name]))
    jobs = [Job(name, str(checkpoints[name]), scenarios(dcp)) for name in names]
    if (tp, dcp) == (2, 2) and not torch.cuda.is_available():
        # The MLA DCP path's Triton call sites, under the interpreter (gloo carries CPU tensors only).
        name = "v2_no_q_lora_yarn_greedy"
        jobs.append(Job(name, str(checkpoints[name]), (Scenario((prompt(9), prompt(2)), 5, 4),), kernels="triton"))
    spawn_pool.spawn(run_rank, (tp, dcp, 1, free_port(), jobs, str(tmp_path), BLOCK_SIZE), tp)
    for job in jobs:
        per_rank = [torch.load(tmp_path / job.result_file(r)) for r in range(tp)]
        check_against_hf(job, per_rank[0])
        for rank, other in enumerate(per_rank[1:], start=1):
            assert other["tokens"] == per_rank[0]["tokens"], f"{job.name}: rank {rank} sampled other tokens"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dcp,pcp", [(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 2), (2, 4, 2)])
def test_prefill_context_parallel_matches_transformers(tp: int, dcp: int, pcp: int, checkpoints: dict[str, Path],
                                                       tmp_path: Path, spawn_pool: SpawnPool) -> None:
    """PCP with MLA: each PCP group computes one early and one late part of every prefill chunk of the latent
    cache; tokens equal transformers' and logits within bounds on every rank. Not bit for bit across PCP groups:
    each runs the step's decodes beside other prefill rows, and the MoE (tokens grouped by expert) rounds by batch.
    The V2 models (the V3 one's routing runs in its (4, 4) test)."""
    names = list(TINY_MLA)
    for name in names:
        ParallelConfig(tp, dcp, pcp).validate(ModelConfig.from_pretrained(checkpoints[name]))
    jobs = [Job(name, str(checkpoints[name]), scenarios(dcp)) for name in names]
    spawn_pool.spawn(run_rank, (tp, dcp, 1, free_port(), jobs, str(tmp_path), BLOCK_SIZE, pcp), tp * pcp)
    for job in jobs:
        per_rank = [torch.load(tmp_path / job.result_file(r)) for r in range(tp * pcp)]
        for rank, result in enumerate(per_rank):
            assert result["tokens"] == per_rank[0]["tokens"], f"{job.name}: rank {rank} sampled other tokens"
            check_against_hf(job, result)


# ---- pieces the end-to-end runs cannot isolate ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["v2_q_lora_bias_group_limited", "v3_sigmoid_noaux_tc"])
def test_router_chooses_and_weighs_as_transformers(name: str, checkpoints: dict[str, Path]) -> None:
    """The gate alone on many random tokens: the same experts and the same weights as transformers' router."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32)
    config = ModelConfig.from_pretrained(checkpoints[name])
    assert config.moe is not None
    hf_router = hf.model.layers[1].mlp.gate
    router = TopKRouter(config.hidden_size, config.moe, torch.device("cpu"))
    router.weight.copy_(hf_router.weight)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    hidden = torch.randn(500, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hf_weights, hf_experts = hf_router(hidden)
        weights, experts = router(hidden)
    order, hf_order = experts.argsort(dim=-1), hf_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), hf_experts.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-6, atol=1e-7)


def test_loader_skips_mtp_layers_and_names_missing_experts(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Tensors of layers past num_hidden_layers (the multi-token-prediction module) are skipped; a missing expert
    is named."""
    source = checkpoints["v2_no_q_lora_yarn_greedy"]
    tensors = load_file(source / "model.safetensors")
    config_text = (source / "config.json").read_text()

    def write(directory: Path, edited: dict[str, torch.Tensor]) -> Path:
        directory.mkdir()
        (directory / "config.json").write_text(config_text)
        save_file(edited, directory / "model.safetensors")
        return directory

    mtp = {**tensors, "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
           "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(16, 64),
           "model.layers.3.shared_head.head.weight": torch.zeros(VOCAB, 64)}
    with_mtp = write(tmp_path / "with_mtp", mtp)
    config = ModelConfig.from_pretrained(with_mtp)
    model = load_model(with_mtp, config, ParallelState.single(1), torch.float32, torch.device("cpu"))
    assert isinstance(model, DeepseekV2ForCausalLM)
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    missing = write(tmp_path / "missing", {k: v for k, v in tensors.items() if k != gone})
    with pytest.raises(ValueError, match=rf"missing 1 tensors: {gone}"):
        load_model(missing, config, ParallelState.single(1), torch.float32, torch.device("cpu"))


def test_experts_split_by_rank_sum_to_the_whole_expert(checkpoints: dict[str, Path]) -> None:
    """Each expert's gate / up rows and down columns are split over TP ranks: the ranks' slices are the whole."""
    directory = checkpoints["v2_no_q_lora_yarn_greedy"]
    config = ModelConfig.from_pretrained(directory)
    full = load_file(directory / "model.safetensors")
    tp = 4
    slices = []
    for rank in range(tp):
        parallel = ParallelState(tp_size=tp, tp_rank=rank, dcp_size=1, dcp_rank=0, num_kv_heads=1)
        model = DeepseekV2ForCausalLM(config, parallel, torch.float32, torch.device("cpu"))
        model.load_weights((name, tensor) for name, tensor in full.items())
        w13, w2 = (model.get_parameter(f"model.layers.1.mlp.experts.{name}") for name in ("w13", "w2"))
        slices.append((w13[5].detach().clone(), w2[5].detach().clone()))
    rows = 16 // tp
    gate = torch.cat([w13[:rows] for w13, _ in slices])
    up = torch.cat([w13[rows:] for w13, _ in slices])
    down = torch.cat([w2 for _, w2 in slices], dim=1)
    prefix = "model.layers.1.mlp.experts.5"
    assert torch.equal(gate, full[f"{prefix}.gate_proj.weight"]) and torch.equal(up, full[f"{prefix}.up_proj.weight"])
    assert torch.equal(down, full[f"{prefix}.down_proj.weight"])
