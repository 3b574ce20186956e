"""AsyncEngine: streamed deltas equal the batch API, aborts free KV, never-fits fails before queueing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.core.request import RequestRejected
from dcpserve.engine.frontend.async_engine import AsyncEngine
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams) -> tuple[list[int], str, str | None]:
    tokens: list[int] = []
    text = []
    reason = None
    async for delta in engine.generate(prompt, params):
        tokens.extend(delta.new_token_ids)
        text.append(delta.new_text)
        reason = delta.finish_reason
    return tokens, "".join(text), reason


def test_concurrent_streams_equal_batch_generation(tiny: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["hello there", "def main():", "x" * 40]
    with LLM(tiny) as llm:
        expected = [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(prompts, params)]

    async def main() -> list[tuple[list[int], str, str | None]]:
        engine = AsyncEngine(EngineArgs(str(tiny)).create_engine_config())
        try:
            return await asyncio.gather(*(collect(engine, p, params) for p in prompts))
        finally:
            await engine.shutdown()

    for (tokens, text, reason), (want_tokens, want_text) in zip(asyncio.run(main()), expected, strict=True):
        assert tokens == want_tokens and text == want_text and reason == "length"


def test_abandoned_stream_aborts_and_frees_kv(tiny: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(EngineArgs(str(tiny)).create_engine_config())
        try:
            stream = engine.generate("a long one", SamplingParams(max_tokens=500, ignore_eos=True))
            async for delta in stream:
                if delta.num_output_tokens == 3:
                    break
            await stream.aclose()  # what a client disconnect does to the ingress' iterator
            for _ in range(100):
                stats = engine.stats()
                if stats.num_running == 0 and stats.kv_blocks_reserved == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats.num_running == 0 and stats.kv_blocks_used == 0 and stats.kv_blocks_reserved == 0
            # The engine keeps serving after the abort.
            tokens, _, _ = await collect(engine, "next", SamplingParams(max_tokens=4, ignore_eos=True))
            assert len(tokens) == 4
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_never_fits_raises_before_anything_is_queued(tiny: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(EngineArgs(str(tiny), max_model_len=64).create_engine_config())
        try:
            with pytest.raises(RequestRejected, match="exceeds max_model_len=64"):
                await collect(engine, "hi", SamplingParams(max_tokens=100))
            assert engine.stats().num_waiting == 0 and engine.stats().num_pending == 0
            stats = engine.stats()
            assert stats.kv_capacity_tokens == engine.kv_capacity_tokens > 0
            assert stats.per_rank[0].tokens_capacity == stats.kv_capacity_tokens
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_request_that_cannot_be_scheduled_does_not_busy_loop(tiny: Path) -> None:
    """Waiting requests that nothing can run (here: every KV block held elsewhere) make the loop wait for an add,
    an abort or IDLE_RETRY_S, not step again at once; the request runs as soon as KV frees up."""
    from dcpserve.engine.core.core import IDLE_RETRY_S
    from dcpserve.engine.core.request import Request

    async def main() -> None:
        engine = AsyncEngine(EngineArgs(str(tiny), kv_cache_memory_bytes=64 * 1024).create_engine_config())
        blocks = engine.engine.block_manager
        holder = Request("holder", [1], SamplingParams(max_tokens=1))
        assert blocks.reserve(holder, blocks.capacity_tokens) and blocks.num_free_blocks == 0
        steps = 0
        step = engine.engine.step

        def counted_step():
            nonlocal steps
            steps += 1
            return step()

        engine.engine.step = counted_step  # type: ignore[method-assign]
        try:
            stream = engine.generate("blocked", SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(1.0)
            assert not first.done()
            assert steps <= 1.0 / IDLE_RETRY_S + 3, steps  # a busy loop steps thousands of times a second
            await engine.call_in_core(lambda _: blocks.free(holder))  # the core's state: changed on its thread
            delta = await asyncio.wait_for(first, timeout=5.0)
            assert delta.new_token_ids
            async for _ in stream:
                pass
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_core_that_dies_fails_every_request_in_flight_and_the_health_check(tiny: Path) -> None:
    """A step that raises kills the engine core: each stream in flight ends with EngineDeadError at once (not at a
    timeout), the health check and every later submit or query raise it, and nothing is left waiting."""
    from dcpserve.engine.protocol import EngineDeadError

    async def main() -> None:
        engine = AsyncEngine(EngineArgs(str(tiny)).create_engine_config())
        step = engine.engine.step
        submitted = threading.Event()

        def failing_step():
            # The core's first step after all four requests are in raises, however the core's thread and this
            # loop interleave. Until then each step waits up to a second for them, so that no request can finish
            # (400 steps) before the last one is submitted, on however loaded a machine.
            if submitted.wait(timeout=1.0):
                raise RuntimeError("a rank went away")
            return step()

        engine.engine.step = failing_step  # type: ignore[method-assign]
        params = SamplingParams(temperature=1.0, seed=4, max_tokens=400, ignore_eos=True)
        try:
            streams = [await engine.submit(params, prompt=f"prompt {i}") for i in range(4)]
            submitted.set()

            async def drain(stream) -> BaseException | None:
                try:
                    async for _ in stream:
                        pass
                except BaseException as err:  # noqa: BLE001 - the error is what the test looks at
                    return err
                return None

            errors = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout=10)
            assert all(isinstance(e, EngineDeadError) and "a rank went away" in str(e) for e in errors), errors
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                await engine.submit(params, prompt="after")
            with pytest.raises(EngineDeadError):
                await engine.admission_need([1, 2, 3], 4)
            assert not engine.stats().healthy and engine.stats().num_pending == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_the_prompt_hashes_the_ingress_computed_are_the_ones_the_prefix_cache_uses(tiny: Path) -> None:
    """The ingress hashes a prompt once, to route it; the engine starts from those hashes instead of hashing again.
    Shown by what the cache finds: the same prompt under the true hashes hits the first request's blocks, under
    other hashes of the same count it hits nothing (so the engine did not recompute them), and the tokens are the
    same either way. Hashes that cannot belong to the prompt are refused."""
    from dcpserve.engine.core.prefix_cache import prompt_hashes

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(3, 3 + 100))

    async def main() -> tuple[list[list[int]], list[int]]:
        engine = AsyncEngine(EngineArgs(str(tiny)).create_engine_config())
        try:
            ledger = engine.kv_ledger()
            seed = EngineArgs(str(tiny)).prefix_hash_seed()
            hashes = prompt_hashes(prompt, ledger.tokens_per_block, seed)
            assert len(hashes) >= 2
            outputs, hits = [], []
            for i, given in enumerate([hashes, hashes, [h ^ 1 for h in hashes]]):
                before = engine.stats().prefix_cache_hits
                stream = await engine.submit(params, list(prompt), f"r{i}", prompt_hashes=given)
                outputs.append([t async for d in stream for t in d.new_token_ids])  # its last batch's snapshot
                hits.append(engine.stats().prefix_cache_hits - before)
            with pytest.raises(ValueError, match="computed for another engine"):
                await engine.submit(params, list(prompt[:10]), "short", prompt_hashes=hashes)
            return outputs, hits
        finally:
            await engine.shutdown()

    outputs, hits = asyncio.run(main())
    assert outputs[0] == outputs[1] == outputs[2]
    assert hits[0] == 0 and hits[1] > 0 and hits[2] == 0, hits
