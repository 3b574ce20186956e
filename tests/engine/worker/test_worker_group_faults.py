"""The Ray worker group's step channel under faults and large steps, on a real local Ray cluster (logical GPUs, CPU
ranks trading their collectives over shared memory): a rank that raises or is SIGKILLed mid-step fails the step at
once (never a hang) and the group reports itself dead; health answers during a step; AsyncEngine turns the failure
into an error on every stream; a 16k-token prompt with prompt logprobs (replies of ~0.4 MB per step) equals the
in-process engine's."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dcpserve.cluster.tiny_model import TinyModelSpec, write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.frontend.async_engine import AsyncEngine
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.protocol import EngineDeadError
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.worker.ray_executor import PING_TIMEOUT_S, RayWorkerGroup, WorkerGroupError
from tests.engine.llm_parts import engine_of, worker_group_of

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(300)]

PROMPT = list(range(10, 42))
PROMPTLY_S = 10.0  # a failed step must raise well within this on a busy 2-core machine (not after a gloo timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture
def llm(tiny: Path, ray_cluster: ModuleType) -> Iterator[LLM]:
    if ray_cluster.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs 2 (logical) GPUs")
    import ray.cloudpickle

    # The runner patches below travel to the rank actors by value: tests/ need not be importable there.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with LLM(tiny, tensor_parallel_size=2, decode_context_parallel_size=2) as llm:
        yield llm


def _on_rank(group: RayWorkerGroup, rank: int, patch: Callable[[Any], Any]) -> Any:
    """Runs patch(rank's RankWorker) inside the rank actor (its default thread, beside the steps thread)."""
    import ray

    return ray.get(group.workers[rank].__ray_call__.remote(patch), timeout=30)


def _raise_in_every_step(worker: Any) -> None:
    def execute(output: Any) -> None:
        raise ValueError("injected failure before any collective")

    worker.runner.execute = execute


def _slow_steps(seconds: float) -> Callable[[Any], None]:
    def patch(worker: Any) -> None:
        original = worker.runner.execute

        def execute(output: Any) -> Any:
            time.sleep(seconds)
            return original(output)

        worker.runner.execute = execute

    return patch


def _pid(worker: Any) -> int:
    return os.getpid()


def _start_request(llm: LLM, max_tokens: int = 50) -> None:
    """One greedy request, past its prefill step (its decode steps follow)."""
    engine = engine_of(llm)
    engine.add_request(prompt_token_ids=PROMPT, sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                            ignore_eos=True))
    engine.step()


def _assert_dead(group: RayWorkerGroup, reason: str) -> None:
    """Every later call says the group is dead, with the first failure's reason, without waiting."""
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match=reason):
        group.check_health()
    with pytest.raises(WorkerGroupError, match=reason):
        group.execute(object())  # type: ignore[arg-type]  # never sent: the group is dead
    assert time.monotonic() - start < 1.0


def _transports(worker: Any) -> dict[str, str]:
    return dict(worker.parallel.transports)


def test_the_ranks_of_one_node_trade_their_collectives_over_shared_memory(llm: LLM) -> None:
    group = worker_group_of(llm)
    assert [_on_rank(group, rank, _transports) for rank in range(2)] == [{"tp": "shm", "dcp": "shm"}] * 2


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_rank_that_raises_fails_the_step_at_once(failing_rank: int, llm: LLM) -> None:
    """The other rank is left blocked in the step's first collective (gloo's timeout is 300 s): the step still
    raises as soon as the failing rank replies, names it and its exception, and the group is dead."""
    group = worker_group_of(llm)
    _start_request(llm)
    _on_rank(group, failing_rank, _raise_in_every_step)
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match=f"TP rank {failing_rank} of 2 raised in the step") as raised:
        engine_of(llm).step()
    assert time.monotonic() - start < PROMPTLY_S
    assert "injected failure before any collective" in str(raised.value)
    _assert_dead(group, f"TP rank {failing_rank} of 2 raised")
    start = time.monotonic()
    engine_of(llm).shutdown()  # the ranks were stopped with the failure: nothing to wait for
    assert time.monotonic() - start < PROMPTLY_S


