"""An agentic multi-turn trace through the served app: the host KV tier off and on, side by side in one run.

On a Ray head of this benchmark's own (4 logical GPUs, as `make serve`) it `serve deploy`s one replica of the tiny
model per configuration (a serve config written to its temp dir) and plays the same seeded trace through the OpenAI
API with the official `openai` client (bench/agentic_trace.py): sessions of turns that each re-send the whole
history plus a new tool-output / user chunk, with think time between turns and sampled replies of bounded length,
each request carrying its session's key as `prompt_cache_key`. The replica's device KV is sized so that the sessions'
total KV is `--kv-ratio` (default 6) times it: their prefixes cannot all stay on the device. The configurations: the
native engine with kv_host_tier off and on (the same device KV; the tier sized to hold every session), and with
`--backend vllm` or `both` the vLLM backend (tier off only: vLLM's CPU build cannot offload). It reports output
tokens/s, TTFT p50 / p90 of first and of later turns, turns answered / failed, prefix-hit tokens by tier (the app's
Prometheus counters, the replica's own stats where those have no tier split), the tier's copies, and the ratios the
issue's targets name. A turn that fails ends its session (its later turns are reported not sent, naming it); turns
that would start past the time bound are reported not sent: every planned turn is accounted for.

    python -m bench agentic                  # tier off vs on, native engine, tp=1 (about 3-4 minutes on 2 cores)
    python -m bench agentic --quick          # a smaller trace (about 2 minutes at tp=1, 4 at tp2-dcp2)
    python -m bench agentic --layout tp2-dcp2 --write-docs   # also docs/img/agentic.png and its docs section
    .venv-vllm/bin/python -m bench agentic --backend both     # and the vLLM backend (tier off)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import agentic_client as client
from bench.agentic_docs import PLOT, report
from bench.agentic_report import ConfigResult, PrefixCounts, check_accounted
from bench.agentic_trace import TIER_MARGIN, Trace, Workload, device_kv_tokens, kv_ratio, make_trace
from bench.harness import compare
from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
SECTION = "bench/agentic.py"
LAYOUTS = {"tp1": (1, 1), "tp2-dcp2": (2, 2)}  # --layout -> (tp, dcp)
BLOCK_SIZE = {"native": 16, "vllm": 32}  # vLLM's CPU attention pages in multiples of 32 tokens
METRICS_INTERVAL_MS = 1000  # Ray's export period of the app's metrics on this benchmark's head
METRICS_WAIT_S = 3.0  # the replica's counters (every 0.5 s) exported (every 1 s) and scraped
WORKLOADS = {
    False: (Workload(sessions=16, turns=8, system_tokens=1024, task_tokens=2048, chunk_tokens=(256, 512),
                     reply_tokens=(16, 48), think_mean_s=0.5, arrival_mean_s=0.5), 240.0),
    True: (Workload(sessions=10, turns=6, system_tokens=512, task_tokens=1024, chunk_tokens=(192, 384),
                    reply_tokens=(8, 32), think_mean_s=0.3, arrival_mean_s=0.3), 60.0),
}  # --quick -> (workload, seconds after which no new turn is sent)


def say(line: str) -> None:
    print(f"[agentic] {line}", flush=True)


@dataclass(frozen=True)
class Config:
    """One column: an engine backend with the host tier off or on."""

    backend: str
    tier: bool

    @property
    def label(self) -> str:
        return f"{self.backend}, tier {'on' if self.tier else 'off'}"


def tier_field_present() -> bool:
    """Whether EngineArgs has kv_host_tier (another engineer adds it; checked at start and before the report)."""
    from dcpserve.engine.args import EngineArgs

    return "kv_host_tier" in {f.name for f in dataclasses.fields(EngineArgs)}


def unavailable(config: Config, dcp: int) -> str | None:
    """Why a configuration cannot run here, or None."""
    if config.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return "needs vLLM: run with .venv-vllm/bin/python"
        if config.tier:
            return "vLLM's CPU build cannot offload KV to host memory"
        if dcp > 1:
            return "vLLM's CPU attention cannot shard KV (dcp > 1)"
    elif config.tier and not tier_field_present():
        return "EngineArgs has no kv_host_tier yet"
    return None


@dataclass(frozen=True)
class Sizing:
    """The replica's KV for one backend: device tokens, per-rank bytes, and the host tier's per-rank bytes."""

    tp: int
    dcp: int
    block_size: int
    device_tokens: int
    budget_bytes: int  # kv_cache_memory_bytes per rank
    tier_bytes: int  # kv_host_tier per rank
    max_model_len: int


def sizing(trace: Trace, model: ModelConfig, backend: str, layout: str) -> Sizing:
    import torch

    tp, dcp = LAYOUTS[layout]
    block_size = BLOCK_SIZE[backend]
    per_token = model.kv_bytes_per_token_per_rank(tp, torch.float32)
    device_tokens = device_kv_tokens(trace, block_size * dcp)
    pages = device_tokens // (block_size * dcp) + (1 if backend == "vllm" else 0)  # vLLM keeps a null page
    tier_tokens = math.ceil(trace.planned_kv_tokens * TIER_MARGIN / dcp)
    max_model_len = min(model.max_position_embeddings, math.ceil(trace.longest_request_tokens / 1024) * 1024)
    if trace.longest_request_tokens > max_model_len:
        raise SystemExit(f"the trace's longest request is {trace.longest_request_tokens} tokens, past the model's "
                         f"{model.max_position_embeddings}: give fewer --turns or shorter chunks")
    return Sizing(tp, dcp, block_size, device_tokens, pages * block_size * per_token, tier_tokens * per_token,
                  max_model_len)


def app_config(config: Config, size: Sizing, sessions: int, tier_text: str | None) -> dict[str, Any]:
    serve = compare.app_config(size.tp, size.dcp, size.block_size, size.budget_bytes, size.max_model_len, "usage",
                               max(64, 4 * sessions), backend=config.backend)
    args = serve["applications"][0]["args"]
    args["enable_prefix_caching"] = True
    if config.tier:
        args["kv_host_tier"] = tier_text if tier_text is not None else size.tier_bytes
    return serve


def measure(config: Config, head: compare.ServeHead, model_dir: Path, model: ModelConfig, trace: Trace,
            args: argparse.Namespace, deadline_s: float) -> ConfigResult:
    size = sizing(trace, model, config.backend, args.layout)
    tier = (f", kv_host_tier {args.tier or f'{size.tier_bytes:,} bytes'} per rank" if config.tier else "")
    result = ConfigResult(config.label, f"{config.backend} tp={size.tp} dcp={size.dcp}, block_size "
                                        f"{size.block_size}, {size.budget_bytes:,} KV bytes per rank{tier}")
    why = unavailable(config, size.dcp)
    if why is not None:
        say(f"{config.label}: not run: {why}")
        result.unavailable = why
        return result
    say(f"{config.label}: deploying {result.description}")
    try:
        result.deploy_s = head.deploy(model_dir, app_config(config, size, len(trace.sessions), args.tier),
                                      config.label.replace(", ", "_").replace(" ", "-"))
    except (SystemExit, subprocess.CalledProcessError) as err:
        say(f"{config.label}: deploy failed: {err}")
        result.unavailable = f"deploy failed: {str(err)[:200]}"
        head.shutdown_serve()
        return result
    try:
        _, info = head.replica(config.label)
        result.capacity_tokens = info["capacity"] * size.block_size * size.dcp
        say(f"{config.label}: device KV {result.capacity_tokens:,} tokens; the sessions' planned KV "
            f"{trace.planned_kv_tokens:,} tokens = {kv_ratio(trace.planned_kv_tokens, result.capacity_tokens):.1f}x")
        keys = asyncio.run(client.probe_session_keys(head.base_url, model.vocab_size, say))
        before = wait_and_scrape(head)
        say(f"{config.label}: {len(trace.sessions)} sessions x {trace.workload.turns} turns, "
            f"{trace.num_requests} requests")
        asyncio.run(client.run_trace(head.base_url, trace, result, keys, deadline_s, args.progress_every, say))
        after = wait_and_scrape(head)
        delta = client.difference(after, before)
        result.tier_metrics = client.host_metric_names(after)
        result.prefix = prefix_counts(config, head, delta)
        result.copies = client.tier_copies(delta) if config.tier else None
        check_accounted(result, trace.num_requests)
        say(f"{config.label}: {result.answered} answered, {result.failed} failed, {result.not_sent} not sent; "
            f"{result.output_tokens_per_s:.1f} output tok/s; sessions' KV {result.kv_tokens_seen:,} tokens = "
            f"{kv_ratio(result.kv_tokens_seen, result.capacity_tokens):.1f}x the device's")
        for record in [r for r in result.records if r.error is not None][:3]:
            say(f"{config.label}: session {record.session} turn {record.turn} failed: {record.error}")
    finally:
        head.shutdown_serve()
    return result


def wait_and_scrape(head: compare.ServeHead) -> dict[tuple[str, str], float]:
    time.sleep(METRICS_WAIT_S)
    return client.scrape(head.settings.state_dir / "ray")


def prefix_counts(config: Config, head: compare.ServeHead, delta: dict[tuple[str, str], float]) -> PrefixCounts:
    """The trace's prefix-cache counts from the app's Prometheus counters. Tier off: every hit is a device hit (the
    tier's counters read 0 without a tier). Tier on: the split from the hit counter by tier, else from the replica's
    own stats (EngineStats.host_tier, counted since the replica started: the warm-up's distinct short prompts hit
    nothing)."""
    queried, hit = client.totals(delta, client.PREFIX_QUERIES), client.totals(delta, client.PREFIX_HITS)
    if not config.tier:
        return PrefixCounts(queried, hit, hit, 0 if config.backend == "native" else None,
                            "tier off: every hit is a device hit")
    split = client.tier_split(delta)
    if split is not None:
        agree = "" if sum(split) == hit else f"; device + host = {sum(split):,}, the hit counter {hit:,}"
        return PrefixCounts(queried, hit, split[0], split[1], f"{client.TIER_HITS}{agree}")
    engine = head.serve_stats("EngineReplica", "stats", 1)[0]["engine"]
    tier = engine.get("host_tier")
    if not tier:
        return PrefixCounts(queried, hit, None, None, "no tier counters in the app's Prometheus, no host_tier in "
                                                      "the replica's stats")
    return PrefixCounts(queried, hit, int(tier["hit_tokens_device"]), int(tier["hit_tokens_host"]),
                        "no tier counters in the app's Prometheus: the replica's stats (EngineStats.host_tier)")


def configs(backend: str) -> list[Config]:
    native = [Config("native", False), Config("native", True)]
    vllm = [Config("vllm", False), Config("vllm", True)]
    return {"native": native, "vllm": vllm, "both": native + vllm}[backend]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smaller trace (about 2 minutes on 2 cores at tp1, 4 at tp2-dcp2)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"write {PLOT.relative_to(REPO_ROOT)} and this benchmark's section of docs/benchmarks.md")
    parser.add_argument("--deploy-timeout", type=float, default=300.0, help="seconds to wait for each deploy")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp1", help="the native engine's layout")
    parser.add_argument("--backend", choices=["native", "vllm", "both"], default="native",
                        help="vllm / both: the vLLM backend too (tier off; run with .venv-vllm/bin/python)")
    parser.add_argument("--tier", help="kv_host_tier per rank (a size like 256MiB or a share like 0.25; default: "
                                       f"the sessions' planned KV x {TIER_MARGIN})")
    parser.add_argument("--sessions", type=int, help="sessions (overrides the workload's)")
    parser.add_argument("--turns", type=int, help="turns per session (overrides the workload's)")
    parser.add_argument("--kv-ratio", type=float, help="sessions' total KV / device KV (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed")
    parser.add_argument("--time-bound", type=float, help="seconds after a configuration's start past which no new "
                                                         "turn is sent (those are reported not sent)")
    parser.add_argument("--progress-every", type=int, default=10, help="a progress line per this many turns")
    args = parser.parse_args(argv)
    if args.progress_every < 1:
        parser.error(f"--progress-every must be >= 1, got {args.progress_every}")
    return args


def chosen_workload(args: argparse.Namespace) -> tuple[Workload, float]:
    workload, bound = WORKLOADS[args.quick]
    overrides = {"sessions": args.sessions, "turns": args.turns, "kv_ratio": args.kv_ratio}
    try:
        workload = dataclasses.replace(workload, seed=args.seed,
                                       **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as err:
        raise SystemExit(f"the workload's options: {err}") from None
    return workload, bound if args.time_bound is None else args.time_bound


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    docs = DocsSection(SECTION)
    if args.write_docs:
        docs.check()
    workload, deadline_s = chosen_workload(args)
    say(f"kv_host_tier in EngineArgs: {'yes' if tier_field_present() else 'no (tier on reported not available)'}")
    started = time.monotonic()
    # Ray reads this when the head starts (the head's environment is this process's, dcpserve/local/serve.py): the
    # app's counters reach Prometheus within a second instead of ten.
    os.environ["RAY_metrics_report_interval_ms"] = str(METRICS_INTERVAL_MS)
    with compare.state_dir("dcpagent-", say) as state:
        model_dir = write_tiny_model(state / "tiny-model")
        model = ModelConfig.from_pretrained(model_dir)
        trace = make_trace(workload, model.vocab_size)
        say(f"trace: {workload.describe()}; {trace.num_requests} requests, planned KV {trace.planned_kv_tokens:,} "
            f"tokens, the longest request {trace.longest_request_tokens:,}")
        with compare.serve_head(state, args.deploy_timeout) as head:
            results = [measure(config, head, model_dir, model, trace, args, deadline_s)
                       for config in configs(args.backend)]
    return report(results, trace, args, time.monotonic() - started, docs if args.write_docs else None,
                  bench_command("agentic", argv), tier_field_present(), say)


if __name__ == "__main__":
    sys.exit(main())
