"""Layout pools through the deployed app: one pooled app against two homogeneous ones on the same 4 logical GPUs.

A Ray head of this bench's own with 4 logical GPUs (bench/harness/compare.py), the tiny model in float32, and three apps
deployed one after another with `serve deploy`, each sent the same mixed burst through the `openai` client:

- pooled: one replica of tp=2 dcp=1 (pool "short") and one of tp=2 dcp=2 (pool "long"), gpu_budget 4;
- 2 x tp=2 dcp=1;
- 2 x tp=2 dcp=2.

Every rank has the same KV bytes, so a dcp=2 replica holds twice the tokens of a dcp=1 one. The burst: 70% requests
of ~500 prompt tokens and 30% of ~6,000, in a shuffled order, all sent at once; sampled at temperature 1 with a
seed per request, so outputs end on EOS at lengths nobody knows (max_tokens caps them). Goodput is the requests
that finished with TTFT <= --ttft-target-s and their own mean inter-token latency <= --itl-target-s, per second of
the burst's makespan.

    python -m bench pools                  # the three apps (about 10 minutes on 2 cores)
    python -m bench pools --write-docs     # also writes its section of docs/benchmarks.md and the plot
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import compare
from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.config import ModelConfig
from dcpserve.simulator.metrics import percentile

SCRIPT = "bench/pools.py"
PLOT = Path("docs/img/pools.png")
COLORS = ("tab:green", "tab:gray", "tab:blue")
BLOCK_SIZE = 16
PAGES_PER_RANK = 768  # 12,288 tokens per tp=2 dcp=1 replica, 24,576 per tp=2 dcp=2 one
MAX_MODEL_LEN = 8192
SHORT_TOKENS, LONG_TOKENS = 500, 6000


@dataclass(frozen=True)
class Setup:
    label: str
    pools: list[dict[str, Any]] | None  # None: one layout of `dcp` with 2 replicas
    dcp: int = 1


SETUPS = (
    Setup("pooled: tp2 dcp1 + tp2 dcp2", [
        {"name": "short", "tensor_parallel_size": 2, "autoscaling": {"min_replicas": 1, "max_replicas": 1}},
        {"name": "long", "tensor_parallel_size": 2, "decode_context_parallel_size": 2,
         "autoscaling": {"min_replicas": 1, "max_replicas": 1}}]),
    Setup("2 x tp2 dcp1", None, 1),
    Setup("2 x tp2 dcp2", None, 2),
)


@dataclass
class Result:
    setup: Setup
    kinds: list[str]  # each request's kind, "short" or "long", in the burst's order
    burst: compare.BurstResult
    pool_grants: dict[str, int] = field(default_factory=dict)

    def met(self, ttft_s: float, itl_s: float) -> list[tuple[str, compare.RequestRecord]]:
        """(kind, record) of the requests that finished within both bounds."""
        return [(kind, r) for kind, r in zip(self.kinds, self.burst.records, strict=True)
                if r.error is None and r.first_token is not None and r.first_token - r.sent <= ttft_s
                and mean_itl(r) <= itl_s]


def mean_itl(record: compare.RequestRecord) -> float:
    if record.first_token is None or record.last_token is None or record.completion_tokens < 2:
        return 0.0
    return (record.last_token - record.first_token) / (record.completion_tokens - 1)


def burst(count: int, seed: int) -> list[tuple[str, list[int]]]:
    """(kind, prompt) of the burst, shuffled: 70% short, 30% long, lengths +-10% around their kind's."""
    rng = random.Random(seed)
    longs = round(count * 0.3)
    kinds = ["long"] * longs + ["short"] * (count - longs)
    rng.shuffle(kinds)
    return [(kind, [rng.randrange(20, 250) for _ in range(
        round((LONG_TOKENS if kind == "long" else SHORT_TOKENS) * rng.uniform(0.9, 1.1)))]) for kind in kinds]


def app_config(setup: Setup, budget_bytes: int, max_queued: int) -> dict[str, Any]:
    config = compare.app_config(2, setup.dcp, BLOCK_SIZE, budget_bytes, MAX_MODEL_LEN, "usage", max_queued)
    args = config["applications"][0]["args"]
    args["max_num_seqs"] = 16
    if setup.pools is None:
        args["autoscaling"] = {"min_replicas": 2, "max_replicas": 2}
    else:
        args["pools"] = setup.pools
        args["gpu_budget"] = compare.NUM_GPUS
    return config


def measure(head: compare.ServeHead, model_dir: Path, setup: Setup, budget_bytes: int,
            prompts: list[tuple[str, list[int]]], max_tokens: int, say: Any) -> Result:
    label = setup.label.replace(" ", "_").replace(":", "").replace("+", "and")
    say(f"{setup.label}: deploying")
    deploy_s = head.deploy(model_dir, app_config(setup, budget_bytes, len(prompts)), label)
    result = Result(setup, [kind for kind, _ in prompts], compare.BurstResult(setup.label, 0, deploy_s))
    asyncio.run(compare.run_burst(head.base_url, [prompt for _, prompt in prompts], max_tokens, result.burst,
                                  progress=say, seeds=list(range(len(prompts)))))
    if setup.pools is not None:
        stats = head.serve_stats("KvAdmission", "stats", 1)[0]
        result.pool_grants = stats.get("pool_grants", {})
    head.shutdown_serve()
    return result


