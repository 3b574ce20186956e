"""Prefix caching through the deployed app with 2 engine replicas: multi-turn conversations go back to the replica
that holds their history, and a request whose prefix is cached computes only the rest of its prompt.

The openai client against the app on the session's Ray head (bench/harness/cluster.py). The speed claims (TTFT,
tokens/s, hit rates against KV-only routing) are `python -m bench prefix`'s. Here the counts that hold whatever the
interleaving are asserted (every prompt block and token was looked up, no more was served from a cache than earlier
turns left there, a repeated prompt computes only its last block and its answer); the shares themselves depend on when
the replicas' reports land, so they are printed, and the rule behind them (every turn returns to its history) is
asserted exactly, for many seeded interleavings, in tests/deployments/admission/test_admission_sim.py.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest

from bench.harness.cluster import RayHead, ServeCluster, deploy_app, tiny_app_args

pytestmark = [pytest.mark.timeout(400)]

MODEL = "tiny-prefix"
CONVERSATIONS, TURNS, CONTEXT, USER, ANSWER = 4, 4, 200, 24, 8
TOKENS_PER_BLOCK = 16  # tp=1: block_size 16 x dcp 1


def replica_counters(cluster: ServeCluster) -> dict[str, dict[str, int]]:
    """Every engine replica's prefix counters, by replica id (a stats() call addressed to each)."""
    return {stats.replica_id: {k: getattr(stats.engine, k) for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                                     "tokens_computed", "kv_blocks_cached")}
            for stats in cluster.every_replica_stats()}


async def completion(client: Any, prompt: list[int]) -> list[int]:
    answer = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=ANSWER, temperature=1.0, seed=len(prompt), logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    tokens = [int(t.split(":", 1)[1]) for t in answer.choices[0].logprobs.tokens]
    assert len(tokens) == ANSWER
    return tokens


async def conversations(url: str) -> list[list[int]]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    rng = random.Random(7)

    async def one() -> list[int]:
        history = [rng.randrange(256) for _ in range(CONTEXT)]
        for _ in range(TURNS):
            history += [rng.randrange(256) for _ in range(USER)]
            history += await completion(client, history)
        return history

    try:
        return list(await asyncio.gather(*(one() for _ in range(CONVERSATIONS))))
    finally:
        await client.close()


APP_ARGS = tiny_app_args(MODEL, tensor_parallel_size=1, decode_context_parallel_size=1,
                         kv_cache_memory_bytes=4 << 20, autoscaling={"min_replicas": 2, "max_replicas": 2})


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    with deploy_app(ray_head, APP_ARGS) as running:
        yield running


def prompt_blocks(turn: int) -> int:
    """Blocks of a turn's prompt that could be cached (never the block of its last token)."""
    return (CONTEXT + turn * (USER + ANSWER) + USER - 1) // TOKENS_PER_BLOCK


def test_conversations_return_to_the_replica_holding_their_history(cluster: ServeCluster) -> None:
    before = cluster.admission_stats()
    histories = asyncio.run(conversations(cluster.url))
    after = cluster.admission_stats()
    counters = replica_counters(cluster)
    assert len(counters) == 2, counters

    # The router's view: of the prompt blocks that could be cached, those the granted replica had cached. At most,
    # every turn after the first finds its whole previous turn's prompt there (its answer's blocks too once a report
    # named them): 75% of all prompt blocks when every turn returns to its history.
    queried = after.prefix_query_blocks - before.prefix_query_blocks
    hit = after.prefix_hit_blocks - before.prefix_hit_blocks
    assert queried == sum(prompt_blocks(t) for t in range(TURNS)) * CONVERSATIONS
    most = sum((CONTEXT + t * (USER + ANSWER)) // TOKENS_PER_BLOCK for t in range(1, TURNS)) * CONVERSATIONS
    print(f"router prefix-hit share: {hit}/{queried} blocks = {hit / queried:.0%} (every turn home: {most})")
    assert 0 <= hit <= most
    # The replicas' own count: the prompt tokens they served from their caches.
    queries = sum(c["prefix_cache_queries"] for c in counters.values())
    hits = sum(c["prefix_cache_hits"] for c in counters.values())
    print(f"replica prefix hit rate: {hits}/{queries} tokens = {hits / queries:.0%}")
    assert queries == CONVERSATIONS * sum(CONTEXT + t * (USER + ANSWER) + USER for t in range(TURNS))
    assert 0 <= hits <= most * TOKENS_PER_BLOCK

    # The same long prompt again, with both replicas idle: it goes to the replica caching it (the longest run wins
    # among replicas in balance) and computes only what is not cached: its last block's tokens and the answer.
    last = histories[0]
    computed_before = sum(c["tokens_computed"] for c in replica_counters(cluster).values())
    asyncio.run(_one(cluster.url, last))
    computed_after = sum(c["tokens_computed"] for c in replica_counters(cluster).values())
    assert computed_after - computed_before < TOKENS_PER_BLOCK + ANSWER


async def _one(url: str, prompt: list[int]) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        await completion(client, prompt)
    finally:
        await client.close()
