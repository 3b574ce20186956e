"""Decode graphs of a worker group (emulated capture on CPU, ranks as processes): at tp=2 dcp=2 and tp=2 dcp=2
pcp=2 on the tiny dense model and at tp=2 dcp=2 on the tiny DeepSeek MLA MoE model, every rank's ModelRunner
captures the same sizes with the capture-safety check on (the Triton kernels, the DCP / PCP exchange and the TP
collectives of the decode forward, interpreted), each rank's self-check runs the collectives in step with its peers,
and the driver's greedy tokens and logprobs from the graphs equal the eager group's over the same scripted steps.

The steps are scripted, as the scheduler would send them (every rank gets the same SchedulerOutputs): prompts
prefilled, then decodes whose input tokens are fixed in advance (no token goes back from the driver to its peers),
requests finishing one after another so the decode batch shrinks 3 (eager: past the largest graph) -> 2 -> 1.
(Few sizes: each rank's capture runs the interpreted Triton kernels four times a size.)
The collectives go over torch.distributed (gloo here, NCCL on CUDA), as a GPU group's do: the shared-memory
transport of CPU groups copies through numpy on the host, which the check rightly refuses. The kernels switch to
the fused CPU ones after the capture (the emulated graph runs whatever the forward runs;
the interpreter is too slow for the whole script)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpserve.cluster.tiny_model import write_tiny_mla_model, write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.core.block_manager import blocks_needed
from dcpserve.engine.core.step import ScheduledRequest, SchedulerOutput
from dcpserve.engine.layers.attention import Attention, KernelBackend
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.worker.cuda_graphs import emulated_capture
from dcpserve.engine.worker.model_runner import ModelRunner
from dcpserve.engine.worker.parallel import destroy_parallel_state, init_parallel_state
from tests.spawn_pool import SpawnPool

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the Triton kernels on CPU tensors, under the interpreter")

BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPTS = ((5, 9, 13, 17, 21), (8, 6, 4, 2, 30, 31, 32, 33, 34, 35, 36), (40, 41, 42))
DECODE_STEPS = (6, 2, 4)  # decodes of each request: batches of 3, 3, 2, 2, 1, 1
REPLAYED_STEPS = 4  # the batches of at most 2 (max_num_seqs = 3: graphs of 1 and 2; 3 runs eagerly)
LAYOUTS = {"tp2_dcp2": ("dense", 2, 2, 1), "tp2_dcp2_pcp2": ("dense", 2, 2, 2), "mla_moe_tp2_dcp2": ("mla", 2, 2, 1)}


def _select(runner: ModelRunner, kernels: KernelBackend) -> None:
    for module in runner.model.modules():
        if isinstance(module, Attention):
            module.select_kernels(kernels)


def _script(runner: ModelRunner, tag: str, vocab_size: int) -> list[dict[str, tuple[int, float]]]:
    """Runs the scripted steps (module docstring); returns the driver's (token, logprob) per request per step (empty
    dicts on the other ranks)."""
    tokens_per_block = BLOCK_SIZE * runner.parallel.dcp_size
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    lengths = [len(p) for p in PROMPTS]
    blocks = [blocks_needed(n, tokens_per_block) for n in lengths]
    first = [sum(blocks[:i]) + 1 for i in range(len(PROMPTS))]  # page 0 never used
    next_block = sum(blocks) + 1
    step = SchedulerOutput([
        ScheduledRequest(ids[i], list(p), 0, list(range(first[i], first[i] + blocks[i])), True, 0, params)
        for i, p in enumerate(PROMPTS)])
    results = []
    for k in range(max(DECODE_STEPS) + 1):
        output = runner.execute(step)
        results.append({rid: (t, output.logprobs[rid].logprob) for rid, t in output.sampled_token_ids.items()}
                       if output is not None else {})
        entries, finished = [], []
        for i, rid in enumerate(ids):
            if k == DECODE_STEPS[i]:
                finished.append(rid)
            if k >= DECODE_STEPS[i]:
                continue
            new_blocks = []
            if lengths[i] + 1 > blocks[i] * tokens_per_block:
                new_blocks, next_block, blocks[i] = [next_block], next_block + 1, blocks[i] + 1
            token = (13 * i + 7 * k + 5) % vocab_size  # scripted, not the sampled one: no token goes back to peers
            entries.append(ScheduledRequest(rid, [token], lengths[i], new_blocks, True, k + 1))
            lengths[i] += 1
        step = SchedulerOutput(entries, finished_request_ids=finished)
    runner.execute(step)  # the last requests' finish: the batch is empty again
    return results


def _off_by_one(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
    """A wrong "graph" (its replay runs the forward, collectives and all, and adds 1): its self-check disagrees."""
    output = fn()
    return (lambda: output.copy_(fn() + 1)), output


def _graph_rank(rank: int, model_dir: str, tp: int, dcp: int, pcp: int, port: int, out_dir: str,
                wrong_rank: int = -1) -> None:
    """One rank: eager script, capture (every rank together; `wrong_rank` with a wrong capture), graphed script;
    saves what it saw."""
    torch.set_num_threads(1)
    config = EngineArgs(model=model_dir, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                        prefill_context_parallel_size=pcp, block_size=BLOCK_SIZE, max_num_seqs=3,
                        kv_cache_memory_bytes=1 << 20, device="cpu").create_engine_config()
    parallel = init_parallel_state(tp, rank, dcp, config.model_config.num_key_value_heads,
                                   f"tcp://127.0.0.1:{port}", "gloo", 120.0, pcp_size=pcp, transport="gloo")
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dcpserve.engine.worker.model_runner").addHandler(handler)
    try:
        runner = ModelRunner(config, parallel, torch.device("cpu"))
        runner.allocate_kv_cache(NUM_BLOCKS)
        vocab = config.model_config.vocab_size
        _select(runner, "cpu")
        eager = _script(runner, "eager", vocab)
        _select(runner, "triton")
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        runner.capture_decode_graphs(_off_by_one if rank == wrong_rank else emulated_capture, safety_check=True)
        graphs = runner.decode_graphs
        cache_kept = all(torch.equal(k, k0) and torch.equal(v, v0)
                         for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True))
        _select(runner, "cpu")
        graphed = _script(runner, "graphed", vocab)  # eagerly on every rank when the group did not capture
        torch.save({"eager": eager, "graphed": graphed, "errors": errors, "cache_kept": cache_kept,
                    "sizes": graphs.sizes if graphs is not None else None,
                    "replays": graphs.replays if graphs is not None else 0, "driver": parallel.is_driver},
                   Path(out_dir) / f"rank{rank}.pt")
        torch.distributed.barrier()  # nobody tears down its pairs while a peer may still read from them
    finally:
        logging.getLogger("dcpserve.engine.worker.model_runner").removeHandler(handler)
        destroy_parallel_state(parallel)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph_group")
    return {"dense": write_tiny_model(root / "dense", seed=0), "mla": write_tiny_mla_model(root / "mla", seed=0)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_rank_captures_and_replays_the_eager_tokens(layout: str, models: dict[str, Path], tmp_path: Path,
                                                         spawn_pool: SpawnPool) -> None:
    from bench.harness.model_harness import free_port

    name, tp, dcp, pcp = LAYOUTS[layout]
    world = tp * pcp
    spawn_pool.spawn(_graph_rank, (str(models[name]), tp, dcp, pcp, free_port(), str(tmp_path)), world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for rank, seen in enumerate(ranks):
        assert seen["errors"] == [] and seen["sizes"] == [1, 2], (rank, seen["errors"])
        assert seen["cache_kept"], rank  # the self-check's filled pages zeroed again, the rest untouched
        assert seen["replays"] == REPLAYED_STEPS, rank  # the same steps on every rank
    (driver,) = [seen for seen in ranks if seen["driver"]]
    eager, graphed = driver["eager"], driver["graphed"]
    assert len(graphed) == len(eager) == max(DECODE_STEPS) + 1
    assert sum(len(step) for step in eager) == len(PROMPTS) + sum(DECODE_STEPS)
    for want, have in zip(eager, graphed, strict=True):
        assert [t for t, _ in have.values()] == [t for t, _ in want.values()]
        for (_, a), (_, b) in zip(have.values(), want.values(), strict=True):
            assert a == pytest.approx(b, abs=1e-5)



def test_one_ranks_failed_capture_leaves_every_rank_eager(models: dict[str, Path], tmp_path: Path,
                                                         spawn_pool: SpawnPool) -> None:
    """Rank 1's self-check disagrees; rank 0's passes: the group agrees on eager decode everywhere (a graph with a
    collective must be replayed on every rank of it or on none), and the script then runs eagerly in step."""
    from bench.harness.model_harness import free_port

    spawn_pool.spawn(_graph_rank, (str(models["dense"]), 2, 2, 1, free_port(), str(tmp_path), 1), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [seen["sizes"] for seen in ranks] == [None, None]
    assert any("failed on another rank" in e for e in ranks[0]["errors"]), ranks[0]["errors"]
    assert any("disagrees with the eager forward" in e for e in ranks[1]["errors"]), ranks[1]["errors"]
    assert all(seen["cache_kept"] for seen in ranks)
    eager, graphed = ([list(step.values()) for step in ranks[0][run]] for run in ("eager", "graphed"))
    assert graphed == eager and len(eager) == max(DECODE_STEPS) + 1
