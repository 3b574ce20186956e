"""Two-pool splits of a GPU budget, for `dcpserve plan --trace --gpu-budget` (dcpserve/simulator/plan.py simulates
them): which splits to try, and the serve config of the one to deploy.

A split is an app of two layout pools (dcpserve/deployments/admission/pools.py) of the plan's layouts, each with a fixed
number of whole replicas, together within the budget. For each pair of layouts and each share of about 1/4, 1/2 and 3/4
of the budget (SHARES), the first layout gets that share's GPUs rounded to whole replicas (at least one), the second as
many replicas as the rest holds (at least one; none: no split at that share), and the first then takes what the
second leaves over, so a split uses the whole budget where whole replicas can. Two shares that come to the same
replicas are one split. Pairs of L layouts give at most 3 * L * (L - 1) / 2 splits, each one simulation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dcpserve.simulator.build import PoolOption

SHARES = (0.25, 0.5, 0.75)  # of the budget's GPUs, for the first layout of a pair


def pool_name(tp: int, dcp: int) -> str:
    """A pool's name from its layout ("tp8-dcp4"): a valid serve config pool name (dcpserve/deployments/config.py
    POOL_NAME)."""
    return f"tp{tp}-dcp{dcp}"


@dataclass(frozen=True)
class Split:
    """Two pools of different layouts, each with its replicas, within a GPU budget."""

    pools: tuple[PoolOption, PoolOption]

    @property
    def label(self) -> str:
        """"tp=8 dcp=1 x1 + tp=8 dcp=8 x1": each pool's layout and replicas."""
        return " + ".join(f"{pool.layout} x{pool.replicas}" for pool in self.pools)

    @property
    def gpus(self) -> int:
        return sum(pool.tp * pool.replicas for pool in self.pools)


def split_candidates(layouts: Sequence[tuple[int, int]], budget: int) -> list[Split]:
    """The splits to simulate (module doc): for each pair of distinct layouts (tp, dcp), in the order given, the
    splits of `budget` GPUs at each of SHARES."""
    splits: list[Split] = []
    for index, (tp_a, dcp_a) in enumerate(layouts):
        for tp_b, dcp_b in layouts[index + 1:]:
            seen: set[tuple[int, int]] = set()
            for share in SHARES:
                replicas_a = max(1, int(share * budget / tp_a + 0.5))
                replicas_b = (budget - replicas_a * tp_a) // tp_b
                if replicas_b < 1:
                    continue
                replicas_a = (budget - replicas_b * tp_b) // tp_a  # what the second layout leaves over
                if (replicas_a, replicas_b) in seen:
                    continue
                seen.add((replicas_a, replicas_b))
                splits.append(Split((PoolOption(pool_name(tp_a, dcp_a), tp_a, dcp_a, replicas_a),
                                     PoolOption(pool_name(tp_b, dcp_b), tp_b, dcp_b, replicas_b))))
    return splits


def serve_config_snippet(pools: Sequence[PoolOption], gpu_budget: int, max_model_len: int) -> str:
    """The split as the application's `args:` in serve_config.yaml (dcpserve/deployments/config.py AppArgs: gpu_budget
    and pools, each PoolArgs' name, layout and autoscaling). Each pool's min_replicas = max_replicas = the replicas it
    was simulated with."""
    lines = [
        f"# serve_config.yaml, in the application's args beside max_model_len: {max_model_len} (as planned); each",
        "# pool keeps the replicas it was simulated with (min_replicas = max_replicas)",
        f"gpu_budget: {gpu_budget}",
        "pools:",
    ]
    for pool in pools:
        lines += [
            f"  - name: {pool.name}",
            f"    tensor_parallel_size: {pool.tp}",
            f"    decode_context_parallel_size: {pool.dcp}",
            f"    autoscaling: {{min_replicas: {pool.replicas}, max_replicas: {pool.replicas}}}",
        ]
    return "\n".join(lines)
