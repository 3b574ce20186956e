"""Admission policies measured through the deployed app: "full" (reserve prompt + max_tokens) vs "usage".

One replica of tp=2 x dcp=2 (4 logical GPUs on a Ray head of this benchmark's own, dcpserve/local/serve.py, as
`make serve` and bench/capacity.py), the tiny model, the same per-rank KV budget for both policies, sized so that
"full" holds only a few of the burst's requests. The burst asks for a large max_tokens, but every request stops
much earlier on a stop string (greedy, so the stop position is known beforehand): "full" reserves KV for 1024
output tokens that are never written, "usage" admits by the prompt plus a headroom and preempts (recomputing, so
greedy outputs do not change) when decode runs out of blocks.

Before the runs it generates the same prompts offline (dcpserve.engine.frontend.llm.LLM, tp=1, in process, greedy,
ignore_eos) and picks, for request i, a 2-4 character stop string whose first occurrence in the greedy text lies at a
token position spread over the workload's range; the app then cuts the output there. For each policy it `serve deploy`s
the app, sends the burst at once through the official `openai` async client (streaming), polls /health for the
sequences the admission queue has granted, reads the replica's preemption counter from the Ray node's metrics
endpoint, then shuts Serve down before the next policy.

    python -m bench admission                 # full run (console only)
    python -m bench admission --write-docs    # also writes docs/img/admission.png and its section of docs/benchmarks.md
    python -m bench admission --quick         # a smaller workload
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import compare
from bench.harness.compare import BurstResult, Row, ServeHead, metric_row
from bench.harness.prometheus import metric_lines
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.config import ModelConfig
from dcpserve.engine.core.block_manager import blocks_needed

REPO_ROOT = Path(__file__).resolve().parents[1]

TP, DCP, BLOCK_SIZE, MAX_MODEL_LEN = 2, 2, 16, 2048
TOKENS_PER_BLOCK = BLOCK_SIZE * DCP  # a logical block
POLICIES = ("full", "usage")
CANDIDATES_PER_REQUEST = 2  # random prompts generated offline per request, to find texts that do not loop early
METRICS_WAIT_S = 15.0  # Ray exports custom metrics every 10 s (metrics_report_interval_ms)
COMPARISON = compare.Comparison("bench/admission.py", ("admission",), POLICIES,
                                "Admission policies: full reservation vs usage-based admission with preemption",
                                REPO_ROOT / "docs" / "img" / "admission.png", "admission full vs usage")


@dataclass(frozen=True)
class Workload:
    """A burst of `num_requests` random-id prompts, greedy, max_tokens large, each cut early by a stop string."""

    prompt_tokens: int
    max_tokens: int
    num_requests: int
    full_sequences: int  # the per-rank budget is sized so "full" holds this many requests at once
    stop_first: int  # stop positions (output tokens) spread evenly over [stop_first, stop_last]
    stop_last: int
    seed: int = 0

    @property
    def reserved_blocks(self) -> int:
        """What "full" reserves per request (logical blocks)."""
        return blocks_needed(self.prompt_tokens + self.max_tokens, TOKENS_PER_BLOCK)

    def prompts(self, vocab_size: int, per_request: int = 1) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(5, vocab_size) for _ in range(self.prompt_tokens)]
                for _ in range(self.num_requests * per_request)]

    def stop_positions(self) -> list[int]:
        """Target stop positions, spread evenly, then shuffled so long and short requests interleave in the FIFO."""
        n = self.num_requests
        positions = [round(self.stop_first + (self.stop_last - self.stop_first) * i / max(n - 1, 1)) for i in range(n)]
        random.Random(self.seed + 1).shuffle(positions)
        return positions


# quick -> workload
WORKLOADS = {
    False: Workload(prompt_tokens=64, max_tokens=1024, num_requests=24, full_sequences=3, stop_first=30, stop_last=400),
    True: Workload(prompt_tokens=64, max_tokens=512, num_requests=12, full_sequences=3, stop_first=20, stop_last=160),
}


@dataclass(frozen=True)
class StopPlan:
    """Request i: its stop string, and what the offline greedy run says the app should return."""

    stop: str
    char_pos: int  # first occurrence of `stop` in the offline greedy text
    expected_text: str  # the offline greedy text cut at char_pos
    expected_tokens: int  # output tokens up to and including the one that completes the stop string


@dataclass
class PolicyResult(BurstResult):
    """Everything measured for one admission policy (its label), with the replica's preemption counters."""

    preemptions: int | None = None
    recomputed_tokens: int | None = None
    metrics_note: str = ""


