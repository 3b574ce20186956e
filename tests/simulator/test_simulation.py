"""The simulation end to end, on the real admission queue, scheduler, block manager and autoscaling policy: what must
hold whatever the load (every request answered, every token delivered, no KV held after the drain), the mechanisms
(admission policies, prefix routing, queue bounds, autoscaling up and down), and determinism."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dcpserve.cli import main
from dcpserve.deployments.config import AutoscalingArgs
from dcpserve.engine.config import SchedulerConfig
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.step_fit import LinearStepModel
from dcpserve.simulator.synth import PRESETS, generate
from dcpserve.simulator.trace import TraceRequest, expected_hash_ids

ROOT = Path(__file__).resolve().parents[2]
# 2 ms a step, 20 us a token, 1 ns a context token: a small GPU-like replica.
STEP_MODEL = LinearStepModel(c0=2e-3, c_tok=20e-6, c_seq=0.0, c_ctx=1e-9, c_pair=0.0)


def shape(num_blocks: int = 400, admission: str = "usage", dcp: int = 2, max_num_seqs: int = 64,
          prefix_caching: bool = True) -> ReplicaShape:
    scheduler = SchedulerConfig(max_model_len=32768, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                admission=admission)  # type: ignore[arg-type]  # "usage" | "full" from the tests
    return ReplicaShape(tp=2, dcp=dcp, num_blocks=num_blocks, block_size=16, scheduler=scheduler,
                        enable_prefix_caching=prefix_caching)


def single_turn(count: int, gap_ms: float, seed: int = 0, input_tokens: int = 1500,
                output_tokens: int = 200) -> list[TraceRequest]:
    """count requests gap_ms apart, lengths varying around the given ones, each with a prefix of its own."""
    requests = []
    for index in range(count):
        length = input_tokens + (index * 7919 + seed) % input_tokens
        ids = tuple(range(index * 1000, index * 1000 + expected_hash_ids(length)))
        requests.append(TraceRequest(index * gap_ms, length, output_tokens + (index * 31) % output_tokens, ids))
    return requests


def run(config: SimulationConfig, trace: list[TraceRequest]) -> tuple[Simulation, dict[str, Any]]:
    simulation = Simulation(config, STEP_MODEL)
    return simulation, simulation.run(trace)


def assert_drained(simulation: Simulation, summary: dict[str, Any], trace: list[TraceRequest]) -> None:
    """Every request answered, every finished one got exactly its trace's tokens, nothing held anywhere."""
    assert summary["requests"] == len(trace)
    assert summary["finished"] + sum(summary["refused"].values()) == len(trace)
    records = simulation.recorder.records
    assert all(r.outcome != "pending" for r in records.values())
    by_ticket = {f"t{i}": request for i, request in enumerate(trace)}  # open loop: tickets in trace order
    for ticket, record in records.items():
        if record.outcome == "finished" and ticket in by_ticket:
            assert record.num_output_tokens == by_ticket[ticket].output_length, ticket
    assert summary["output_tokens"] == sum(r.num_output_tokens for r in records.values())
    assert simulation.recorder.sequences == 0
    for replica in simulation.replicas.values():
        usage = replica.block_manager.usage()
        assert usage.used == 0 and usage.reserved == 0, replica.replica_id
        assert not replica.scheduler.requests
    assert simulation.queue is not None and simulation.queue.num_queued == 0
    assert not any(r.grants for r in simulation.queue.replicas.values())


