"""A replica's tensor-parallel worker group on Ray: one actor per TP rank, torch.distributed between them.

Layout: with GPUs in the cluster, one bundle of {GPU: 1} per rank in a STRICT_PACK placement group (DCP adds no
GPUs: it reuses the TP ranks); the group may be given (a Serve replica's own placement group, whose first
bundles belong to the replica) or created here. On a cluster without GPU resources the ranks run as CPU
actors. Each group picks its own rendezvous address and port (rank 0's node, a free port), so several groups
share a host. Every step the driver puts the SchedulerOutput once into the object store, every rank executes
it, and rank 0 returns the sampled tokens (and the logprobs requests asked for: a ModelRunnerOutput).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput
from engine.scheduler import SchedulerOutput


@ray.remote
class RankWorker:
    """One TP rank: its process group membership, model runner and KV cache shard."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.runner: Any = None
        self.parallel: Any = None

    def rendezvous_address(self) -> str:
        """tcp://this-node:free-port, for rank 0 to host the group's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def init(self, init_method: str, cpu_threads: int) -> int:
        """Joins the process group, loads this rank's weights; returns the KV pages this rank could hold."""
        from engine.model_runner import ModelRunner
        from engine.parallel import init_parallel_state

        use_cuda = self.config.device.startswith("cuda") and torch.cuda.is_available()
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        else:
            torch.set_num_threads(cpu_threads)
        parallel = self.config.parallel
        self.parallel = init_parallel_state(
            tp_size=parallel.tp,
            tp_rank=self.rank,
            dcp_size=parallel.dcp,
            num_kv_heads=self.config.model_config.num_key_value_heads,
            init_method=init_method,
            backend="nccl" if use_cuda else "gloo",
        )
        self.runner = ModelRunner(self.config, self.parallel, device)
        return self.runner.available_blocks()

    def allocate(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, output: SchedulerOutput) -> tuple[ModelRunnerOutput | None, float]:
        """(sampled tokens and logprobs on rank 0, None elsewhere; this rank's DCP exchange seconds in the step)."""
        tokens = self.runner.execute(output)
        return tokens, self.runner.last_exchange_seconds

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        from engine.parallel import destroy_parallel_state

        if self.parallel is not None:
            destroy_parallel_state(self.parallel)


class RayWorkerGroup:
    """Starts, drives and stops the rank actors of one replica."""

    def __init__(
        self,
        config: EngineConfig,
        placement_group: PlacementGroup | None = None,
        first_bundle: int = 0,
        startup_timeout_s: float = 600.0,
    ) -> None:
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        tp = config.parallel.tp
        self.config = config
        self._owned_group: PlacementGroup | None = None
        self.last_exchange_seconds = 0.0
        use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        if placement_group is None and use_gpus:
            placement_group = self._create_group(tp, startup_timeout_s)
            self._owned_group = placement_group
        options: list[dict[str, Any]] = []
        for rank in range(tp):
            option: dict[str, Any] = {"num_cpus": 0, "num_gpus": 1 if use_gpus else 0}
            if placement_group is not None:
                option["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=first_bundle + rank
                )
            options.append(option)
        self.workers = [RankWorker.options(**options[r]).remote(config, r) for r in range(tp)]
        try:
            init_method = ray.get(self.workers[0].rendezvous_address.remote(), timeout=startup_timeout_s)
            # CPU ranks share this host's cores (Ray's logical CPUs may exceed them): oversubscribing torch threads
            # makes every gloo collective wait on a descheduled peer.
            cpu_threads = max(1, (os.cpu_count() or 1) // tp)
            available = ray.get(
                [w.init.remote(init_method, cpu_threads) for w in self.workers], timeout=startup_timeout_s
            )
            self.num_blocks = min(available)
            if self.num_blocks < 1:
                raise RuntimeError(
                    f"no room for KV cache on some rank (pages per rank: {available}); raise kv_cache_memory_bytes "
                    f"(or gpu_memory_utilization on GPUs)"
                )
            ray.get([w.allocate.remote(self.num_blocks) for w in self.workers], timeout=startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def in_current_placement(cls, config: EngineConfig) -> RayWorkerGroup:
        """Inside a Serve replica whose placement group is [replica bundle] + one bundle per rank, the ranks take
        those bundles; anywhere else the group reserves its own GPUs (or runs CPU actors on a GPU-less cluster)."""
        if ray.is_initialized():
            group = get_current_placement_group()
            if group is not None and len(group.bundle_specs) == config.parallel.tp + 1:
                return cls(config, placement_group=group, first_bundle=1)
        return cls(config)

    @staticmethod
    def _create_group(tp: int, timeout_s: float) -> PlacementGroup:
        group = placement_group([{"GPU": 1}] * tp, strategy="STRICT_PACK")
        if not group.wait(timeout_seconds=timeout_s):
            remove_placement_group(group)
            gpus = ray.cluster_resources().get("GPU", 0)
            raise RuntimeError(
                f"tp={tp} needs {tp} GPUs on one node (STRICT_PACK bundles of {{GPU: 1}}) but none were free within "
                f"{timeout_s:.0f}s; the cluster has {gpus:g} GPUs in all. On a CPU machine start Ray with "
                f"--num-gpus {tp} (logical GPUs)"
            )
        return group

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        ref = ray.put(output)
        refs = [w.execute.remote(ref) for w in self.workers]
        # Fail as soon as any rank fails: a dead rank leaves the others blocked in a collective that never ends, so
        # a plain ray.get over the list (which waits for rank 0 first) would hang the step, and every request with it.
        pending = refs
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)  # raises at once (RayActorError for a dead rank)
        results = ray.get(refs)
        # Every rank waits in the same collectives, so the slowest rank's exchange time is the step's.
        self.last_exchange_seconds = max(seconds for _, seconds in results)
        return results[0][0] or ModelRunnerOutput()

    def check_health(self) -> None:
        ray.get([w.ping.remote() for w in self.workers], timeout=60)

    def shutdown(self) -> None:
        for worker in getattr(self, "workers", []):
            try:
                ray.get(worker.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a dead worker is being removed anyway
                pass
            ray.kill(worker)
        self.workers = []
        if self._owned_group is not None:
            remove_placement_group(self._owned_group)
            self._owned_group = None
