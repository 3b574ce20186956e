"""A burst of long sampled requests against a running app (`make serve`), then: does it still answer, is it idle?

The traffic that once wedged the ingress: N non-streaming /v1/completions at once, each with a long prompt of token
ids, a large max_tokens, temperature 1 and its own seed (the tiny model then stops on EOS at lengths nobody knows
in advance), far more KV than the app holds. It prints the answers by HTTP status (only 200 and 429 are healthy
outcomes), their latencies, then how fast /health and a new completion answer right after the burst and how much
CPU the ingress process burns over idle seconds (a busy loop shows as ~1 s per second).

    make serve                               # in one terminal
    .venv/bin/python -m bench burst          # in another (defaults: the issue's 24 x 300-token prompts, max 3000)
    .venv/bin/python -m bench burst --requests 48 --rounds 2 --write-docs   # also writes its docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.harness.docs_section import DocsSection, bench_command
from bench.harness.faults import cpu_seconds

REPO_ROOT = Path(__file__).resolve().parents[1]

DOCS = DocsSection("bench/burst.py")


def ingress_pid(dashboard_url: str, token_path: Path, app: str) -> int | None:
    """The OpenAIIngress replica's pid from Serve's REST API (None when the dashboard cannot be asked)."""
    try:
        token = token_path.read_text().strip()
        reply = httpx.get(f"{dashboard_url}/api/serve/applications/", headers={"Authorization": f"Bearer {token}"},
                          timeout=10)
        reply.raise_for_status()
        replicas = reply.json()["applications"][app]["deployments"]["OpenAIIngress"]["replicas"]
        return int(replicas[0]["pid"])
    except (OSError, KeyError, IndexError, ValueError, httpx.HTTPError) as err:
        print(f"(no ingress pid from {dashboard_url}: {err!r}; skipping the idle-CPU check)")
        return None


async def one(http: httpx.AsyncClient, model: str, index: int, args: argparse.Namespace) -> tuple[int, float, int, str]:
    """(status, seconds, completion tokens, error message) of one request."""
    prompt = [(7 * index + 13 * i) % 250 + 3 for i in range(args.prompt_tokens)]
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "seed": args.seed + index}
    start = time.monotonic()
    try:
        reply = await http.post("/v1/completions", json=body)
    except httpx.HTTPError as err:
        return -1, time.monotonic() - start, 0, f"no answer: {err!r}"
    took = time.monotonic() - start
    if reply.status_code != 200:
        return reply.status_code, took, 0, reply.json().get("error", {}).get("message", reply.text)
    return 200, took, reply.json()["usage"]["completion_tokens"], ""


async def burst(url: str, model: str, args: argparse.Namespace) -> list[tuple[int, float, int, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=args.client_timeout_s,
                                 limits=httpx.Limits(max_connections=args.requests + 8)) as http:
        return await asyncio.gather(*(one(http, model, i, args) for i in range(args.requests)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=f"http://127.0.0.1:{os.environ.get('DCPSERVE_PORT', '8000')}")
    parser.add_argument("--dashboard-url",
                        default=f"http://127.0.0.1:{os.environ.get('DCPSERVE_DASHBOARD_PORT', '8265')}")
    parser.add_argument("--token-path", type=Path,
                        default=Path(os.environ.get("DCPSERVE_STATE_DIR", REPO_ROOT / ".dcpserve")) / "ray_auth_token")
    parser.add_argument("--app", default="dcpserve", help="the Serve application name")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="request i gets seed + i")
    parser.add_argument("--rounds", type=int, default=1, help="bursts, one after another")
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle seconds the ingress' CPU time is measured")
    parser.add_argument("--client-timeout-s", type=float, default=600.0)
    parser.add_argument("--write-docs", action="store_true", help="also write the tables to docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.write_docs:
        DOCS.check()
    lines: list[str] = []

    def out(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    try:
        models = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"]
    except httpx.HTTPError as err:
        raise SystemExit(f"no app answers at {args.url} ({err!r}); start one with `make serve`") from None
    model = models[0]["id"]
    pid = ingress_pid(args.dashboard_url, args.token_path, args.app)
    healthy = True
    out(f"{args.requests} requests x {args.prompt_tokens}-token prompts, max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}, against {args.url} ({model})")
    out("| round | seconds | 200 | 429 | other | median latency 200 (s) | completion tokens (min / median / max) |")
    out("|---|---|---|---|---|---|---|")
    for round_index in range(args.rounds):
        start = time.monotonic()
        results = asyncio.run(burst(args.url, model, args))
        took = time.monotonic() - start
        counts = collections.Counter(status for status, *_ in results)
        ok = [r for r in results if r[0] == 200]
        lengths = sorted(r[2] for r in ok) or [0]
        other = sum(v for k, v in counts.items() if k not in (200, 429))
        latency = statistics.median(r[1] for r in ok) if ok else float("nan")
        out(f"| {round_index + 1} | {took:.1f} | {counts[200]} | {counts[429]} | {other} | {latency:.1f} | "
              f"{lengths[0]} / {statistics.median(lengths):.0f} / {lengths[-1]} |")
        for status, _, _, message in results:
            if status not in (200, 429):
                healthy = False
                out(f"  unexpected {status}: {message}")
        messages = collections.Counter(message for status, _, _, message in results if status == 429)
        for message, count in messages.items():
            out(f"  429 x {count}: {message}")

    with httpx.Client(base_url=args.url, timeout=60) as http:
        start = time.monotonic()
        health = http.get("/health")
        health_s = time.monotonic() - start
        start = time.monotonic()
        reply = http.post("/v1/completions", json={"model": model, "prompt": [5, 6, 7], "max_tokens": 4,
                                                   "temperature": 0})
        new_s = time.monotonic() - start
    out(f"after the burst: /health {health.status_code} in {health_s:.2f}s, a new completion {reply.status_code} "
          f"in {new_s:.2f}s")
    healthy &= health.status_code == 200 and reply.status_code == 200
    if pid is not None:
        before = cpu_seconds(pid)
        time.sleep(args.idle_s)
        used = cpu_seconds(pid) - before
        out(f"ingress (pid {pid}) CPU over {args.idle_s:.0f}s idle: {used:.2f}s ({100 * used / args.idle_s:.0f}%)")
        healthy &= used < 0.25 * args.idle_s
    if args.write_docs:
        command = bench_command("burst", argv)
        DOCS.write("## A burst of long sampled requests through `make serve`\n\n"
                   f"`make serve` (tp=2 x dcp=2, 4 MiB KV per rank, autoscaling 1..2 replicas), then "
                   f"`{command}` on a 2-core machine. Healthy: only 200s and 429s, /health and a new request "
                   "answer at once, the ingress idles.\n\n```text\n" + "\n".join(lines) + "\n```\n")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