def test_a_burst_far_past_the_kv_is_served_or_refused_with_a_reason() -> None:
    """400 requests in 2 s onto two replicas that hold ~10 of them at once: every one is answered (tokens or a
    refusal naming its reason), the refusals are the queue's own (full, timeout), and the KV drains to zero."""
    trace = single_turn(400, gap_ms=5.0)
    config = SimulationConfig(shape(), num_replicas=2, serve=ServeSettings(max_queued_requests=64, queue_timeout_s=5.0))
    simulation, summary = run(config, trace)
    assert_drained(simulation, summary, trace)
    assert summary["finished"] > 50
    assert set(summary["refused"]) <= {"queue_full", "queue_timeout"}
    assert summary["refused"].get("queue_full", 0) > 0 and summary["refused"].get("queue_timeout", 0) > 0
    assert summary["peak_concurrent_sequences"] <= 2 * 64
    # Open loop: the steady window ends when the last request arrives.
    assert summary["steady"]["window_s"] == pytest.approx(399 * 0.005)
    assert 0 < summary["steady"]["output_tokens"] < summary["output_tokens"]


def test_usage_admission_runs_more_sequences_than_full_and_preempts_losslessly() -> None:
    trace = single_turn(60, gap_ms=1.0, input_tokens=600, output_tokens=400)
    results = {}
    for admission in ("usage", "full"):
        config = SimulationConfig(shape(num_blocks=120, admission=admission), num_replicas=1,
                                  serve=ServeSettings(max_queued_requests=100, queue_timeout_s=600.0))
        simulation, summary = run(config, trace)
        assert_drained(simulation, summary, trace)
        assert summary["finished"] == len(trace)  # nothing refused: the queue is long and patient enough
        results[admission] = summary
    assert results["usage"]["peak_concurrent_sequences"] > results["full"]["peak_concurrent_sequences"]
    assert results["full"]["preemptions"] == 0
    assert results["usage"]["preemptions"] > 0  # decode growth ran out of KV; every request still got its tokens


def returns_to_its_replica(simulation: Simulation) -> float:
    """Of the later turns of sessions, the share served by the replica that served the session's previous turn."""
    last: dict[str, str] = {}
    returned = later = 0
    for record in simulation.recorder.records.values():  # in sending order: a session's turns in turn order
        if record.session_id is None or record.replica_id is None:
            continue
        if record.session_id in last:
            later += 1
            returned += last[record.session_id] == record.replica_id
        last[record.session_id] = record.replica_id
    return returned / later


def test_prefix_routing_sends_a_session_back_to_its_replica() -> None:
    """Multi-turn sessions on four replicas: with prefix routing nearly every later turn goes back to the replica
    holding its history and more prompt tokens are cache hits; granting by free KV alone scatters the turns."""
    trace = generate(PRESETS["agentic"], 300, seed=3)
    trace = [r for r in trace if r.input_length <= 30000]
    results = {}
    for routing in (True, False):
        config = SimulationConfig(shape(num_blocks=3000, dcp=1), num_replicas=4, concurrency=16,
                                  serve=ServeSettings(prefix_routing=routing, max_queued_requests=100))
        simulation, summary = run(config, trace)
        assert summary["finished"] + sum(summary["refused"].values()) == len(trace)
        assert summary["steady"] is None  # fewer sessions than clients: no window in which every client had work
        results[routing] = (returns_to_its_replica(simulation), summary["prefix_hit_rate"])
    assert results[True][0] > 0.75
    assert results[False][0] < results[True][0] - 0.2
    assert results[True][1] > results[False][1]


def test_autoscaling_follows_a_burst_up_and_back_down() -> None:
    """The app's policy with Serve's delays on simulated time: a burst raises the replicas to the GPUs' limit after
    upscale_delay_s + replica_start_s; when the traffic is gone they come back to min_replicas after
    downscale_delay_s, each drained before it stops."""
    trace = single_turn(300, gap_ms=20.0) + [TraceRequest(300_000.0, 1000, 10, tuple(range(10**6, 10**6 + 2)))]
    scaling = AutoscalingArgs(min_replicas=1, max_replicas=4, target_sequences_per_replica=4, upscale_delay_s=5.0,
                              downscale_delay_s=30.0)
    config = SimulationConfig(shape(), num_replicas=4, autoscaling=scaling, replica_start_s=20.0,
                              serve=ServeSettings(max_queued_requests=400, queue_timeout_s=120.0))
    simulation, summary = run(config, trace)
    assert_drained(simulation, summary, trace)
    counts = [count for _, count in summary["replicas_over_time"]]
    assert counts[0] == 1 and max(counts) == 4 and counts[-1] == 1
    first_up = next(t for t, count in summary["replicas_over_time"] if count > 1)
    assert first_up >= 5.0 + 20.0  # the delay held, then the replica started
    # GPU time counts what ran: less than 4 replicas all along, more than 1.
    duration = summary["duration_s"]
    assert 2 * duration < summary["gpu_seconds"] < 4 * 2 * duration


