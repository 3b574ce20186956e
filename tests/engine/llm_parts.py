"""The parts of an LLM the engine tests reach into (its native engine, model runner or worker group), typed: each
asserts the LLM has the part (a native engine; the runner in this process at tp = 1, a Ray worker group above)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.worker.executor import InProcessExecutor

if TYPE_CHECKING:
    from dcpserve.engine.worker.model_runner import ModelRunner
    from dcpserve.engine.worker.ray_executor import RayWorkerGroup


def engine_of(llm: LLM) -> LLMEngine:
    """The native engine (an LLM with backend='vllm' has none)."""
    assert llm.engine is not None, "backend='vllm': the LLM has no native engine"
    return llm.engine


def runner_of(llm: LLM | LLMEngine) -> ModelRunner:
    """The model runner of a tp = 1 engine, in this process."""
    executor = (engine_of(llm) if isinstance(llm, LLM) else llm).executor
    assert isinstance(executor, InProcessExecutor), f"not a tp = 1 engine: {executor!r}"
    return executor.runner


def worker_group_of(llm: LLM | LLMEngine) -> RayWorkerGroup:
    """The Ray worker group of a tp > 1 engine."""
    from dcpserve.engine.worker.ray_executor import RayWorkerGroup

    executor = (engine_of(llm) if isinstance(llm, LLM) else llm).executor
    assert isinstance(executor, RayWorkerGroup), f"not a tp > 1 engine: {executor!r}"
    return executor
