"""Layout pools through the deployed app (bench/harness/cluster.py): one app, a short pool (tp=2 dcp=1: 512 tokens of
KV) and a long pool (tp=2 dcp=2: 1,024 tokens), behind one ingress and admission queue. Whatever the interleaving:
every request answered with the offline engine's greedy tokens, a request the short pool cannot hold granted only
to the long pool, and nothing held after the drain."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.harness.cluster import RayHead, ServeCluster, deploy_app, tiny_app_args
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(400)]

MODEL = "tiny-pools"
ONE_REPLICA = {"min_replicas": 1, "max_replicas": 1}
# max_model_len 1024: the long pool holds a whole request of it (the deploy refuses pools none of which does).
APP_ARGS = tiny_app_args(MODEL, admission="usage", max_model_len=1024, pools=[
    {"name": "short", "tensor_parallel_size": 2, "autoscaling": ONE_REPLICA},
    {"name": "long", "tensor_parallel_size": 2, "decode_context_parallel_size": 2, "autoscaling": ONE_REPLICA},
], gpu_budget=4)
# 8 short requests (100 + 40 tokens) and 4 long ones (600 + 40: past the short pool's 512 tokens).
SHORT = [[(7 * i + 3 * j) % 300 + 20 for j in range(100)] for i in range(8)]
LONG = [[(5 * i + 11 * j) % 300 + 20 for j in range(600)] for i in range(4)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    with deploy_app(ray_head, APP_ARGS) as running:
        yield running


def test_each_request_goes_to_a_pool_that_holds_it_and_gets_the_offline_tokens(cluster: ServeCluster) -> None:
    import openai

    prompts = SHORT + LONG
    with LLM(cluster.model_dir) as llm:  # tp=1: the layouts are exact against it (tests/engine, tests/cluster)
        expected = [o.outputs[0].text for o in llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                     ignore_eos=True))]

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=300)

        async def one(prompt: list[int]) -> str:
            reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                    extra_body={"ignore_eos": True})
            return reply.choices[0].text

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await client.close()

    got = asyncio.run(run())
    assert got == expected
    stats = cluster.admission_stats()
    grants = stats.pool_grants
    # Every grant counted, re-grants after a refusal included; a long request's grants are all "only_pool" on the
    # long pool, and no request has the short pool as its only one.
    assert sum(grants.values()) == len(prompts) + stats.num_refusals + stats.num_unreachable
    assert grants.get("long/only_pool", 0) >= len(LONG) and "short/only_pool" not in grants
    assert {r.pool for r in stats.replicas.values()} == {"short", "long"}
    assert all(r.num_grants == 0 and r.granted == 0 for r in stats.replicas.values())
