"""Autoscaling of layout pools under one GPU budget: each pool's policy (Serve calls them one after another in its
controller) scales up only into GPUs no other pool holds or reserves, and a pool that scales down frees them."""

from __future__ import annotations

import types
from typing import Any

from dcpserve.deployments.autoscaling import GpuLedger, SequenceAutoscalingPolicy, within_budget


def ctx(deployment: str, current: int, sequences: list[float], queued: float = 0.0, max_replicas: int = 8) -> Any:
    replicas = [f"{deployment}-{i}" for i in range(current)]
    return types.SimpleNamespace(
        app_name="dcpserve", deployment_name=deployment, current_num_replicas=current, target_num_replicas=current,
        running_replicas=replicas, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=max_replicas,
        aggregated_metrics={"sequences": dict(zip(replicas, sequences, strict=True)),
                            "kv_usage": {r: 0.1 for r in replicas},
                            "admission_queued": {r: queued for r in replicas}})


def test_within_budget_caps_growth_and_never_forces_a_shrink() -> None:
    assert within_budget(desired=4, current=1, tp=2, budget=8, others=2) == 3  # 6 GPUs left: 3 replicas
    assert within_budget(desired=4, current=1, tp=2, budget=8, others=8) == 1  # nothing left: stays
    assert within_budget(desired=1, current=3, tp=2, budget=8, others=8) == 1  # its own load fell: it shrinks


def test_two_pools_share_the_budget_and_a_scale_down_makes_room() -> None:
    ledger = GpuLedger()
    short = SequenceAutoscalingPolicy(target_sequences_per_replica=4, gpu_budget=8, tensor_parallel_size=2,
                                      ledger=ledger)
    long = SequenceAutoscalingPolicy(target_sequences_per_replica=4, gpu_budget=8, tensor_parallel_size=2,
                                     ledger=ledger)
    # Both at one replica; the short pool's load asks for 3 replicas (12 sequences), the long pool's for 4.
    assert short(ctx("EngineReplica-short", 1, [12.0]))[0] == 3  # 6 of 8 GPUs: the long pool holds 0 so far
    assert long(ctx("EngineReplica-long", 1, [16.0]))[0] == 1  # the short pool reserved 6: 2 left, its own
    # The short pool's load falls to one replica's worth: it gives back 4 GPUs, and the long pool takes them.
    assert short(ctx("EngineReplica-short", 3, [1.0, 1.0, 1.0]))[0] == 1
    assert long(ctx("EngineReplica-long", 1, [16.0]))[0] == 1  # short still holds 3 replicas until they stop
    assert short(ctx("EngineReplica-short", 1, [3.0]))[0] == 1
    assert long(ctx("EngineReplica-long", 1, [16.0]))[0] == 3  # 8 - 2 = 6 GPUs: 3 replicas of tp=2


def test_without_a_budget_a_pool_scales_as_alone() -> None:
    policy = SequenceAutoscalingPolicy(target_sequences_per_replica=4, tensor_parallel_size=2, ledger=GpuLedger())
    assert policy(ctx("EngineReplica", 1, [30.0]))[0] == 8
