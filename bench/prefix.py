"""Prefix caching and prefix-aware routing, measured through the deployed app (2 engine replicas).

On a Ray head of this benchmark's own (4 logical GPUs, as `make serve`) it deploys the tiny model three times, the same
layout and 2 replicas each time, and runs the same two workloads against each through the OpenAI API (official
streaming SSE over raw HTTP, as vLLM's benchmark_serving does):

- shared system prompt: requests of one long system prompt plus a short user turn of their own, a few at a time;
- multi-turn chats: conversations, each with its own long context, whose every turn resends the whole history
  (earlier turns, the answers the model gave, token for token, and a new user turn), the conversations at once.

The configurations: caching on with prefix-aware routing (the default), caching on with routing by free KV alone
(prefix_routing false: what a router blind to prefixes does), and caching off. It reports TTFT and output
tokens/s (caching on vs off), and the prefix hit rate (prompt tokens served from the replicas' caches, from their
engine counters) and the routing prefix-hit share (prompt blocks the granted replica had cached or was computing).

    python -m bench prefix                 # full run (console only; about 10 minutes on 2 cores)
    python -m bench prefix --write-docs    # also writes its section of docs/benchmarks.md
    python -m bench prefix --quick         # smaller workloads
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import compare
from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.cluster.tiny_model import write_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = "bench/prefix.py"
REPLICAS = 2


@dataclass(frozen=True)
class Workload:
    system_tokens: int  # the shared system prompt
    user_tokens: int  # a user turn
    system_requests: int
    system_concurrency: int
    conversations: int
    turns: int
    context_tokens: int  # each conversation's own context (document, tools) before its first turn
    answer_tokens: int  # max_tokens of every request

    def describe(self) -> str:
        final = self.context_tokens + self.turns * (self.user_tokens + self.answer_tokens)
        return (f"shared system prompt: {self.system_requests} requests of {self.system_tokens} + "
                f"{self.user_tokens} tokens, {self.system_concurrency} at a time; multi-turn: {self.conversations} "
                f"conversations at once x {self.turns} turns, each starting from {self.context_tokens} tokens of "
                f"its own and adding {self.user_tokens} user + {self.answer_tokens} answer tokens a turn (up to "
                f"{final} tokens); every request max_tokens={self.answer_tokens}, greedy, ignore_eos")


WORKLOADS = {
    False: Workload(system_tokens=4000, user_tokens=64, system_requests=24, system_concurrency=4, conversations=6,
                    turns=6, context_tokens=2500, answer_tokens=24),
    True: Workload(system_tokens=1000, user_tokens=32, system_requests=8, system_concurrency=4, conversations=4,
                   turns=3, context_tokens=600, answer_tokens=12),
}
# label -> (enable_prefix_caching, prefix_routing)
CONFIGS = {"caching + prefix routing": (True, True), "caching, KV-only routing": (True, False),
           "caching off": (False, True)}


def say(line: str) -> None:
    print(f"[prefix] {line}", flush=True)


@dataclass
class Timing:
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


@dataclass
class ConfigResult:
    label: str
    system: Timing
    chat: Timing
    chat_queried: int  # prompt tokens the replicas looked up during the multi-turn set
    chat_hit: int  # of those, served from their caches
    router_query_blocks: int
    router_hit_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.chat_hit / self.chat_queried if self.chat_queried else 0.0

    @property
    def router_share(self) -> float:
        return self.router_hit_blocks / self.router_query_blocks if self.router_query_blocks else 0.0


def app_config(caching: bool, routing: bool, max_model_len: int) -> dict[str, Any]:
    config = compare.app_config(1, 1, 16, 64 << 20, max_model_len, "usage", 256)
    args = config["applications"][0]["args"]
    args.update({"enable_prefix_caching": caching, "prefix_routing": routing,
                 "autoscaling": {"min_replicas": REPLICAS, "max_replicas": REPLICAS}})
    return config


def serve_stats(head: compare.ServeHead, deployment: str, method: str, calls: int) -> list[dict[str, Any]]:
    """`method`'s answers from the deployment through Serve handles (compare.ServeHead.serve_stats)."""
    return head.serve_stats(deployment, method, calls)


def engine_counters(head: compare.ServeHead) -> tuple[int, int]:
    """(prompt tokens looked up, served from cache), summed over the replicas."""
    by_replica: dict[str, dict[str, Any]] = {}
    for stats in serve_stats(head, "EngineReplica", "stats", 16):
        by_replica[stats["replica_id"]] = stats
    if len(by_replica) != REPLICAS:
        raise SystemExit(f"expected {REPLICAS} engine replicas to answer, got {sorted(by_replica)}")
    return (sum(s["engine"]["prefix_cache_queries"] for s in by_replica.values()),
            sum(s["engine"]["prefix_cache_hits"] for s in by_replica.values()))


