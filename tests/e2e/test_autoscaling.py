"""Autoscaling by concurrent sequences on the session's Ray head (bench/harness/cluster.py).

TP=2 x DCP=2 replicas on 4 logical GPUs, so at most 2 replicas fit; autoscaling 1..2 with a target of 1 sequence
per replica and short delays. Three long streams (the official openai client) raise the deployment to 2 running
replicas; closing them (client disconnect: the engine aborts and frees the KV) lowers it back to 1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from bench.harness.cluster import RayHead, ServeCluster, deploy_app, tiny_app_args

pytestmark = [pytest.mark.timeout(400)]

MODEL = "tiny-autoscale"
NUM_STREAMS = 3  # > 2 sequences: desired = ceil(3 / 1) = 3, clamped to max_replicas = 2
STREAM_MAX_TOKENS = 1500  # long enough to keep every stream decoding for the whole scale-up
SCALE_TIMEOUT_S = 90.0

APP_ARGS = tiny_app_args(
    MODEL,
    kv_cache_memory_bytes=2 * 1024 * 1024,  # 4096 tokens per rank, 8192 per replica: 3 streams of ~1.5k fit in one
    autoscaling={
        "min_replicas": 1,
        "max_replicas": 2,  # 2 replicas x tp 2 = all 4 logical GPUs
        "target_sequences_per_replica": 1,
        "upscale_delay_s": 1,
        "downscale_delay_s": 3,
        "look_back_period_s": 2,
    },
)


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    with deploy_app(ray_head, APP_ARGS) as running:
        yield running


async def _wait_for_replicas(cluster: ServeCluster, done: Callable[[dict[str, int]], bool], what: str,
                             history: list[tuple[float, dict[str, int]]], start: float) -> float:
    """Polls Serve's replica states until done(states); returns the seconds it took. Fails with what it saw."""
    deadline = time.monotonic() + SCALE_TIMEOUT_S
    while True:
        states = await asyncio.to_thread(cluster.replica_states)
        if not history or history[-1][1] != states:
            history.append((round(time.monotonic() - start, 1), states))
        if done(states):
            return time.monotonic() - start
        if time.monotonic() > deadline:
            raise AssertionError(f"EngineReplica did not reach {what} within {SCALE_TIMEOUT_S:.0f}s; "
                                 f"replica states seen (seconds, states): {history}")
        await asyncio.sleep(1.0)


async def _wait_for_health(cluster: ServeCluster, done: Callable[[dict], bool], what: str,
                           timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
        while not done(health := (await http.get("/health")).json()):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s:.0f}s; last /health: {health}")
            await asyncio.sleep(0.5)


def test_load_raises_replicas_and_idle_lowers_them(cluster: ServeCluster) -> None:
    import openai

    assert cluster.replica_states() == {"RUNNING": 1}  # min_replicas, before any load
    chunks_received = [0] * NUM_STREAMS

    async def stream(client: openai.AsyncOpenAI, index: int) -> None:
        # One request after another until cancelled, so `index` always holds one running sequence.
        while True:
            response = await client.completions.create(
                model=MODEL, prompt=f"def load_{index}():", max_tokens=STREAM_MAX_TOKENS, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )
            async with response:  # leaving it (cancellation included) closes the connection: a client disconnect
                async for _ in response:
                    chunks_received[index] += 1

    async def run() -> tuple[float, float, list[tuple[float, dict[str, int]]]]:
        history: list[tuple[float, dict[str, int]]] = []
        client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
        start = time.monotonic()
        load = [asyncio.create_task(stream(client, i)) for i in range(NUM_STREAMS)]
        try:
            up_s = await _wait_for_replicas(cluster, lambda states: states.get("RUNNING", 0) == 2,
                                            "2 RUNNING replicas under load", history, start)
            for task in load:
                assert not task.done(), task.exception()  # every stream kept going through the scale-up
            # The new replica joined admission: it reports its KV to the queue, which can now grant it requests.
            await _wait_for_health(cluster, lambda health: health.get("healthy_replicas") == 2,
                                   "2 healthy replicas in /health")
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            await client.close()
        stopped = time.monotonic()
        down_s = await _wait_for_replicas(cluster, lambda states: states == {"RUNNING": 1},
                                          "1 replica (and nothing else) when idle", history, start)
        return up_s, down_s - (stopped - start), history

    up_s, down_s, history = asyncio.run(run())
    assert all(chunks_received), chunks_received  # the load was real: every stream got chunks
    assert max(sum(states.values()) for _, states in history) <= 2, history  # never past max_replicas (4 GPUs)
    print(f"scale up to 2 in {up_s:.1f}s, back to 1 in {down_s:.1f}s after the load stopped; states: {history}")