def say(line: str) -> None:
    print(f"[admission] {line}", flush=True)


# ---- stop strings from an offline greedy run -----------------------------------------------------------------------

def plan_stops(model_dir: Path, candidates: list[list[int]],
               workload: Workload) -> tuple[list[list[int]], list[StopPlan]]:
    """Greedy text of every candidate prompt (offline, tp=1); then, per target stop position, a prompt whose text
    is still new there (the random-weight model's greedy text often falls into a loop, after which every substring
    has occurred before) and a stop string at that position. Returns the burst's prompts and their plans."""
    from dcpserve.engine.frontend.llm import LLM
    from dcpserve.engine.sampling_params import SamplingParams
    from dcpserve.engine.tokenizer import IncrementalDetokenizer

    horizon = workload.stop_last + 64
    say(f"offline greedy run (dcpserve.engine.frontend.llm.LLM, tp=1): {len(candidates)} candidate prompts x {horizon} "
        f"tokens, to pick stop strings")
    start = time.monotonic()
    with LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN) as llm:
        outputs = llm.generate(prompt_token_ids=candidates,
                               sampling_params=SamplingParams(temperature=0, max_tokens=horizon, ignore_eos=True))
        tokenizer = llm.tokenizer
    say(f"offline run done in {time.monotonic() - start:.0f}s")

    def stop_at(prompt: list[int], token_ids: list[int], target: int) -> StopPlan | None:
        detok = IncrementalDetokenizer(tokenizer, prompt)
        lengths = []  # text length after each output token
        for token in token_ids:
            detok.push(token)
            lengths.append(len(detok.text))
        text = detok.text
        for pos in range(lengths[target - 1], len(text)):  # from the text the target-th token completes
            for k in (3, 4, 2):
                stop = text[pos:pos + k]
                if len(stop) == k and stop.strip() and "\ufffd" not in stop and text.find(stop) == pos:
                    tokens = next(t + 1 for t, n in enumerate(lengths) if n >= pos + k)
                    if tokens > target + 16:
                        return None  # the text is no longer new there
                    return StopPlan(stop, pos, text[:pos], tokens)
        return None

    targets = workload.stop_positions()
    chosen: dict[int, tuple[list[int], StopPlan]] = {}
    unused = list(range(len(candidates)))
    for i in sorted(range(len(targets)), key=lambda i: -targets[i]):  # the longest first: they are the hardest
        for c in unused:
            plan = stop_at(candidates[c], list(outputs[c].outputs[0].token_ids), targets[i])
            if plan is not None:
                chosen[i] = (candidates[c], plan)
                unused.remove(c)
                break
        else:
            raise SystemExit(f"no candidate prompt's greedy text is still new after {targets[i]} tokens: "
                             f"raise the number of candidates")
    return [chosen[i][0] for i in range(len(targets))], [chosen[i][1] for i in range(len(targets))]


# ---- the cluster ----------------------------------------------------------------------------------------------------

def kv_budget_bytes(model: ModelConfig, workload: Workload) -> int:
    """Per-rank KV bytes in which "full" holds exactly `full_sequences` requests (one page per rank = one logical
    block of BLOCK_SIZE * DCP tokens)."""
    return compare.kv_budget_bytes(model, TP, BLOCK_SIZE, workload.full_sequences * workload.reserved_blocks)


