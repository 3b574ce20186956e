"""The service-level autoscaling policy on the simulation (the real admission queue, its latency window and ledger,
the scheduler, the policy and Serve's delays on simulated time): a load step that pushes p90 TTFT past its target
adds a replica in bounded time and TTFT comes back under it; no scale-down while the replicas left could not hold the
pool's KV; at most one scale event per cooldown."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dcpserve.deployments.autoscaling import SequenceAutoscalingPolicy, SloAutoscalingPolicy
from dcpserve.deployments.config import AutoscalingArgs
from dcpserve.simulator.build import build
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.trace import TraceRequest, expected_hash_ids

from .test_simulate_pools import DSV2_ON_H100, simulate_args
from .test_simulation import STEP_MODEL, assert_drained, shape, simulate_cli

TTFT_TARGET_S = 2.0
REPLICA_START_S = 10.0


def phases(*rates: tuple[float, float], input_tokens: int = 6000, output_tokens: int = 10) -> list[TraceRequest]:
    """Requests at an even rate in each (requests per second, seconds) phase, one after another, each its own
    prefix."""
    trace: list[TraceRequest] = []
    start = 0.0
    for rate, seconds in rates:
        for k in range(int(rate * seconds)):
            first = len(trace) * 1000
            trace.append(TraceRequest((start + k / rate) * 1000.0, input_tokens, output_tokens,
                                      tuple(range(first, first + expected_hash_ids(input_tokens)))))
        start += seconds
    return trace


@dataclass
class Decision:
    now: float
    target: int  # Serve's target before it
    decided: int
    state: dict[str, Any]  # the policy's inputs and decision
    pool_load: tuple[int, int, int]  # the queue's own AdmissionQueue.pool_load at that moment


@dataclass
class Watched:
    simulation: Simulation
    decisions: list[Decision] = field(default_factory=list)

    @property
    def events(self) -> list[Decision]:
        return [d for d in self.decisions if d.decided != d.target]


def watched(config: SimulationConfig) -> Watched:
    """A simulation whose autoscaler's every decision is kept, with the policy's state and the queue's pool load."""
    simulation = Simulation(config, STEP_MODEL)
    watch = Watched(simulation)
    autoscaler = simulation.scaling["default"].autoscaler
    decide = autoscaler.decide

    def keep(now: float, running: list[str], target: int) -> int:
        decided = decide(now, running, target)
        assert simulation.queue is not None
        watch.decisions.append(Decision(now, target, decided, dict(autoscaler.policy_state),
                                        simulation.queue.pool_load("default")))
        return decided

    autoscaler.decide = keep  # type: ignore[method-assign]  # the test watches every decision
    return watch


def p90_ttft(simulation: Simulation, start: float, end: float) -> float:
    """p90 (nearest rank) of the TTFT of the requests that arrived in [start, end)."""
    ttfts = sorted(r.first_token_at - r.arrival for r in simulation.recorder.records.values()
                   if start <= r.arrival < end and r.first_token_at is not None)
    return ttfts[math.ceil(0.9 * len(ttfts)) - 1]


def test_a_load_step_past_the_ttft_target_adds_one_replica_and_ttft_comes_back_under_it() -> None:
    """4 req/s of 6000-token prompts (half of one replica's prefill) for 30 s, then 12 req/s (1.5 times it) for
    50 s, then 4 req/s again. The step pushes p90 TTFT past 2 s; the TTFT signal (not the sequences or KV usage)
    adds one replica no later than slo_window_s + look_back_period_s + upscale_delay_s + metrics_interval_s +
    replica_start_s after the step; with two replicas TTFT comes back under target while the step's load lasts, and
    the scale-down comes after the cooldown, with the remaining KV able to hold the load."""
    step_at, step_ends = 30.0, 80.0
    trace = phases((4.0, step_at), (12.0, step_ends - step_at), (4.0, 70.0))
    scaling = AutoscalingArgs(
        min_replicas=1, max_replicas=3, target_sequences_per_replica=1000, upscale_delay_s=2.0,
        downscale_delay_s=10.0, look_back_period_s=2.0, ttft_target_s=TTFT_TARGET_S, slo_window_s=10.0,
        cooldown_s=40.0)
    config = SimulationConfig(shape(num_blocks=40000), num_replicas=3, autoscaling=scaling,
                              replica_start_s=REPLICA_START_S,
                              serve=ServeSettings(max_queued_requests=2000, queue_timeout_s=600.0))
    watch = watched(config)
    simulation = watch.simulation
    summary = simulation.run(trace)
    assert_drained(simulation, summary, trace)
    assert summary["finished"] == len(trace)

    assert p90_ttft(simulation, 0.0, step_at) < TTFT_TARGET_S  # one replica holds the light load
    assert p90_ttft(simulation, step_at, step_at + 20.0) > TTFT_TARGET_S  # the step pushes TTFT past its target
    up, down = watch.events[0], watch.events[-1]
    assert (up.target, up.decided, up.state["reason"]) == (1, 2, "ttft")
    assert up.state["ttft_s"] > TTFT_TARGET_S and up.state["kv_usage"] < scaling.kv_usage_scale_up
    added = next(t for t, count in summary["replicas_over_time"] if count == 2)
    assert added == up.now + REPLICA_START_S
    bound = (scaling.slo_window_s + scaling.look_back_period_s + scaling.upscale_delay_s
             + scaling.metrics_interval_s + REPLICA_START_S)
    assert added - step_at <= bound, (added, step_at, bound)
    # Two replicas bring TTFT back under target while the step's load goes on: the requests of its last 10 s, and
    # the policy's own window.
    assert p90_ttft(simulation, step_ends - 10.0, step_ends) < TTFT_TARGET_S
    assert any(d.state.get("ttft_s", math.inf) < TTFT_TARGET_S for d in watch.decisions if added < d.now < step_ends)
    # One replica more was enough: no second scale-up; then one scale-down once the load is light again.
    assert [(e.target, e.decided) for e in watch.events] == [(1, 2), (2, 1)]
    assert down.now > step_ends and down.state["reason"] == "down"
    for before, after in zip(watch.events, watch.events[1:], strict=False):
        assert after.now - before.now >= scaling.cooldown_s
    load, capacity, replicas = down.pool_load
    assert load <= (replicas - 1) / replicas * capacity * scaling.kv_usage_scale_up


