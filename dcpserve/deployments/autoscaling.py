"""Custom Serve autoscaling policies: replicas by concurrent sequences, earlier when KV fills up; and, with latency
targets, by the app's own service levels.

`SequenceAutoscalingPolicy` (no latency target set):
desired = ceil((sum over replicas of their sequences + requests waiting in the admission queue)
               / target_sequences_per_replica)
and, while the mean KV usage (held / capacity) is above kv_usage_scale_up, at least one more than now. Serve
wraps the policy with min/max replicas, upscale_delay_s / downscale_delay_s and the scaling factors
(ray.serve.autoscaling_policy._apply_autoscaling_config), so a decision must hold for its delay before it acts.

`SloAutoscalingPolicy` (ttft_target_s or itl_target_s set): the same signals plus the pool's served TTFT and mean ITL
at a percentile over a window, and the pool's KV load from the admission queue's ledger; its arithmetic is
`slo_decision` (the rules are in its docstring): one replica more as soon as any signal is past its target, one fewer
only when every signal is well inside (scale_down_fraction) and the replicas left could hold the KV of today's load,
and no scale event within cooldown_s of the previous one.

Inputs are the replicas' record_autoscaling_stats() values (`replica_stats`), averaged by Serve over
look_back_period_s: `sequences` (running + waiting in the engine), `kv_usage`, `admission_queued` (the app's queue
length, which every replica passes on, so the policy takes the maximum rather than the sum); with a latency target
also the admission queue's answer to the replica's last KV report (`SloReport`): `ttft_s` and `itl_s` (left out while
no request of the pool finished in the window, so a missing latency never reads as 0 s), `kv_load_blocks`,
`kv_capacity_blocks`, `pool_replicas`.

Layout pools (dcpserve/deployments/admission/pools.py) each have a deployment and a policy of their own, and may share
the app's `gpu_budget`. Serve calls every deployment's policy in its controller, one after another, so the pools'
policies share a ledger there (`GpuLedger`): each records the GPUs it holds or is about to hold (its current or desired
replicas, whichever is more, times tp), and a pool scales up only into GPUs no other pool holds or reserves. A pool
that scales down frees its GPUs for the others at its next decision.

The service-level policy exports each decision's inputs, replica counts and reason as Prometheus metrics
(dcpserve/deployments/metrics.py `AutoscalingMetrics`, docs/metrics.md), from Serve's controller where it runs; they are
created at its first call, so the policy is built without them (the simulator, unit tests), and a failure to record
is logged, never in the way of the decision.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dcpserve.deployments.config import AutoscalingArgs
from dcpserve.deployments.messages import SloReport
from dcpserve.deployments.metrics import AutoscalingMetrics
from dcpserve.engine.protocol import KvLedger

logger = logging.getLogger("ray.serve")


def replica_stats(ledger: KvLedger, num_running: int, num_waiting: int, admission_queued: int,
                  slo: SloReport | None = None) -> dict[str, float]:
    """One replica's autoscaling stats (EngineReplica.record_autoscaling_stats, and the simulator's replicas):
    its concurrent sequences, its KV usage (committed + headroom over capacity) and the admission queue's length;
    with `slo`, the pool's latencies (each only when it has one) and KV load."""
    stats = {
        "sequences": float(max(len(ledger.per_request), num_running + num_waiting)),
        "kv_usage": min(1.0, (ledger.committed_blocks + ledger.headroom_blocks) / ledger.capacity_blocks),
        "admission_queued": float(admission_queued),
    }
    if slo is not None:
        if slo.ttft_s is not None:
            stats["ttft_s"] = slo.ttft_s
        if slo.itl_s is not None:
            stats["itl_s"] = slo.itl_s
        stats["kv_load_blocks"] = float(slo.kv_load_blocks)
        stats["kv_capacity_blocks"] = float(slo.kv_capacity_blocks)
        stats["pool_replicas"] = float(slo.pool_replicas)
    return stats


