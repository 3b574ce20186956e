"""usage admission through the deployed app (bench/harness/cluster.py): long streams that together outgrow a replica's
KV are preempted and recomputed inside the engine, and every client still gets its complete, correct stream; a
chat request without max_tokens runs to the end of the context (OpenAI's default), not 16 tokens.

One replica at tp=2 x dcp=2 with 1024 tokens of KV (32 logical blocks). Three greedy streams of 60 + 450 tokens
are all admitted (usage counts their prompts), then need 1530 tokens: preemption is forced. The expected tokens
come from the engine at tp=1 in this process, with room for everything (the layouts are exact against
transformers: tests/cluster, tests/engine).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from bench.harness.cluster import CAPACITY_BLOCKS, RayHead, ServeCluster, deploy_app, present, tiny_app_args
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(400)]

MODEL = "tiny-preempt"
# The leak grace outlasts the disconnect test's wait: only the ingress' own release can free a grant there.
APP_ARGS = tiny_app_args(MODEL, admission="usage", kv_headroom=0.05, grant_leak_grace_s=600)
PROMPTS = [[(11 * i + 5 * j) % 400 + 20 for j in range(60)] for i in range(3)]
MAX_TOKENS = 450  # 3 x (60 + 450) = 1530 tokens > 1024: the streams cannot all hold their KV at the end


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    with deploy_app(ray_head, APP_ARGS) as running:
        yield running


def test_streams_outgrowing_the_kv_are_preempted_and_complete(cluster: ServeCluster) -> None:
    import openai

    assert 3 * (60 + MAX_TOKENS) > CAPACITY_BLOCKS * 32
    with LLM(cluster.model_dir) as llm:  # tp=1, 128 MiB of KV: no preemption
        expected = [o.outputs[0].text for o in llm.generate(
            prompt_token_ids=PROMPTS, sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                     ignore_eos=True))]

    async def stream(client: openai.AsyncOpenAI, prompt: list[int]) -> tuple[str, int, str | None]:
        text, finish, used = [], None, 0
        response = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for chunk in response:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return "".join(text), used, finish

    async def chat_without_max_tokens(client: openai.AsyncOpenAI) -> tuple[int, str | None]:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me everything"}], temperature=0,
            extra_body={"ignore_eos": True},
        )
        return present(reply.usage).completion_tokens, reply.choices[0].finish_reason

    async def run() -> tuple[list[tuple[str, int, str | None]], tuple[int, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=300)
        try:
            streams = await asyncio.gather(*(stream(client, p) for p in PROMPTS))
            chat = await chat_without_max_tokens(client)
        finally:
            await client.close()
        return streams, chat

    streams, (chat_tokens, chat_finish) = asyncio.run(run())
    for index, (text, used, finish) in enumerate(streams):
        assert used == MAX_TOKENS and finish == "length", (index, used, finish)
        assert text == expected[index], f"stream {index} differs from the unpreempted run"
    # No max_tokens: until the end of the context. With ignore_eos that is where the replica's KV ends (1024
    # tokens of prompt + output), far past the old default of 16.
    assert chat_finish == "length" and chat_tokens > 16 * 10, (chat_tokens, chat_finish)


def test_streaming_clients_that_disconnect_free_their_kv(cluster: ServeCluster) -> None:
    """Six streams closed right after their first chunk, three rounds: afterwards the queue holds no grant and the
    replica's ledger (reported every 0.25 s) holds nothing, and every grant was released by the ingress (the leak
    grace of 600 s is far past the 60 s wait: a release that never comes, as when a generator left to the garbage
    collector or a cancelled release kept them until leak reconciliation, fails here)."""
    import httpx

    def held(health: dict) -> int:
        return health["kv_granted_blocks"] + health["kv_external_blocks"]

    async def one(http: httpx.AsyncClient, index: int) -> None:
        body = {"model": MODEL, "prompt": [30 + index] * 20, "max_tokens": 800, "temperature": 1.0, "seed": index,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    break  # leaving the block closes the connection: a client disconnect

    async def round_trip() -> float:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            await asyncio.gather(*(one(http, i) for i in range(6)))
            closed = time.monotonic()
            while held(health := (await http.get("/health")).json()):
                if time.monotonic() - closed > 60:
                    raise AssertionError(f"KV still held 60 s after the clients left: {health}")
                await asyncio.sleep(0.2)
            return time.monotonic() - closed

    freed = [asyncio.run(round_trip()) for _ in range(3)]
    print(f"KV free {', '.join(f'{s:.1f}' for s in freed)} s after the clients left")
    assert cluster.admission_stats().num_leaked == 0
