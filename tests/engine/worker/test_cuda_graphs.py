"""Decode CUDA graphs (dcpserve/engine/worker/cuda_graphs.py): the fixed buffers, padding to the captured sizes and the
output rows, exercised on CPU through `emulated_capture` (a graph's contract: an output fixed at capture, rewritten from
the buffers by each replay), against the eager engine on the same weights. The CUDA capture itself needs a GPU; so does
the test at the end, which runs there."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.worker.cuda_graphs import Capture, DecodeGraphs, emulated_capture
from tests.engine.llm_parts import engine_of, runner_of

SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _llm(tiny: Path, **kwargs: object) -> LLM:
    # On CPU whatever the machine: the engine's default device is CUDA where there is one, and there it captures
    # real graphs at start (test_cuda_graphs_on_the_device), which these tests of the emulated contract do not expect.
    return LLM(tiny, block_size=8, max_num_seqs=16, kv_cache_memory_bytes=4 << 20, device="cpu", **kwargs)


def _capture(llm: LLM, sizes: tuple[int, ...] = SIZES, capture: Capture = emulated_capture) -> None:
    runner = runner_of(llm)
    runner.capture_decode_graphs(capture)
    if runner.decode_graphs is not None and sizes != tuple(runner.decode_graphs.sizes):
        # The engine captures every size up to max_num_seqs; a few are enough here and keep the test fast.
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.config.model_config.vocab_size,
                                            runner.batch.max_blocks_per_seq, runner.device, capture, sizes)


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Eleven requests of different prompt lengths and output lengths: the decode batch shrinks from 11 (past the
    largest size: eager) through every size, padded (7 -> 8, 5 -> 4 + ...), as requests finish; greedy and seeded
    sampling, with logprobs."""
    prompts = [[(7 * i + j) % 400 + 5 for j in range(3 + 9 * i)] for i in range(11)]
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=4 + 3 * i, ignore_eos=True,
                             logprobs=1) for i in range(11)]
    return prompts, params


def test_graph_replays_equal_the_eager_engine(tiny: Path) -> None:
    prompts, params = _workload()
    with _llm(tiny) as eager:
        expected = eager.generate(prompt_token_ids=prompts, sampling_params=params)
        assert runner_of(eager).decode_graphs is None  # CPU: eager unless a capture is given
    with _llm(tiny) as graphed:
        _capture(graphed)
        got = graphed.generate(prompt_token_ids=prompts, sampling_params=params)
        graphs = runner_of(graphed).decode_graphs
    assert graphs is not None and graphs.replays > 0
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].logprobs is not None and want.outputs[0].logprobs is not None
        for a, b in zip(have.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_a_step_no_graph_serves_runs_eagerly(tiny: Path) -> None:
    with _llm(tiny) as llm:
        _capture(llm, sizes=(1, 2))
        graphs = runner_of(llm).decode_graphs
        assert graphs is not None
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.generate(prompt_token_ids=[[5, 6, 7]] * 3, sampling_params=params)  # 3 decodes: past the largest size
        assert graphs.replays == 0
        llm.generate(prompt_token_ids=[[5, 6, 7]] * 2, sampling_params=params)  # prefill eager, then 5 decode steps
        assert graphs.replays == 5


def test_padding_rows_store_nothing(tiny: Path) -> None:
    """A batch of 3 replays the graph of 4: its padding row has slot -1, so no page of the cache changes but the
    ones the 3 sequences write."""
    with _llm(tiny) as llm:
        _capture(llm, sizes=(4,))
        runner = runner_of(llm)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for i in range(3):
            engine_of(llm).add_request(prompt_token_ids=[9 + i] * 5, sampling_params=params)
        engine_of(llm).step()  # the prefill: every prompt's KV written, the first tokens sampled
        before = [k.clone() for k, _ in runner.kv_caches]
        pages = {b for r in engine_of(llm).scheduler.running for b in r.block_ids}
        engine_of(llm).step()  # one decode step of 3 through the graph of 4
        assert runner.decode_graphs is not None and runner.decode_graphs.replays == 1
        for layer, (k, _) in enumerate(runner.kv_caches):
            changed = {int(p) for p in (k != before[layer]).flatten(1).any(dim=1).nonzero()[:, 0]}
            assert changed and changed <= pages, (changed, pages)


def test_a_failed_or_wrong_capture_leaves_decode_eager(tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    def failing(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        raise RuntimeError("capture not permitted")

    def stale(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        """A "graph" whose replay never updates its output."""
        output = fn()
        return (lambda: None), output

    with _llm(tiny) as llm:
        runner = runner_of(llm)
        with caplog.at_level(logging.ERROR, logger="dcpserve.engine.worker.model_runner"):
            runner.capture_decode_graphs(failing)
            assert runner.decode_graphs is None and "capture not permitted" in caplog.text
            caplog.clear()
            runner.capture_decode_graphs(stale)
            assert runner.decode_graphs is None and "disagrees with the eager forward" in caplog.text
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(temperature=0, max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3


def test_enforce_eager_skips_the_capture(tiny: Path) -> None:
    with _llm(tiny, enforce_eager=True) as llm:
        runner = runner_of(llm)
        runner.capture_decode_graphs(emulated_capture)
        assert runner.decode_graphs is None


# CUDA: a padded batch runs the real rows through GEMMs of another shape than eager's (8 rows for 7), which cuBLAS
# may sum in another order: the same token, or a near-tie (top-2 logprobs of eager's step this close) it may flip.
NEAR_TIE = 1e-3


def test_cuda_graphs_on_the_device(tiny: Path) -> None:
    """On CUDA the engine captures real graphs at start; greedy tokens equal an enforce_eager engine's up to the
    first near-tie (after it the sequences differ, so the rest is not compared), and the step that replays is
    most steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts, params = _workload()
    params = [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True, logprobs=2) for p in params]
    with LLM(tiny, device="cuda", enforce_eager=True, max_num_seqs=16, kv_cache_memory_bytes=64 << 20) as eager:
        assert runner_of(eager).decode_graphs is None
        expected = eager.generate(prompt_token_ids=prompts, sampling_params=params)
    with LLM(tiny, device="cuda", max_num_seqs=16, kv_cache_memory_bytes=64 << 20) as graphed:
        graphs = runner_of(graphed).decode_graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
        got = graphed.generate(prompt_token_ids=prompts, sampling_params=params)
        assert graphs.replays > 0
    compared = 0
    for want, have in zip(expected, got, strict=True):
        want_tokens, have_tokens = want.outputs[0].token_ids, have.outputs[0].token_ids
        assert len(have_tokens) == len(want_tokens)
        assert want.outputs[0].logprobs is not None
        for i, (a, b) in enumerate(zip(want_tokens, have_tokens, strict=True)):
            if a != b:
                top = want.outputs[0].logprobs[i].top
                assert b in dict(top) and abs(top[0][1] - dict(top)[b]) <= NEAR_TIE, (i, a, b, top)
                break
            compared += 1
    assert compared >= sum(len(o.outputs[0].token_ids) for o in expected) // 2
