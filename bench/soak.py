"""Soak: bounded minutes of mixed traffic with one fault of each kind on a schedule, on a cluster of its own.

Traffic from two tenants (API keys: `default` from an environment variable, `batch` from a keys file the soak
writes, with a small max_concurrent_requests) at priorities 0, 5 and SHEDDABLE_PRIORITY (sheddable), every pair of
tenant and priority in turn, all at once for --minutes:
- streaming and non-streaming completions and chat, sampled with seeds (outputs end at lengths nobody knows);
- clients that disconnect right after their first chunk;
- bad inputs (malformed JSON, invalid parameters and priorities, an unknown model, an oversized body, a wrong API
  key): each must get an OpenAI-shaped 4xx;
- every --burst-period-s a burst of long sampled requests far past the KV capacity, while autoscaling (1..2
  replicas) adds and removes replicas; after each burst /health and a new request must answer within seconds.
Refusals are answers: a 429 coded shed, limit_exceeded, queue_full, queue_timeout or deadline_exceeded (REFUSALS) is
what the app owes a request it cannot take; a 429 with any other code is a failure.
Faults, spread over the run: SIGKILL a TP rank, a whole engine replica, the admission queue, the ingress (by the
pids Serve's and Ray's APIs report); after each, the time until a new request succeeds is the recovery time.

At the end it stops the traffic, waits for every request to end and prints: requests sent, answered by status and
error code (overall and per tenant and priority), lost (never answered), hung (the client gave up), KV held after the
drain, over-commits observed (each engine replica's KV ledger every 0.5 s: allocated, and under admission full
committed, blocks above its capacity; /health's granted + external above the capacity is reported as the queue's
view), recovery times, and the CPU the app's processes burn when idle.

    python bench/soak.py                          # 5 minutes (console only)
    python bench/soak.py --minutes 5 --write-docs # also writes its section of docs/benchmarks.md
    python bench/soak.py --minutes 1              # what tests/e2e/test_soak.py runs, shorter
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Running `python bench/soak.py` puts bench/ first on sys.path, where bench/engine.py would shadow `engine`.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import httpx

from bench.docs_section import DocsSection
from dcpserve.deployments.replica.engine_replica import ReplicaQuery
from tests.e2e import faults
from tests.e2e.cluster import ServeCluster, serve_cluster, tiny_app_args

DOCS = DocsSection("bench/soak.py")
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
    Two tenants (module doc); priorities at or above SHEDDABLE_PRIORITY are shed under saturation."""
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


def say(line: str) -> None:
    print(f"[soak] {line}", flush=True)


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


def _ledgers(cluster: ServeCluster) -> list[dict[str, Any]]:
    """EngineReplica.stats() of each replica the admission queue knows as healthy, each call addressed to it."""
    replicas = cluster.call("KvAdmission", "stats", timeout_s=5)["replicas"]
    return [cluster.call("EngineReplica", "stats", ReplicaQuery(replica_id), timeout_s=5)
            for replica_id, replica in replicas.items() if replica["healthy"]]


def _over_committed(stats: dict[str, Any], admission: str) -> str | None:
    capacity, used, committed = stats["kv_capacity_blocks"], stats["kv_used_blocks"], stats["kv_held_blocks"]
    if used > capacity or (admission == "full" and committed > capacity):
        return f"replica {stats['replica_id']}: {used} blocks allocated, {committed} committed of {capacity}"
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


def inject(cluster: ServeCluster, fault: str) -> int:
    """SIGKILLs one process of the kind; returns its pid."""
    if fault == "TP rank":
        pid = faults.alive_actor_pids(cluster, "RankWorker")[-1]
    else:
        deployment = {"engine replica": "EngineReplica", "admission queue": "KvAdmission",
                      "ingress": "OpenAIIngress"}[fault]
        pid = int(faults.serve_replicas(cluster, deployment)[0]["pid"])
    faults.kill(pid)
    return pid


