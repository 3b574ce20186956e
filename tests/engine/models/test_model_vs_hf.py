"""Model vs Hugging Face transformers on the same random weights: greedy tokens equal, logits within 1e-4.

Tiny random checkpoints (Llama MQA; Llama GQA with q/k/v/o bias and llama3 RoPE scaling; Qwen2 with q/k/v bias,
tied embeddings and a sharded checkpoint; Qwen3 with q/k norm and head_dim != hidden / heads; vocab 301, so
every TP size pads the vocabulary) are saved with save_pretrained, loaded through dcpserve.engine.worker.loader and
driven through paged KV caches with hand-built AttentionMetadata (bench/harness/model_harness.py): chunked prefill, then
32 greedy decode steps, for one batch mixing prompts of 1 token, exactly one logical block, a short one and two
of several logical blocks (decodes and prefill chunks in the same step). tp = 1 runs in this process; tp > 1
runs as real processes over gloo, every rank saving its tokens and logits, checked here against transformers.
"""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.harness.model_harness import Job, Scenario, free_port, run_job, run_rank
from bench.harness.random_models import COMMON, randomize_norms_and_biases
from dcpserve.engine.config import ModelConfig, ParallelConfig, RopeScaling
from dcpserve.engine.layers.embedding import VocabParallelEmbedding
from dcpserve.engine.layers.rotary import RotaryEmbedding
from dcpserve.engine.layers.weights import TensorSource
from dcpserve.engine.worker.loader import load_model
from dcpserve.engine.worker.parallel import ParallelState
from tests.engine.models.hf_compare import (
    BF16_LOGITS_ATOL,
    BLOCK_SIZE,
    check_against_hf,
    prompt,
    scenarios,
)
from tests.spawn_pool import SpawnPool

# name -> (transformers class name, config overrides, save_pretrained kwargs, (tp, dcp) layouts checked)
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any], list[tuple[int, int]]]] = {
    "llama_mqa": (
        "Llama", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False), {},
        [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)],
    ),
    "llama_gqa_bias_llama3_rope": (
        "Llama",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, attention_bias=True,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        {}, [(1, 1), (2, 1), (4, 2)],
    ),
    "qwen2_bias_tied_sharded": (
        "Qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        {"max_shard_size": "40KB"}, [(1, 1), (2, 1), (4, 2)],
    ),
    "qwen3_qk_norm": (
        "Qwen3", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False),
        {}, [(1, 1), (2, 2), (4, 4)],
    ),
    # Qwen3's long-context setting (its model card: yarn, factor 4 over 32768), shrunk so every prompt runs past the
    # original context of 16 tokens.
    "qwen3_yarn": (
        "Qwen3",
        dict(num_attention_heads=8, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
             rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                              "original_max_position_embeddings": 16}),
        {}, [(1, 1), (2, 2)],
    ),
}
# (tp, dcp, interleave) run as real processes; (4, 2) uses interleave 2 (pairs of tokens alternate ranks).
MULTI_RANK_LAYOUTS = [(2, 1, 1), (2, 2, 1), (4, 2, 2), (4, 4, 1)]


def make_checkpoint(name: str, directory: Path) -> Path:
    """A random tiny transformers model saved with safetensors; norms and biases are random too."""
    import transformers

    family, overrides, save_kwargs, _ = MODELS[name]
    config = getattr(transformers, f"{family}Config")(**COMMON, **overrides)
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    randomize_norms_and_biases(model)
    path = directory / name
    model.save_pretrained(path, **save_kwargs)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These models are tiny: intra-op threads only add contention (30x slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {name: make_checkpoint(name, root) for name in MODELS}
    assert (paths["qwen2_bias_tied_sharded"] / "model.safetensors.index.json").is_file(), "expected a sharded save"
    return paths


def _validate(name: str, checkpoint: Path, tp: int, dcp: int, pcp: int = 1) -> None:
    ParallelConfig(tp, dcp, pcp).validate(ModelConfig.from_pretrained(checkpoint))


def _valid(checkpoint: Path, tp: int, dcp: int, pcp: int) -> bool:
    try:
        _validate("", checkpoint, tp, dcp, pcp)
    except ValueError:
        return False
    return True


def triton_scenario() -> Scenario:
    """Short (the Triton interpreter is slow on CPU): a chunked prompt crossing blocks, decoding beside a short one."""
    return Scenario((prompt(9), prompt(2)), prefill_chunk=5, max_new_tokens=4)


def test_single_rank_triton_kernels_match_transformers(
    checkpoints: dict[str, Path], device: torch.device, tmp_path: Path
) -> None:
    """The Attention layer's Triton call sites (CUDA, or Triton's interpreter on CPU)."""
    name = "qwen3_qk_norm"
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), (triton_scenario(),), kernels="triton", device=str(device))
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    check_against_hf(job, results)


