"""Service levels under overload on the real app: a flooding tenant against a light one, and priority bands, with the
app's service-level order and with FIFO, side by side in one run (each mode its own cluster on this machine).

Scenarios, in each mode (admission_order service_levels, then fifo):
- B alone: tenant B sends one streamed completion every --b-period-s for --b-seconds (its TTFT with A absent);
- A floods, B steady: tenant A runs a closed loop of 10 x the app's capacity (the requests the KV holds at once),
  retrying each 429 after its Retry-After as the openai SDK does, while B sends as before; B's TTFT percentiles
  and 429s, A's 429s;
- priorities: three closed loops of clients over capacity, priorities 0, 5 and 10 (sheddable: the app's
  sheddable_priority); TTFT by priority, refusals by reason, and whether any request that is not sheddable waited
  past its queue_timeout_s.
Every prompt is token ids (so its length is exact), sampled at temperature 1 with its own seed: outputs end on EOS
at lengths nobody knows in advance. TTFT is the client's: from sending to the first streamed token.

    .venv/bin/python -m bench fairness                 # about 6 minutes on 2 cores
    .venv/bin/python -m bench fairness --write-docs    # also writes its docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.harness.cluster import ServeCluster, serve_cluster, tiny_app_args
from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.deployments.admission.latency_window import nearest_rank

REPO_ROOT = Path(__file__).resolve().parents[1]

DOCS = DocsSection("bench/fairness.py")
MODEL = "tiny-fairness"
KEYS = {"A": "tenant-a-key-0123456789", "B": "tenant-b-key-0123456789", "P": "tenant-p-key-0123456789"}
PROMPT_TOKENS = 64
MAX_TOKENS = 64
QUEUE_TIMEOUT_S = 20.0
SHEDDABLE = 10


def app_args(order: str, keys_file: Path) -> dict[str, Any]:
    """One replica, tp=1, 'full' admission (a grant is exactly what a request may use), KV for about 6 requests."""
    return tiny_app_args(
        MODEL, tensor_parallel_size=1, decode_context_parallel_size=1, admission="full",
        kv_cache_memory_bytes=480 * 1024, max_num_seqs=16, max_queued_requests=32,
        queue_timeout_s=QUEUE_TIMEOUT_S, api_keys_file=str(keys_file), admission_order=order,
        sheddable_priority=SHEDDABLE, autoscaling={"min_replicas": 1, "max_replicas": 1})


@dataclass
class Outcome:
    tenant: str
    priority: int
    status: int
    code: str | None
    ttft_s: float | None
    sent_at: float
    retry_after_s: float  # what a refusal's Retry-After asked for


@dataclass
class Record:
    outcomes: list[Outcome] = field(default_factory=list)

    def of(self, tenant: str | None = None, priority: int | None = None) -> list[Outcome]:
        return [o for o in self.outcomes if (tenant is None or o.tenant == tenant)
                and (priority is None or o.priority == priority)]


async def one_request(http: httpx.AsyncClient, tenant: str, priority: int, seed: int, record: Record) -> Outcome:
    body = {"model": MODEL, "prompt": [(seed * 7 + i) % 250 + 3 for i in range(PROMPT_TOKENS)],
            "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed, "stream": True, "priority": priority}
    sent = time.monotonic()
    ttft, status, code, retry_after = None, 0, None, 0.0
    try:
        async with http.stream("POST", "/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as reply:
            status = reply.status_code
            if status != 200:
                error = json.loads(await reply.aread())["error"]
                code = error["code"]
                if status >= 500:
                    print(f"[fairness] {tenant} got {status}: {error['message'][-1500:]}", flush=True)
                retry_after = float(reply.headers.get("Retry-After", 0))
            else:
                async for line in reply.aiter_lines():
                    if ttft is None and line.startswith("data: ") and '"text": "' in line:
                        ttft = time.monotonic() - sent
    except httpx.HTTPError as err:
        code = type(err).__name__
    outcome = Outcome(tenant, priority, status, code, ttft, sent, retry_after)
    record.outcomes.append(outcome)
    return outcome


async def closed_loop(http: httpx.AsyncClient, tenant: str, priority: int, clients: int, until: float,
                      record: Record, seed0: int) -> None:
    async def client(k: int) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            outcome = await one_request(http, tenant, priority, seed0 + 1000 * k + n, record)
            if outcome.status != 200:
                await asyncio.sleep(max(outcome.retry_after_s, 0.2))  # as the openai SDK: after Retry-After

    await asyncio.gather(*(client(k) for k in range(clients)))


async def open_loop(http: httpx.AsyncClient, tenant: str, period_s: float, seconds: float, record: Record,
                    seed0: int) -> None:
    tasks = []
    for i in range(int(seconds / period_s)):
        tasks.append(asyncio.get_running_loop().create_task(one_request(http, tenant, 0, seed0 + i, record)))
        await asyncio.sleep(period_s)
    await asyncio.gather(*tasks)


async def drained(http: httpx.AsyncClient) -> dict[str, Any]:
    """/health once nothing is queued or granted (or after 60 s): what the drain left."""
    health: dict[str, Any] = {}
    for _ in range(120):
        health = (await http.get("/health")).json()
        if health["queued"] == 0 and health["num_grants"] == 0 and health["kv_granted_blocks"] == 0:
            break
        await asyncio.sleep(0.5)
    return health


async def run_mode(cluster: ServeCluster, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=120, limits=limits) as http:
        health = (await http.get("/health")).json()
        capacity = health["kv_capacity_blocks"] * 16 // (PROMPT_TOKENS + MAX_TOKENS)  # requests the KV holds at once
        for i in range(4):  # warm up
            await one_request(http, "B", 0, 10_000 + i, Record())
        alone = Record()
        await open_loop(http, "B", args.b_period_s, args.b_seconds, alone, 0)
        flood = Record()
        until = time.monotonic() + args.b_seconds + 6
        a_task = asyncio.get_running_loop().create_task(
            closed_loop(http, "A", 0, 10 * capacity, until, flood, 100_000))
        await asyncio.sleep(5)  # A fills the KV and the queue first
        probe = asyncio.get_running_loop().create_task(health_latency(http, time.monotonic() + args.b_seconds))
        await open_loop(http, "B", args.b_period_s, args.b_seconds, flood, 50_000)
        health_s = await probe
        await a_task
        after_flood = await drained(http)
        waits = (await asyncio.to_thread(cluster.admission_stats)).tenants
        prio = Record()
        until = time.monotonic() + args.b_seconds
        await asyncio.gather(*(closed_loop(http, "P", priority, 2 * capacity, until, prio, 200_000 + 10_000 * priority)
                               for priority in (0, 5, SHEDDABLE)))
        after_prio = await drained(http)
    return {"capacity": capacity, "alone": alone, "flood": flood, "prio": prio, "health_s": health_s, "waits": waits,
            "drains": [after_flood, after_prio]}


async def health_latency(http: httpx.AsyncClient, until: float) -> list[float]:
    """How long /health (the HTTP proxy, the ingress and one admission call; no queue, no engine) takes while A
    floods: what the machine's load alone adds to any request's time to first token."""
    times = []
    while time.monotonic() < until:
        start = time.monotonic()
        await http.get("/health")
        times.append(time.monotonic() - start)
        await asyncio.sleep(0.5)
    return times


def p(values: list[float], q: float) -> float | None:
    return nearest_rank(values, q) if values else None


def ttfts(outcomes: list[Outcome]) -> list[float]:
    return [o.ttft_s for o in outcomes if o.status == 200 and o.ttft_s is not None]


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def refused(outcomes: list[Outcome]) -> str:
    codes = collections.Counter(o.code or str(o.status) for o in outcomes if o.status != 200)
    return ", ".join(f"{code} {n}" for code, n in sorted(codes.items())) or "none"


def tables(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| order | B alone p50 / p90 TTFT (s) | B with A flooding p50 / p90 (s) | B p90 ratio | B 429s | "
             "A 200s | A refusals | admission wait: B max / A p90 (s) | /health p50 / p90 during the flood (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for order, r in results.items():
        alone, with_a = ttfts(r["alone"].of("B")), ttfts(r["flood"].of("B"))
        ratio = (p(with_a, 0.9) or 0) / (p(alone, 0.9) or 1)
        b_refused = [o for o in r["flood"].of("B") if o.status != 200]
        a = r["flood"].of("A")
        lines.append(f"| {order} | {fmt(p(alone, 0.5))} / {fmt(p(alone, 0.9))} | {fmt(p(with_a, 0.5))} / "
                     f"{fmt(p(with_a, 0.9))} | {ratio:.2f}x | {len(b_refused)} of {len(r['flood'].of('B'))} | "
                     f"{sum(o.status == 200 for o in a)} | {refused(a)} | {fmt(r['waits']['B'].wait_max_s)} / "
                     f"{fmt(r['waits']['A'].wait_p90_s)} | {fmt(p(r['health_s'], 0.5))} / "
                     f"{fmt(p(r['health_s'], 0.9))} |")
    lines += ["", "| order | priority | requests | p50 / p90 TTFT (s) | refusals |", "|---|---|---|---|---|"]
    for order, r in results.items():
        for priority in (0, 5, SHEDDABLE):
            outcomes = r["prio"].of("P", priority)
            times = ttfts(outcomes)
            lines.append(f"| {order} | {priority}{' (sheddable)' if priority >= SHEDDABLE else ''} | {len(outcomes)} "
                         f"| {fmt(p(times, 0.5))} / {fmt(p(times, 0.9))} | {refused(outcomes)} |")
    lines += ["", "| order | p0 p90 / p5 p90 | sheddable served / refused | non-sheddable queue timeouts | "
              "sheddable served while one of those waited | KV capacity (requests) | left after the drains "
              "(queued, grants) |", "|---|---|---|---|---|---|---|"]
    for order, r in results.items():
        p0, p5 = p(ttfts(r["prio"].of("P", 0)), 0.9), p(ttfts(r["prio"].of("P", 5)), 0.9)
        timeouts = [o for o in r["prio"].outcomes if o.priority < SHEDDABLE and o.code == "queue_timeout"]
        sheddable = r["prio"].of("P", SHEDDABLE)
        served = [o for o in sheddable if o.status == 200]
        overlapping = sum(any(t.sent_at <= o.sent_at <= t.sent_at + QUEUE_TIMEOUT_S for t in timeouts) for o in served)
        left = "; ".join(f"{d['queued']}, {d['num_grants']}" for d in r["drains"])
        lines.append(f"| {order} | {(p0 or 0) / (p5 or 1):.2f} | {len(served)} / {len(sheddable) - len(served)} | "
                     f"{len(timeouts)} | {overlapping} | {r['capacity']} | {left} |")
    return lines


def run_one(args: argparse.Namespace) -> int:
    """One order on a cluster of its own; its results as JSON in args.out."""
    with tempfile.TemporaryDirectory(prefix="dcpfair-") as state:
        keys_file = Path(state) / "api_keys"
        keys_file.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
        print(f"[fairness] {args.one_order}: starting a cluster of its own", flush=True)
        with serve_cluster(Path(state) / "cluster", app_args(args.one_order, keys_file)) as cluster:
            result = asyncio.run(run_mode(cluster, args))
    Path(args.out).write_text(json.dumps({
        key: [dataclasses.asdict(o) for o in value.outcomes] if isinstance(value, Record) else value
        for key, value in result.items()}))
    return 0


def loaded(raw: dict[str, Any]) -> dict[str, Any]:
    """run_one's JSON back as run_mode's result."""
    return {key: Record([Outcome(**o) for o in value]) if key in ("alone", "flood", "prio") else value
            for key, value in raw.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b-period-s", type=float, default=0.5, help="tenant B sends one request this often")
    parser.add_argument("--b-seconds", type=float, default=30.0, help="how long B sends (and the priority loops run)")
    parser.add_argument("--orders", default="service_levels,fifo")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--one-order", help=argparse.SUPPRESS)  # internal: run one order, write its results to --out
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_order:
        return run_one(args)
    if args.write_docs:
        DOCS.check()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="dcpfair-") as state:
        for order in args.orders.split(","):
            # A process per order: Serve's handles in a driver stay bound to the first cluster it talked to.
            out = Path(state) / f"{order}.json"
            subprocess.run([sys.executable, "-m", "bench", "fairness", "--one-order", order, "--out", str(out),
                            "--b-period-s", str(args.b_period_s), "--b-seconds", str(args.b_seconds)], check=True,
                           cwd=REPO_ROOT)
            results[order] = loaded(json.loads(out.read_text()))
            print("\n".join(tables({order: results[order]})), flush=True)
    lines = tables(results)
    print("\n".join(lines))
    if args.write_docs:
        command = bench_command("fairness", argv)
        DOCS.write("## Service levels under overload\n\n"
                   f"`{command}` on a 2-core machine, each order on a cluster of its own: one replica "
                   f"(tp=1), 'full' admission, KV for the requests in the last table's capacity column, "
                   f"{PROMPT_TOKENS}-token prompts, up to {MAX_TOKENS} sampled tokens (temperature 1, a seed each, "
                   f"EOS ends them). B sends one streamed request every {args.b_period_s:g} s for "
                   f"{args.b_seconds:g} s, alone and then while A runs 10 x capacity clients in a closed loop "
                   "(each retries a refusal after its Retry-After, 5 s). Then one tenant runs 2 x capacity clients "
                   f"at each of priorities 0, 5 and {SHEDDABLE} (sheddable). TTFT is the client's, from sending to "
                   "the first token.\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
