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

    python -m bench soak                          # 5 minutes (console only)
    python -m bench soak --minutes 5 --write-docs # also writes its section of docs/benchmarks.md
    python -m bench soak --minutes 1              # what tests/e2e/test_soak.py runs, shorter
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness import faults
from bench.harness.cluster import ServeCluster, serve_cluster
from bench.harness.docs_section import DocsSection, bench_command
from bench.soak_report import healthy, listed, so_far, table
from bench.soak_traffic import (
    AUTH,
    FAULTS,
    KEY,
    MODEL,
    PRIORITIES,
    SECOND_TENANT_MAX_CONCURRENT,
    SHEDDABLE_PRIORITY,
    Report,
    app_args,
    background,
    bad_inputs,
    burst,
    clients,
    disconnectors,
    kv_watch,
    write_keys_file,
)

DOCS = DocsSection("bench/soak.py")


def say(line: str) -> None:
    print(f"[soak] {line}", flush=True)


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
                f"request in {new_s:.2f}s; so far {listed(so_far(report))}")
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
        command = bench_command("soak", argv)
        DOCS.write("## Soak: mixed traffic with faults\n\n"
                   f"`{command}` on a 2-core machine: its own cluster (tp=2 x dcp=2, 1..2 replicas, 4096 KV "
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
