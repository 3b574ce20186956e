"""Soak: bounded minutes of mixed traffic with one fault of each kind on a schedule, on a cluster of its own.

Traffic (tests/e2e/faults.py's Load plus the shapes below), all at once for --minutes:
- streaming and non-streaming completions and chat, sampled with seeds (outputs end at lengths nobody knows);
- clients that disconnect right after their first chunk;
- bad inputs (malformed JSON, invalid parameters, an unknown model, an oversized body, a wrong API key): each must
  get an OpenAI-shaped 4xx;
- every --burst-period-s a burst of long sampled requests far past the KV capacity, while autoscaling (1..2
  replicas) adds and removes replicas; after each burst /health and a new request must answer within seconds.
Faults, spread over the run: SIGKILL a TP rank, a whole engine replica, the admission queue, the ingress (by the
pids Serve's and Ray's APIs report); after each, the time until a new request succeeds is the recovery time.

At the end it stops the traffic, waits for every request to end and prints: requests sent, answered by status, lost
(never answered), hung (the client gave up), KV held after the drain, over-commits observed (/health every 0.5 s:
granted + external blocks above the capacity), recovery times, and the CPU the app's processes burn when idle.

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
from tests.e2e import faults
from tests.e2e.cluster import ServeCluster, serve_cluster, tiny_app_args

DOCS = DocsSection("bench/soak.py")
MODEL = "tiny-soak"
KEY = "soak-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAULTS = ("TP rank", "engine replica", "admission queue", "ingress")
BODY_LIMIT = 256 * 1024


def app_args(admission: str = "full") -> dict[str, Any]:
    """The soak's app. Under admission "full" the KV a replica commits never exceeds its capacity, so /health's
    counts can prove no over-commit; under "usage" preempted requests waiting to be recomputed count their whole
    need, so committed KV may exceed the capacity by design (the engine never allocates more than it has)."""
    return tiny_app_args(
        MODEL,
        admission=admission,
        kv_cache_memory_bytes=1024 * 1024,  # 4096 tokens per replica: a burst of long requests is far past it
        api_keys_env="DCPSERVE_SOAK_API_KEYS",
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
class Report:
    """Everything the run observed."""

    outcomes: list[faults.Outcome] = field(default_factory=list)
    bad_inputs: collections.Counter[int] = field(default_factory=collections.Counter)
    bad_input_failures: list[str] = field(default_factory=list)
    disconnects: int = 0
    recoveries: list[tuple[str, float, float]] = field(default_factory=list)  # fault, at s, recovery s
    burst_checks: list[tuple[float, float, float]] = field(default_factory=list)  # at s, /health s, new request s
    admission: str = "full"
    over_commits: int = 0  # "full": samples with committed KV above the capacity ("usage": committed above, by design)
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
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=AUTH) as http:
        seed = 0
        while not stop.is_set():
            seed += 1
            body = {"model": MODEL, "prompt": [9] * 30, "max_tokens": 600, "temperature": 1.0, "seed": seed,
                    "stream": True}
            try:
                async with http.stream("POST", "/v1/completions", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: "):
                            break  # leaving closes the connection: the client is gone after its first chunk
                report.disconnects += 1
            except httpx.HTTPError:
                pass
            await asyncio.sleep(2.0)


async def health_watch(url: str, report: Report, stop: threading.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while not stop.is_set():
            try:
                health = (await http.get("/health")).json()
                if "kv_capacity_blocks" in health:
                    report.health_samples += 1
                    if health["kv_granted_blocks"] + health["kv_external_blocks"] > health["kv_capacity_blocks"]:
                        report.over_commits += 1
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.5)


async def burst(url: str, report: Report, size: int, round_index: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=AUTH,
                                 limits=httpx.Limits(max_connections=size + 4)) as http:
        async def one(i: int) -> None:
            outcome = faults.Outcome("burst", time.monotonic())
            report.outcomes.append(outcome)
            body = {"model": MODEL, "prompt": [(7 * i + j) % 250 + 3 for j in range(300)], "max_tokens": 1500,
                    "temperature": 1.0, "seed": 10_000 * round_index + i}
            try:
                reply = await http.post("/v1/completions", json=body)
                outcome.status = reply.status_code
                if reply.status_code == 200:
                    outcome.tokens = reply.json()["usage"]["completion_tokens"]
                else:
                    outcome.error = reply.json()["error"]["message"]
            except httpx.TimeoutException:
                outcome.error = "client timeout after 300s"
            except (httpx.HTTPError, ValueError) as err:
                outcome.error = f"connection: {err!r}"
            outcome.ended = time.monotonic()

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
    load = faults.Load(cluster.url, MODEL, streams=2, plain=1, chats=1, max_tokens=150, client_timeout_s=180,
                       headers=AUTH)
    load.outcomes = report.outcomes  # one list: the load's requests and the bursts'
    load.start()
    others = background([lambda: bad_inputs(cluster.url, report, stop),
                         lambda: disconnectors(cluster.url, report, stop),
                         lambda: health_watch(cluster.url, report, stop)])
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
                f"request in {new_s:.2f}s; so far {dict(collections.Counter(_label(o) for o in report.outcomes))}")
            next_burst = time.monotonic() + burst_period_s
            continue
        time.sleep(0.5)
    say("stopping the traffic; waiting for every request to end")
    stop.set()
    load.stop(240)
    others.join(60)
    report.kv_held_after_drain = _held_after_drain(cluster)
    report.idle_cpu = _idle_cpu(cluster)
    return report


def _timed(action: Any) -> float:
    start = time.monotonic()
    action()
    return time.monotonic() - start


def _label(outcome: faults.Outcome) -> str:
    if outcome.ended is None:
        return "lost"
    if outcome.hung:
        return "hung"
    if outcome.status == 200 and outcome.error is None:
        return "200"
    if outcome.status is None:
        return "connection error"
    return f"{outcome.status}" if outcome.status != 200 else "200 then error"


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
        f"| answered, by outcome | {', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))} |",
        f"| lost (never answered) | {counts['lost']} |",
        f"| hung (client gave up) | {counts['hung']} |",
        f"| clients that disconnected after their first chunk | {report.disconnects} |",
        f"| bad inputs, by status (-1: ingress down) | {dict(sorted(report.bad_inputs.items()))} |",
        f"| bad inputs answered other than an OpenAI-shaped 4xx | {len(report.bad_input_failures)} |",
        f"| KV held after the drain (blocks) | {report.kv_held_after_drain} |",
        (f"| over-commits observed ({report.health_samples} /health samples) | {report.over_commits} |"
         if report.admission == "full" else
         f"| samples with committed KV above the capacity (preempted requests waiting; by design under usage) | "
         f"{report.over_commits} of {report.health_samples} |"),
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
    if report.kv_held_after_drain:
        problems.append(f"{report.kv_held_after_drain} KV blocks held after the drain")
    if report.over_commits and report.admission == "full":
        problems.append(f"{report.over_commits} over-commits")
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
                        help="the app's admission policy (over-commits are checkable under full; see app_args)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if args.write_docs:
        DOCS.check()
    with tempfile.TemporaryDirectory(prefix="dcpsoak-") as state:
        say(f"starting a cluster of its own (state under {state})")
        with serve_cluster(Path(state), app_args(args.admission),
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
                   f"tokens per replica, admission {args.admission}, API keys), streaming / non-streaming "
                   "completions and chat sampled with seeds, "
                   "clients that disconnect after their first chunk, bad inputs, bursts of long sampled requests far "
                   f"past the KV every {args.burst_period_s:g} s, and one SIGKILL of each kind (TP rank, engine "
                   "replica, admission queue, ingress) spread over the run. Requests that were in flight when a "
                   "process died end with an error (status 200 then an error event, a 500, or a connection error "
                   "when the ingress died); none is lost or left hanging.\n\n" + "\n".join(lines) + "\n")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