def sequence_replicas(demand: float, target_sequences_per_replica: float) -> int:
    """Replicas that hold the demand (sequences + queued) at target_sequences_per_replica each."""
    return math.ceil(demand / target_sequences_per_replica - 1e-9) if demand > 0 else 0


def desired_replicas(
    sequences_per_replica: list[float],
    kv_usage_per_replica: list[float],
    admission_queued: float,
    current_replicas: int,
    *,
    target_sequences_per_replica: float,
    kv_usage_scale_up: float,
) -> int:
    """The policy's arithmetic, separate from Serve's context object so it can be tested directly."""
    desired = sequence_replicas(sum(sequences_per_replica) + admission_queued, target_sequences_per_replica)
    if kv_usage_per_replica:
        mean_usage = sum(kv_usage_per_replica) / len(kv_usage_per_replica)
        if mean_usage > kv_usage_scale_up:
            desired = max(desired, current_replicas + 1)
    return desired


@dataclass(frozen=True)
class SloTargets:
    """The service-level policy's parameters (AutoscalingArgs' fields of the same names)."""

    ttft_target_s: float | None
    itl_target_s: float | None
    target_sequences_per_replica: float
    kv_usage_scale_up: float
    scale_down_fraction: float
    cooldown_s: float


@dataclass(frozen=True)
class SloInputs:
    """One decision's inputs, as the policy reads them from the replicas' stats (module doc)."""

    current_replicas: int  # running (Serve's current_num_replicas)
    target_replicas: int  # Serve's target: running + starting
    demand: float  # sequences on the replicas + requests in the admission queue
    kv_usage: float  # mean over the replicas
    ttft_s: float | None  # the pool's TTFT percentile over the window; None: nothing finished in it
    itl_s: float | None
    kv_load_blocks: float | None  # None: no replica has the queue's answer yet
    kv_capacity_blocks: float
    pool_replicas: float  # the replicas kv_capacity_blocks is of
    since_scale_s: float | None  # since the last scale event (target change); None: none yet


@dataclass(frozen=True)
class SloDecision:
    """A decision and why: `reason` is the first of ttft, itl, sequences, kv_usage past its target (scale up),
    `down`, or `hold`; `cooldown` when the rules asked for `wanted` but the cooldown kept the target."""

    desired: int
    wanted: int
    reason: str
    sequence_replicas: int
    kv_remaining_blocks: float  # what one replica fewer may hold: see slo_decision


def _inside(value: float | None, target: float | None, fraction: float) -> bool:
    return target is None or value is None or value <= fraction * target


def slo_decision(inputs: SloInputs, targets: SloTargets) -> SloDecision:
    """The service-level policy's arithmetic (pure: Serve's context and the clock are read by the policy).

    Past target (scale up): ttft_s > ttft_target_s; itl_s > itl_target_s; sequence_replicas = ceil(demand /
    target_sequences_per_replica) > current; mean kv_usage > kv_usage_scale_up. With any past target:
        desired = max(target_replicas, current + 1, sequence_replicas)
    (a replica already starting counts as the +1; the sequence rule may ask for more.)

    Well inside (scale down), all of:
        target_replicas == current (nothing starting or stopping);
        ttft_s <= scale_down_fraction * ttft_target_s and itl_s <= scale_down_fraction * itl_target_s (a target not
            set, or a latency without samples in the window, is inside);
        sequence_replicas <= current - 1;
        kv_load_blocks <= kv_remaining_blocks, where
            kv_remaining_blocks = (pool_replicas - 1) / pool_replicas * kv_capacity_blocks * kv_usage_scale_up
        (the replicas left, at the usage the KV rule would scale up at, could hold the blocks held, granted and
        waiting; no KV report yet: not inside).
    Then desired = current - 1. Otherwise desired = target_replicas.

    Cooldown: when the decision differs from target_replicas and the last scale event was less than cooldown_s ago,
    desired = target_replicas (reason `cooldown`). Hysteresis: a latency between scale_down_fraction x target and the
    target neither adds nor removes a replica, so a load oscillating around the target adds one and keeps it.
    """
    current, target = inputs.current_replicas, inputs.target_replicas
    by_sequences = sequence_replicas(inputs.demand, targets.target_sequences_per_replica)
    n = inputs.pool_replicas
    remaining = (n - 1) / n * inputs.kv_capacity_blocks * targets.kv_usage_scale_up if n >= 1 else 0.0
    past = [name for name, over in (
        ("ttft", targets.ttft_target_s is not None and inputs.ttft_s is not None
         and inputs.ttft_s > targets.ttft_target_s),
        ("itl", targets.itl_target_s is not None and inputs.itl_s is not None and inputs.itl_s > targets.itl_target_s),
        ("sequences", by_sequences > current),
        ("kv_usage", inputs.kv_usage > targets.kv_usage_scale_up),
    ) if over]
    fraction = targets.scale_down_fraction
    if past:
        wanted, reason = max(target, current + 1, by_sequences), past[0]
    elif (target == current and current > 0
          and _inside(inputs.ttft_s, targets.ttft_target_s, fraction)
          and _inside(inputs.itl_s, targets.itl_target_s, fraction)
          and by_sequences <= current - 1
          and inputs.kv_load_blocks is not None and inputs.kv_load_blocks <= remaining):
        wanted, reason = current - 1, "down"
    else:
        wanted, reason = target, "hold"
    desired = wanted
    if wanted != target and inputs.since_scale_s is not None and inputs.since_scale_s < targets.cooldown_s:
        desired, reason = target, "cooldown"
    return SloDecision(desired, wanted, reason, by_sequences, remaining)


