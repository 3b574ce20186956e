"""The service-level autoscaling policy: its arithmetic (slo_decision) at each rule's boundary, the policy in Serve's
interface (aggregation, the cooldown on an injected clock, its state), the replica's stats, and its arguments."""

from __future__ import annotations

import dataclasses
import logging
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from ray.util import metrics as ray_metrics

from dcpserve.deployments.autoscaling import (
    GpuLedger,
    SequenceAutoscalingPolicy,
    SloAutoscalingPolicy,
    SloInputs,
    SloTargets,
    make_policy,
    policy_function,
    policy_kwargs,
    replica_stats,
    slo_decision,
)
from dcpserve.deployments.config import AutoscalingArgs, parse_args
from dcpserve.deployments.messages import SloReport
from dcpserve.engine.protocol import KvLedger

TARGETS = SloTargets(ttft_target_s=2.0, itl_target_s=0.05, target_sequences_per_replica=8.0, kv_usage_scale_up=0.85,
                     scale_down_fraction=0.7, cooldown_s=60.0)
# Two replicas, all well inside: 8 sequences (one replica's worth), latencies far under 0.7 x target, KV load 100 of
# the 2 x 1000 blocks (one replica left may hold 1/2 x 2000 x 0.85 = 850).
INSIDE = SloInputs(current_replicas=2, target_replicas=2, demand=8.0, kv_usage=0.1, ttft_s=0.5, itl_s=0.01,
                   kv_load_blocks=100.0, kv_capacity_blocks=2000.0, pool_replicas=2.0, since_scale_s=None)


def decide(targets: SloTargets = TARGETS, base: SloInputs = INSIDE, **changes: Any) -> tuple[int, str]:
    decision = slo_decision(dataclasses.replace(base, **changes), targets)
    return decision.desired, decision.reason


def test_any_signal_past_its_target_adds_a_replica() -> None:
    assert decide() == (1, "down")
    assert decide(ttft_s=2.0) == (2, "hold")  # at the target is not past it (and not inside the band either)
    assert decide(ttft_s=2.001) == (3, "ttft")
    assert decide(itl_s=0.05) == (2, "hold")
    assert decide(itl_s=0.051) == (3, "itl")
    assert decide(demand=16.0) == (2, "hold")  # two replicas' worth: held, not removed
    assert decide(demand=16.5) == (3, "sequences")
    assert decide(kv_usage=0.86) == (3, "kv_usage")
    assert decide(ttft_s=3.0, demand=40.0) == (5, "ttft")  # the sequence rule asks for more than +1
    # A replica already starting (Serve's target 3, 2 running) is the +1: nothing more is asked.
    assert decide(ttft_s=3.0, target_replicas=3) == (3, "ttft")
    # A target that is not set is no signal; a latency without samples never counts as past.
    assert decide(dataclasses.replace(TARGETS, itl_target_s=None), itl_s=9.0) == (1, "down")
    assert decide(ttft_s=None, itl_s=None) == (1, "down")


def test_no_scale_down_while_the_replicas_left_could_not_hold_the_kv() -> None:
    # Four replicas of 1000 blocks: three left hold 3/4 x 4000 x 0.85 = 2550 blocks at the scale-up usage.
    four = dataclasses.replace(INSIDE, current_replicas=4, target_replicas=4, kv_capacity_blocks=4000.0,
                               pool_replicas=4.0)
    assert decide(base=four, kv_load_blocks=2550.0) == (3, "down")
    assert decide(base=four, kv_load_blocks=2551.0) == (4, "hold")
    assert slo_decision(four, TARGETS).kv_remaining_blocks == pytest.approx(2550.0)
    assert decide(kv_load_blocks=None) == (2, "hold")  # no KV report yet: never down


