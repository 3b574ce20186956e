"""Decode graphs of every tiny model at tp = 1 (emulated capture on CPU): the dense model, the DeepSeek MLA MoE model,
the Qwen3-MoE model and the DeepSeek-V3 FP8 one (its block-FP8 linears as CPU runs them: dequantized) pass the
capture-safety check over the decode forward the GPU would capture (Triton attention, run by the interpreter; the
grouped experts), capture, replay the eager engine's tokens and logprobs, and leave the KV cache as allocated. The
check and the self-check can fail: the fused CPU attention (which reads lengths back by design) fails the check, and
a replay that ignores the cache fails the self-check, which reads a non-zero cache. Multi-rank:
test_cuda_graphs_multirank.py."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpserve.cluster.tiny_fp8 import write_tiny_fp8_model
from dcpserve.cluster.tiny_model import write_tiny_mla_model, write_tiny_model
from dcpserve.cluster.tiny_moe import write_tiny_qwen_moe_model
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.layers.attention import Attention, KernelBackend
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.worker import cuda_graphs
from dcpserve.engine.worker.cuda_graphs import Capture, DecodeGraphs, emulated_capture
from tests.engine.llm_parts import runner_of

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the Triton kernels on CPU tensors, under the interpreter")

def _write_fp8(directory: Path, seed: int) -> Path:
    return write_tiny_fp8_model(directory, directory.parent / f"{directory.name}_twin", seed)[0]


WRITERS: dict[str, Callable[..., Path]] = {
    "dense": write_tiny_model, "deepseek_mla_moe": write_tiny_mla_model, "qwen3_moe": write_tiny_qwen_moe_model,
    "deepseek_v3_fp8": _write_fp8}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph_models")
    return {name: write(root / name, seed=0) for name, write in WRITERS.items()}


def _llm(model: Path, kernels: KernelBackend = "triton") -> LLM:
    llm = LLM(model, block_size=8, max_num_seqs=4, kv_cache_memory_bytes=1 << 20, device="cpu")
    for module in runner_of(llm).model.modules():
        if isinstance(module, Attention):
            module.select_kernels(kernels)
    return llm


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Five requests that end one after another: decode batches of 5 (eager: past the largest size), 4, 3 (the
    graph of 4, padded), 2 and 1, across page boundaries."""
    prompts = [[(11 * i + 3 * j) % 250 + 4 for j in range(4 + 5 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 3 * i, ignore_eos=True, logprobs=1) for i in range(5)]
    return prompts, params


def _graphs(llm: LLM, capture: Capture, sizes: list[int], safety_check: bool = False) -> DecodeGraphs:
    runner = runner_of(llm)
    with torch.inference_mode():
        return DecodeGraphs(runner.model, runner.kv_caches, runner.config.model_config.vocab_size,
                            runner.batch.max_blocks_per_seq, runner.device, capture, sizes, safety_check)


@interpreted
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_the_decode_forward_passes_the_capture_safety_check(name: str, models: dict[str, Path]) -> None:
    """The forward the GPU captures (Triton attention, grouped experts): checked, captured and compared with eager
    on the self-check's filled cache; the cache is zeros again afterwards. (One size of 2 rows: each interpreted
    forward takes about a second.)"""
    with _llm(models[name]) as llm:
        graphs = _graphs(llm, emulated_capture, [2], safety_check=True)
        assert graphs.graphs.keys() == {2}
        assert all(not k.any() and not v.any() for k, v in runner_of(llm).kv_caches)


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_graph_replays_equal_the_eager_engine(name: str, models: dict[str, Path]) -> None:
    """The engine's own capture (every size up to max_num_seqs = 4) replays eager's tokens and logprobs. The fused
    CPU kernels run here (the interpreter is too slow for a whole generation): the emulated graph runs whatever the
    forward runs, so this checks the buffers, padding and rows for each model, the test above the GPU's ops."""
    prompts, params = _workload()
    with _llm(models[name], kernels="cpu") as eager:
        expected = eager.generate(prompt_token_ids=prompts, sampling_params=params)
    with _llm(models[name], kernels="cpu") as graphed:
        runner = runner_of(graphed)
        runner.capture_decode_graphs(emulated_capture)
        graphs = runner.decode_graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4]
        assert all(not k.any() and not v.any() for k, v in runner.kv_caches)  # the self-check's pages zeroed again
        got = graphed.generate(prompt_token_ids=prompts, sampling_params=params)
    assert graphs.replays >= 8
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].logprobs is not None and want.outputs[0].logprobs is not None
        for a, b in zip(have.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_the_check_refuses_the_fused_cpu_attention(models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """The CPU kernels plan each step from its lengths read back to the host: the check names that read and where,
    and decode stays eager."""
    with _llm(models["dense"], kernels="cpu") as llm:
        runner = runner_of(llm)
        with caplog.at_level(logging.ERROR, logger="dcpserve.engine.worker.model_runner"):
            runner.capture_decode_graphs(emulated_capture, safety_check=True)
        assert runner.decode_graphs is None
        assert "not safe to capture" in caplog.text and "Tensor.__int__" in caplog.text
        assert "dcpserve/kernels/cpu_attention.py:" in caplog.text
        assert all(not k.any() for k, _ in runner.kv_caches)


def test_the_self_check_reads_a_non_zero_cache(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A "graph" whose replay reads no cache (its lengths zeroed) agrees with the eager forward over a zero cache
    (attention over zeros is zero either way), so only a filled cache shows it."""

    def ignores_the_cache(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        graphs = getattr(fn.func, "__self__", None) if isinstance(fn, partial) else None
        assert isinstance(graphs, DecodeGraphs)
        output = fn()

        def replay() -> None:
            lens = graphs.seq_lens.clone()
            graphs.seq_lens.zero_()
            output.copy_(fn())
            graphs.seq_lens.copy_(lens)

        return replay, output

    with _llm(models["dense"], kernels="cpu") as llm:
        with pytest.raises(RuntimeError, match="disagrees with the eager forward"):
            _graphs(llm, ignores_the_cache, [2])
        assert all(not k.any() for k, _ in runner_of(llm).kv_caches)
        assert _graphs(llm, emulated_capture, [2]).graphs.keys() == {2}
        monkeypatch.setattr(cuda_graphs, "CHECK_CACHE_SCALE", 0.0)  # the pages "filled" with zeros
        assert _graphs(llm, ignores_the_cache, [2]).graphs.keys() == {2}