class GpuLedger:
    """GPUs each pool of an app holds or reserves, in the Serve controller's process (module doc)."""

    def __init__(self) -> None:
        self._gpus: dict[tuple[str, str], int] = {}  # (app, deployment) -> GPUs

    def others(self, app: str, deployment: str) -> int:
        return sum(gpus for (a, d), gpus in self._gpus.items() if a == app and d != deployment)

    def record(self, app: str, deployment: str, gpus: int) -> None:
        self._gpus[app, deployment] = gpus


LEDGER = GpuLedger()


def within_budget(desired: int, current: int, tp: int, budget: int, others: int) -> int:
    """The replicas a pool may have: desired, less what the GPUs left by the other pools cannot hold; never below
    current (a pool is not made to shrink for another, it frees GPUs when its own load drops)."""
    allowed = (budget - others) // tp
    return min(desired, max(allowed, current))


class SequenceAutoscalingPolicy:
    """Serve instantiates this once with policy_kwargs and calls it every control-loop period."""

    def __init__(self, *, target_sequences_per_replica: float = 8.0, kv_usage_scale_up: float = 0.85,
                 gpu_budget: int | None = None, tensor_parallel_size: int = 1,
                 ledger: GpuLedger | None = None) -> None:
        if target_sequences_per_replica <= 0:
            raise ValueError(f"target_sequences_per_replica must be > 0, got {target_sequences_per_replica}")
        if not 0 < kv_usage_scale_up <= 1:
            raise ValueError(f"kv_usage_scale_up must be in (0, 1], got {kv_usage_scale_up}")
        self.target_sequences_per_replica = target_sequences_per_replica
        self.kv_usage_scale_up = kv_usage_scale_up
        self.gpu_budget = gpu_budget
        self.tp = tensor_parallel_size
        self.ledger = ledger or LEDGER

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        running = set(ctx.running_replicas)
        sequences = [v for r, v in metrics.get("sequences", {}).items() if r in running]
        usage = [v for r, v in metrics.get("kv_usage", {}).items() if r in running]
        queued = max(metrics.get("admission_queued", {}).values(), default=0.0)
        if not sequences and not queued:
            # No reports yet (replicas starting): keep the current target.
            return self._budgeted(ctx, ctx.target_num_replicas), {}
        desired = desired_replicas(
            sequences, usage, queued, ctx.current_num_replicas,
            target_sequences_per_replica=self.target_sequences_per_replica, kv_usage_scale_up=self.kv_usage_scale_up,
        )
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        return self._budgeted(ctx, max(low, min(high, desired))), {"demand": sum(sequences) + queued}

    def _budgeted(self, ctx: Any, desired: int) -> int:
        if self.gpu_budget is None:
            return desired
        app, deployment = ctx.app_name or "", ctx.deployment_name
        desired = within_budget(desired, ctx.current_num_replicas, self.tp, self.gpu_budget,
                                self.ledger.others(app, deployment))
        self.ledger.record(app, deployment, max(desired, ctx.current_num_replicas) * self.tp)
        return desired