def test_scale_down_needs_every_signal_well_inside() -> None:
    assert decide(ttft_s=1.4) == (1, "down")  # 0.7 x 2.0
    assert decide(ttft_s=1.41) == (2, "hold")  # inside the target but in the band
    assert decide(itl_s=0.036) == (2, "hold")  # 0.7 x 0.05 = 0.035
    assert decide(demand=8.01) == (2, "hold")  # one replica would be past target_sequences_per_replica
    assert decide(target_replicas=3) == (3, "hold")  # a replica still starting is not taken back
    assert decide(current_replicas=2, target_replicas=1) == (1, "hold")  # one stopping: nothing more


def test_cooldown_suppresses_a_second_event() -> None:
    assert decide(ttft_s=3.0, since_scale_s=59.9) == (2, "cooldown")
    assert decide(since_scale_s=59.9) == (2, "cooldown")
    assert slo_decision(dataclasses.replace(INSIDE, since_scale_s=59.9), TARGETS).wanted == 1
    assert decide(ttft_s=3.0, since_scale_s=60.0) == (3, "ttft")
    assert decide(since_scale_s=60.0) == (1, "down")
    assert decide(since_scale_s=0.0) == (2, "cooldown")
    assert decide(ttft_s=1.8, since_scale_s=1.0) == (2, "hold")  # no event wanted: the cooldown changes nothing


def ctx(target: int, current: int, ttft_s: float | None, load: float = 100.0, itl_s: float | None = 0.01,
        sequences: float = 1.0) -> Any:
    replicas = [f"r{i}" for i in range(current)]
    metrics: dict[str, dict[str, float]] = {
        "sequences": {r: sequences for r in replicas}, "kv_usage": {r: 0.1 for r in replicas},
        "admission_queued": {r: 0.0 for r in replicas}, "kv_load_blocks": {r: load for r in replicas},
        "kv_capacity_blocks": {r: 1000.0 * current for r in replicas},
        "pool_replicas": {r: float(current) for r in replicas}}
    if ttft_s is not None:
        metrics["ttft_s"] = {r: ttft_s for r in replicas}
    if itl_s is not None:
        metrics["itl_s"] = {r: itl_s for r in replicas}
    return types.SimpleNamespace(
        app_name="dcpserve", deployment_name="EngineReplica", current_num_replicas=current,
        target_num_replicas=target, running_replicas=replicas, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8, aggregated_metrics=metrics)


def run_closed_loop(scale_down_fraction: float, seconds: int = 600) -> list[tuple[float, int]]:
    """The policy against a pool whose TTFT is load / replicas (2.2 s at 2 replicas, 1.47 s at 3: inside the 2 s
    target, above 0.7 x target), Serve applying each decision at once; returns the scale events (time, replicas)."""
    now = [0.0]
    policy = SloAutoscalingPolicy(ttft_target_s=2.0, scale_down_fraction=scale_down_fraction, cooldown_s=60.0,
                                  ledger=GpuLedger(), clock=lambda: now[0])
    replicas, events = 2, []
    for second in range(seconds):
        now[0] = float(second)
        desired, _ = policy(ctx(replicas, replicas, ttft_s=4.4 / replicas))
        if desired != replicas:
            replicas = desired
            events.append((now[0], replicas))
    return events


def test_hysteresis_keeps_a_latency_near_its_target_from_flapping() -> None:
    assert run_closed_loop(scale_down_fraction=0.7) == [(0.0, 3)]  # up once, then 1.47 s sits in the band
    # Without the band (down below 0.75 x target), the same pool flaps: down to 2, past target, up to 3, ...
    flapping = run_closed_loop(scale_down_fraction=0.75)
    assert [count for _, count in flapping[:4]] == [3, 2, 3, 2]
    # ... and even then at most one event per cooldown (the policy sees Serve's target change one call later).
    gaps = [b - a for (a, _), (b, _) in zip(flapping, flapping[1:], strict=False)]
    assert gaps and min(gaps) >= 60.0 + 1.0


