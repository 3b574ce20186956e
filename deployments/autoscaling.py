"""Custom Serve autoscaling policy: replicas by concurrent sequences, earlier when KV fills up.

desired = ceil((sum over replicas of their sequences + requests waiting in the admission queue)
               / target_sequences_per_replica)
and, while the mean KV usage (held / capacity) is above kv_usage_scale_up, at least one more than now. Serve
wraps the policy with min/max replicas, upscale_delay_s / downscale_delay_s and the scaling factors
(ray.serve.autoscaling_policy._apply_autoscaling_config), so a decision must hold for its delay before it acts.

Inputs are the replicas' record_autoscaling_stats() values, averaged by Serve over look_back_period_s:
`sequences` (running + waiting in the engine), `kv_usage`, `admission_queued` (the app's queue length, which
every replica passes on, so the policy takes the maximum rather than the sum).

Layout pools (deployments/pools.py) each have a deployment and a policy of their own, and may share the app's
`gpu_budget`. Serve calls every deployment's policy in its controller, one after another, so the pools' policies
share a ledger there (`GpuLedger`): each records the GPUs it holds or is about to hold (its current or desired
replicas, whichever is more, times tp), and a pool scales up only into GPUs no other pool holds or reserves. A pool
that scales down frees its GPUs for the others at its next decision.
"""

from __future__ import annotations

import math
from typing import Any

from engine.protocol import KvLedger


def replica_stats(ledger: KvLedger, num_running: int, num_waiting: int, admission_queued: int) -> dict[str, float]:
    """One replica's autoscaling stats (EngineReplica.record_autoscaling_stats, and the simulator's replicas):
    its concurrent sequences, its KV usage (committed + headroom over capacity) and the admission queue's length."""
    return {
        "sequences": float(max(len(ledger.per_request), num_running + num_waiting)),
        "kv_usage": min(1.0, (ledger.committed_blocks + ledger.headroom_blocks) / ledger.capacity_blocks),
        "admission_queued": float(admission_queued),
    }


def desired_replicas(
    sequences_per_replica: list[float],
    kv_usage_per_replica: list[float],
    admission_queued: float,
    current_replicas: int,
    target_sequences_per_replica: float,
    kv_usage_scale_up: float,
) -> int:
    """The policy's arithmetic, separate from Serve's context object so it can be tested directly."""
    demand = sum(sequences_per_replica) + admission_queued
    desired = math.ceil(demand / target_sequences_per_replica - 1e-9) if demand > 0 else 0
    if kv_usage_per_replica:
        mean_usage = sum(kv_usage_per_replica) / len(kv_usage_per_replica)
        if mean_usage > kv_usage_scale_up:
            desired = max(desired, current_replicas + 1)
    return desired


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

    def __init__(self, target_sequences_per_replica: float = 8.0, kv_usage_scale_up: float = 0.85,
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
            self.target_sequences_per_replica, self.kv_usage_scale_up,
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