async def completion(client: Any, prompt: list[int], max_tokens: int, timing: Timing) -> list[int]:
    """One streamed greedy completion (raw HTTP + SSE, as vLLM's benchmark_serving does: the openai SDK's own request
    building walks a long token-id prompt in Python, tens of ms the server never sees); returns its token ids (the
    next turn resends them)."""
    body = {"model": compare.MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True}
    payload = json.dumps(body)
    sent = time.perf_counter()
    first = None
    tokens: list[int] = []
    async with client.stream("POST", "/v1/completions", content=payload,
                             headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            raise SystemExit(f"a request failed: {response.status_code} {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices", ()):
                new = (choice.get("logprobs") or {}).get("tokens") or []
                if new and first is None:
                    first = time.perf_counter()
                tokens += [int(t.split(":", 1)[1]) for t in new]
    if first is None or len(tokens) != max_tokens:
        raise SystemExit(f"a request streamed {len(tokens)} of {max_tokens} tokens")
    timing.ttft_s.append(first - sent)
    timing.output_tokens += len(tokens)
    return tokens


def http_client(base_url: str) -> Any:
    import httpx

    return httpx.AsyncClient(base_url=base_url, timeout=900, limits=httpx.Limits(max_connections=64))


async def warm_up(base_url: str, vocab: int) -> None:
    """A few short requests of their own first, so no configuration pays the replicas' first steps in its numbers."""
    rng = random.Random(0)
    client = http_client(base_url)
    try:
        for _ in range(2):
            await asyncio.gather(*(completion(client, [rng.randrange(vocab) for _ in range(64)], 4, Timing())
                                   for _ in range(2 * REPLICAS)))
    finally:
        await client.aclose()


async def system_prompt_set(base_url: str, workload: Workload, vocab: int, seed: int) -> Timing:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(workload.system_tokens)]
    prompts = [system + [rng.randrange(vocab) for _ in range(workload.user_tokens)]
               for _ in range(workload.system_requests)]
    timing = Timing()
    gate = asyncio.Semaphore(workload.system_concurrency)
    client = http_client(base_url)
    start = time.perf_counter()

    async def one(prompt: list[int]) -> None:
        async with gate:
            await completion(client, prompt, workload.answer_tokens, timing)

    try:
        await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.aclose()
    timing.seconds = time.perf_counter() - start
    return timing


async def multi_turn_set(base_url: str, workload: Workload, vocab: int, seed: int) -> Timing:
    rng = random.Random(seed + 1)
    timing = Timing()
    client = http_client(base_url)
    start = time.perf_counter()

    async def conversation() -> None:
        history = [rng.randrange(vocab) for _ in range(workload.context_tokens)]
        for _ in range(workload.turns):
            history += [rng.randrange(vocab) for _ in range(workload.user_tokens)]
            history += await completion(client, history, workload.answer_tokens, timing)

    try:
        await asyncio.gather(*(conversation() for _ in range(workload.conversations)))
    finally:
        await client.aclose()
    timing.seconds = time.perf_counter() - start
    return timing


def measure(label: str, head: compare.ServeHead, model_dir: Path, workload: Workload, vocab: int,
            max_model_len: int) -> ConfigResult:
    caching, routing = CONFIGS[label]
    say(f"{label}: deploying {REPLICAS} replicas (tp=1), enable_prefix_caching={caching}, "
        f"prefix_routing={routing}")
    head.deploy(model_dir, app_config(caching, routing, max_model_len), label.replace(" ", "_").replace(",", ""))
    asyncio.run(warm_up(head.base_url, vocab))
    say(f"{label}: shared system prompt set")
    system = asyncio.run(system_prompt_set(head.base_url, workload, vocab, seed=1))
    queried0, hit0 = engine_counters(head)
    router0 = serve_stats(head, "KvAdmission", "stats", 1)[0]
    say(f"{label}: multi-turn set")
    chat = asyncio.run(multi_turn_set(head.base_url, workload, vocab, seed=2))
    queried1, hit1 = engine_counters(head)
    router1 = serve_stats(head, "KvAdmission", "stats", 1)[0]
    head.shutdown_serve()
    result = ConfigResult(label, system, chat, queried1 - queried0, hit1 - hit0,
                          router1["prefix_query_blocks"] - router0["prefix_query_blocks"],
                          router1["prefix_hit_blocks"] - router0["prefix_hit_blocks"])
    say(f"{label}: system TTFT median {statistics.median(system.ttft_s) * 1000:.0f} ms, "
        f"{system.tokens_per_s:.1f} tok/s; multi-turn hit rate {result.hit_rate:.0%}, TTFT median "
        f"{statistics.median(chat.ttft_s) * 1000:.0f} ms")
    return result