def test_the_policy_reads_the_stats_and_returns_its_inputs_and_decision() -> None:
    now = [100.0]
    policy = SloAutoscalingPolicy(ttft_target_s=2.0, itl_target_s=0.05, cooldown_s=30.0, ledger=GpuLedger(),
                                  clock=lambda: now[0])
    desired, state = policy(ctx(2, 2, ttft_s=2.5))
    assert desired == 3
    assert state["reason"] == "ttft" and state["ttft_s"] == 2.5 and state["since_scale_s"] is None
    assert set(state) == {
        "current_replicas", "target_replicas", "demand", "kv_usage", "ttft_s", "itl_s", "kv_load_blocks",
        "kv_capacity_blocks", "pool_replicas", "since_scale_s", "desired", "wanted", "reason", "sequence_replicas",
        "kv_remaining_blocks"}
    now[0] = 101.0  # Serve took the decision: its target is 3, the new replica is starting (it is the +1)
    desired, state = policy(ctx(3, 2, ttft_s=2.5))
    assert (desired, state["reason"], state["since_scale_s"]) == (3, "ttft", 0.0)
    now[0] = 110.0
    desired, state = policy(ctx(3, 3, ttft_s=2.5))  # started, the window still past target: the cooldown holds
    assert (desired, state["reason"], state["wanted"], state["since_scale_s"]) == (3, "cooldown", 4, 9.0)
    now[0] = 131.0
    assert policy(ctx(3, 3, ttft_s=None, itl_s=None))[1]["reason"] == "down"  # nothing finished in the window
    # The replica whose answer leaves the least room decides: one of three reports 2000 blocks held of 3000.
    context = ctx(3, 3, ttft_s=0.1)
    context.aggregated_metrics["kv_load_blocks"]["r1"] = 2000.0
    desired, state = policy(context)
    assert (desired, state["reason"], state["kv_load_blocks"]) == (3, "hold", 2000.0)
    # Stats of a replica no longer running are not read; without any stats the target is kept.
    assert policy(ctx(3, 0, ttft_s=9.0)) == (3, {})


Recorded = dict[str, list[tuple[float, dict[str, str]]]]  # metric name -> (value, tags) in the order recorded


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    """Every value the policy's metrics hand Ray, with the tags Ray would export it with (Metric._record captured,
    as tests/deployments/test_metrics.py does: default tags merged with the call's, every tag key checked)."""
    values: Recorded = defaultdict(list)

    def capture(self: ray_metrics.Metric, value: float, tags: dict[str, str] | None = None) -> None:
        final = self._get_final_tags(tags)
        self._validate_tags(final)
        values[self._name].append((value, dict(final)))

    monkeypatch.setattr(ray_metrics.Metric, "_record", capture)
    return values


def by_label(recorded: Recorded, name: str, label: str) -> dict[str, float]:
    """A gauge's last value for each value of `label`, checking every record names the test's deployment."""
    deployment = {"application": "dcpserve", "deployment": "EngineReplica"}
    assert all(tags.items() >= deployment.items() for _, tags in recorded[name]), recorded[name]
    return {tags[label]: value for value, tags in recorded[name]}


