"""The price of Ray's mutual TLS, measured: the app of `make serve` with TLS on and off, side by side in one run.

For each run it starts `make serve` itself (`python -m dcpserve.local.serve`, the tiny model at
serve_config.local.yaml's TP=2 x DCP=2, with DCPSERVE_TLS=1 or 0, on free ports, one state dir whose model is
written before the first run), times it from its start to the first completion answered, then sends one burst
through the OpenAI API (the shape of bench/burst.py: N streamed requests at once with long prompts, temperature 1,
each with its own seed, so that they end on EOS at lengths nobody knows in advance) and records output tokens/s,
TTFT and ITL, then sends 1-token completions one at a time (a request's own path, no queue around it); then stops
it. The runs alternate on, off, off, on, ... so that drift on this noisy machine falls on both alike; the table gives
the median of each configuration's runs and the ratio on / off.

Then `make cluster` (`python -m dcpserve.local.nodes up`: a CPU head, Ray's autoscaler adding a GPU worker node) once
with TLS and once without: the time from its start to the banner, then the banner's `serve deploy`, then the first
completion (the worker node is started by the autoscaler, with its own certificate when TLS is on).

    python -m bench tls                 # console only
    python -m bench tls --write-docs    # also its section of docs/benchmarks.md
    python -m bench tls --rounds 1 --no-cluster --requests 8   # a quick look

Where the time goes: over each burst, the CPU seconds of every process of `make serve` (its Ray head's included), by
role (the ingress, the engine replica, its rank actors, Serve's proxy, the raylet, ...), per output token; and the
per-message cost of TLS on Ray's own calls, each configuration in a process of its own
with a local Ray instance (`--calls-child`): the median round trip of a no-op actor call, and of one item of a
streaming actor call (what a replica sends its ingress once per engine step), over thousands of each.

This process never joins either cluster (it talks HTTP to the app and to Serve's REST API), which is what lets one run
hold both: Ray fixes a process's TLS setting when it is imported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness.compare import BurstResult, environment_line, run_burst
from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.local import serve as local_serve

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = DocsSection("bench/tls.py")
MODEL = "dcpserve-tiny"  # serve_config.local.yaml's served_model_name
CONFIGS = ("TLS off", "TLS on")
START_TIMEOUT_S = 600.0


def say(line: str) -> None:
    print(f"[bench tls] {line}", flush=True)


def first_completion(url: str, deadline: float, process: subprocess.Popen[bytes], log: Path) -> None:
    """Polls until a completion is answered 200 (the app up and serving), or SystemExit."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"exited with {process.returncode} before answering; see {log}")
        try:
            reply = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "def hello",
                                                              "max_tokens": 4, "temperature": 0}, timeout=30)
            if reply.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"no completion within {START_TIMEOUT_S:.0f}s; see {log}")