@pytest.mark.parametrize("name", list(MODELS))
def test_single_rank_matches_transformers(name: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The layer's own kernel choice on CPU: the fused CPU kernels."""
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), scenarios(1))
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    assert results["kernels"] == ["cpu"]
    check_against_hf(job, results)


@pytest.mark.parametrize("name", list(MODELS))
def test_single_rank_bf16_is_close_to_transformers_bf16(name: str, checkpoints: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """bf16 weights and KV cache (what deployments serve), the fused CPU kernels: transformers' bf16 logits within
    bf16's own spacing, tokens equal up to a near-tie."""
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), scenarios(1), dtype="bfloat16")
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    check_against_hf(job, results, BF16_LOGITS_ATOL, near_ties=True)


def test_single_rank_triton_kernels_bf16_are_close_to_transformers(
    checkpoints: dict[str, Path], device: torch.device, tmp_path: Path
) -> None:
    """The Triton kernels in bf16, natively (the interpreter's bf16 arithmetic is broken, so CUDA only)."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device: Triton's CPU interpreter computes bf16 wrongly")
    name = "qwen3_qk_norm"
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), scenarios(1), kernels="triton", device=str(device), dtype="bfloat16")
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    check_against_hf(job, results, BF16_LOGITS_ATOL, near_ties=True)


def test_single_rank_reference_kernels_match_transformers(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The exact references, selected explicitly (the layer never picks them itself)."""
    name = "llama_gqa_bias_llama3_rope"
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), scenarios(1), kernels="ref")
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    assert results["kernels"] == ["ref"]
    check_against_hf(job, results)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dcp,interleave", MULTI_RANK_LAYOUTS)