def describe(result: Result, ttft_s: float, itl_s: float) -> list[str]:
    burst = result.burst
    done = [r for r in burst.records if r.error is None and r.first_token is not None]
    ttfts = sorted(r.first_token - r.sent for r in done if r.first_token is not None)
    itls = sorted(mean_itl(r) for r in done)
    met = result.met(ttft_s, itl_s)
    counts = {kind: f"{sum(k == kind for k, _ in met)}/{result.kinds.count(kind)}" for kind in ("short", "long")}
    return [result.setup.label, f"{len(met) / burst.makespan_s:.3f}", f"{len(met)}/{len(burst.records)}",
            counts["short"], counts["long"], f"{percentile(ttfts, 50):.1f} / {percentile(ttfts, 90):.1f} s",
            f"{percentile(itls, 50) * 1e3:.0f} / {percentile(itls, 90) * 1e3:.0f} ms",
            f"{burst.output_tokens_per_s:.0f}", f"{burst.makespan_s:.0f} s", str(burst.errors),
            ", ".join(f"{k} {v}" for k, v in sorted(result.pool_grants.items())) or "-"]


def write_plot(path: Path, results: list[Result], ttft_s: float, itl_s: float) -> None:
    """Left: each app's granted sequences over the burst; right: each app's goodput, split by kind of request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (timeline, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for result, color in zip(results, COLORS, strict=False):
        timeline.step([t for t, _ in result.burst.timeline], [n for _, n in result.burst.timeline], where="post",
                      color=color,
                      label=result.setup.label)
    timeline.set_xlabel("seconds since the burst")
    timeline.set_ylabel("granted sequences")
    timeline.legend(loc="upper right")
    labels = [r.setup.label.split(":")[0] for r in results]
    bottoms = [0.0] * len(results)
    for kind, hatch in (("short", ""), ("long", "//")):
        values = [sum(k == kind for k, _ in r.met(ttft_s, itl_s)) / r.burst.makespan_s for r in results]
        bars.bar(labels, values, bottom=bottoms, color=COLORS[:len(results)], hatch=hatch, edgecolor="black",
                 label=f"{kind} requests")
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    bars.set_ylabel(f"goodput (req/s, TTFT <= {ttft_s:g} s, ITL <= {itl_s * 1e3:g} ms)")
    bars.legend(loc="upper right", fontsize=8)
    fig.suptitle("layout pools: one burst, three apps on the same 4 logical GPUs (bench/pools.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40, help="requests in the burst (default 40)")
    parser.add_argument("--max-tokens", type=int, default=96, help="each request's max_tokens (default 96)")
    parser.add_argument("--ttft-target-s", type=float, default=30.0, help="TTFT bound of goodput (default 30 s)")
    parser.add_argument("--itl-target-s", type=float, default=0.5, help="mean ITL bound of goodput (default 0.5 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deploy-timeout", type=float, default=600.0)
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    docs = DocsSection(SCRIPT)
    if args.write_docs:
        docs.check()

    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    prompts = burst(args.requests, args.seed)
    with compare.state_dir("dcppools-", say) as state:
        model_dir = write_tiny_model(state / "tiny-model")
        model = ModelConfig.from_pretrained(model_dir)
        budget_bytes = compare.kv_budget_bytes(model, 2, BLOCK_SIZE, PAGES_PER_RANK)
        with compare.serve_head(state, args.deploy_timeout) as head:
            results = [measure(head, model_dir, setup, budget_bytes, prompts, args.max_tokens, say)
                       for setup in SETUPS]
    header = ["app", "goodput req/s", "met", "short met", "long met", "TTFT p50 / p90", "ITL p50 / p90",
              "output tok/s", "makespan", "failed", "grants by pool"]
    rows = [describe(result, args.ttft_target_s, args.itl_target_s) for result in results]
    rates = [float(row[1]) for row in rows]
    best_single = max(rates[1:])
    lines = [f"## Layout pools through the deployed app (`{SCRIPT}`)", "",
             f"`{bench_command('pools', argv)}`; {compare.environment_line()}", "",
             f"The tiny model (float32), {args.requests} requests sent at once: 70% of ~{SHORT_TOKENS} prompt tokens, "
             f"30% of ~{LONG_TOKENS}, temperature 1 with a seed each, max_tokens {args.max_tokens}; "
             f"{PAGES_PER_RANK * BLOCK_SIZE:,} tokens of KV per tp=2 dcp=1 replica (twice that at dcp=2), max_num_seqs "
             f"16. Goodput: requests with TTFT <= {args.ttft_target_s:g} s and mean ITL <= "
             f"{args.itl_target_s * 1e3:g} ms per second of the makespan.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", f"Pooled against the better homogeneous app: {rates[0] / best_single:.2f}x the goodput."
              if best_single else "", ""]
    section = "\n".join(lines)
    print(section)
    if args.write_docs:
        docs.write(section + f"\n![layout pools]({PLOT.relative_to('docs')})\n")
        write_plot(compare.REPO_ROOT / PLOT, results, args.ttft_target_s, args.itl_target_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
