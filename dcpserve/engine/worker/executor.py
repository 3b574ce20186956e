"""Where a replica's model runs: in this process (one rank: tp = pcp = 1) or on a Ray worker group (tp * pcp > 1)."""

from __future__ import annotations

from typing import Protocol

import torch

from dcpserve.engine.config import EngineConfig
from dcpserve.engine.core.outputs import ModelRunnerOutput
from dcpserve.engine.core.step import SchedulerOutput
from dcpserve.engine.worker.parallel import ParallelState


class Executor(Protocol):
    """Runs steps on every rank and returns the driver rank's sampled tokens and logprobs."""

    num_blocks: int

    @property
    def last_exchange_seconds(self) -> float:
        """DCP exchange time of the last execute() (max over ranks; 0 without DCP)."""

    @property
    def last_copy_seconds(self) -> tuple[float, float]:
        """(swap-out, swap-in) seconds of the host KV tier's copies in the last execute() (max over ranks)."""

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """tp = 1: one model runner in this process, no Ray and no torch.distributed."""

    def __init__(self, config: EngineConfig) -> None:
        from dcpserve.engine.worker.model_runner import ModelRunner

        parallel = ParallelState.single(config.model_config.num_key_value_heads)
        self.runner = ModelRunner(config, parallel, torch.device(config.device))
        self.num_blocks = self.runner.available_blocks()
        self.runner.allocate_kv_cache(self.num_blocks)
        self.runner.allocate_host_tier(config.cache.host_tier_blocks)
        self.runner.capture_decode_graphs()

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = self.runner.execute(output)
        return result if result is not None else ModelRunnerOutput()

    @property
    def last_exchange_seconds(self) -> float:
        return self.runner.last_exchange_seconds

    @property
    def last_copy_seconds(self) -> tuple[float, float]:
        return self.runner.last_copy_seconds

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.runner.kv_caches = []
        self.runner.host_pool = None


def create_executor(config: EngineConfig) -> Executor:
    """The in-process runner for one rank; the Ray worker group (imported only then) for tp * pcp > 1."""
    if config.parallel.world_size == 1:
        return InProcessExecutor(config)
    from dcpserve.engine.worker.ray_executor import RayWorkerGroup

    return RayWorkerGroup.in_current_placement(config)