def test_sigkill_of_a_rank_mid_step_fails_the_step_and_health_at_once(llm: LLM) -> None:
    group = worker_group_of(llm)
    _start_request(llm)
    _on_rank(group, 0, _slow_steps(3.0))  # every step now takes 3 s on rank 0
    victim = _on_rank(group, 1, _pid)
    outcome: list[BaseException | None] = []

    def step() -> None:
        try:
            engine_of(llm).step()
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            outcome.append(err)

    stepping = threading.Thread(target=step)
    stepping.start()
    time.sleep(1.0)  # the step is in flight: rank 0 sleeps in it
    start = time.monotonic()
    group.check_health()  # answered during the step: the step runs on the ranks' steps thread
    assert time.monotonic() - start < PING_TIMEOUT_S / 2
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    stepping.join(PROMPTLY_S)
    assert not stepping.is_alive(), "the step did not end after a rank was killed"
    assert time.monotonic() - killed_at < PROMPTLY_S
    assert isinstance(outcome[0], WorkerGroupError) and "TP rank 1 of 2" in str(outcome[0]), outcome
    _assert_dead(group, "TP rank 1 of 2")


def test_async_engine_ends_every_stream_and_fails_health_when_a_rank_dies(
    tiny: Path, ray_cluster: ModuleType
) -> None:
    if ray_cluster.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs 2 (logical) GPUs")
    config = EngineArgs(str(tiny), tensor_parallel_size=2, decode_context_parallel_size=2).create_engine_config()

    async def main() -> None:
        engine = AsyncEngine(config)
        try:
            group = worker_group_of(engine.engine)
            params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            streams = [engine.generate(prompt_token_ids=[5 + i] * 8, sampling_params=params) for i in range(3)]
            firsts = [await stream.__anext__() for stream in streams]  # every request is decoding
            assert all(delta.new_token_ids for delta in firsts)
            await engine.check_health()
            os.kill(_on_rank(group, 1, _pid), signal.SIGKILL)
            start = time.monotonic()
            for stream in streams:
                with pytest.raises(EngineDeadError, match="TP rank 1 of 2"):
                    async with asyncio.timeout(PROMPTLY_S):
                        async for _ in stream:
                            pass
            with pytest.raises(EngineDeadError, match="TP rank 1 of 2"):
                await engine.check_health()
            assert time.monotonic() - start < PROMPTLY_S
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_16k_token_prompt_with_prompt_logprobs_equals_the_in_process_engine(
    tmp_path: Path, ray_cluster: ModuleType
) -> None:
    """The steps of a long prompt and their large replies (4096 positions of prompt logprobs with the top 5 each,
    ~0.4 MB pickled) cross the step channel intact: tokens equal and logprobs close to tp=1's, which has no channel."""
    if ray_cluster.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs 2 (logical) GPUs")
    model = write_tiny_model(tmp_path / "tiny-32k", seed=0, spec=TinyModelSpec(max_position_embeddings=32768))
    prompt = [(7 * i) % 500 + 3 for i in range(16_500)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=5)
    outputs = {}
    for tp, dcp in ((1, 1), (2, 2)):
        with LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, max_num_batched_tokens=4096,
                 max_model_len=32768) as llm:
            [outputs[tp]] = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    single, grouped = outputs[1], outputs[2]
    assert grouped.outputs[0].token_ids == single.outputs[0].token_ids
    assert grouped.prompt_logprobs is not None and single.prompt_logprobs is not None
    assert len(grouped.prompt_logprobs) == len(single.prompt_logprobs) == len(prompt)
    worst = 0.0
    for position, (ours, reference) in enumerate(
            zip(grouped.prompt_logprobs[1:], single.prompt_logprobs[1:], strict=True), 1):
        assert ours is not None and reference is not None, position
        assert ours.token_id == reference.token_id == prompt[position]
        values = [ours.logprob] + [logprob for _, logprob in ours.top]
        reference_values = [reference.logprob] + [logprob for _, logprob in reference.top]
        assert all(math.isfinite(value) for value in values)
        worst = max([worst] + [abs(a - b) / max(abs(b), 1.0) for a, b in zip(values, reference_values, strict=True)])
        # The same alternatives, except where two of them tie within rounding (their order may then swap).
        reference_top = dict(reference.top)
        for token, logprob in ours.top:
            if token not in reference_top:
                assert abs(logprob - reference.top[-1][1]) <= 1e-5 * max(abs(logprob), 1.0), (position, token)
    assert worst <= 1e-5, f"largest relative logprob difference {worst:.2e}"
