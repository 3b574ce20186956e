"""Serve's autoscaling loop for the engine deployment, on simulated time.

The decision is the app's and Serve's own code: the replicas' stats (dcpserve.deployments.autoscaling.replica_stats,
what EngineReplica.record_autoscaling_stats returns), averaged per replica over look_back_period_s as Serve's controller
averages them (a stat a replica left out of a push, as a latency with no samples, averaged over the pushes that have
it); the app's policy (dcpserve.deployments.autoscaling.make_policy: SequenceAutoscalingPolicy, or SloAutoscalingPolicy
with a latency target, its cooldown on the simulated clock) on a context with the fields it reads; then Serve's scaling
factors and up/down-scale delays (ray.serve.autoscaling_policy's _apply_scaling_factors and _apply_delay_logic, given
the simulated time: Serve's wrapper would read the wall clock).

What differs from Serve, and why it does not change a decision: replicas push stats every metrics_interval_s and
the controller decides at the same period (Serve decides every 0.1 s on the stats pushed so far, so it acts on the
same averages up to metrics_interval_s sooner). The delays are measured on the simulated clock as Serve measures
them on the wall clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ray.serve import autoscaling_policy as serve_policy
from ray.serve.config import AutoscalingConfig

from dcpserve.deployments.autoscaling import GpuLedger, make_policy
from dcpserve.deployments.config import AutoscalingArgs


@dataclass
class PolicyContext:
    """The fields of Serve's AutoscalingContext that the app's policy and Serve's delay logic read."""

    aggregated_metrics: dict[str, dict[str, float]]
    running_replicas: list[str]
    target_num_replicas: int
    current_num_replicas: int
    capacity_adjusted_min_replicas: int
    capacity_adjusted_max_replicas: int
    config: AutoscalingConfig
    policy_state: dict[str, Any] = field(default_factory=dict)
    app_name: str = "simulated"
    deployment_name: str = "EngineReplica"


class SimAutoscaler:
    """Decides the engine deployment's replica count each metrics period, from the replicas' stats."""

    def __init__(self, args: AutoscalingArgs, max_replicas: int, name: str = "EngineReplica",
                 gpu_budget: int | None = None, tp: int = 1, ledger: GpuLedger | None = None) -> None:
        """max_replicas: the most the GPUs allow (the smaller of it and args.max_replicas bounds the count). With
        layout pools, name is the pool's deployment and gpu_budget the GPUs its ledger shares with the others."""
        self.args = args
        self.name = name
        self.max_replicas = min(args.max_replicas, max_replicas)
        if self.max_replicas < args.min_replicas:
            raise ValueError(
                f"the GPUs hold {max_replicas} replicas of this layout, fewer than autoscaling.min_replicas="
                f"{args.min_replicas}; add nodes or lower min_replicas")
        self.config = AutoscalingConfig(
            min_replicas=args.min_replicas, max_replicas=self.max_replicas, initial_replicas=args.initial_replicas,
            upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s,
            look_back_period_s=args.look_back_period_s, metrics_interval_s=args.metrics_interval_s)
        self._now = 0.0  # the simulated time of the decision being made: the policy's clock
        self.policy = make_policy(args, gpu_budget, tp, ledger or GpuLedger(), lambda: self._now)
        self.policy_state: dict[str, Any] = {}  # the policy's last state (its inputs and decision)
        self._stats: dict[str, deque[tuple[float, dict[str, float]]]] = {}
        self._state: dict[str, Any] = {}

    @property
    def initial_replicas(self) -> int:
        return self.args.initial_replicas or self.args.min_replicas

    def record(self, now: float, replica_id: str, stats: dict[str, float]) -> None:
        """A replica's stats push (every metrics_interval_s)."""
        window = self._stats.setdefault(replica_id, deque())
        window.append((now, stats))
        while window and window[0][0] < now - self.args.look_back_period_s:
            window.popleft()

    def forget(self, replica_id: str) -> None:
        self._stats.pop(replica_id, None)

    def decide(self, now: float, running: list[str], target: int) -> int:
        """The new target replica count, given the replicas running now and the current target."""
        aggregated: dict[str, dict[str, float]] = {}
        for replica_id in running:
            window = self._stats.get(replica_id)
            if not window:
                continue
            for name in dict.fromkeys(name for _, stats in window for name in stats):  # in push order
                values = [stats[name] for _, stats in window if name in stats]
                aggregated.setdefault(name, {})[replica_id] = sum(values) / len(values)
        ctx = PolicyContext(aggregated, list(running), target, len(running), self.args.min_replicas,
                            self.max_replicas, self.config, deployment_name=self.name)
        self._now = now
        desired, self.policy_state = self.policy(ctx)
        scaled = serve_policy._apply_scaling_factors(desired, ctx.current_num_replicas, self.config)
        decided, self._state = serve_policy._apply_delay_logic(max(0, scaled), target, self.config, self._state,
                                                               _now=now)
        return max(self.args.min_replicas, min(self.max_replicas, int(decided)))
