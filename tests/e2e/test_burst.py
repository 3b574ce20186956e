"""A burst of long sampled requests far past the KV capacity, with autoscaling mid-burst (bench/harness/cluster.py).

The shape that once wedged the app: long prompts, temperature 1 with a seed each (outputs end on EOS at lengths
nobody knows in advance), a large max_tokens, many more requests than the KV holds, and a second replica that
Serve starts in the middle of the burst. Every request must get exactly one answer, a 200 or a 429 (never a 503
while a healthy replica exists, never a 500), and afterwards the app must answer /health and a new completion
while the ingress process sits idle (its CPU time over 10 idle seconds stays small).

The replicas keep evicted prefix blocks in a host KV tier (kv_host_tier, 4x the device KV) and the prompts come in
four groups sharing a prefix, so the burst also runs swap-outs and reloads through the autoscaled replicas: no
KV stays held on device after the drain, and every replica (the one started mid-burst too) runs its tier.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.harness import faults
from bench.harness.cluster import RayHead, ServeCluster, deploy_app, present, tiny_app_args

pytestmark = [pytest.mark.timeout(420)]

MODEL = "tiny-burst"
NUM_REQUESTS = 16
PROMPT_TOKENS = 300
GROUPS = 4  # request i shares its first SHARED_TOKENS with the requests of its group (i % GROUPS)
SHARED_TOKENS = 160  # 5 blocks of 32
MAX_TOKENS = 1200  # need = ceil((300 + 1200) / 32) = 47 logical blocks; a replica holds 128: 2 such requests
QUEUE_TIMEOUT_S = 20.0
APP_ARGS = tiny_app_args(
    MODEL,
    kv_cache_memory_bytes=1024 * 1024,  # 2048 tokens per rank, x dcp 2 = 4096 per replica = 128 blocks of 32
    kv_host_tier=4 * 1024 * 1024,  # per rank: 4x the device KV
    max_model_len=4096,
    max_queued_requests=64,
    queue_timeout_s=QUEUE_TIMEOUT_S,
    retry_after_s=1,
    autoscaling={
        "min_replicas": 1,
        "max_replicas": 2,  # the second replica starts while the burst runs
        "target_sequences_per_replica": 2,
        "upscale_delay_s": 1,
        "downscale_delay_s": 60,  # no scale-down while this test looks
        "look_back_period_s": 2,
    },
)
IDLE_S = 10.0
IDLE_CPU_MAX_S = 2.5  # a wedged router loop burns ~IDLE_S; an idle ingress a few tenths of a second


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    with deploy_app(ray_head, APP_ARGS) as running:
        yield running


def _ingress_pid(cluster: ServeCluster) -> int:
    app = cluster.serve_details()["applications"]["dcpserve"]
    (replica,) = app["deployments"]["OpenAIIngress"]["replicas"]
    return int(replica["pid"])


def test_burst_of_long_sampled_requests_gets_200_or_429_and_the_app_stays_responsive(cluster: ServeCluster) -> None:
    import openai

    statuses: list[int] = []
    errors: list[str] = []
    output_lengths: list[int] = []

    async def one(client: openai.AsyncOpenAI, index: int) -> None:
        group = index % GROUPS
        prompt = ([(7 * group + 11 * i) % 250 + 3 for i in range(SHARED_TOKENS)]
                  + [(7 * index + 13 * i) % 250 + 3 for i in range(PROMPT_TOKENS - SHARED_TOKENS)])
        try:
            reply = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=1000 + index,
            )
        except openai.APIStatusError as err:
            statuses.append(err.status_code)
            errors.append(f"{err.status_code}: {err.message}")
            return
        statuses.append(200)
        output_lengths.append(present(reply.usage).completion_tokens)
        assert reply.choices[0].finish_reason in ("stop", "length"), reply

    async def burst() -> float:
        client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=300)
        start = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS))), timeout=300)
        finally:
            await client.close()
        return time.monotonic() - start

    took = asyncio.run(burst())
    counts = collections.Counter(statuses)
    print(f"burst of {NUM_REQUESTS} in {took:.1f}s: {dict(counts)}; output lengths {sorted(output_lengths)}; "
          f"errors {errors}; replica states {cluster.replica_states()}")
    assert len(statuses) == NUM_REQUESTS  # every request got exactly one answer
    assert set(counts) <= {200, 429}, errors  # no 503 while a healthy replica exists, no 500
    assert counts[200] >= 2, errors
    for message in errors:
        assert "waited" in message and "retry later" in message, message  # 429s say what happened

    # Right after the burst: /health and a new completion are answered (a wedged app answers neither: the client's
    # generous timeout fails the test).
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        start = time.monotonic()
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4,
                                                   "temperature": 0})
        assert reply.status_code == 200, reply.text
        print(f"a new completion right after the burst: {time.monotonic() - start:.2f}s")

    # Nothing stays held once the app drains, and every replica ran its host tier within its capacity.
    held_s = faults.wait_until_nothing_held(cluster, 60)
    tiers = {stats.replica_id: stats.engine.host_tier for stats in cluster.every_replica_stats()}
    print(f"KV free {held_s:.1f}s after the burst; host tiers: {tiers}")
    for replica_id, tier in tiers.items():
        assert tier is not None, f"replica {replica_id} runs without the host tier it was configured with"
        assert 0 <= tier.used_blocks <= tier.capacity_blocks, tier

    # The ingress is idle, not spinning: its CPU time over IDLE_S stays small.
    pid = _ingress_pid(cluster)
    before = faults.cpu_seconds(pid)
    time.sleep(IDLE_S)
    used = faults.cpu_seconds(pid) - before
    print(f"ingress pid {pid}: {used:.2f}s CPU over {IDLE_S:.0f}s idle")
    assert used < IDLE_CPU_MAX_S, f"the ingress used {used:.2f}s of CPU in {IDLE_S:.0f}s idle: a busy loop"