def stop(process: subprocess.Popen[bytes], env: dict[str, str]) -> None:
    """SIGTERM, as Ctrl-C: `make serve` and `make cluster` stop everything they started; then the Ray temp dir they
    keep for its logs (/tmp/dcpserve-<uid>-<ray port>), which a benchmark of a dozen runs would leave behind."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    shutil.rmtree(f"/tmp/dcpserve-{os.getuid()}-{env['DCPSERVE_RAY_PORT']}", ignore_errors=True)


def local_env(state: Path, tls: bool) -> tuple[dict[str, str], int]:
    """The environment of a `make serve` / `make cluster` run on free ports, and its HTTP port."""
    http, ray_port, dashboard = local_serve.free_ports(3)
    env = {**os.environ, "DCPSERVE_STATE_DIR": str(state), "DCPSERVE_PORT": str(http),
           "DCPSERVE_RAY_PORT": str(ray_port), "DCPSERVE_DASHBOARD_PORT": str(dashboard),
           "DCPSERVE_TLS": "1" if tls else "0"}
    return env, http


# Where the CPU goes, by what Ray's process titles say a process is (the first match wins).
ROLES = (("OpenAIIngress", "ingress"), ("KvAdmission", "admission queue"), ("EngineReplica", "engine replica"),
         ("RankWorker", "rank actors"), ("ProxyActor", "Serve's HTTP proxy"), ("ServeController", "Serve controller"),
         ("raylet", "raylet"), ("gcs_server", "GCS"))


def role(command: str) -> str:
    return next((name for marker, name in ROLES if marker in command), "the rest (agents, dashboard, monitors)")


def cpu_snapshot(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of `root` and every process below it (make serve and its Ray head)."""
    import psutil

    snapshot = {}
    try:
        processes = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    for process in processes:
        try:
            times = process.cpu_times()
            snapshot[process.pid] = (role(" ".join(process.cmdline()) or process.name()), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return snapshot


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role spent between the snapshots (a process that started between them, from 0)."""
    spent: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        spent[name] = spent.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    return spent


@dataclass
class ServeRun:
    tls: bool
    first_completion_s: float
    burst: BurstResult
    cpu_s: dict[str, float]  # CPU seconds of each role (ROLES) over the burst
    alone_s: float  # median latency of a 1-token completion sent alone, the app otherwise idle


ALONE_REQUESTS = 80
ALONE_WARMUP = 10


def alone_latency(url: str, args: argparse.Namespace) -> float:
    """The median seconds of ALONE_REQUESTS completions of max_tokens 1, one at a time, each with a prompt of its own
    (no prefix cache hit), after ALONE_WARMUP unmeasured ones and before the burst: a request's whole path through the
    proxy, ingress, admission queue and replica and back, with nothing queued ahead of it: what TLS adds per request,
    without a burst's queueing (or what a burst leaves behind) around it."""
    rng = random.Random(args.seed + 1)
    times = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for index in range(ALONE_WARMUP + ALONE_REQUESTS):
            prompt = [rng.randrange(5, 500) for _ in range(args.prompt_tokens)]
            start = time.perf_counter()
            reply = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                       "temperature": 0})
            reply.raise_for_status()
            if index >= ALONE_WARMUP:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def serve_run(state: Path, tls: bool, args: argparse.Namespace, round_index: int) -> ServeRun:
    env, http = local_env(state, tls)
    log = state / f"make_serve.{'on' if tls else 'off'}.{round_index}.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "dcpserve.local.serve"], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{http}"
        first_completion(url, started + START_TIMEOUT_S, process, log)
        up_s = time.monotonic() - started
        alone_s = alone_latency(url, args)
        say(f"{CONFIGS[tls]}: make serve answered its first completion after {up_s:.1f}s; a request alone takes "
            f"{1e3 * alone_s:.0f} ms; burst...")
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(5, 500) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
        result = BurstResult(CONFIGS[tls], capacity_blocks=0, deploy_s=up_s)
        seeds = [args.seed + i for i in range(args.requests)]
        before = cpu_snapshot(process.pid)
        asyncio.run(run_burst(url, prompts, args.max_tokens, result, seeds=seeds))
        cpu_s = cpu_by_role(before, cpu_snapshot(process.pid))
        if result.errors:
            raise SystemExit(f"{result.errors} requests failed: "
                             f"{[r.error for r in result.records if r.error][:3]}")
        return ServeRun(tls, up_s, result, cpu_s, alone_s)
    finally:
        stop(process, env)


@dataclass
class ClusterRun:
    tls: bool
    banner_s: float
    deploy_s: float
    first_completion_s: float  # from `make cluster`'s start


def cluster_run(state: Path, tls: bool) -> ClusterRun:
    env, http = local_env(state, tls)
    log = state / f"make_cluster.{'on' if tls else 'off'}.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "dcpserve.local.nodes", "up"], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True)
    try:
        while "the local cluster is up" not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                raise SystemExit(f"`make cluster` did not come up; see {log}")
            time.sleep(0.25)
        banner_s = time.monotonic() - started
        banner = log.read_text(errors="replace")
        command = re.search(r"^\s+(\S+/serve deploy \S+ --address \S+)$", banner, re.MULTILINE)
        export = re.search(r"^\s+export (.+)$", banner, re.MULTILINE)
        if not (command and export):
            raise SystemExit(f"no deploy command in the banner of {log}")
        deploy_env = {**env, **dict(item.split("=", 1) for item in export.group(1).split())}
        subprocess.run(command.group(1).split(), env=deploy_env, check=True, timeout=300, capture_output=True)
        deploy_s = time.monotonic() - started
        first_completion(f"http://127.0.0.1:{http}", started + START_TIMEOUT_S, process, log)
        total = time.monotonic() - started
        say(f"{CONFIGS[tls]}: make cluster's banner after {banner_s:.1f}s, first completion after {total:.1f}s")
        return ClusterRun(tls, banner_s, deploy_s, total)
    finally:
        stop(process, env)