def table(results: dict[str, ConfigResult]) -> list[list[str]]:
    on, blind, off = (results[label] for label in CONFIGS)

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.0f}"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    rows = [
        ["system prompt: TTFT median (ms)", ms(on.system.ttft_s), ms(blind.system.ttft_s), ms(off.system.ttft_s),
         ratio(statistics.median(off.system.ttft_s), statistics.median(on.system.ttft_s))],
        ["system prompt: output tok/s", f"{on.system.tokens_per_s:.1f}", f"{blind.system.tokens_per_s:.1f}",
         f"{off.system.tokens_per_s:.1f}", ratio(on.system.tokens_per_s, off.system.tokens_per_s)],
        ["multi-turn: TTFT median (ms)", ms(on.chat.ttft_s), ms(blind.chat.ttft_s), ms(off.chat.ttft_s),
         ratio(statistics.median(off.chat.ttft_s), statistics.median(on.chat.ttft_s))],
        ["multi-turn: output tok/s", f"{on.chat.tokens_per_s:.1f}", f"{blind.chat.tokens_per_s:.1f}",
         f"{off.chat.tokens_per_s:.1f}", ratio(on.chat.tokens_per_s, off.chat.tokens_per_s)],
        ["multi-turn: prefix hit rate (tokens)", f"{on.hit_rate:.0%}", f"{blind.hit_rate:.0%}", f"{off.hit_rate:.0%}",
         ratio(on.hit_rate, blind.hit_rate)],
        ["multi-turn: router prefix-hit share (blocks)", f"{on.router_share:.0%}", f"{blind.router_share:.0%}", "-",
         ratio(on.router_share, blind.router_share)],
    ]
    return rows


def markdown(rows: list[list[str]], command: str, workload: Workload, seconds: float) -> str:
    header = ["metric", *CONFIGS, "on+prefix routing vs off (or vs KV-only for rates)"]
    lines = ["## Prefix caching and prefix-aware routing (2 replicas, tp=1)", "", f"Command: `{command}`", "",
             "| " + " | ".join(header) + " |", "|:---|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", f"- {compare.cpu_run_line(1)}; the two replicas and the ingress share them.",
              f"- workloads: {workload.describe()}.",
              "- TTFT is measured by the client from sending the request to its first token (admission included). "
              "The hit rate is the replicas' own count (prompt tokens of new requests served from their caches over "
              "those looked up), the routing share the prompt blocks routing found on the granted replica (reported "
              "cached, or computed there by requests granted since its last report).",
              "- KV-only routing is the same app with prefix_routing false: the admission queue grants the "
              "replica with the most free KV, as a router blind to prefixes does; its caches still serve whatever "
              "happens to land on them. It gets more than chance here: a turn's finish frees KV on its replica, so "
              "the most-free rule often sends the conversation's next turn back.",
              "- Requests go as raw HTTP with SSE (as vLLM's benchmark_serving does): the openai SDK builds a request "
              "from a 4,000-token id list in Python for 34 ms on this machine (1 ms for 64 tokens; more while the "
              "cores are busy), which its TTFT would count.",
              f"- {compare.environment_line()}; total {seconds:.0f}s."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads (about 4 minutes)")
    parser.add_argument("--write-docs", action="store_true",
                        help="write this benchmark's section of docs/benchmarks.md")
    parser.add_argument("--deploy-timeout", type=float, default=300.0, help="seconds to wait for each deploy")
    args = parser.parse_args(argv)
    docs = DocsSection(SCRIPT)
    if args.write_docs:
        docs.check()
    workload = WORKLOADS[args.quick]
    started = time.monotonic()
    results: dict[str, ConfigResult] = {}
    with compare.state_dir("dcppfx-", say) as state:
        model_dir = write_tiny_model(state / "tiny-model")
        vocab = 256  # byte-level ids: ordinary tokens of the tiny model's vocabulary
        max_model_len = 8192
        with compare.serve_head(state, args.deploy_timeout) as head:
            for label in CONFIGS:
                results[label] = measure(label, head, model_dir, workload, vocab, max_model_len)
    rows = table(results)
    widths = [max(len(r[i]) for r in rows + [["metric", *CONFIGS, "ratio"]]) for i in range(5)]
    print()
    for row in [["metric", *CONFIGS, "ratio"], *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)))
    seconds = time.monotonic() - started
    print(f"total {seconds:.0f}s")
    if args.write_docs:
        docs.write(markdown(rows, bench_command("prefix", argv), workload, seconds))
        say(f"updated {docs.path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