def scrape_counters(ray_temp: Path, replica_id: str) -> dict[str, float] | None:
    """dcpserve_preemptions and dcpserve_recomputed_tokens of this replica, from the Ray node's Prometheus
    endpoint (found through the service-discovery file Ray writes); None if it cannot be read."""
    totals: dict[str, float] = {}
    found = False
    for line in metric_lines(ray_temp):
        match = re.match(r"^\w*(dcpserve_preemptions|dcpserve_recomputed_tokens)\w*\{([^}]*)\}\s+(\S+)$", line)
        if match and f'replica="{replica_id}"' in match.group(2):
            found = True
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals if found else None


# ---- the bursts -----------------------------------------------------------------------------------------------------

def measure_policy(policy: str, head: ServeHead, model_dir: Path, budget_bytes: int, workload: Workload,
                   prompts: list[list[int]], plans: list[StopPlan]) -> PolicyResult:
    say(f"{policy}: deploying one replica of tp={TP} x dcp={DCP}, admission={policy}")
    # kv_headroom: the default (0.05); the whole burst may wait in the admission FIFO: nothing is refused
    config = compare.app_config(TP, DCP, BLOCK_SIZE, budget_bytes, MAX_MODEL_LEN, policy, workload.num_requests)
    deploy_s = head.deploy(model_dir, config, policy)
    replica_id, info = head.replica(policy)
    result = PolicyResult(policy, info["capacity"], deploy_s)
    fits = result.capacity_blocks // workload.reserved_blocks
    if fits != workload.full_sequences:
        raise SystemExit(f"{policy}: the replica holds {fits} reservations of {workload.reserved_blocks} blocks, "
                         f"the budget was sized for {workload.full_sequences}")
    say(f"{policy}: KV {result.capacity_blocks} blocks = {result.capacity_blocks * TOKENS_PER_BLOCK} tokens "
        f"({fits} full reservations); sending {workload.num_requests} requests at once")
    asyncio.run(compare.run_burst(head.base_url, prompts, workload.max_tokens, result, [p.stop for p in plans],
                                  progress=say))
    say(f"{policy}: {result.output_tokens_per_s:.1f} output tok/s, peak {result.peak_sequences} granted, "
        f"makespan {result.makespan_s:.1f}s, {result.errors} errors")
    say(f"{policy}: waiting {METRICS_WAIT_S:.0f}s for Ray to export the replica's preemption counter")
    time.sleep(METRICS_WAIT_S)
    try:
        counters = scrape_counters(head.settings.state_dir / "ray", replica_id)
    except Exception as err:  # noqa: BLE001 - reported, not invented
        counters, result.metrics_note = None, f"metrics endpoint unreadable: {err!r}"
    if counters is not None:
        result.preemptions = int(counters.get("dcpserve_preemptions", 0))
        result.recomputed_tokens = int(counters.get("dcpserve_recomputed_tokens", 0))
    elif not result.metrics_note:
        result.metrics_note = f"no dcpserve_preemptions series for replica {replica_id} on the node's metrics endpoint"
    head.shutdown_serve()
    return result


# ---- output ---------------------------------------------------------------------------------------------------------

def written_fraction(result: PolicyResult, workload: Workload) -> float:
    """Mean over requests of (prompt + output tokens actually written) / (prompt + max_tokens) = what "full"
    reserves (token count; its block-rounded reservation is slightly larger still)."""
    promised = workload.prompt_tokens + workload.max_tokens
    return statistics.mean((workload.prompt_tokens + r.completion_tokens) / promised for r in result.records)


