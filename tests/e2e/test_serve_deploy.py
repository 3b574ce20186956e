"""The real app through `ray start` + `serve deploy` on a cluster this module starts, driven by the openai client.

One small deployment (TP=2 x DCP=2 on logical GPUs, 32 KV blocks of 32 tokens, a queue of 2) serves every test:
OpenAI completions / chat / streams, greedy output vs engine.LLM, bad input, KV admission (429 + Retry-After,
never-fits 400, no over-commit), and a killed client freeing its KV.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from deployments import local_cluster
from engine.tiny_model import write_tiny_model

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(400)]

MODEL = "tiny-e2e"
CAPACITY_BLOCKS = 32  # 256 KiB per rank / 512 B per token = 512 tokens per rank, x dcp 2 = 1024 = 32 x 32

APP_ARGS = {
    "served_model_name": MODEL,
    "tensor_parallel_size": 2,
    "decode_context_parallel_size": 2,
    "kv_cache_memory_bytes": 262144,
    "max_model_len": 2048,
    "max_num_seqs": 8,
    "max_queued_requests": 2,
    "queue_timeout_s": 20,
    "retry_after_s": 2,
    "routing_stats_period_s": 0.5,
    "kv_report_period_s": 0.25,
    "autoscaling": {"min_replicas": 1, "max_replicas": 1},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    state = tmp_path_factory.mktemp("serve")
    model_dir = write_tiny_model(state / "model")
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [{"name": "dcpserve", "route_prefix": "/", "import_path": "deployments.app:build_app",
                          "args": dict(APP_ARGS)}],
    }
    (state / "serve_config.yaml").write_text(yaml.safe_dump(config))
    settings = local_cluster.LocalSettings(
        http_port=local_cluster.free_port(), ray_port=local_cluster.free_port(),
        dashboard_port=local_cluster.free_port(), num_gpus=4, state_dir=state,
        config=state / "serve_config.yaml", deploy_timeout_s=240,
    )
    env = local_cluster.ray_env(state)
    temp_dir = Path(tempfile.mkdtemp(prefix="dcpe2e-", dir="/tmp"))
    head = local_cluster.start_head(settings, env, temp_dir)
    try:
        local_cluster.wait_for_dashboard(settings, head)
        local_cluster.deploy_and_wait(settings, env, local_cluster.write_config(settings, model_dir), head)
        yield f"http://127.0.0.1:{settings.http_port}"
    finally:
        local_cluster.stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(server: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llm") / "model")  # byte-identical to the served one


def client(server: str):  # noqa: ANN201 - openai.OpenAI
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def health(server: str) -> dict:
    return httpx.get(f"{server}/health", timeout=30).json()


def test_openai_client_completions_chat_and_streams(server: str) -> None:
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    out = c.completions.create(model=MODEL, prompt="def hello", max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.prompt_tokens > 0
    assert out.usage.completion_tokens <= 6 and out.choices[0].text
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                     temperature=0, seed=3)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
    pieces, finishes = [], []
    for chunk in c.completions.create(model=MODEL, prompt="def hello", max_tokens=6, temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        finishes.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == out.choices[0].text  # greedy: the stream adds up to the same text
    assert finishes[-1] == out.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=0, seed=3, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_greedy_output_equals_engine_llm(server: str, model_dir: Path) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prompts = ["def hello", "import json\n"]
    llm = LLM(model_dir, max_model_len=2048)
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                                  ignore_eos=True))]
    c = client(server)
    served = [c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert served == expected


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    ({"model": MODEL, "prompt": 5}, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, "max_model_len=2048"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "x", "n": 2}, "n=2"),
    ({"model": "gpt-4", "prompt": "x"}, "not served here"),
    ({"model": MODEL, "messages": []}, "messages"),
])
def test_bad_input_gets_openai_400(server: str, body: object, fragment: str) -> None:
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(f"{server}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"]
    ok = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the server keeps serving others


def long_prompt(tokens: int) -> list[int]:
    return [(7 * i) % 250 + 5 for i in range(tokens)]


def test_never_fits_is_400_at_once(server: str) -> None:
    start = time.monotonic()
    reply = httpx.post(f"{server}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": long_prompt(1500), "max_tokens": 16})
    assert reply.status_code == 400 and time.monotonic() - start < 10
    message = reply.json()["error"]["message"]
    assert f"holds {CAPACITY_BLOCKS} blocks" in message and "needs 48 KV blocks" in message


def test_burst_queues_in_order_overflows_with_429_and_never_over_commits(server: str) -> None:
    # Each request needs blocks_needed(380 + 20, 32) = 13 of 32 blocks: 2 run, 2 wait, the rest get 429.
    samples: list[dict] = []

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, httpx.Response, float]:
        await asyncio.sleep(0.05 * i)  # arrival order = i
        reply = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": long_prompt(380), "max_tokens": 20, "temperature": 0, "ignore_eos": True})
        return i, reply, time.monotonic()

    async def watch(http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            samples.append((await http.get("/health")).json())
            await asyncio.sleep(0.1)

    async def run() -> list[tuple[int, httpx.Response, float]]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(http, stop))
            results = await asyncio.gather(*(one(http, i) for i in range(7)))
            stop.set()
            await watcher
            return results

    results = asyncio.run(run())
    statuses = [reply.status_code for _, reply, _ in results]
    assert len(results) == 7 and set(statuses) <= {200, 429}, statuses  # exactly one response each
    assert statuses.count(429) >= 1 and statuses.count(200) >= 4, statuses
    for _, reply, _ in results:
        if reply.status_code == 429:
            assert reply.headers["Retry-After"] == "2"
            assert reply.json()["error"]["type"] == "rate_limit_error"
        else:
            assert reply.json()["usage"]["completion_tokens"] == 20
    served = sorted((done, i) for i, reply, done in results if reply.status_code == 200)
    assert [i for _, i in served][2:] == sorted(i for _, i in served)[2:]  # queued ones finish in arrival order
    assert samples, "no /health samples"
    for sample in samples:
        for replica in sample["replicas"].values():
            assert replica["granted"] + replica["external"] <= replica["capacity"] == CAPACITY_BLOCKS


def test_killed_client_frees_its_kv(server: str) -> None:
    with httpx.Client(base_url=server, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "def hello", "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            replica = next(iter(health(server)["replicas"].values()))
            assert replica["granted"] > 0  # 900 + 3 tokens held while it streams
        # The connection is closed mid-stream: the request must be aborted and its KV freed.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        replica = next(iter(health(server)["replicas"].values()))
        if replica["free"] == CAPACITY_BLOCKS:
            break
        time.sleep(0.25)
    assert replica["free"] == CAPACITY_BLOCKS, replica