def test_the_policy_exports_its_inputs_replica_counts_and_reason_at_each_decision(recorded: Recorded) -> None:
    now = [100.0]
    policy = SloAutoscalingPolicy(ttft_target_s=2.0, itl_target_s=0.05, cooldown_s=30.0, ledger=GpuLedger(),
                                  clock=lambda: now[0])
    assert not recorded  # built without recording (the simulator's policies, these tests')
    desired, state = policy(ctx(2, 2, ttft_s=2.5))
    assert desired == 3 and state["reason"] == "ttft"
    assert by_label(recorded, "dcpserve_autoscaling_slo_input", "input") == pytest.approx({
        "ttft_s": 2.5, "itl_s": 0.01, "demand": 2.0, "kv_usage": 0.1, "kv_load_blocks": 100.0,
        "kv_capacity_blocks": 2000.0, "kv_remaining_blocks": 850.0})  # 1/2 x 2000 x 0.85
    assert by_label(recorded, "dcpserve_autoscaling_slo_replicas", "replicas") == {
        "current": 2, "target": 2, "sequences": 1, "wanted": 3, "desired": 3}
    assert recorded["dcpserve_autoscaling_slo_decisions"] == [
        (1.0, {"application": "dcpserve", "deployment": "EngineReplica", "reason": "ttft"})]
    # Serve took it (target 3); nothing finished in the window and no replica has the queue's KV answer: those inputs
    # are not exported (never a 0), the decision is counted under its own reason.
    recorded.clear()
    now[0] = 101.0
    context = ctx(3, 3, ttft_s=None, itl_s=None)
    del context.aggregated_metrics["kv_load_blocks"]
    desired, state = policy(context)
    assert (desired, state["reason"]) == (3, "hold")
    assert by_label(recorded, "dcpserve_autoscaling_slo_input", "input") == pytest.approx({
        "demand": 3.0, "kv_usage": 0.1})
    assert by_label(recorded, "dcpserve_autoscaling_slo_replicas", "replicas")["desired"] == 3
    assert [tags["reason"] for _, tags in recorded["dcpserve_autoscaling_slo_decisions"]] == ["hold"]
    # Without any replica's stats the policy decides nothing: nothing recorded.
    recorded.clear()
    assert policy(ctx(3, 0, ttft_s=9.0)) == (3, {})
    assert not recorded


