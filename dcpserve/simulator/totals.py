"""A run's totals over its replicas, for its summary: preemptions, prefix hits by tier, steps, and the host KV tier's
copies (dcpserve/simulator/run.py adds them to the recorder's summary at the end of a run)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dcpserve.simulator.replica import SimReplica


@dataclass(frozen=True)
class ReplicaTotals:
    """The replicas' counters summed at the end of a run."""

    num_preemptions: int
    queried_tokens: int  # prompt tokens the prefix cache was asked for
    device_hit_tokens: int
    host_hit_tokens: int  # 0 without a host tier
    num_steps: int
    busy_seconds: float

    @classmethod
    def of(cls, replicas: Sequence[SimReplica]) -> ReplicaTotals:
        return cls(num_preemptions=sum(r.scheduler.num_preemptions for r in replicas),
                   queried_tokens=sum(r.block_manager.num_queried_tokens for r in replicas),
                   device_hit_tokens=sum(r.block_manager.num_hit_tokens for r in replicas),
                   host_hit_tokens=sum(r.tiered.num_host_hit_tokens for r in replicas if r.tiered is not None),
                   num_steps=sum(r.num_steps for r in replicas),
                   busy_seconds=sum(r.busy_seconds for r in replicas))

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens

    def hit_rate_by_tier(self) -> dict[str, float]:
        """The prefix hits' share of the queried tokens, from the device pool and from the host tier."""
        queried = self.queried_tokens
        return {"device": self.device_hit_tokens / queried if queried else 0.0,
                "host": self.host_hit_tokens / queried if queried else 0.0}


def host_tier_summary(replicas: Sequence[SimReplica]) -> dict[str, float] | None:
    """The host KV tier's totals over the replicas (None without a tier): blocks copied each way with their bytes
    and seconds per rank (every rank copies its own pages at once), the seconds the copies added to steps past
    their compute, and the blocks the tier dropped."""
    tiered = [(r, r.tiered) for r in replicas if r.tiered is not None]
    if not tiered:
        return None
    return {
        "capacity_blocks": sum(manager.tier_shape.num_blocks for _, manager in tiered),
        "loaded_blocks": sum(manager.num_loaded_blocks for _, manager in tiered),
        "offloaded_blocks": sum(manager.num_offloaded_blocks for _, manager in tiered),
        "loaded_bytes_per_rank": sum(manager.num_loaded_blocks * manager.tier_shape.bytes_per_block_per_rank
                                     for _, manager in tiered),
        "offloaded_bytes_per_rank": sum(manager.num_offloaded_blocks * manager.tier_shape.bytes_per_block_per_rank
                                        for _, manager in tiered),
        "load_seconds": sum(replica.load_seconds for replica, _ in tiered),
        "offload_seconds": sum(replica.offload_seconds for replica, _ in tiered),
        "exposed_copy_seconds": sum(replica.exposed_copy_seconds for replica, _ in tiered),
        "host_evictions": sum(manager.num_host_evictions for _, manager in tiered),
    }