def test_multi_rank_matches_transformers(
    tp: int, dcp: int, interleave: int, checkpoints: dict[str, Path], tmp_path: Path, spawn_pool: SpawnPool
) -> None:
    names = [name for name, spec in MODELS.items() if (tp, dcp) in spec[3]]
    for name in names:
        _validate(name, checkpoints[name], tp, dcp)
    jobs = [Job(name, str(checkpoints[name]), scenarios(dcp)) for name in names]
    if (tp, dcp) == (2, 2) and not torch.cuda.is_available():
        # The DCP path's Triton call sites, under the interpreter (gloo carries CPU tensors only).
        jobs.append(Job("llama_mqa", str(checkpoints["llama_mqa"]), (triton_scenario(),), kernels="triton"))
    spawn_pool.spawn(run_rank, (tp, dcp, interleave, free_port(), jobs, str(tmp_path), BLOCK_SIZE), tp)
    for job in jobs:
        per_rank = [torch.load(tmp_path / job.result_file(r)) for r in range(tp)]
        check_against_hf(job, per_rank[0])
        for rank, other in enumerate(per_rank[1:], start=1):
            assert other["tokens"] == per_rank[0]["tokens"], f"{job.name}: rank {rank} sampled other tokens"
            for a, b in zip(other["logits"], per_rank[0]["logits"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{job.name}: rank {rank} logits differ")


# (tp, dcp, pcp): prefill context parallelism, every model where the layout is valid for it.
PCP_LAYOUTS = [(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 2), (2, 4, 2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dcp,pcp", PCP_LAYOUTS)
def test_prefill_context_parallel_matches_transformers(
    tp: int, dcp: int, pcp: int, checkpoints: dict[str, Path], tmp_path: Path, spawn_pool: SpawnPool
) -> None:
    """Each PCP group computes one early and one late part of every prefill chunk; every PCP group runs the
    decodes. Tokens equal transformers', logits within LOGITS_ATOL; every rank's tokens and logits are rank
    0's, bit for bit (the PCP groups trade hidden states, and compute the decodes the same way)."""
    names = [name for name in MODELS if _valid(checkpoints[name], tp, dcp, pcp)]
    assert names, f"no model takes (tp, dcp, pcp) = {(tp, dcp, pcp)}"
    jobs = [Job(name, str(checkpoints[name]), scenarios(dcp)) for name in names]
    spawn_pool.spawn(run_rank, (tp, dcp, 1, free_port(), jobs, str(tmp_path), BLOCK_SIZE, pcp), tp * pcp)
    for job in jobs:
        per_rank = [torch.load(tmp_path / job.result_file(r)) for r in range(tp * pcp)]
        check_against_hf(job, per_rank[0])
        for rank, other in enumerate(per_rank[1:], start=1):
            assert other["tokens"] == per_rank[0]["tokens"], f"{job.name}: rank {rank} sampled other tokens"
            for a, b in zip(other["logits"], per_rank[0]["logits"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{job.name}: rank {rank} logits differ")


# ---- loader errors ---------------------------------------------------------------------------------------


def _copy_checkpoint(source: Path, target: Path, edit: Any) -> Path:
    """A single-file copy of `source` with its tensors passed through edit(dict) -> dict."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    save_file(edit(dict(tensors)), target / "model.safetensors")
    return target


def _load(directory: Path) -> None:
    config = ModelConfig.from_pretrained(directory)
    load_model(directory, config, ParallelState.single(config.num_key_value_heads), torch.float32, torch.device("cpu"))


def test_loader_needs_safetensors_files(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    (tmp_path / "config.json").write_text((checkpoints["llama_mqa"] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    expected = r"no \*\.safetensors files in .*pytorch_model\.bin.*safe_serialization"
    with pytest.raises(FileNotFoundError, match=expected):
        _load(tmp_path)


def test_loader_names_missing_shards(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    source = checkpoints["qwen2_bias_tied_sharded"]
    for item in source.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    shard = sorted(json.loads((source / "model.safetensors.index.json").read_text())["weight_map"].values())[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"names checkpoint files that are not in .*{shard}"):
        _load(tmp_path)


def test_loader_names_a_shape_mismatch(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = _copy_checkpoint(checkpoints["llama_mqa"], tmp_path / "bad", lambda t: {**t, name: t[name][:8]})
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(8, 64\) but the model expects \(16, 64\)"):
        _load(bad)


def test_loader_names_missing_and_unexpected_tensors(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    gone = "model.layers.0.mlp.up_proj.weight"

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors.pop(gone)
        return {**tensors, "model.layers.0.mlp.extra.weight": torch.zeros(2)}

    bad = _copy_checkpoint(checkpoints["llama_mqa"], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=rf"missing 1 tensors: {gone}; unexpected 1 tensors: model.layers.0.mlp.extra"):
        _load(bad)


def test_loader_casts_to_the_requested_dtype(checkpoints: dict[str, Path]) -> None:
    directory = checkpoints["qwen3_qk_norm"]
    config = ModelConfig.from_pretrained(directory)
    parallel = ParallelState.single(config.num_key_value_heads)
    model = load_model(directory, config, parallel, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference = load_file(directory / "model.safetensors")["model.layers.0.self_attn.q_norm.weight"]
    assert torch.equal(model.get_parameter("model.layers.0.self_attn.q_norm.weight"), reference.to(torch.bfloat16))


def test_model_is_freed_without_the_cycle_collector(checkpoints: dict[str, Path]) -> None:
    """No reference cycles (a weight loader bound to its layer made one): layers and the process groups they hold
    go when the model goes, not at interpreter shutdown, where tearing down gloo aborts the process."""
    directory = checkpoints["qwen2_bias_tied_sharded"]
    config = ModelConfig.from_pretrained(directory)
    model = load_model(directory, config, ParallelState.single(config.num_key_value_heads), torch.float32,
                       torch.device("cpu"))
    refs = [weakref.ref(module) for module in model.modules()]
    gc.disable()
    try:
        del model
        assert [type(ref()).__name__ for ref in refs if ref() is not None] == []
    finally:
        gc.enable()


# ---- layer details the end-to-end runs cannot isolate ------------------------------------------------------


def test_llama3_inv_freq_is_transformers_exactly() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling: dict[str, Any] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    ours = RotaryEmbedding(128, 500000.0, RopeScaling(**scaling), torch.device("cpu")).inv_freq
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's model card
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 16.0,
     "beta_slow": 2.0, "attention_factor": 1.2, "truncate": False},
    {"rope_type": "linear", "factor": 2.0},
])
def test_llama_family_scaled_inv_freq_is_transformers_exactly(rope: dict[str, Any]) -> None:
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 128, "max_position_embeddings": 131072,
        "rope_theta": 1000000.0, "rope_scaling": rope}
    config = ModelConfig.from_dict(raw)
    hf_config = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "rope_scaling",
                                                                        "rope_theta")},
                            rope_parameters={**rope, "rope_theta": 1000000.0})
    expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, torch.device("cpu"))
    rotary = RotaryEmbedding(128, config.rope_theta, config.rope_scaling, torch.device("cpu"))
    assert torch.equal(rotary.inv_freq, expected)
    assert rotary.cos_sin_factor == attention_factor


def test_vocab_shards_pad_and_a_trailing_rank_may_hold_no_rows() -> None:
    """vocab 5 over tp 4: ceil(5 / 4) = 2 rows per rank, so ranks hold [0, 2), [2, 4), [4, 5) + padding, nothing."""
    full = torch.arange(10, dtype=torch.float32).reshape(5, 2) + 1
    shards = []
    for rank in range(4):
        parallel = ParallelState(tp_size=4, tp_rank=rank, dcp_size=1, dcp_rank=0, num_kv_heads=1)
        embedding = VocabParallelEmbedding(5, 2, parallel, torch.float32, torch.device("cpu"))
        embedding.weight.weight_loader(  # type: ignore[attr-defined]  # the loader new_parameter attached
            embedding.weight, TensorSource(full), "model.embed_tokens.weight", None)
        shards.append(embedding.weight.detach().clone())
    assert torch.equal(torch.cat(shards)[:5], full)
    assert torch.equal(torch.cat(shards)[5:], torch.zeros(3, 2))