def run(cluster: ServeCluster, minutes: float, burst_size: int, burst_period_s: float,
        admission: str = "full") -> Report:
    report = Report(admission=admission)
    stop = threading.Event()
    traffic = background([lambda: clients(cluster.url, report, stop),
                          lambda: bad_inputs(cluster.url, report, stop),
                          lambda: disconnectors(cluster.url, report, stop),
                          lambda: kv_watch(cluster, report, stop)])
    start = time.monotonic()
    end = start + minutes * 60
    fault_times = {fault: start + (i + 1) * (end - start) / (len(FAULTS) + 1) for i, fault in enumerate(FAULTS)}
    next_burst = start + 5
    round_index = 0
    while time.monotonic() < end or fault_times:  # every fault is injected, even when bursts ran long
        now = time.monotonic()
        due = [fault for fault, at in fault_times.items() if at <= now]
        if due:
            fault = due[0]
            del fault_times[fault]
            pid = inject(cluster, fault)
            recovery = faults.wait_until_serving(cluster, MODEL, 180, headers=AUTH)
            report.recoveries.append((fault, now - start, recovery))
            say(f"{now - start:5.0f}s  SIGKILL {fault} (pid {pid}): serving again after {recovery:.1f}s")
            continue
        if now >= next_burst:
            round_index += 1
            say(f"{now - start:5.0f}s  burst {round_index}: {burst_size} long sampled requests")
            asyncio.run(burst(cluster.url, report, burst_size, round_index))
            health_s = _timed(lambda: httpx.get(f"{cluster.url}/health", timeout=30).raise_for_status())
            new_s = faults.wait_until_serving(cluster, MODEL, 60, headers=AUTH)
            report.burst_checks.append((time.monotonic() - start, health_s, new_s))
            say(f"{time.monotonic() - start:5.0f}s  after burst {round_index}: /health in {health_s:.2f}s, a new "
                f"request in {new_s:.2f}s; so far {_listed(_so_far(report))}")
            next_burst = time.monotonic() + burst_period_s
            continue
        time.sleep(0.5)
    say("stopping the traffic; waiting for every request to end")
    stop.set()
    traffic.join(240)  # a request still open after that is counted lost
    report.kv_held_after_drain = _held_after_drain(cluster)
    report.idle_cpu = _idle_cpu(cluster)
    return report


def _timed(action: Any) -> float:
    start = time.monotonic()
    action()
    return time.monotonic() - start


def _label(outcome: Outcome) -> str:
    """How a request ended: lost, hung, 200, 200 then error, a connection error, or its status and error code."""
    if outcome.ended is None:
        return "lost"
    if outcome.hung:
        return "hung"
    if outcome.status == 200 and outcome.error is None:
        return "200"
    if outcome.status is None:
        return "connection error"
    if outcome.status == 200:
        return "200 then error"
    return f"{outcome.status} {outcome.code}" if outcome.code else f"{outcome.status}"


def _so_far(report: Report) -> collections.Counter[str]:
    return collections.Counter("in flight" if o.ended is None else _label(o) for o in list(report.outcomes))


def outcomes_by_level(report: Report) -> dict[tuple[str, int], collections.Counter[str]]:
    """(tenant, priority) -> how its requests ended (_label)."""
    levels: dict[tuple[str, int], collections.Counter[str]] = {}
    for outcome in report.outcomes:
        levels.setdefault((outcome.tenant, outcome.priority), collections.Counter())[_label(outcome)] += 1
    return dict(sorted(levels.items()))


def _refused(counts: collections.Counter[str]) -> tuple[int, int]:
    """429s with a code of REFUSALS, and those without."""
    owed = sum(n for label, n in counts.items() if label in {f"429 {code}" for code in REFUSALS})
    return owed, sum(n for label, n in counts.items() if label.startswith("429")) - owed


def _listed(counts: collections.Counter[str]) -> str:
    return ", ".join(f"{label}: {n}" for label, n in sorted(counts.items()))


def _held_after_drain(cluster: ServeCluster) -> int:
    try:
        faults.wait_until_nothing_held(cluster, 60)
        return 0
    except AssertionError:
        health = faults.health(cluster)
        return int(health.get("kv_granted_blocks", 0)) + int(health.get("kv_external_blocks", 0))


