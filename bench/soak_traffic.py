"""The soak's app and traffic (bench/soak.py): two tenants' keys and the app args, the clients that run until stopped
(streams, chat, completions, disconnecting clients, bad inputs), the bursts past the KV, the watch over every engine
replica's KV ledger, and the Report every request and sample is recorded in."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.harness import faults
from bench.harness.cluster import ServeCluster, tiny_app_args
from dcpserve.deployments.messages import ReplicaQuery, ReplicaStats

MODEL = "tiny-soak"
KEY = "soak-key-0123456789"  # the tenant `default` (api_keys_env)
SECOND_TENANT = "batch"
TENANT_KEYS = {"default": KEY, SECOND_TENANT: "soak-batch-key-0123456789"}  # `batch`: api_keys_file
AUTH = {"Authorization": f"Bearer {KEY}"}
SHEDDABLE_PRIORITY = 10
PRIORITIES = (0, 5, SHEDDABLE_PRIORITY)  # urgent, normal, sheddable
SECOND_TENANT_MAX_CONCURRENT = 3  # below what a burst sends as `batch`: its limit_exceeded 429s are part of the mix
# The 429s the app owes requests it cannot take now (dcpserve/deployments/admission/queue.py's refusals): none is a
# loss.
REFUSALS = ("shed", "limit_exceeded", "queue_full", "queue_timeout", "deadline_exceeded")
FAULTS = ("TP rank", "engine replica", "admission queue", "ingress")
BODY_LIMIT = 256 * 1024


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}


def write_keys_file(directory: Path) -> Path:
    """The app's api_keys_file, in `directory` (it must exist where the app's replicas run: this machine): the
    second tenant's named key. The `default` tenant's key comes from DCPSERVE_SOAK_API_KEYS."""
    path = directory / "soak_api_keys"
    path.write_text(f"{SECOND_TENANT} {TENANT_KEYS[SECOND_TENANT]}\n")
    path.chmod(0o600)
    return path


def app_args(keys_file: Path, admission: str = "full") -> dict[str, Any]:
    """The soak's app. Under admission "full" the KV a replica commits never exceeds its capacity, so its ledger can
    prove no over-commit; under "usage" preempted requests waiting to be recomputed count their whole need, so
    committed KV may exceed the capacity by design (the engine never allocates more than it has: that is checked).
    Two tenants (bench/soak.py's doc); priorities at or above SHEDDABLE_PRIORITY are shed under saturation."""
    return tiny_app_args(
        MODEL,
        admission=admission,
        kv_cache_memory_bytes=1024 * 1024,  # 4096 tokens per replica: a burst of long requests is far past it
        api_keys_env="DCPSERVE_SOAK_API_KEYS",
        api_keys_file=str(keys_file),
        tenants={SECOND_TENANT: {"max_concurrent_requests": SECOND_TENANT_MAX_CONCURRENT}},
        sheddable_priority=SHEDDABLE_PRIORITY,
        max_request_body_bytes=BODY_LIMIT,
        health_check_period_s=2,
        queue_timeout_s=20,
        retry_after_s=1,
        autoscaling={"min_replicas": 1, "max_replicas": 2, "target_sequences_per_replica": 4,
                     "upscale_delay_s": 1, "downscale_delay_s": 10, "look_back_period_s": 2},
    )


@dataclass
class Outcome(faults.Outcome):
    """One request of the soak: how it ended (faults.Outcome), who sent it, how urgent it was and its error's code."""

    tenant: str = "default"
    priority: int = 0
    code: str | None = None  # the OpenAI error's code: a refusal's (REFUSALS), a failure's, a stream's error event's


@dataclass
class Report:
    """Everything the run observed."""

    outcomes: list[Outcome] = field(default_factory=list)
    bad_inputs: collections.Counter[int] = field(default_factory=collections.Counter)
    bad_input_failures: list[str] = field(default_factory=list)
    disconnects: int = 0
    recoveries: list[tuple[str, float, float]] = field(default_factory=list)  # fault, at s, recovery s
    burst_checks: list[tuple[float, float, float]] = field(default_factory=list)  # at s, /health s, new request s
    admission: str = "full"
    # Over-commits are counted where they would be: in each engine replica's own KV ledger (the authority: it refuses
    # what it cannot hold), sampled every 0.5 s. Allocated above the capacity is one under either admission;
    # committed above it too under "full" ("usage": preempted requests waiting count their whole need, by design).
    over_commits: int = 0
    over_commit_examples: list[str] = field(default_factory=list)
    ledger_samples: int = 0
    # /health's granted + external above the capacity: the queue's view, which may count a request's KV twice for a
    # report period (released, then granted to a waiter, before its replica reports it freed), and under "usage"
    # counts preempted requests' whole need. Reported, not a failure: an over-commit shows in the ledgers.
    view_above_capacity: int = 0
    health_samples: int = 0
    kv_held_after_drain: int = -1
    idle_cpu: dict[str, float] = field(default_factory=dict)


BAD_INPUTS: list[tuple[str, dict[str, str], bytes]] = [
    ("/v1/completions", {}, b"{not json"),
    ("/v1/completions", {}, json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode()),
    ("/v1/completions", {}, json.dumps({"model": "no-such-model", "prompt": "x"}).encode()),
    ("/v1/completions", {}, json.dumps({"model": MODEL, "prompt": "x", "temperature": 9}).encode()),
    ("/v1/completions", {}, json.dumps({"model": MODEL, "prompt": "x" * (BODY_LIMIT + 1)}).encode()),
    ("/v1/completions", {}, json.dumps({"model": MODEL, "prompt": [10**9]}).encode()),
    ("/v1/completions", {}, json.dumps({"model": MODEL, "prompt": "x", "priority": "high"}).encode()),
    ("/v1/completions", {}, json.dumps({"model": MODEL, "prompt": "x", "priority": 10**6}).encode()),
    ("/v1/chat/completions", {}, json.dumps({"model": MODEL, "messages": []}).encode()),
    ("/v1/chat/completions", {"Authorization": "Bearer wrong"}, json.dumps({"model": MODEL, "messages": []}).encode()),
]


async def bad_inputs(url: str, report: Report, stop: threading.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        index = 0
        while not stop.is_set():
            path, headers, body = BAD_INPUTS[index % len(BAD_INPUTS)]
            index += 1
            try:
                reply = await http.post(path, content=body, headers={**AUTH, "Content-Type": "application/json",
                                                                     **headers})
                error = reply.json().get("error", {})
            except (httpx.HTTPError, ValueError):
                # No answer from the ingress (it was SIGKILLed): a connection error or Serve's proxy answering for
                # it, not a wrong answer of ours.
                report.bad_inputs[-1] += 1
            else:
                report.bad_inputs[reply.status_code] += 1
                if not 400 <= reply.status_code < 500 or not error.get("message"):
                    report.bad_input_failures.append(f"{path} {body[:60]!r}: {reply.status_code} {reply.text[:200]}")
            await asyncio.sleep(0.5)


async def disconnectors(url: str, report: Report, stop: threading.Event) -> None:
    """Streams left after their first chunk, from each tenant in turn (a disconnect must free its KV and its place
    under the tenant's limit)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        seed = 0
        while not stop.is_set():
            seed += 1
            body = {"model": MODEL, "prompt": [9] * 30, "max_tokens": 600, "temperature": 1.0, "seed": seed,
                    "stream": True}
            try:
                async with http.stream("POST", "/v1/completions", json=body,
                                       headers=bearer(list(TENANT_KEYS)[seed % 2])) as reply:
                    if reply.status_code == 200:
                        async for line in reply.aiter_lines():
                            if line.startswith("data: "):
                                break  # leaving closes the connection: the client is gone after its first chunk
                        report.disconnects += 1
            except httpx.HTTPError:
                pass
            await asyncio.sleep(2.0)


def _ledgers(cluster: ServeCluster) -> list[ReplicaStats]:
    """EngineReplica.stats() of each replica the admission queue knows as healthy, each call addressed to it."""
    replicas = cluster.call("KvAdmission", "stats", timeout_s=5).replicas
    return [cluster.call("EngineReplica", "stats", ReplicaQuery(replica_id), timeout_s=5)
            for replica_id, replica in replicas.items() if replica.healthy]


def _over_committed(stats: ReplicaStats, admission: str) -> str | None:
    ledger = stats.ledger
    capacity, used, committed = ledger.capacity_blocks, ledger.used_blocks, ledger.committed_blocks
    if used > capacity or (admission == "full" and committed > capacity):
        return f"replica {stats.replica_id}: {used} blocks allocated, {committed} committed of {capacity}"
    return None


async def kv_watch(cluster: ServeCluster, report: Report, stop: threading.Event) -> None:
    """Every 0.5 s: each engine replica's KV ledger (an over-commit is there or nowhere) and /health's counts."""
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as http:
        while not stop.is_set():
            try:
                ledgers = await asyncio.to_thread(_ledgers, cluster)
            except Exception:  # noqa: BLE001 - the queue or a replica is down or replaced (a fault): no sample now
                ledgers = []
            for stats in ledgers:
                report.ledger_samples += 1
                if (why := _over_committed(stats, report.admission)) is not None:
                    report.over_commits += 1
                    report.over_commit_examples.append(why)
            try:
                health = (await http.get("/health")).json()
                if "kv_capacity_blocks" in health:
                    report.health_samples += 1
                    if health["kv_granted_blocks"] + health["kv_external_blocks"] > health["kv_capacity_blocks"]:
                        report.view_above_capacity += 1
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.5)


def _error(body: bytes) -> tuple[str, str | None]:
    """An OpenAI error body's message and code; anything else (Serve's proxy answering for a dead ingress)
    verbatim, without a code."""
    try:
        error = json.loads(body)["error"]
        return str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {body[:200]!r}", None


async def _exchange(http: httpx.AsyncClient, outcome: Outcome, path: str, body: dict[str, Any]) -> None:
    headers = bearer(outcome.tenant)
    if not body.get("stream"):
        reply = await http.post(path, json=body, headers=headers)
        outcome.status = reply.status_code
        if reply.status_code == 200:
            outcome.tokens = reply.json()["usage"]["completion_tokens"]
        else:
            outcome.error, outcome.code = _error(reply.content)
        return
    async with http.stream("POST", path, json=body, headers=headers) as reply:
        outcome.status = reply.status_code
        if reply.status_code != 200:  # refusals come before the stream starts (the ingress admits first)
            outcome.error, outcome.code = _error(await reply.aread())
            return
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                outcome.error, outcome.code = str(chunk["error"]["message"]), chunk["error"].get("code")
            elif chunk.get("choices"):
                outcome.tokens += 1
    if outcome.error is None:
        outcome.error = "stream ended without [DONE]"


async def send(http: httpx.AsyncClient, report: Report, kind: str, tenant: str, priority: int,
               body: dict[str, Any], timeout_s: float) -> bool:
    """One request as `tenant` at `priority`, recorded in the report before it is sent and ended whatever happens
    (an outcome never ended is a lost request); returns whether it was answered 200 without an error."""
    outcome = Outcome(kind, time.monotonic(), tenant=tenant, priority=priority)
    report.outcomes.append(outcome)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        await asyncio.wait_for(_exchange(http, outcome, path, {**body, "priority": priority}), timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        outcome.error = f"client timeout after {timeout_s:.0f}s"
    except httpx.HTTPError as err:
        outcome.error = f"connection: {err!r}"
    except Exception as err:  # noqa: BLE001 - whatever the server sent, this request ended: record how
        outcome.error = f"unexpected: {err!r}"
    outcome.ended = time.monotonic()
    return outcome.status == 200 and outcome.error is None


def level(n: int, offset: int = 0) -> tuple[str, int]:
    """The tenant and priority of a client's n-th request: the tenants alternate and each meets every priority in
    turn, so any 6 consecutive requests cover every pair."""
    return list(TENANT_KEYS)[n % 2], PRIORITIES[(n // 2 + offset) % len(PRIORITIES)]


async def clients(url: str, report: Report, stop: threading.Event, max_tokens: int = 150,
                  timeout_s: float = 180.0) -> None:
    """The steady traffic until stop: two streaming completion clients, one non-streaming and one chat client,
    each in a loop over every tenant and priority (level); a refused client backs off, as Retry-After asks."""
    async def loop(http: httpx.AsyncClient, kind: str, index: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            seed = 1000 * index + n
            body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
                                    "stream": kind == "stream"}
            if kind == "chat":
                body["messages"] = [{"role": "user", "content": f"question {seed}: tell me about load {index}"}]
            else:
                body["prompt"] = [(index * 7 + j) % 200 + 3 for j in range(40)]
            tenant, priority = level(n, index)
            if not await send(http, report, kind, tenant, priority, body, timeout_s):
                await asyncio.sleep(0.5)

    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=httpx.Limits(max_connections=8)) as http:
        await asyncio.gather(loop(http, "stream", 0), loop(http, "stream", 1), loop(http, "json", 2),
                             loop(http, "chat", 3))


async def burst(url: str, report: Report, size: int, round_index: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=size + 4)) as http:
        async def one(i: int) -> None:
            body = {"model": MODEL, "prompt": [(7 * i + j) % 250 + 3 for j in range(300)], "max_tokens": 1500,
                    "temperature": 1.0, "seed": 10_000 * round_index + i}
            # Request i: tenant i % 2 at priority i % 3, so 6 requests of a burst cover every pair.
            await send(http, report, "burst", list(TENANT_KEYS)[i % 2], PRIORITIES[i % len(PRIORITIES)], body, 300)

        await asyncio.gather(*(one(i) for i in range(size)))


def background(coro_factories: list[Any]) -> threading.Thread:
    async def main() -> None:
        await asyncio.gather(*(factory() for factory in coro_factories))

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    return thread
