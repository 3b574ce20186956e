"""The host KV tier under a rank failure, on the Ray worker group at tp=2 dcp=2: a TP rank SIGKILLed while a step
that carries the tier's copies is in flight fails that step at once (never a hang) and the group is dead; the engine
that replaces it starts with an empty tier (nothing HOSTED in its prefix report) and serves the same request with the
tokens of transformers, recomputing what the dead engine's tier held."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.core.host_tier import tier_layout
from dcpserve.engine.core.prefix_cache import HOSTED
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.worker.ray_executor import RayWorkerGroup, WorkerGroupError
from tests.engine.host_tier_harness import BLOCK_SIZE, HOST_SLOTS, POOL_BLOCKS, PREFIX_TOKENS, prompts_for, run_together
from tests.engine.llm_checks import hf_greedy
from tests.engine.llm_parts import engine_of, worker_group_of

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(300)]

TP, DCP = 2, 2
PROMPTLY_S = 10.0  # the failed step raises well within this on a busy 2-core machine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tier_faults"), seed=0)


def _llm(tiny: Path) -> LLM:
    from tests.engine.host_tier_harness import engine_args

    page = tier_layout(engine_args(str(tiny), TP, DCP, 1, True).create_engine_config()).bytes_per_block
    return LLM(tiny, tensor_parallel_size=TP, decode_context_parallel_size=DCP, block_size=BLOCK_SIZE, max_num_seqs=2,
               enable_prefix_caching=True, admission="usage", kv_cache_memory_bytes=POOL_BLOCKS * page,
               kv_host_tier=HOST_SLOTS * page)


def _on_rank(group: RayWorkerGroup, rank: int, patch: Callable[[Any], Any]) -> Any:
    import ray

    return ray.get(group.workers[rank].__ray_call__.remote(patch), timeout=30)


def _slow_steps(worker: Any) -> None:
    original = worker.runner.execute

    def execute(output: Any) -> Any:
        time.sleep(3.0)
        return original(output)

    worker.runner.execute = execute


def _pid(worker: Any) -> int:
    return os.getpid()


def _hosted(engine: LLMEngine) -> set[int]:
    report = engine.block_manager.reporter.report(None, 0)  # type: ignore[union-attr]  # prefix caching is on
    return {block for block, state in report.changes.items() if state == HOSTED}


def test_a_rank_killed_with_copies_in_flight_fails_the_step_and_a_new_engine_starts_with_an_empty_tier(
    tiny: Path, ray_cluster: ModuleType
) -> None:
    if ray_cluster.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs 2 (logical) GPUs")
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the patches travel to the ranks by value
    tpb = BLOCK_SIZE * DCP
    prompts = prompts_for(tpb)
    with _llm(tiny) as llm:
        engine, group = engine_of(llm), worker_group_of(llm)
        run_together(engine, {"A": (prompts["A"], PREFIX_TOKENS)})
        run_together(engine, {"B": (prompts["B"], PREFIX_TOKENS)})  # evicts A's cached tail into the tier
        assert _hosted(engine), "B's blocks did not push A's into the tier"
        sent: list[tuple[int, int]] = []  # (swap-outs, swap-ins) of each step the driver sends
        execute = group.execute

        def recording(output: Any) -> Any:
            sent.append((len(output.swap_out), len(output.swap_in)))
            return execute(output)

        group.execute = recording  # type: ignore[method-assign]  # the driver's side of the step, in this process
        _on_rank(group, 0, _slow_steps)
        victim = _on_rank(group, 1, _pid)
        engine.add_request(prompt_token_ids=prompts["A2"], request_id="A2")  # reloads A's blocks from the tier
        outcome: list[BaseException | None] = []

        def step() -> None:
            try:
                engine.step()
                outcome.append(None)
            except BaseException as err:  # noqa: BLE001 - the test inspects it
                outcome.append(err)

        stepping = threading.Thread(target=step)
        stepping.start()
        time.sleep(1.0)  # the step is on the ranks: rank 0 sleeps before its copies and forward
        assert sent and sent[-1][1] > 0, f"the step in flight carries no swap-in: {sent}"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        stepping.join(PROMPTLY_S)
        assert not stepping.is_alive(), "the step did not end after a rank was killed"
        assert time.monotonic() - killed_at < PROMPTLY_S
        assert isinstance(outcome[0], WorkerGroupError) and "TP rank 1 of 2" in str(outcome[0]), outcome
        with pytest.raises(WorkerGroupError, match="TP rank 1 of 2"):
            group.check_health()
    # The replacement: a fresh tier, nothing HOSTED; A2 is recomputed, with the tokens of an engine without a tier.
    with _llm(tiny) as llm:
        engine = engine_of(llm)
        stats = engine.stats().host_tier
        assert stats is not None and stats.used_blocks == 0 and not _hosted(engine)
        fresh = run_together(engine, {"A2": (prompts["A2"], PREFIX_TOKENS)})
        assert engine.stats().host_tier.hit_tokens_host == 0  # type: ignore[union-attr]
    assert fresh["A2"] == hf_greedy(tiny, [prompts["A2"]], PREFIX_TOKENS)[tuple(prompts["A2"])]