def _idle_cpu(cluster: ServeCluster, seconds: float = 5.0) -> dict[str, float]:
    """Share of one core each Serve replica process of the app uses over idle seconds (a busy loop shows ~1)."""
    pids = {f"{d} {r['replica_id']}": int(r["pid"])
            for d in ("OpenAIIngress", "KvAdmission", "EngineReplica") for r in faults.serve_replicas(cluster, d)}
    before = {name: faults.cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {name: (faults.cpu_seconds(pid) - before[name]) / seconds for name, pid in pids.items()}


def table(report: Report, minutes: float) -> list[str]:
    counts = collections.Counter(_label(o) for o in report.outcomes)
    lines = [
        "| what | value |", "|---|---|",
        f"| duration | {minutes:g} min |",
        f"| requests sent (load + bursts) | {len(report.outcomes)} |",
        f"| answered, by outcome (status and error code) | {_listed(counts)} |",
        f"| 429s: refusals the app owes ({' / '.join(REFUSALS)}), others | {', '.join(map(str, _refused(counts)))} |",
    ]
    for (tenant, priority), level_counts in outcomes_by_level(report).items():
        sheddable = ", sheddable" if priority >= SHEDDABLE_PRIORITY else ""
        lines.append(f"| tenant {tenant}, priority {priority}{sheddable} | {_listed(level_counts)} |")
    lines += [
        f"| lost (never answered) | {counts['lost']} |",
        f"| hung (client gave up) | {counts['hung']} |",
        f"| clients that disconnected after their first chunk | {report.disconnects} |",
        f"| bad inputs, by status (-1: ingress down) | {dict(sorted(report.bad_inputs.items()))} |",
        f"| bad inputs answered other than an OpenAI-shaped 4xx | {len(report.bad_input_failures)} |",
        f"| KV held after the drain (blocks) | {report.kv_held_after_drain} |",
        f"| over-commits observed ({report.ledger_samples} samples of the engine replicas' KV ledgers) | "
        f"{report.over_commits} |",
        (f"| /health: granted + external above the capacity (the queue's view: a released request's KV counted "
         f"until its replica reports it freed) | {report.view_above_capacity} of {report.health_samples} |"
         if report.admission == "full" else
         f"| /health: committed KV above the capacity (preempted requests waiting; by design under usage) | "
         f"{report.view_above_capacity} of {report.health_samples} |"),
    ]
    for fault, at, recovery in report.recoveries:
        lines.append(f"| SIGKILL {fault} at {at:.0f}s: recovery | {recovery:.1f} s |")
    for at, health_s, new_s in report.burst_checks:
        lines.append(f"| after the burst ending at {at:.0f}s: /health, a new request | {health_s:.2f} s, "
                     f"{new_s:.2f} s |")
    busiest = max(report.idle_cpu.items(), key=lambda item: item[1], default=("-", 0.0))
    lines.append(f"| busiest app process when idle (share of a core) | {busiest[1]:.2f} ({busiest[0]}) |")
    return lines


def healthy(report: Report) -> list[str]:
    """The run's failures (empty: it passed)."""
    counts = collections.Counter(_label(o) for o in report.outcomes)
    problems = []
    if counts["lost"] or counts["hung"]:
        problems.append(f"{counts['lost']} lost and {counts['hung']} hung requests")
    if _refused(counts)[1]:
        problems.append(f"429s other than the refusals owed ({', '.join(REFUSALS)}): {_listed(counts)}")
    if report.kv_held_after_drain:
        problems.append(f"{report.kv_held_after_drain} KV blocks held after the drain")
    if report.over_commits:
        problems.append(f"{report.over_commits} over-commits: {report.over_commit_examples[:3]}")
    if not report.ledger_samples:
        problems.append("no engine replica's KV ledger was sampled: over-commits went unchecked")
    if report.bad_input_failures:
        problems.append(f"bad inputs answered wrongly: {report.bad_input_failures[:3]}")
    if any(share > 0.5 for share in report.idle_cpu.values()):
        problems.append(f"an app process is busy when idle: {report.idle_cpu}")
    if len(report.recoveries) != len(FAULTS):
        problems.append(f"faults injected: {report.recoveries}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--burst-size", type=int, default=16)
    parser.add_argument("--burst-period-s", type=float, default=40.0)
    parser.add_argument("--admission", choices=("full", "usage"), default="full",
                        help="the app's admission policy (committed KV is checked against the capacity under full, "
                        "allocated KV under both; see app_args)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if args.write_docs:
        DOCS.check()
    with tempfile.TemporaryDirectory(prefix="dcpsoak-") as state:
        say(f"starting a cluster of its own (state under {state})")
        with serve_cluster(Path(state), app_args(write_keys_file(Path(state)), args.admission),
                           extra_env={"DCPSERVE_SOAK_API_KEYS": KEY}) as cluster:
            say(f"app running at {cluster.url} (admission {args.admission}); {args.minutes:g} minutes of traffic")
            report = run(cluster, args.minutes, args.burst_size, args.burst_period_s, args.admission)
    lines = table(report, args.minutes)
    print("\n".join(lines))
    problems = healthy(report)
    print("PASSED" if not problems else "FAILED: " + "; ".join(problems))
    if args.write_docs:
        command = "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
        DOCS.write("## Soak: mixed traffic with faults\n\n"
                   f"`{command.strip()}` on a 2-core machine: its own cluster (tp=2 x dcp=2, 1..2 replicas, 4096 KV "
                   f"tokens per replica, admission {args.admission}, API keys), two tenants (`default`; `batch` "
                   f"with max_concurrent_requests={SECOND_TENANT_MAX_CONCURRENT}) at priorities "
                   f"{', '.join(map(str, PRIORITIES))} (sheddable from {SHEDDABLE_PRIORITY}), streaming / "
                   "non-streaming completions and chat sampled with seeds, "
                   "clients that disconnect after their first chunk, bad inputs, bursts of long sampled requests far "
                   f"past the KV every {args.burst_period_s:g} s, and one SIGKILL of each kind (TP rank, engine "
                   "replica, admission queue, ingress) spread over the run. Requests that were in flight when a "
                   "process died end with an error (status 200 then an error event, a 500, or a connection error "
                   "when the ingress died); a 429 is one of the refusals the app owes (shed, limit_exceeded, "
                   "queue_full, queue_timeout, deadline_exceeded); none is lost or left hanging.\n\n"
                   + "\n".join(lines) + "\n")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