def table_rows(results: list[PolicyResult], workload: Workload, plans: list[StopPlan]) -> list[Row]:
    """(metric, full, usage, usage / full) rows; concurrency and output tokens/s in bold."""
    full, usage = results
    same = sum(a.text == b.text and a.completion_tokens == b.completion_tokens
               for a, b in zip(full.records, usage.records, strict=True))

    def preemptions(r: PolicyResult) -> str:
        return "n/a" if r.preemptions is None else f"{r.preemptions} ({r.recomputed_tokens:,} tokens recomputed)"

    return [
        compare.bold(metric_row("peak concurrent sequences (admission grants)", results, lambda r: r.peak_sequences,
                                "d")),
        metric_row("mean concurrent sequences over the burst", results, lambda r: r.mean_sequences, ".1f"),
        compare.bold(metric_row("output tokens/s", results, lambda r: r.output_tokens_per_s, ".1f")),
        metric_row("burst wall time (s)", results, lambda r: r.makespan_s, ".1f"),
        metric_row("TTFT median (s, admission wait included)", results, lambda r: r.ttft_median_s, ".2f"),
        metric_row("output tokens", results, lambda r: r.output_tokens, ",", ratio=False),
        metric_row("errors", results, lambda r: r.errors, "d", ratio=False),
        metric_row("KV written / reserved by full (mean per request)", results,
                   lambda r: written_fraction(r, workload), ".1%", ratio=False),
        metric_row("preemptions (replica counter)", results, preemptions, "", ratio=False),
        metric_row("outputs equal to the offline greedy text", results,
                   lambda r: sum(rec.text == p.expected_text for rec, p in zip(r.records, plans, strict=True)), "d",
                   ratio=False),
        ("greedy outputs identical, full vs usage (text and tokens)", "", "", f"{same}/{len(full.records)}"),
    ]


def write_plot(results: list[PolicyResult], workload: Workload, path: Path) -> None:
    compare.write_plot(
        path, results, [f"admission={r.label} ({r.makespan_s:.0f}s, peak {r.peak_sequences})" for r in results],
        [(0, workload.full_sequences)],
        title=f"{workload.num_requests} requests: {workload.prompt_tokens}-token prompts, max_tokens "
              f"{workload.max_tokens}, stop after {workload.stop_first}-{workload.stop_last} tokens",
        ylabel="sequences granted (in the engine)",
        suptitle=f"Same KV budget, admission full vs usage, tp={TP} x dcp={DCP} (CPU, 4 logical GPUs)",
        title_size=9,
    )


def header_lines(workload: Workload, model: ModelConfig, budget_bytes: int, results: list[PolicyResult]) -> list[str]:
    import torch

    capacity = results[0].capacity_blocks
    notes = [r.metrics_note for r in results if r.metrics_note]
    return [
        f"{compare.cpu_run_line(TP)} (with the Ray head, Serve and this client). Per-step cost is dominated by fixed "
        f"gloo / Ray overhead, so throughput tracks how many sequences each step batches; the admission and "
        f"concurrency numbers are exact",
        f"model: the tiny model (dcpserve.cluster.tiny_model), float32, "
        f"{model.kv_bytes_per_token_per_rank(TP, torch.float32)} "
        f"KV bytes per token per rank before DCP sharding",
        f"layout: one replica (autoscaling min = max = 1) of tp={TP} x dcp={DCP}, block_size {BLOCK_SIZE} (a logical "
        f"block is {TOKENS_PER_BLOCK} tokens), max_model_len {MAX_MODEL_LEN}; per-rank KV budget {budget_bytes:,} "
        f"bytes = {capacity} logical blocks = {capacity * TOKENS_PER_BLOCK:,} tokens, sized so \"full\" holds "
        f"{workload.full_sequences} reservations of {workload.reserved_blocks} blocks (prompt + max_tokens); "
        f"\"usage\" with the default kv_headroom 0.05",
        f"workload: a burst of {workload.num_requests} requests at once, random prompt ids (seed {workload.seed}) of "
        f"{workload.prompt_tokens} tokens (chosen among {CANDIDATES_PER_REQUEST}x as many random prompts: those "
        f"whose greedy text has not fallen into a loop by the request's stop position), max_tokens "
        f"{workload.max_tokens}, greedy (temperature 0), ignore_eos, streamed through the deployed app with the "
        f"openai client; request i stops on a 2-4 character stop string chosen from an offline greedy run "
        f"(dcpserve.engine.frontend.llm.LLM, tp=1) so that it ends after "
        f"{workload.stop_first}-{workload.stop_last} output "
        f"tokens (spread evenly, shuffled)",
        "concurrent sequences: the admission queue's grants (num_grants in /health) every "
        f"{compare.HEALTH_PERIOD_S}s; under \"usage\" a granted request may be preempted inside the engine (waiting to "
        "be recomputed), so grants are an upper bound on the running sequences there; output tokens/s = all output "
        "tokens / time from the burst to the last token",
        "KV written / reserved: per request (prompt + output tokens it actually produced) / (prompt + max_tokens), "
        "the tokens \"full\" reserves for it, averaged; the same for both policies since outputs are identical",
        "preemptions: the replica's dcpserve_preemptions and dcpserve_recomputed_tokens counters, read from the Ray "
        f"node's Prometheus endpoint {METRICS_WAIT_S:.0f}s after the burst (Ray exports every 10s)"
        + (f"; not available: {'; '.join(notes)}" if notes else ""),
        compare.deploy_line(results),
        compare.environment_line(),
    ]