CALLS = 2000


def calls_child(tls: bool) -> None:
    """In a process of its own (Ray fixes its TLS setting at import): a local Ray instance with or without mutual
    TLS, and the median microseconds of a no-op actor call and of a streamed item; prints them as JSON."""
    import json

    from dcpserve.local.tls import local_ray_tls, prepare_driver_tls, tls_setting

    if tls_setting() != tls:
        raise SystemExit(f"--calls-child {int(tls)} runs with DCPSERVE_TLS={int(tls)} (set by calls_run)")
    local_serve.bind_ray_to_loopback()
    prepare_driver_tls()
    import ray

    temp_dir = tempfile.mkdtemp(prefix="dcpbench-", dir="/tmp")  # Ray's socket paths must stay short
    local_ray_tls(Path(temp_dir), say)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        @ray.remote
        class Echo:
            def ping(self) -> int:
                return 0

            def stream(self, n: int) -> Iterator[int]:
                for i in range(n):  # noqa: UP028 - Ray's generators do not take `yield from` of a range
                    yield i

        echo = Echo.remote()  # type: ignore[attr-defined]  # a Ray actor class
        ray.get(echo.ping.remote())
        calls = []
        for _ in range(CALLS):
            start = time.perf_counter()
            ray.get(echo.ping.remote())
            calls.append(time.perf_counter() - start)
        items = []
        start = time.perf_counter()
        for ref in echo.stream.options(num_returns="streaming").remote(CALLS):
            ray.get(ref)
            now = time.perf_counter()
            items.append(now - start)
            start = now
        print("CALLS" + json.dumps({"call_us": 1e6 * statistics.median(calls),
                                    "item_us": 1e6 * statistics.median(items)}), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)  # Ray's session logs and this instance's CA


