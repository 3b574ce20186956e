"""The agentic benchmark's output (bench/agentic.py): the console table, the issue's target ratios, and with
--write-docs the section of docs/benchmarks.md and docs/img/agentic.png (TTFT by turn)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from bench.agentic_report import (
    ConfigResult,
    console_table,
    markdown_table,
    table,
    target_ratios,
    verdict,
    write_plot,
)
from bench.agentic_trace import TIER_MARGIN, Trace
from bench.harness import compare
from bench.harness.docs_section import DocsSection

PLOT = compare.REPO_ROOT / "docs" / "img" / "agentic.png"


def tier_note(results: Sequence[ConfigResult]) -> str:
    """Where the "from host" row comes from with the tier on (with it off the tier holds nothing)."""
    sources = sorted({r.prefix.source for r in results if r.prefix is not None and r.label.endswith("tier on")})
    return f" ({'; '.join(sources)})" if sources else ""


def target_lines(results: Sequence[ConfigResult]) -> list[str]:
    """The issue's targets, tier on against tier off of the native engine, or why they cannot be computed."""
    off = next((r for r in results if r.label == "native, tier off"), None)
    on = next((r for r in results if r.label == "native, tier on"), None)
    if off is None or on is None or off.unavailable or on.unavailable:
        why = on.unavailable if on is not None and on.unavailable else "the native tier-off / tier-on pair did not run"
        return [f"targets (tier on / tier off): not measured: {why}"]
    return [f"{name}, tier on / off: {verdict(value, bound, op)}" for name, value, bound, op
            in target_ratios(off, on)]


def report(results: list[ConfigResult], trace: Trace, args: argparse.Namespace, seconds: float,
           docs: DocsSection | None, command: str, tier_field: bool, say: Callable[[str], None]) -> int:
    """Prints the table and the targets (`tier_field`: whether EngineArgs has kv_host_tier now); writes the docs and
    the plot if `docs`. 1 if a turn failed, else 0."""
    header, rows = table(results, tier_note(results))
    targets = target_lines(results)
    print()
    print(console_table(header, rows))
    print()
    for line in targets:
        print(line)
    print(f"kv_host_tier in EngineArgs at the end: {'yes' if tier_field else 'no'}; total {seconds:.0f}s")
    if docs is not None:
        title = f"{trace.workload.sessions} sessions x {trace.workload.turns} turns, {args.layout}"
        write_plot(PLOT, results, f"TTFT by turn: {title}")
        docs.write(section(results, trace, args, header, rows, targets, command, seconds))
        say(f"updated {docs.path.relative_to(compare.REPO_ROOT)} and {PLOT.relative_to(compare.REPO_ROOT)}")
    failed = sum(r.failed for r in results)
    if failed:
        say(f"{failed} turns failed (each with its error above)")
    return 1 if failed else 0


def section(results: Sequence[ConfigResult], trace: Trace, args: argparse.Namespace, header: list[str],
            rows: list[list[str]], targets: list[str], command: str, seconds: float) -> str:
    ran = [r for r in results if not r.unavailable]
    lines = [
        "## Agentic multi-turn sessions: the host KV tier off and on (`bench/agentic.py`)", "",
        f"Command: `{command}`", "", *[f"- {line}" for line in targets], "", *markdown_table(header, rows), "",
        f"![TTFT by turn, tier off and on](img/{PLOT.name})", "",
        f"- {compare.cpu_run_line(1 if args.layout == 'tp1' else 2)}; one replica, admission usage, prefix caching "
        f"on in every configuration.",
        f"- trace: {trace.workload.describe()}: {trace.num_requests} requests; each turn re-sends the whole history "
        f"(the replies the server gave, as token ids) plus its new chunk, with the session's key as "
        f"prompt_cache_key. The device KV is sized so that the sessions' planned KV ({trace.planned_kv_tokens:,} "
        f"tokens, replies at max_tokens) is {trace.workload.kv_ratio:g}x it; the table's ratio is from the replies "
        f"given. The tier, unless --tier sets it, holds every session's KV (the planned KV x {TIER_MARGIN:g} over "
        f"the DCP ranks), so its LRU need drop nothing.",
        *[f"- {r.label}: {r.description}" for r in ran],
        "- TTFT from sending a turn to its first token (admission wait included); later turns: every turn after a "
        "session's first. Output tokens/s: all output tokens over the time from the first session's start to the "
        "last reply (think times included, the same in every configuration).",
        "- prefix-hit tokens: prompt tokens the replica served from its prefix cache during the trace (the app's "
        "Prometheus counters dcpserve_prefix_cache_query_tokens / _hit_tokens, differenced over the trace); by "
        "tier as the row's note says.",
        "- the host tier's series the app exported: " + (", ".join(sorted({n for r in ran for n in r.tier_metrics}))
                                                         or "none") + ".",
        "- prompts go as token ids in the openai client's extra_body: the SDK walks a `prompt=` list in Python "
        "(88-113 ms for 8,000 ids here), which TTFT would count.",
        "- deploy time (not measured above): " + (", ".join(f"{r.label} {r.deploy_s:.0f}s" for r in ran) or "none"),
        f"- {compare.environment_line()}; total {seconds:.0f}s.",
    ]
    return "\n".join(lines)