def test_the_same_seed_gives_the_same_summary_bit_for_bit(tmp_path: Path) -> None:
    """Two runs of the CLI in processes with different string-hash seeds write identical summary.json files. The
    two run at once (each is one core's work): as a test that ends the tier's last worker, it took twice as long."""
    model = tmp_path / "model"
    model.mkdir()
    from dcpserve.cluster.published_models import DEEPSEEK_V2_LITE

    (model / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    runs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"out{hash_seed}"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        process = subprocess.Popen(
            [sys.executable, "-m", "dcpserve.cli", "simulate", "--trace", "chat", "--requests", "200", "--seed", "5",
             "--model", str(model), "--gpu", "h100", "--gpus-per-node", "2", "--layout", "tp=2,dcp=2",
             "--concurrency", "32", "--quiet", "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        runs.append((process, out))
    outputs = []
    try:
        for process, out in runs:
            _, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, stderr
            outputs.append((out / "summary.json").read_bytes())
    finally:
        for process, _ in runs:
            process.kill()
            process.wait()
    assert outputs[0] == outputs[1]
    summary = json.loads(outputs[0])
    assert summary["finished"] > 0 and summary["output_tokens_per_s_per_gpu"] > 0


def simulate_cli(*args: str) -> tuple[int, str, str]:
    """dcpserve simulate in this process: (status, stdout, stderr); a SystemExit message is the stderr line."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(["simulate", "--quiet", *args])
        except SystemExit as exit_:
            status = 1 if isinstance(exit_.code, str) else (exit_.code or 0)
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
    return status, out.getvalue(), err.getvalue()


def test_bad_input_stops_before_simulating_with_the_reason(tmp_path: Path) -> None:
    """A trace line that is not JSON (its line number), a layout the model cannot take (the planner's rule), weights
    that do not fit the GPU (the numbers): each ends the command with status 1 and one clear line, nothing run."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]\n')
    cases = [
        (["--trace", str(trace), "--model", "deepseek-v2-lite", "--gpu", "h100", "--layout", "tp=8"],
         f"{trace}:2"),
        (["--trace", "chat", "--model", "deepseek-v2-lite", "--layout", "tp=8,dcp=3"], "dcp"),
        (["--trace", "chat", "--model", "kimi-k2", "--gpu", "h100", "--layout", "tp=2"], "GiB per rank"),
        (["--trace", "nonsense", "--model", "deepseek-v2-lite"], "no preset"),
        (["--trace", "chat", "--model", "no-such-model"], "published config"),
        (["--trace", "chat", "--model", "kimi-k2", "--layout", "tp=eight"], "tp=T,dcp=D"),
    ]
    for args, fragment in cases:
        status, stdout, stderr = simulate_cli(*args)
        assert status != 0, args
        assert fragment in stderr, (args, stderr[-2000:])
        assert stdout == "", args


def test_a_layout_sweep_runs_every_valid_layout_and_marks_the_frontier(tmp_path: Path) -> None:
    """DeepSeek-V2-Lite on two H100s: tp=1, tp=2 and tp=2 x dcp=2 each run (one row each, a summary.json each); the
    frontier is the rows no other row beats on both tok/s per GPU and ITL p50, and sweep.json says which."""
    status, stdout, stderr = simulate_cli(
        "--trace", "8k-1k", "--requests", "48", "--model", "deepseek-v2-lite", "--gpu", "h100", "--gpus-per-node", "2",
        "--concurrency", "16", "--sweep", "layouts", "--out", str(tmp_path))
    assert status == 0, stderr
    rows = [line for line in stdout.splitlines() if line.startswith("tp=")]
    assert [row.split()[0] + " " + row.split()[1] for row in rows] == ["tp=1 dcp=1", "tp=2 dcp=1", "tp=2 dcp=2"]
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    points = {p["point"]: p for p in sweep["points"]}
    assert set(points) == {"tp=1 dcp=1", "tp=2 dcp=1", "tp=2 dcp=2"}
    on_frontier = [p for p in points.values() if p["frontier"]]
    assert on_frontier and sum(row.endswith("*") for row in rows) == len(on_frontier)
    for point in on_frontier:  # nothing beats a frontier point on both
        assert not any(o["output_tokens_per_s_per_gpu"] > point["output_tokens_per_s_per_gpu"]
                       and o["itl_p50_s"] < point["itl_p50_s"] for o in points.values())
    for label in points:
        summary = json.loads((tmp_path / label.replace("=", "").replace(" ", "_") / "summary.json").read_text())
        assert summary["setup"]["layout"] == label
    status, _, stderr = simulate_cli("--trace", "chat", "--model", "deepseek-v2-lite", "--sweep", "concurrency=a")
    assert status != 0 and "concurrency=64,128,256" in stderr


def test_admission_counts_match_the_records_and_request_latency_delays_each_ttft() -> None:
    """The queue's decisions, as the app's metrics count them, agree with what each request went through; a request
    latency adds exactly itself to every TTFT when the load is light enough that nothing waits."""
    trace = single_turn(120, gap_ms=5.0)
    config = SimulationConfig(shape(num_blocks=300), num_replicas=1,
                              serve=ServeSettings(max_queued_requests=20, queue_timeout_s=3.0))
    simulation, summary = run(config, trace)
    assert_drained(simulation, summary, trace)
    admission = summary["admission"]
    assert admission["admitted"] == summary["finished"]  # nothing refused after its grant in this run
    assert admission.get("rejected_queue_full", 0) == summary["refused"].get("queue_full", 0) > 0
    assert admission.get("rejected_timeout", 0) == summary["refused"].get("queue_timeout", 0)
    assert admission["queued"] > 0 and summary["queue_wait_mean_s"] > 0
    assert 0 < summary["peak_granted_sequences"] <= summary["peak_concurrent_sequences"] + admission.get(
        "refused_by_replica", 0)
    assert summary["steps"] > 0 and summary["step_mean_s"] > 0
    finished = [r for r in simulation.recorder.records.values() if r.outcome == "finished"]
    waited = [r for r in finished if r.admitted_at is not None and r.admitted_at > r.arrival]
    for r in finished:
        assert r.admitted_at is not None and r.first_token_at is not None
        assert r.arrival <= r.admitted_at <= r.first_token_at
    assert 0 < len(waited) < len(finished)  # some were granted on arrival, some after a wait

    light = single_turn(5, gap_ms=10_000.0)
    _, base = run(SimulationConfig(shape(), num_replicas=1), light)
    _, delayed = run(SimulationConfig(shape(), num_replicas=1, request_latency_s=0.25), light)
    assert base["admission"] == {"admitted": 5} == delayed["admission"]
    for q in ("p50", "p90", "p99"):
        assert delayed["ttft_s"][q] == pytest.approx(base["ttft_s"][q] + 0.25, abs=1e-9)
    with pytest.raises(ValueError, match="request_latency_s must be >= 0"):
        SimulationConfig(shape(), num_replicas=1, request_latency_s=-1.0)


def test_a_pooled_app_sends_long_requests_only_where_they_fit_and_loses_nothing() -> None:
    """Two pools behind one queue: short (dcp=1, 16-token blocks, 150 blocks: at most 2,400 tokens) and long
    (dcp=2, 32-token blocks, 400 blocks), the short one faster. Requests of ~1,350-2,700 tokens in all: those past
    the short pool's capacity go to the long pool only; the others fill the faster pool first and overflow."""
    from dcpserve.simulator.run import SimPool

    trace = single_turn(60, gap_ms=50.0, input_tokens=1200, output_tokens=150)
    totals = [r.input_length + r.output_length for r in trace]
    assert min(totals) < 2400 < max(totals)  # both kinds in the trace
    short = SimPool("short", shape(num_blocks=150, dcp=1), 1, STEP_MODEL)
    long = SimPool("long", shape(num_blocks=400, dcp=2), 1, STEP_MODEL.scaled(1.5))
    config = SimulationConfig(short.shape, 1, serve=ServeSettings(max_queued_requests=100, queue_timeout_s=600.0),
                              pools=(short, long))
    simulation, summary = run(config, trace)
    assert_drained(simulation, summary, trace)
    assert summary["finished"] == len(trace)
    grants = summary["pool_grants"]
    assert sum(grants.values()) == summary["admission"]["admitted"]  # re-grants after a refusal too
    assert grants.get("long/only_pool", 0) > 0  # the longest fit the long pool only
    assert "short/only_pool" not in grants  # every request the short pool holds, the long one holds too
    assert sum(n for key, n in grants.items() if key.startswith("short/")) > 0
    by_replica = {r.replica_id: r for r in simulation.replicas.values()}
    lengths = {f"t{i}": r.input_length + r.output_length for i, r in enumerate(trace)}
    for ticket, record in simulation.recorder.records.items():
        assert record.replica_id is not None
        if lengths[ticket] > 2400:  # past what the short pool's KV holds: the long pool, whatever the load
            assert by_replica[record.replica_id].pool == "long", record
    with pytest.raises(ValueError, match=r"with layout pools, autoscaling is each pool's \(SimPool.autoscaling\)"):
        SimulationConfig(short.shape, 1, autoscaling=AutoscalingArgs(), pools=(short, long))


def test_pools_autoscale_within_one_gpu_budget() -> None:
    """Two pools of tp=2, each allowed 1-3 replicas, under a budget of 8 GPUs (4 replicas in all): a burst far past
    both pools' KV makes both want 3; at no moment do their replicas hold more than 8 GPUs, and every request is
    still answered."""
    from dcpserve.simulator.run import SimPool

    scaling = AutoscalingArgs(min_replicas=1, max_replicas=3, target_sequences_per_replica=2.0,
                              upscale_delay_s=1.0, downscale_delay_s=5.0, look_back_period_s=2.0)
    short = SimPool("short", shape(num_blocks=150, dcp=1), 3, STEP_MODEL, autoscaling=scaling)
    long = SimPool("long", shape(num_blocks=400, dcp=2), 3, STEP_MODEL, autoscaling=scaling)
    trace = single_turn(200, gap_ms=20.0, input_tokens=1200, output_tokens=150)
    config = SimulationConfig(short.shape, 1, serve=ServeSettings(max_queued_requests=500, queue_timeout_s=600.0),
                              pools=(short, long), gpu_budget=8, replica_start_s=2.0)
    simulation = Simulation(config, STEP_MODEL)
    peak = [0]
    record_gpus = simulation.recorder.gpus_changed

    def watch(now: float, gpus: int) -> None:
        peak[0] = max(peak[0], gpus)
        record_gpus(now, gpus)

    simulation.recorder.gpus_changed = watch  # type: ignore[method-assign]  # the test watches every change
    summary = simulation.run(trace)
    assert_drained(simulation, summary, trace)
    assert summary["finished"] == len(trace)
    assert 4 < peak[0] <= 8  # both pools grew past their one replica each, and never past the budget
