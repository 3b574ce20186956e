"""The real app through `serve deploy` (the CLI) on the session's Ray head, driven by the openai client.

One small deployment (TP=2 x DCP=2 on logical GPUs, 32 KV blocks of 32 tokens, a queue of 2) serves every test:
OpenAI completions / chat / streams, greedy output vs engine.LLM, bad input, KV admission (queued requests admitted
in FIFO order, 429 + Retry-After, never-fits 400, no over-commit), a killed client freeing its KV, every listener of
the cluster on loopback or behind Ray's mutual TLS, and no key of it in a log, a metric or a reply. KV pressure is
made by grants the test holds itself (ServeCluster.held_kv), never by a long request that should still be running.
The head comes from bench/harness/cluster.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from bench.harness.cluster import (
    CAPACITY_BLOCKS,
    RayHead,
    ServeCluster,
    deploy_app,
    present,
    serve_inter_deployment_grpc_ports,
    tiny_app_args,
)
from bench.harness.listeners import assert_only_the_clusters_certificate, key_leaks
from dcpserve.deployments.messages import Acquire, Granted

if TYPE_CHECKING:
    import openai

pytestmark = [pytest.mark.timeout(400)]

MODEL = "tiny-e2e"
# admission "full": the FIFO, never-fits and capacity scenarios below count prompt + max_tokens per request
# (tests/e2e/test_preemption.py covers "usage"). Grants the test holds are never reported by the replica: the
# leak grace outlasts the module. A queued request waits for the test's releases: a queue timeout far past them.
APP_ARGS = tiny_app_args(MODEL, admission="full", max_queued_requests=2, queue_timeout_s=120, retry_after_s=2,
                         grant_leak_grace_s=600)


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    with deploy_app(ray_head, APP_ARGS, via_cli=True) as running:
        yield running


@pytest.fixture(scope="module")
def server(cluster: ServeCluster) -> str:
    return cluster.url


@pytest.fixture(scope="module")
def model_dir(cluster: ServeCluster) -> Path:
    return cluster.model_dir


def client(server: str) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def health(server: str) -> dict:
    return httpx.get(f"{server}/health", timeout=30).json()


def test_openai_client_completions_chat_and_streams(server: str) -> None:
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    out = c.completions.create(model=MODEL, prompt="def hello", max_tokens=6, temperature=0)
    assert out.usage is not None
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.prompt_tokens > 0
    assert out.usage.completion_tokens <= 6 and out.choices[0].text
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                     temperature=0, seed=3)
    chat_usage = chat.usage
    assert chat_usage is not None
    assert chat.choices[0].message.role == "assistant" and chat_usage.completion_tokens <= 5
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
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat_usage.completion_tokens
    # vLLM's continuous_usage_stats (guidellm's default streaming request): usage rides on every chunk.
    chunks = list(c.chat.completions.create(  # type: ignore[call-overload]  # continuous_usage_stats: vLLM's, not in the SDK's types
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, seed=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [ch.usage for ch in chunks]
    assert all(usage is not None for usage in usages)
    completion_tokens = [usage.completion_tokens for usage in usages if usage is not None]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == chat_usage.completion_tokens
    assert completion_tokens[0] == 0 and usages[0] is not None and usages[0].prompt_tokens == chat_usage.prompt_tokens


def test_greedy_output_equals_engine_llm(server: str, model_dir: Path) -> None:
    from dcpserve.engine.frontend.llm import LLM
    from dcpserve.engine.sampling_params import SamplingParams

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
    ({"model": MODEL, "prompt": "x", "n": 17}, "n: Input should be less than or equal to 16"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs: Input should be less than or equal to 20"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias has token ids outside the vocabulary"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix is not supported"),
    ({"model": MODEL, "prompt": "x", "guided_json": {"type": "objectx"}},
     "guided_json: the json constraint cannot be compiled"),
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


def long_prompt(tokens: int, variant: int = 0) -> list[int]:
    """A prompt of its own per variant from the first token on: requests of different variants share no cached
    prefix block, so each needs the whole KV the capacity arithmetic counts for it."""
    return [(7 * i + variant) % 250 + 5 for i in range(tokens)]


def test_never_fits_is_400_at_once(server: str) -> None:
    start = time.monotonic()
    reply = httpx.post(f"{server}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": long_prompt(1500), "max_tokens": 16})
    assert reply.status_code == 400 and time.monotonic() - start < 10
    message = reply.json()["error"]["message"]
    assert f"holds {CAPACITY_BLOCKS} blocks" in message and "needs 48 KV blocks" in message


# The burst: the test holds all 32 blocks itself (19 + 13). Requests 0 and 1 (13 blocks each: (380 + 20) / 32) fit
# nowhere and fill the queue of 2; 2..4 overflow at once. Releasing the 13 admits 0, the head of the line; 1 needs
# 0's blocks (the test keeps its 19 until the end), so it starts only once 0 has finished. Every order below follows
# from the grants the test holds, not from how fast anything decodes.
BURST_REQUESTS = 5
BURST_MAX_TOKENS = 20
BURST_PROMPT_TOKENS = 380
HELD = {"held-19": 19, "held-13": 13}


async def _wait_until(check: Callable[[], Awaitable[object]], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (seen := await check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting until {what}; last seen: {seen!r}")
        await asyncio.sleep(0.05)


def test_burst_queues_in_fifo_order_overflows_with_429_and_never_over_commits(cluster: ServeCluster) -> None:
    samples: list[dict] = []
    events: list[dict] = [{"i": i} for i in range(BURST_REQUESTS)]

    async def one(http: httpx.AsyncClient, i: int) -> None:
        event = events[i]
        body = {"model": MODEL, "prompt": long_prompt(BURST_PROMPT_TOKENS, i), "max_tokens": BURST_MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            event["status"], event["headers"] = reply.status_code, reply.headers
            if reply.status_code != 200:
                event["body"] = json.loads(await reply.aread())
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices") and "first_token" not in event:
                    event["first_token"] = time.monotonic()
                if chunk.get("usage"):
                    event["completion_tokens"] = chunk["usage"]["completion_tokens"]
            event["done"] = time.monotonic()

    async def watch(http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            samples.append((await http.get("/health")).json())
            await asyncio.sleep(0.1)

    async def call(method: str, *args: object) -> Any:
        return await asyncio.to_thread(cluster.call, "KvAdmission", method, *args)

    async def run() -> dict[str, float]:
        marks: dict[str, float] = {}
        for ticket, blocks in HELD.items():
            assert isinstance(await call("acquire", Acquire(ticket, blocks, 30.0)), Granted)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(http, stop))

            async def queued(n: int) -> bool:
                return (await http.get("/health")).json()["queued"] == n

            tasks = []
            for i in range(BURST_REQUESTS):
                tasks.append(asyncio.create_task(one(http, i)))
                if i < 2:  # one at a time, each once the queue visibly holds it: arrival order = submit order
                    await _wait_until(functools.partial(queued, i + 1), f"request {i} waits in the admission queue")
                else:
                    await asyncio.wait_for(tasks[i], timeout=60)  # the queue is full: an answer at once
            assert not tasks[0].done() and not tasks[1].done()  # nothing could be granted: they still wait
            marks["released_13"] = time.monotonic()
            await call("release", "held-13")
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
            await call("release", "held-19")
            stop.set()
            await watcher
        return marks

    marks = asyncio.run(run())
    statuses = [event.get("status") for event in events]
    assert statuses == [200] * 2 + [429] * 3, (statuses, events)  # exactly one answer each: 2 waited, 3 overflowed
    for event in events[2:]:
        assert event["headers"]["Retry-After"] == "2" and event["body"]["error"]["type"] == "rate_limit_error"
        assert "max_queued_requests=2" in event["body"]["error"]["message"], event["body"]
    for event in events[:2]:
        assert event["completion_tokens"] == BURST_MAX_TOKENS and "first_token" in event, event
    # FIFO: the head of the line starts once the test's release made room for it, and the next only after it ended.
    head, second = events[0], events[1]
    assert marks["released_13"] < head["first_token"] < second["first_token"], events[:2]
    assert samples, "no /health samples"
    for sample in samples:  # one replica: the app-wide counts are its own
        assert sample["kv_granted_blocks"] + sample["kv_external_blocks"] <= sample["kv_capacity_blocks"] == \
            CAPACITY_BLOCKS
    assert cluster.admission_stats().num_leaked == 0  # every grant was released by its holder


def test_every_listener_is_on_loopback_or_lets_in_only_the_clusters_certificate(
        cluster: ServeCluster, tmp_path: Path) -> None:
    """With the app running (its ingress, admission queue, a tp=2 replica with its rank actors, their process group
    and its store), every socket a process of the head or this driver listens on is on loopback, or takes a TLS
    session with a certificate of the cluster's CA and refuses one without a certificate or with another CA's
    (probed over loopback only). No exemption: Serve's inter-deployment gRPC server in each replica, which Ray 2.60
    binds to every interface, is among those probed, and a gRPC channel to it settles READY with the cluster's
    certificate only (docs/operations.md, "What listens where")."""
    tls = present(cluster.head.tls, "TLS: the suite runs with it (DCPSERVE_TLS=0 exposes what this test finds)")
    sockets = cluster.head.listening_sockets()
    assert len(sockets) > 10, sockets  # the check sees the cluster's listeners: GCS, raylet, agents, proxy, ranks
    assert any(s.port == cluster.settings.http_port for s in sockets), sockets
    grpc = serve_inter_deployment_grpc_ports(cluster.head.api)
    assert len(grpc) == 3, grpc  # the ingress, the admission queue, the engine replica
    assert_only_the_clusters_certificate(sockets, tls, grpc, tmp_path)


def test_no_key_material_in_logs_metrics_or_replies(cluster: ServeCluster) -> None:
    """Every private key of the head's TLS directory (its CA, the head, the user's client, this driver, the probes)
    and this driver's own slot: no line of any of them appears in the head's log, any log of Ray's session (every
    process of the cluster, the app's replicas included), the metrics of every node, or the app's /health,
    /v1/models and an error reply."""
    tls = present(cluster.head.tls, "TLS")
    assert len(list(tls.directory.rglob("*.key"))) >= 3  # ca, head, the driver (at least)
    texts: dict[str, str] = {"ray_head.log": (cluster.settings.state_dir / "ray_head.log").read_text(errors="replace")}
    logs = cluster.temp_dir / "session_latest" / "logs"
    for path in logs.rglob("*"):
        if path.is_file():
            texts[str(path.relative_to(logs))] = path.read_text(errors="replace")
    assert len(texts) > 20, sorted(texts)  # the GCS', raylet's, agents' and every worker's logs
    discovery = json.loads((cluster.temp_dir / "session_latest" / "prom_metrics_service_discovery.json").read_text())
    targets = [target for group in discovery for target in group["targets"]]
    assert targets, discovery
    for target in targets:
        texts[f"metrics {target}"] = httpx.get(f"http://{target}/metrics", timeout=30).text
    for route in ("/health", "/v1/models"):
        texts[route] = httpx.get(f"{cluster.url}{route}", timeout=30).text
    texts["an error reply"] = httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL}, timeout=30).text
    assert key_leaks(tls.directory, texts) == []


def test_killed_client_frees_its_kv(cluster: ServeCluster) -> None:
    """A client that closes its connection mid-stream: the request is aborted and its grant released by the ingress
    (the app's leak grace of 600 s is far past the wait below, so only that release can free it)."""
    server = cluster.url
    with httpx.Client(base_url=server, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "def hello", "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert health(server)["kv_granted_blocks"] > 0  # 900 + 3 tokens held while it streams
        # The connection is closed mid-stream: the request must be aborted and its KV freed.
    deadline = time.monotonic() + 60
    while (counts := health(server))["kv_free_blocks"] != CAPACITY_BLOCKS:
        assert time.monotonic() < deadline, f"KV still held 60 s after the client left: {counts}"
        time.sleep(0.25)
    assert cluster.admission_stats().num_leaked == 0
