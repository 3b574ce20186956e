"""The soak's verdict (bench/soak.py): how each request ended, by tenant and priority, the table the console and
docs/benchmarks.md show, and the failures that fail the run."""

from __future__ import annotations

import collections

from bench.soak_traffic import FAULTS, REFUSALS, SHEDDABLE_PRIORITY, Outcome, Report


def outcome_label(outcome: Outcome) -> str:
    """How a request ended: lost, hung, 200, 200 then error, a connection error, or its status and error code."""
    if outcome.ended is None:
        return "lost"
    if outcome.hung:
        return "hung"
    if outcome.status == 200 and outcome.error is None:
        return "200"
    if outcome.status is None:
        return "connection error"
    if outcome.status == 200:
        return "200 then error"
    return f"{outcome.status} {outcome.code}" if outcome.code else f"{outcome.status}"


def so_far(report: Report) -> collections.Counter[str]:
    return collections.Counter("in flight" if o.ended is None else outcome_label(o) for o in list(report.outcomes))


def outcomes_by_level(report: Report) -> dict[tuple[str, int], collections.Counter[str]]:
    """(tenant, priority) -> how its requests ended (_label)."""
    levels: dict[tuple[str, int], collections.Counter[str]] = {}
    for outcome in report.outcomes:
        levels.setdefault((outcome.tenant, outcome.priority), collections.Counter())[outcome_label(outcome)] += 1
    return dict(sorted(levels.items()))


def refused(counts: collections.Counter[str]) -> tuple[int, int]:
    """429s with a code of REFUSALS, and those without."""
    owed = sum(n for label, n in counts.items() if label in {f"429 {code}" for code in REFUSALS})
    return owed, sum(n for label, n in counts.items() if label.startswith("429")) - owed


def listed(counts: collections.Counter[str]) -> str:
    return ", ".join(f"{label}: {n}" for label, n in sorted(counts.items()))


def table(report: Report, minutes: float) -> list[str]:
    counts = collections.Counter(outcome_label(o) for o in report.outcomes)
    lines = [
        "| what | value |", "|---|---|",
        f"| duration | {minutes:g} min |",
        f"| requests sent (load + bursts) | {len(report.outcomes)} |",
        f"| answered, by outcome (status and error code) | {listed(counts)} |",
        f"| 429s: refusals the app owes ({' / '.join(REFUSALS)}), others | {', '.join(map(str, refused(counts)))} |",
    ]
    for (tenant, priority), level_counts in outcomes_by_level(report).items():
        sheddable = ", sheddable" if priority >= SHEDDABLE_PRIORITY else ""
        lines.append(f"| tenant {tenant}, priority {priority}{sheddable} | {listed(level_counts)} |")
    lines += [
        f"| lost (never answered) | {counts['lost']} |",
        f"| hung (client gave up) | {counts['hung']} |",
        f"| clients that disconnected after their first chunk | {report.disconnects} |",
        f"| bad inputs, by status (-1: ingress down) | {dict(sorted(report.bad_inputs.items()))} |",
        f"| bad inputs answered other than an OpenAI-shaped 4xx | {len(report.bad_input_failures)} |",
        f"| KV held after the drain (blocks) | {report.kv_held_after_drain} |",
        f"| over-commits observed ({report.ledger_samples} samples of the engine replicas' KV ledgers) | "
        f"{report.over_commits} |",
        (f"| /health: granted + external above the capacity (the queue's view: a released request's KV counted "
         f"until its replica reports it freed) | {report.view_above_capacity} of {report.health_samples} |"
         if report.admission == "full" else
         f"| /health: committed KV above the capacity (preempted requests waiting; by design under usage) | "
         f"{report.view_above_capacity} of {report.health_samples} |"),
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
    counts = collections.Counter(outcome_label(o) for o in report.outcomes)
    problems = []
    if counts["lost"] or counts["hung"]:
        problems.append(f"{counts['lost']} lost and {counts['hung']} hung requests")
    if refused(counts)[1]:
        problems.append(f"429s other than the refusals owed ({', '.join(REFUSALS)}): {listed(counts)}")
    if report.kv_held_after_drain:
        problems.append(f"{report.kv_held_after_drain} KV blocks held after the drain")
    if report.over_commits:
        problems.append(f"{report.over_commits} over-commits: {report.over_commit_examples[:3]}")
    if not report.ledger_samples:
        problems.append("no engine replica's KV ledger was sampled: over-commits went unchecked")
    if report.bad_input_failures:
        problems.append(f"bad inputs answered wrongly: {report.bad_input_failures[:3]}")
    if any(share > 0.5 for share in report.idle_cpu.values()):
        problems.append(f"an app process is busy when idle: {report.idle_cpu}")
    if len(report.recoveries) != len(FAULTS):
        problems.append(f"faults injected: {report.recoveries}")
    return problems
