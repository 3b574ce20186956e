"""The deployed app with the vLLM backend (the real vLLM CPU wheel: `make test-vllm`), driven by the openai client.

The tiny model at tp=2 (vLLM's multiprocessing executor, one core per rank; dcp=1 since vLLM's CPU attention cannot
shard KV) behind the same ingress, admission queue, router and replica as the native engine:
- greedy tokens equal transformers' (and so the native engine's, which tests/engine checks against the same);
- KV capacity is what vLLM sized (its logged size minus its null block); with the whole KV held by the test's own
  grant every request gets a 429 at once ("full" admission, no queue), and a burst past the KV is answered 200 or 429
  each, never over-commits and never makes vLLM preempt;
- a client that disconnects mid-stream leaves nothing held inside vLLM (running back to 0, the ledger empty), and
  its grant is released by the ingress. That vLLM stops generating an aborted request is the engine's own test
  (tests/engine/test_engine_protocol.py), where nothing between the abort and vLLM can be slow.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from bench.harness.cluster import RayHead, ServeCluster, deploy_app, present, tiny_app_args
from dcpserve.deployments.messages import ReplicaStats
from tests.e2e.structured_checks import (
    check_bad_constraints_are_400s,
    check_constraints_and_tools,
    check_thirty_schemas,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny-vllm"
# 33 pages of 32 tokens (16 KiB each for the tiny model, its one KV head replicated on both TP ranks): vLLM keeps one
# as its null block, so 32 logical blocks = 1024 tokens, exactly one max_model_len request (vLLM's minimum).
BLOCK_TOKENS = 32
CAPACITY_BLOCKS = 32
APP_ARGS = tiny_app_args(
    MODEL,
    backend="vllm",
    tensor_parallel_size=2,
    decode_context_parallel_size=1,
    block_size=BLOCK_TOKENS,
    kv_cache_memory_bytes=(CAPACITY_BLOCKS + 1) * 16384,
    max_model_len=1024,
    admission="full",
    max_queued_requests=0,  # no waiting: what does not fit now is a 429 at once
    grant_leak_grace_s=600,  # the test's own grant is never reported by the replica: it must outlast the module
)
PROMPTS = [[7], list(range(10, 42)), list(range(100, 171))]


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    with deploy_app(ray_head, APP_ARGS, deploy_timeout_s=400) as running:
        yield running


def client(cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_quiet(cluster: ServeCluster, timeout_s: float = 60) -> ReplicaStats:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cluster.engine_stats()
        if stats.engine.num_running == 0 and not stats.ledger.per_request:
            return stats
        assert time.monotonic() < deadline, f"the vLLM replica still holds requests: {stats}"
        time.sleep(0.5)


def test_greedy_tokens_equal_transformers(cluster: ServeCluster) -> None:
    from transformers import AutoModelForCausalLM

    from dcpserve.engine.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(cluster.model_dir, dtype=torch.float32)
    tokenizer = present(load_tokenizer(str(cluster.model_dir), ()), "tokenizer")
    api = client(cluster)
    for prompt in PROMPTS:
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
        reply = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
        # The API returns text: the same tokens decode to the same text with the model's tokenizer.
        assert reply.choices[0].text == tokenizer.decode(expected[0, len(prompt):].tolist()), prompt
        assert present(reply.usage).completion_tokens == 12


def test_capacity_is_what_vllm_sized(cluster: ServeCluster) -> None:
    stats = wait_quiet(cluster)
    assert stats.engine.backend == "vllm" and stats.engine.tp == 2 and stats.engine.dcp == 1
    assert stats.ledger.capacity_blocks == CAPACITY_BLOCKS and stats.ledger.tokens_per_block == BLOCK_TOKENS
    # This app's engine replica's own logs (its Ray worker's, where vLLM's engine core writes too): other apps on
    # the session's head sized KV caches of their own.
    (replica,) = cluster.serve_details()["applications"][cluster.app_name]["deployments"]["EngineReplica"]["replicas"]
    logs = [log for log in (cluster.temp_dir / "session_latest" / "logs").glob(f"**/worker-*-{replica['pid']}.*")
            if log.is_file()]
    logged = []
    for log in logs:
        logged += re.findall(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    assert logged, f"vLLM's 'KV cache size' line is in none of the replica's logs {logs}"
    # vLLM counts its null block in the size it logs; the ledger does not (it never holds KV).
    assert {int(n.replace(",", "")) for n in logged} == {(CAPACITY_BLOCKS + 1) * BLOCK_TOKENS}


def test_a_burst_is_admitted_by_the_kv_it_finds_and_vllm_never_preempts(cluster: ServeCluster) -> None:
    """8 requests of 16 blocks each ((56 + 456) / 32) against 32 blocks, no queue.

    With the test holding the whole KV, every one is a 429 at once: nothing fits now, and nothing waits. Then the same
    burst with the KV free: which of them find room depends on when each arrives against when the first ones end, so
    what is asserted is what holds whatever the timing: each is answered 200 with all its tokens or 429 with
    Retry-After, the first two to arrive always fit, the grants never exceed the KV, and vLLM never preempts (under
    "full" admission what was admitted always fits)."""
    body = {"model": MODEL, "prompt": list(range(20, 76)), "max_tokens": 456, "temperature": 1.0,
            "ignore_eos": True}
    samples: list[dict] = []

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            stop = asyncio.Event()

            async def watch() -> None:
                while not stop.is_set():
                    samples.append((await http.get("/health")).json())
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            replies = await asyncio.gather(*(http.post("/v1/completions", json={**body, "seed": i})
                                             for i in range(8)))
            stop.set()
            await watcher
            return list(replies)

    wait_quiet(cluster)
    with cluster.held_kv(CAPACITY_BLOCKS):
        held = asyncio.run(burst())
    assert [r.status_code for r in held] == [429] * 8, [(r.status_code, r.text[:200]) for r in held]
    wait_quiet(cluster)
    samples.clear()
    replies = asyncio.run(burst())
    statuses = [r.status_code for r in replies]
    print(f"burst with the KV free: {statuses.count(200)} x 200, {statuses.count(429)} x 429")
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 2, [(r.status_code, r.text[:200]) for r in replies]
    for reply in held + replies:
        if reply.status_code == 200:
            assert reply.json()["usage"]["completion_tokens"] == 456  # nothing lost or cut short
        else:
            assert reply.headers.get("retry-after") and "KV" in reply.json()["error"]["message"], reply.text
    assert samples, "no /health samples"
    for sample in samples:
        assert sample["kv_granted_blocks"] + sample["kv_external_blocks"] <= sample["kv_capacity_blocks"], sample
    stats = wait_quiet(cluster)
    assert stats.engine.num_preemptions == 0 and stats.ledger.free_blocks == CAPACITY_BLOCKS
    assert cluster.admission_stats().num_leaked == 0


def test_disconnect_leaves_nothing_held_inside_vllm(cluster: ServeCluster) -> None:
    """A client that leaves after 5 chunks of a 900-token stream: afterwards vLLM runs and holds nothing, the ingress
    released the grant (the leak grace of 600 s is far past the wait), and the next request is served. Whether vLLM
    got the abort before the last of the 900 tokens (about 1 ms each here) depends on the machine's load: printed."""
    before = wait_quiet(cluster).engine.generation_tokens
    stream = client(cluster).completions.create(model=MODEL, prompt="def hello", max_tokens=900, temperature=1.0,
                                                seed=5, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()  # the client goes away mid-stream
    stats = wait_quiet(cluster)
    assert stats.engine.num_waiting == 0 and stats.ledger.committed_blocks == 0
    generated = stats.engine.generation_tokens - before
    print(f"vLLM generated {generated} of the 900 tokens of the disconnected request")
    assert 5 <= generated <= 900
    assert cluster.admission_stats().num_leaked == 0
    # And the replica serves the next request normally.
    reply = client(cluster).completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert present(reply.usage).completion_tokens >= 1


def test_bad_input_is_a_400_from_either_backend(cluster: ServeCluster) -> None:
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        too_long = http.post("/v1/completions", json={"model": MODEL, "prompt": [5 + i % 500 for i in range(1000)],
                                                      "max_tokens": 100})
        bad_token = http.post("/v1/completions", json={"model": MODEL, "prompt": [600], "max_tokens": 4})
    assert too_long.status_code == 400 and "max_model_len=1024" in too_long.json()["error"]["message"]
    assert bad_token.status_code == 400 and "512" in bad_token.json()["error"]["message"]



def test_client_features_pass_through_vllm(cluster: ServeCluster) -> None:
    """The OpenAI features of the API (issue: client compatibility) on the vLLM backend: echo scoring equals
    transformers' log-probabilities, seeded choices equal one-choice requests with seed + j, chat top_logprobs."""
    from transformers import AutoModelForCausalLM

    api = client(cluster)
    prompt = [5, 17, 99, 230, 7, 64]
    scored = api.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    model = AutoModelForCausalLM.from_pretrained(cluster.model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    token_logprobs = present(present(scored.choices[0].logprobs).token_logprobs)
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx([float(expected[i - 1, prompt[i]]) for i in range(1, 6)], abs=1e-4)
    both = api.completions.create(model=MODEL, prompt=[10, 11, 12], n=2, seed=3, max_tokens=5, temperature=1.0,
                                  extra_body={"ignore_eos": True})
    for j in range(2):
        alone = api.completions.create(model=MODEL, prompt=[10, 11, 12], seed=3 + j, max_tokens=5, temperature=1.0,
                                       extra_body={"ignore_eos": True})
        assert alone.choices[0].text == both.choices[j].text
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert all(len(item.top_logprobs) == 2 for item in present(present(chat.choices[0].logprobs).content))


def test_structured_outputs_and_tools_pass_through_to_vllm(cluster: ServeCluster) -> None:
    """The same constraints as the native app's (tests/e2e/structured_checks.py), on vLLM's own structured outputs."""
    check_thirty_schemas(f"{cluster.url}/v1", MODEL, concurrency=1)  # this app queues nothing
    check_constraints_and_tools(client(cluster), MODEL)
    check_bad_constraints_are_400s(client(cluster), MODEL)
    wait_quiet(cluster)
