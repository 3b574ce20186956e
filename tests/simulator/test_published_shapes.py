"""The direction of published TP-vs-DCP effects, on the simulator with the roofline model (bench/simulate_published.py
has the full comparison and its numbers): DeepSeek-V3 at tp=8 on 8 x H200, closed loop. At 1k in / 1k out every
sequence fits plain TP's KV, so DCP8 only adds its exchange: fewer tokens per second and a longer ITL (ATOM PR #847:
-22%, ITL 52 -> 69 ms). At 8k / 8k plain TP's replicated KV holds a third of the clients' sequences and DCP8 holds
them all: more tokens per second (ATOM: +68%)."""

from __future__ import annotations

from typing import Any

from dcpserve.cluster.published_models import model_spec
from dcpserve.engine.config import SchedulerConfig
from dcpserve.simulator.gpus import gpu_spec
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.step_time import RooflineModel
from dcpserve.simulator.synth import PRESETS, generate


def simulate(dcp: int, preset: str, concurrency: int, requests: int) -> dict[str, Any]:
    step_model = RooflineModel(model_spec("deepseek-v3"), gpu_spec("h200"), 8, dcp, weight_dtype="float8")
    shape = ReplicaShape(tp=8, dcp=dcp, num_blocks=step_model.kv_blocks_per_replica(64), block_size=64,
                         scheduler=SchedulerConfig(max_model_len=32768, max_num_seqs=1024,
                                                   max_num_batched_tokens=8192))
    config = SimulationConfig(shape=shape, num_replicas=1, concurrency=concurrency,
                              serve=ServeSettings(max_queued_requests=10_000, queue_timeout_s=1e9,
                                                  request_timeout_s=1e9))
    summary = Simulation(config, step_model).run(generate(PRESETS[preset], requests, seed=0))
    assert summary["finished"] == requests
    return summary


def test_dcp_loses_on_short_requests_that_fit_plain_tp() -> None:
    tp, dcp = (simulate(d, "1k-1k", 128, 256) for d in (1, 8))
    assert tp["peak_concurrent_sequences"] == dcp["peak_concurrent_sequences"] == 128  # no KV limit either way
    assert dcp["steady"]["output_tokens_per_s_per_gpu"] < tp["steady"]["output_tokens_per_s_per_gpu"]
    assert dcp["itl_s"]["p50"] > tp["itl_s"]["p50"]


def test_dcp_wins_on_long_sequences_plain_tp_cannot_hold() -> None:
    tp, dcp = (simulate(d, "8k-8k", 64, 128) for d in (1, 8))
    # Usage admission starts every prompt on TP8 too, then preempts as the answers outgrow its KV (fewer
    # sequences decode at once, and recomputed prompts cost steps); DCP8's KV holds them all.
    assert tp["preemptions"] > 0 and dcp["preemptions"] == 0
    assert dcp["steady"]["output_tokens_per_s_per_gpu"] > 1.3 * tp["steady"]["output_tokens_per_s_per_gpu"]