def long_requests(num_blocks: int) -> Watched:
    """Two replicas of num_blocks each serving 20000-token prompts with 2000-token answers at 1 req/s for 60 s: six
    at a time, about 4200 blocks held, with TTFT (0.42 s) and the sequences far inside their targets."""
    trace = phases((1.0, 60.0), input_tokens=20000, output_tokens=2000)
    scaling = AutoscalingArgs(
        min_replicas=1, max_replicas=2, initial_replicas=2, target_sequences_per_replica=1000, upscale_delay_s=2.0,
        downscale_delay_s=5.0, look_back_period_s=2.0, ttft_target_s=TTFT_TARGET_S, slo_window_s=10.0,
        cooldown_s=20.0)
    config = SimulationConfig(shape(num_blocks=num_blocks), num_replicas=2, autoscaling=scaling,
                              replica_start_s=REPLICA_START_S,
                              serve=ServeSettings(max_queued_requests=2000, queue_timeout_s=600.0))
    watch = watched(config)
    summary = watch.simulation.run(trace)
    assert_drained(watch.simulation, summary, trace)
    assert summary["ttft_s"]["p90"] < 0.7 * TTFT_TARGET_S
    return watch


def test_no_scale_down_while_the_replicas_left_could_not_hold_the_kv() -> None:
    """Latencies and sequences well inside, but the pool holds ~4200 of its 2 x 3000 blocks: one replica could hold
    3000 x 0.85 = 2550, so the pool keeps both replicas all along. The same load on replicas of 6000 blocks (one
    holds 5100) loses one replica, after downscale_delay_s."""
    kept = long_requests(3000)
    assert not kept.events
    held = [d for d in kept.decisions if 10.0 <= d.now < 60.0]  # the load in full (it ends as the trace does)
    assert held and all(d.state["reason"] == "hold" for d in held), [d.state for d in held]
    for decision in held:  # the queue's own ledger says it too
        load, capacity, replicas = decision.pool_load
        assert replicas == 2 and load > (replicas - 1) / replicas * capacity * 0.85
    shrunk = long_requests(6000)
    assert [(e.target, e.decided, e.state["reason"]) for e in shrunk.events] == [(2, 1, "down")]
    load, capacity, replicas = shrunk.events[0].pool_load
    assert load <= (replicas - 1) / replicas * capacity * 0.85


def test_simulate_takes_the_targets_and_refuses_bad_ones_by_option() -> None:
    args = ("--trace", "chat", *DSV2_ON_H100, "--autoscale")
    simulation, _ = build(simulate_args(*args, "--ttft-target-s", "2", "--slo-window-s", "15", "--cooldown-s", "10"))
    scaling = simulation.config.autoscaling
    assert scaling is not None
    assert (scaling.ttft_target_s, scaling.itl_target_s, scaling.slo_window_s, scaling.cooldown_s) == (2, None, 15, 10)
    assert scaling.slo_percentile == AutoscalingArgs().slo_percentile
    assert isinstance(simulation.scaling["default"].autoscaler.policy, SloAutoscalingPolicy)
    plain, _ = build(simulate_args(*args))
    assert type(plain.scaling["default"].autoscaler.policy) is SequenceAutoscalingPolicy
    for extra, message in ((("--ttft-target-s", "0"), "--ttft-target-s: Input should be greater than 0"),
                           (("--itl-target-s", "0.05", "--slo-percentile", "2"),
                            "--slo-percentile: Input should be less than or equal to 1"),
                           (("--cooldown-s", "5"), "autoscaling.cooldown_s applies only with a latency target")):
        status, stdout, stderr = simulate_cli(*args, *extra)
        assert status == 1 and message in stderr and stdout == "", stderr