def calls_run(tls: bool) -> dict[str, float]:
    import json

    done = subprocess.run([sys.executable, "-m", "bench", "tls", "--calls-child", "1" if tls else "0"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, "DCPSERVE_TLS": "1" if tls else "0"})
    line = next((x for x in done.stdout.splitlines() if x.startswith("CALLS")), None)
    if line is None:
        raise SystemExit(f"the Ray call measurement failed: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(line[len("CALLS"):])
    return result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(serve: list[ServeRun], cluster: list[ClusterRun], calls: list[tuple[bool, dict[str, float]]]) -> list[str]:
    def row(metric: str, off: float, on: float, fmt: str) -> str:
        return f"| {metric} | {off:{fmt}} | {on:{fmt}} | {f'{on / off:.2f}x' if off else '-'} |"

    def of(tls: bool, value: str) -> float:
        return median([getattr(run.burst, value) for run in serve if run.tls == tls])

    lines = ["| metric | TLS off | TLS on | on / off |", "|:---|---:|---:|---:|",
             row("output tokens/s (burst)", of(False, "output_tokens_per_s"), of(True, "output_tokens_per_s"), ".1f"),
             row("TTFT p50 (ms)", 1e3 * of(False, "ttft_median_s"), 1e3 * of(True, "ttft_median_s"), ".0f"),
             row("ITL p50 (ms)", 1e3 * of(False, "itl_median_s"), 1e3 * of(True, "itl_median_s"), ".1f"),
             row(f"a 1-token completion alone, p50 of {ALONE_REQUESTS} (ms)",
                 1e3 * median([r.alone_s for r in serve if not r.tls]),
                 1e3 * median([r.alone_s for r in serve if r.tls]), ".1f"),
             row("`make serve` start to first completion (s)",
                 median([r.first_completion_s for r in serve if not r.tls]),
                 median([r.first_completion_s for r in serve if r.tls]), ".1f")]
    for label, value in (("`make cluster` start to banner (s)", "banner_s"),
                         ("`make cluster` start to first completion, via `serve deploy` (s)", "first_completion_s")):
        off = [getattr(r, value) for r in cluster if not r.tls]
        on = [getattr(r, value) for r in cluster if r.tls]
        if off and on:
            lines.append(row(label, median(off), median(on), ".1f"))
    def cpu_ms_per_token(tls: bool, name: str | None) -> float:
        return median([1e3 * (sum(run.cpu_s.values()) if name is None else run.cpu_s.get(name, 0.0))
                       / run.burst.output_tokens for run in serve if run.tls == tls])

    for name in (None, *sorted({name for run in serve for name in run.cpu_s},
                               key=lambda name: -cpu_ms_per_token(False, name))):
        lines.append(row(f"CPU ms per output token: {name or 'all processes of make serve'}",
                         cpu_ms_per_token(False, name), cpu_ms_per_token(True, name), ".2f"))
    for label, key in (("Ray actor call round trip, no-op (us)", "call_us"),
                       ("Ray streamed item, one per engine step to the ingress (us)", "item_us")):
        off = [result[key] for tls, result in calls if not tls]
        on = [result[key] for tls, result in calls if tls]
        if off and on:
            lines.append(row(label, median(off), median(on), ".0f"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="`make serve` runs (and Ray call measurements) per configuration (default 3)")
    parser.add_argument("--requests", type=int, default=24, help="requests in each burst (default 24)")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="prompt length in tokens (default 300)")
    parser.add_argument("--max-tokens", type=int, default=1000, help="max_tokens of each request (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="prompts' seed; request i samples with seed + i")
    parser.add_argument("--no-cluster", action="store_true", help="skip the `make cluster` runs")
    parser.add_argument("--write-docs", action="store_true", help="write its section of docs/benchmarks.md")
    parser.add_argument("--calls-child", choices=("0", "1"), help=argparse.SUPPRESS)  # one calls_run's process
    args = parser.parse_args(argv)
    if args.calls_child is not None:
        calls_child(args.calls_child == "1")
        return 0
    if args.write_docs:
        DOCS.check()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dcpserve-bench-tls-") as scratch:
        state = Path(scratch)
        local_serve.ensure_tiny_model(state)  # written once, before any run is timed
        order = [tls for pair in range(args.rounds) for tls in ((True, False) if pair % 2 == 0 else (False, True))]
        serve = [serve_run(state, tls, args, i) for i, tls in enumerate(order)]
        cluster = [] if args.no_cluster else [cluster_run(state, tls) for tls in (True, False)]
    calls = [(tls, calls_run(tls)) for tls in order]
    lines = table(serve, cluster, calls)
    cores = len(os.sched_getaffinity(0))
    notes = [
        f"{len(order)} `make serve` runs (and as many Ray call measurements, {CALLS} of each kind per run) in the "
        f"order {', '.join(CONFIGS[t] for t in order)}; medians per configuration. Each burst: "
        f"{args.requests} streamed requests x {args.prompt_tokens}-token prompts, max_tokens {args.max_tokens}, "
        f"temperature 1 with seeds {args.seed}..{args.seed + args.requests - 1} (they end on EOS).",
        "Per run: " + "; ".join(
            f"{CONFIGS[r.tls]} {r.burst.output_tokens_per_s:.0f} tok/s, TTFT {1e3 * r.burst.ttft_median_s:.0f} ms, "
            f"alone {1e3 * r.alone_s:.0f} ms"
            for r in serve) + ".",
        f"CPU run on {cores} cores: the tiny model at TP=2 x DCP=2 (serve_config.local.yaml), its ranks CPU actors.",
        environment_line(),
    ]
    print()
    print("\n".join(lines))
    for note in notes:
        print(f"- {note}")
    print(f"total {time.monotonic() - began:.0f}s")
    if args.write_docs:
        DOCS.write("\n".join(["## The price of Ray's mutual TLS (`make serve`, `make cluster`)", "",
                              f"Command: `{bench_command('tls', argv)}`", "", *lines, "",
                              *[f"- {note}" for note in notes]]))
        say(f"updated {DOCS.path.relative_to(REPO_ROOT)}")
    return 0