class SloAutoscalingPolicy(SequenceAutoscalingPolicy):
    """The service-level policy (slo_decision) in Serve's interface; it keeps when Serve's target last changed.

    Its state (Serve's policy_state, returned every call) holds the decision's inputs and the decision: `demand`,
    `kv_usage`, `ttft_s`, `itl_s` (None without samples), `kv_load_blocks`, `kv_capacity_blocks`, `pool_replicas`,
    `since_scale_s` (None before the first event), `current_replicas`, `target_replicas`, `sequence_replicas`,
    `kv_remaining_blocks`, `wanted`, `desired` (after min/max and the GPU budget) and `reason`; the same go to
    Prometheus (`_export`).
    """

    def __init__(self, *, ttft_target_s: float | None = None, itl_target_s: float | None = None,
                 scale_down_fraction: float = 0.7, cooldown_s: float = 60.0,
                 target_sequences_per_replica: float = 8.0, kv_usage_scale_up: float = 0.85,
                 gpu_budget: int | None = None, tensor_parallel_size: int = 1, ledger: GpuLedger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """clock: seconds, for the cooldown (the simulator gives its simulated time)."""
        super().__init__(target_sequences_per_replica=target_sequences_per_replica,
                         kv_usage_scale_up=kv_usage_scale_up, gpu_budget=gpu_budget,
                         tensor_parallel_size=tensor_parallel_size, ledger=ledger)
        for name, value in (("ttft_target_s", ttft_target_s), ("itl_target_s", itl_target_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if ttft_target_s is None and itl_target_s is None:
            raise ValueError("the service-level policy needs ttft_target_s or itl_target_s")
        if not 0 < scale_down_fraction < 1:
            raise ValueError(f"scale_down_fraction must be in (0, 1), got {scale_down_fraction}")
        if not cooldown_s >= 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self.targets = SloTargets(ttft_target_s, itl_target_s, target_sequences_per_replica, kv_usage_scale_up,
                                  scale_down_fraction=scale_down_fraction, cooldown_s=cooldown_s)
        self._clock = clock
        self._last_target: int | None = None  # Serve's target at the previous call
        self._last_scale_at: float | None = None  # when the policy saw that target change
        self._metrics: AutoscalingMetrics | None = None  # created at the first decision (module doc)
        self._export_failed = False  # a failure to record was logged with its traceback; later ones at debug

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = self._clock()
        target = ctx.target_num_replicas
        if self._last_target is not None and target != self._last_target:
            self._last_scale_at = now
        self._last_target = target
        metrics = ctx.aggregated_metrics or {}
        running = set(ctx.running_replicas)

        def values(name: str) -> dict[Any, float]:
            return {r: v for r, v in metrics.get(name, {}).items() if r in running}

        sequences, usage = values("sequences"), values("kv_usage")
        queued = max(metrics.get("admission_queued", {}).values(), default=0.0)
        if not sequences and not queued:
            return self._budgeted(ctx, target), {}  # no reports yet (replicas starting): keep the target
        loads, capacities, counts = values("kv_load_blocks"), values("kv_capacity_blocks"), values("pool_replicas")
        reported = [r for r in loads if r in capacities and r in counts and counts[r] >= 1]
        # The replicas' answers came at different times: the one that leaves the least room decides.
        tightest = min(reported, default=None,
                       key=lambda r: (counts[r] - 1) / counts[r] * capacities[r] - loads[r])
        inputs = SloInputs(
            current_replicas=ctx.current_num_replicas, target_replicas=target,
            demand=sum(sequences.values()) + queued,
            kv_usage=sum(usage.values()) / len(usage) if usage else 0.0,
            ttft_s=max(values("ttft_s").values(), default=None), itl_s=max(values("itl_s").values(), default=None),
            kv_load_blocks=None if tightest is None else loads[tightest],
            kv_capacity_blocks=0.0 if tightest is None else capacities[tightest],
            pool_replicas=0.0 if tightest is None else counts[tightest],
            since_scale_s=None if self._last_scale_at is None else now - self._last_scale_at,
        )
        decision = slo_decision(inputs, self.targets)
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        desired = self._budgeted(ctx, max(low, min(high, decision.desired)))
        state = {**dataclasses.asdict(inputs), **dataclasses.asdict(decision), "desired": desired}
        self._export(ctx, inputs, decision, desired)
        return desired, state

    def _export(self, ctx: Any, inputs: SloInputs, decision: SloDecision, desired: int) -> None:
        """Records one decision (AutoscalingMetrics). Recording must never stop the decision: a failure is logged,
        the first with its traceback."""
        kv_reported = inputs.kv_load_blocks is not None  # else capacity and remaining read 0: not exported
        exported = {
            "demand": inputs.demand, "kv_usage": inputs.kv_usage, "ttft_s": inputs.ttft_s, "itl_s": inputs.itl_s,
            "kv_load_blocks": inputs.kv_load_blocks,
            "kv_capacity_blocks": inputs.kv_capacity_blocks if kv_reported else None,
            "kv_remaining_blocks": decision.kv_remaining_blocks if kv_reported else None,
        }
        replicas = {"current": inputs.current_replicas, "target": inputs.target_replicas,
                    "sequences": decision.sequence_replicas, "wanted": decision.wanted, "desired": desired}
        try:
            if self._metrics is None:
                self._metrics = AutoscalingMetrics()
            self._metrics.record(ctx.app_name or "", ctx.deployment_name, exported, replicas, decision.reason)
        except Exception:
            logger.log(logging.DEBUG if self._export_failed else logging.WARNING,
                       "the service-level policy of %s/%s could not record its metrics; it decides on without them",
                       ctx.app_name, ctx.deployment_name, exc_info=not self._export_failed)
            self._export_failed = True


def policy_function(scaling: AutoscalingArgs) -> str:
    """A pool's autoscaling policy as Serve's import path: by service levels with a latency target, else by
    sequences and KV usage."""
    policy = SloAutoscalingPolicy if scaling.slo_targets else SequenceAutoscalingPolicy
    return f"{__name__}:{policy.__name__}"


def policy_kwargs(scaling: AutoscalingArgs, gpu_budget: int | None, ranks: int) -> dict[str, Any]:
    """The policy's constructor arguments (JSON, as Serve's policy_kwargs must be); ranks: the GPUs a replica takes
    from the budget."""
    kwargs: dict[str, Any] = {
        "target_sequences_per_replica": scaling.target_sequences_per_replica,
        "kv_usage_scale_up": scaling.kv_usage_scale_up,
        "gpu_budget": gpu_budget,
        "tensor_parallel_size": ranks,
    }
    if scaling.slo_targets:
        kwargs.update(ttft_target_s=scaling.ttft_target_s, itl_target_s=scaling.itl_target_s,
                      scale_down_fraction=scaling.scale_down_fraction, cooldown_s=scaling.cooldown_s)
    return kwargs


def make_policy(scaling: AutoscalingArgs, gpu_budget: int | None, ranks: int, ledger: GpuLedger,
                clock: Callable[[], float]) -> SequenceAutoscalingPolicy:
    """The policy Serve would instantiate from policy_function and policy_kwargs, with the simulator's ledger and
    clock."""
    kwargs = policy_kwargs(scaling, gpu_budget, ranks)
    if scaling.slo_targets:
        return SloAutoscalingPolicy(**kwargs, ledger=ledger, clock=clock)
    return SequenceAutoscalingPolicy(**kwargs, ledger=ledger)