# ---- main -----------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = COMPARISON.parse_args(__doc__.split("\n\n")[0], "a smaller workload", argv)
    COMPARISON.docs.check()  # unpaired markers fail now, not after the run
    workload = WORKLOADS[args.quick]
    if workload.num_requests <= workload.full_sequences:
        raise SystemExit("the burst must exceed what \"full\" holds, or nothing queues")
    started = time.monotonic()
    with compare.state_dir("dcpadm-", say) as state:
        model_dir = write_tiny_model(state / "tiny-model")
        model = ModelConfig.from_pretrained(model_dir)
        budget_bytes = kv_budget_bytes(model, workload)
        prompts, plans = plan_stops(model_dir, workload.prompts(model.vocab_size, CANDIDATES_PER_REQUEST), workload)
        say("stop positions (output tokens): " + ", ".join(str(p.expected_tokens) for p in plans))
        with compare.serve_head(state, args.deploy_timeout) as head:
            results = [measure_policy(policy, head, model_dir, budget_bytes, workload, prompts, plans)
                       for policy in POLICIES]

    for result in results:
        for i, record in enumerate(result.records):
            if record.error is not None:
                say(f"{result.label}: request {i} failed: {record.error}")
    for i, (a, b) in enumerate(zip(*(r.records for r in results), strict=True)):
        if a.text != b.text or a.completion_tokens != b.completion_tokens:
            say(f"request {i}: outputs differ: full {a.completion_tokens} tokens {a.text[-40:]!r}, usage "
                f"{b.completion_tokens} tokens {b.text[-40:]!r}")

    rows = table_rows(results, workload, plans)
    full, usage = results
    headline = (f"**With the same KV budget, admission=usage runs {usage.peak_sequences / full.peak_sequences:.1f}x "
                f"the concurrent sequences of admission=full ({usage.peak_sequences} vs {full.peak_sequences}) and "
                f"serves {usage.output_tokens_per_s / full.output_tokens_per_s:.2f}x the output tokens/s**, with "
                f"{full.errors + usage.errors} errors; requests wrote on average "
                f"{written_fraction(full, workload):.0%} of the KV \"full\" reserved for them.")
    COMPARISON.report(rows, headline, started)
    if args.write_docs:
        COMPARISON.write_docs(argv, headline, rows, header_lines(workload, model, budget_bytes, results),
                              lambda path: write_plot(results, workload, path), say)
    return 0


if __name__ == "__main__":
    sys.exit(main())