def test_a_failure_to_record_is_logged_and_never_stops_the_decision(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    def fail(self: ray_metrics.Metric, value: float, tags: dict[str, str] | None = None) -> None:
        raise RuntimeError("no metrics agent")

    monkeypatch.setattr(ray_metrics.Metric, "_record", fail)
    policy = SloAutoscalingPolicy(ttft_target_s=2.0, ledger=GpuLedger(), clock=lambda: 0.0)
    with caplog.at_level(logging.DEBUG, logger="ray.serve"):
        assert policy(ctx(2, 2, ttft_s=2.5))[0] == 3
        assert policy(ctx(2, 2, ttft_s=0.1))[0] == 1  # Serve's target did not move (no cooldown): well inside
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not record its metrics" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None and "no metrics agent" in str(warnings[0].exc_info[1])
    # The next failures are logged too, at debug (the controller calls the policy several times a second).
    assert [r.levelno for r in caplog.records if "could not record" in r.getMessage()] == [
        logging.WARNING, logging.DEBUG]


def test_replica_stats_leave_out_a_latency_without_samples() -> None:
    ledger = KvLedger("usage", capacity_blocks=100, tokens_per_block=16, used_blocks=10, committed_blocks=20,
                      headroom_blocks=5, per_request={"a": 20})
    assert set(replica_stats(ledger, 1, 0, 3)) == {"sequences", "kv_usage", "admission_queued"}
    report = SloReport(None, 0.02, 40, 200, 2)
    stats = replica_stats(ledger, 1, 0, 3, report)
    assert "ttft_s" not in stats  # never a 0 s that Serve would average into the window
    assert stats["itl_s"] == 0.02 and stats["kv_load_blocks"] == 40.0 and stats["pool_replicas"] == 2.0
    assert all(isinstance(value, float) for value in stats.values())


def test_a_kv_report_is_answered_with_its_pools_latencies_only_when_it_asks() -> None:
    """KvAdmission.report: the queue's length and prefix position always; the pool's SloReport (its latencies at the
    percentile over the window, and its KV load) only for a report with slo_window_s (a replica with a target)."""
    import asyncio

    from dcpserve.deployments.admission.kv_admission import KvAdmission
    from dcpserve.deployments.messages import KvReport, KvReportReply

    async def scenario() -> tuple[KvReportReply, KvReportReply]:
        admission = KvAdmission.func_or_class(max_queued=4)  # type: ignore[attr-defined]  # mypy ignores class decorators: @serve.deployment made it a Deployment
        try:
            plain = await admission.report(KvReport(replica_id="r", capacity=200, tokens_per_block=16,
                                                    held={"a": 40}, probes=1))
            asking = await admission.report(KvReport(replica_id="r", capacity=200, tokens_per_block=16,
                                                     held={"a": 40}, probes=1, slo_window_s=60.0))
        finally:
            admission._expiry.cancel()
        return plain, asking

    plain, asking = asyncio.run(scenario())
    assert plain.slo is None and plain.num_queued == 0 and plain.prefix_version == 0
    assert asking.slo == SloReport(None, None, 40, 200, 1)  # no request of the pool finished: no latency


def test_the_policy_is_chosen_by_the_targets() -> None:
    plain = AutoscalingArgs()
    assert policy_function(plain) == "dcpserve.deployments.autoscaling:SequenceAutoscalingPolicy"
    assert policy_kwargs(plain, None, 2) == {"target_sequences_per_replica": 8.0, "kv_usage_scale_up": 0.85,
                                             "gpu_budget": None, "tensor_parallel_size": 2}
    slo = AutoscalingArgs(itl_target_s=0.04, cooldown_s=10.0)
    assert policy_function(slo) == "dcpserve.deployments.autoscaling:SloAutoscalingPolicy"
    kwargs = policy_kwargs(slo, 8, 2)
    assert kwargs["itl_target_s"] == 0.04 and kwargs["ttft_target_s"] is None and kwargs["cooldown_s"] == 10.0
    assert kwargs["scale_down_fraction"] == 0.7
    assert type(make_policy(plain, None, 1, GpuLedger(), float)) is SequenceAutoscalingPolicy
    assert isinstance(make_policy(slo, None, 1, GpuLedger(), float), SloAutoscalingPolicy)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("ttft_target_s", 0, "autoscaling.ttft_target_s: Input should be greater than 0"),
    ("itl_target_s", -0.1, "autoscaling.itl_target_s: Input should be greater than 0"),
    ("slo_percentile", 0, "autoscaling.slo_percentile: Input should be greater than 0"),
    ("slo_percentile", 1.5, "autoscaling.slo_percentile: Input should be less than or equal to 1"),
    ("slo_window_s", 0, "autoscaling.slo_window_s: Input should be greater than 0"),
    ("scale_down_fraction", 1.0, "autoscaling.scale_down_fraction: Input should be less than 1"),
    ("scale_down_fraction", 0, "autoscaling.scale_down_fraction: Input should be greater than 0"),
    ("cooldown_s", -1, "autoscaling.cooldown_s: Input should be greater than or equal to 0"),
])
def test_bad_service_level_args_are_refused_by_name(tmp_path: Path, field: str, value: float, message: str) -> None:
    target = {} if field.endswith("target_s") else {"ttft_target_s": 2.0}
    with pytest.raises(ValueError, match=message):
        parse_args({"model": str(tmp_path), "autoscaling": {**target, field: value}})


def test_service_level_knobs_without_a_target_are_refused() -> None:
    with pytest.raises(ValidationError, match="autoscaling.cooldown_s applies only with a latency target"):
        AutoscalingArgs(cooldown_s=10.0)
    with pytest.raises(ValidationError, match="leave out slo_percentile, slo_window_s"):
        AutoscalingArgs(slo_window_s=10.0, slo_percentile=0.5)
    assert not AutoscalingArgs().slo_targets and AutoscalingArgs(ttft_target_s=1.0).slo_targets


def test_the_policy_refuses_bad_arguments_by_name() -> None:
    with pytest.raises(ValueError, match="ttft_target_s must be > 0, got 0"):
        SloAutoscalingPolicy(ttft_target_s=0)
    with pytest.raises(ValueError, match="needs ttft_target_s or itl_target_s"):
        SloAutoscalingPolicy()
    with pytest.raises(ValueError, match=r"scale_down_fraction must be in \(0, 1\), got 1"):
        SloAutoscalingPolicy(itl_target_s=0.1, scale_down_fraction=1)
    with pytest.raises(ValueError, match="cooldown_s must be >= 0, got -1"):
        SloAutoscalingPolicy(itl_target_s=0.1, cooldown_s=-1)
