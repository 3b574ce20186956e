"""The replica's stream batching (deployments.replica.batched_deltas) on a virtual clock: what reaches the ingress is
a function of when the engine produced each token, never of how fast this machine is."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest

from deployments.replica import batched_deltas
from engine.protocol import RequestDelta, TokenLogprob, merge_deltas
from tests.deployments import virtual_time


def _delta(i: int, finished: bool, logprobs: bool = True) -> RequestDelta:
    return RequestDelta("r", [i], f"t{i} ", finished, "length" if finished else None, 7, i + 1,
                        [TokenLogprob(i, -0.5 * i, 1)] if logprobs else None,
                        [None, TokenLogprob(3, -1.0, 2)] if i == 0 else None)


class _Engine:
    """A request's engine stream: one token every `step_s`, finishing after `num_tokens`; records an early close."""

    def __init__(self, num_tokens: int, step_s: float) -> None:
        self.num_tokens = num_tokens
        self.step_s = step_s
        self.produced_at: list[float] = []
        self.closed_early = False

    async def stream(self) -> AsyncIterator[RequestDelta]:
        loop = asyncio.get_running_loop()
        done = False
        try:
            for i in range(self.num_tokens):
                await asyncio.sleep(self.step_s)
                self.produced_at.append(loop.time())
                done = i == self.num_tokens - 1
                yield _delta(i, done)
        finally:
            self.closed_early = not done


async def _receive(engine: _Engine, interval_s: float) -> list[tuple[float, RequestDelta]]:
    loop = asyncio.get_running_loop()
    return [(loop.time(), item) async for item in batched_deltas(engine.stream(), interval_s)]


@pytest.mark.parametrize("step_s", [0.003, 0.01, 0.04, 0.2])
def test_the_first_token_at_once_then_one_item_per_interval_and_the_last_at_once(step_s: float) -> None:
    interval = 0.05
    engine = _Engine(100, step_s)
    received = virtual_time.run(_receive(engine, interval))
    items = [item for _, item in received]
    assert merge_deltas(items) == merge_deltas([_delta(i, i == 99) for i in range(100)])  # nothing lost or reordered
    assert received[0][0] == engine.produced_at[0] and items[0].new_token_ids == [0]  # TTFT unchanged
    assert received[-1][0] == engine.produced_at[-1] and items[-1].finished  # the end is not held back
    times = [t for t, _ in received]
    gaps = [b - a for a, b in zip(times, times[1:-1], strict=False)]
    assert all(gap >= interval - 1e-9 for gap in gaps), gaps  # at most one item per interval (the last excepted)
    duration = engine.produced_at[-1] - engine.produced_at[0]
    assert len(items) <= 2 + math.ceil(duration / interval)
    if step_s <= interval / 4:
        assert len(items) <= 100 / 4  # at least 4 tokens per item when tokens come 4 times faster


def test_interval_zero_passes_every_delta_through() -> None:
    engine = _Engine(10, 0.01)
    items = [item for _, item in virtual_time.run(_receive(engine, 0.0))]
    assert items == [_delta(i, i == 9) for i in range(10)]


def test_closing_the_batched_stream_closes_the_engine_stream() -> None:
    """A client that goes away closes the replica's generator: the engine's stream ends too (it aborts the
    request), also while the batcher waits out an interval."""
    engine = _Engine(1000, 0.01)

    async def main() -> int:
        batched = batched_deltas(engine.stream(), 0.05)
        seen = 0
        async for item in batched:
            seen += len(item.new_token_ids)
            if seen >= 10:
                break
        await batched.aclose()
        await asyncio.sleep(0)
        return seen

    assert virtual_time.run(main()) >= 10
    assert engine.closed_early and len(engine.produced_at) < 1000


def test_an_engine_error_reaches_the_reader_after_the_tokens_before_it() -> None:
    async def failing() -> AsyncIterator[RequestDelta]:
        for i in range(3):
            await asyncio.sleep(0.01)
            yield _delta(i, False)
        raise RuntimeError("the engine failed")

    async def main() -> list[int]:
        tokens: list[int] = []
        with pytest.raises(RuntimeError, match="the engine failed"):
            async for item in batched_deltas(failing(), 0.05):
                tokens += item.new_token_ids
        return tokens

    assert virtual_time.run(main()) == [0, 1, 2]
