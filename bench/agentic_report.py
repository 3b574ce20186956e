"""The agentic benchmark's records and report (bench/agentic.py): each turn as the client saw it, each configuration's
counters, TTFT percentiles of first and later turns and by turn, the ratios the issue's targets name, the table and
the plot of TTFT by turn."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dcpserve.simulator.metrics import percentile

# The targets for the tier, as (metric, bound, "<=" or ">="): tier on / tier off.
TARGETS = (("later turns' TTFT p50", 0.5, "<="), ("prefix-hit tokens", 2.0, ">="), ("output tokens/s", 1.0, ">="))


@dataclass
class TurnRecord:
    """One turn of one session, times in seconds from the configuration's start. Exactly one of: answered
    (error and not_sent None), failed (error: what the server or client said), not sent (not_sent: why)."""

    session: int
    turn: int
    prompt_tokens: int = 0
    sent: float | None = None
    first_token: float | None = None
    finished: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    not_sent: str | None = None

    @property
    def answered(self) -> bool:
        return self.error is None and self.not_sent is None and self.finished is not None

    @property
    def ttft_s(self) -> float | None:
        if not self.answered or self.first_token is None or self.sent is None:
            return None
        return self.first_token - self.sent


@dataclass(frozen=True)
class PrefixCounts:
    """Prompt tokens the replica looked up in its prefix cache during the trace, and the hits by tier (host None:
    the replica reports no tier split)."""

    queried: int
    hit: int
    hit_device: int | None
    hit_host: int | None
    source: str  # where the numbers come from (replica stats, Prometheus)


@dataclass(frozen=True)
class TierCopies:
    """The host tier's traffic during the trace (the app's counters): blocks and seconds of copies each way (seconds:
    the slowest rank's step time spent copying), and blocks the tier's LRU dropped."""

    blocks_to_host: int
    blocks_to_device: int
    seconds_to_host: float
    seconds_to_device: float
    dropped: int


@dataclass
class ConfigResult:
    """One configuration's run: its records and what the replica and its metrics said."""

    label: str
    description: str
    capacity_tokens: int = 0
    deploy_s: float = 0.0
    makespan_s: float = 0.0
    records: list[TurnRecord] = field(default_factory=list)
    prefix: PrefixCounts | None = None
    copies: TierCopies | None = None  # None: no tier, or the app exports no copy counters
    session_keys: bool = False  # prompt_cache_key was sent (the API took it)
    unavailable: str | None = None  # why this configuration did not run (nothing measured)
    kv_tokens_seen: int = 0  # the sessions' KV at their ends, from the replies actually given
    tier_metrics: list[str] = field(default_factory=list)  # names of the app's series that speak of a host tier

    @property
    def answered(self) -> int:
        return sum(r.answered for r in self.records)

    @property
    def failed(self) -> int:
        return sum(r.error is not None for r in self.records)

    @property
    def not_sent(self) -> int:
        return sum(r.not_sent is not None for r in self.records)

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.records if r.answered)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    def ttft(self, later: bool, q: float) -> float | None:
        """TTFT percentile q of the first turns (later False) or of every later turn (later True); None if none."""
        values = sorted(t for r in self.records if (r.turn > 0) == later and (t := r.ttft_s) is not None)
        return percentile(values, q) if values else None


def check_accounted(result: ConfigResult, planned: int) -> None:
    """Nothing lost: every planned turn is answered, failed with an error, or not sent with a reason, exactly once."""
    if len(result.records) != planned:
        raise SystemExit(f"{result.label}: {len(result.records)} turn records for {planned} planned turns")
    for record in result.records:
        states = [record.answered, record.error is not None, record.not_sent is not None]
        if sum(states) != 1:
            raise SystemExit(f"{result.label}: session {record.session} turn {record.turn} is neither answered nor "
                             f"failed with an error nor reported unsent: {record}")


def ttft_by_turn(records: Sequence[TurnRecord]) -> dict[int, list[float]]:
    """Turn index -> the answered turns' TTFTs, sorted."""
    by_turn: dict[int, list[float]] = {}
    for record in records:
        if (ttft := record.ttft_s) is not None:
            by_turn.setdefault(record.turn, []).append(ttft)
    return {turn: sorted(values) for turn, values in sorted(by_turn.items())}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None where either is unknown or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def target_ratios(off: ConfigResult, on: ConfigResult) -> list[tuple[str, float | None, float, str]]:
    """The issue's three targets as (metric, tier on / tier off, bound, comparison)."""
    values = {
        "later turns' TTFT p50": ratio(on.ttft(True, 50), off.ttft(True, 50)),
        "prefix-hit tokens": ratio(on.prefix.hit if on.prefix else None, off.prefix.hit if off.prefix else None),
        "output tokens/s": ratio(on.output_tokens_per_s, off.output_tokens_per_s),
    }
    return [(name, values[name], bound, op) for name, bound, op in TARGETS]


def verdict(value: float | None, bound: float, op: str) -> str:
    if value is None:
        return "not measured"
    met = value <= bound if op == "<=" else value >= bound
    return f"{value:.2f}x ({'met' if met else 'missed'}: target {op} {bound:g}x)"


Row = list[str]


def table(results: Sequence[ConfigResult], tier_note: str) -> tuple[list[str], list[Row]]:
    """(header, rows): one column per configuration; a configuration that did not run shows why in every cell."""
    header = ["metric", *(r.label for r in results)]

    def row(metric: str, value: Callable[[ConfigResult], object], fmt: str = "") -> Row:
        cells = [metric]
        for r in results:
            v = None if r.unavailable else value(r)
            cells.append("n/a" if r.unavailable else "-" if v is None else format(v, fmt) if
                         isinstance(v, (int, float)) else str(v))
        return cells

    def ms(later: bool, q: float) -> Callable[[ConfigResult], object]:
        return lambda r: None if (v := r.ttft(later, q)) is None else v * 1000

    def hits(get: Callable[[PrefixCounts], int | None]) -> Callable[[ConfigResult], object]:
        return lambda r: None if r.prefix is None else get(r.prefix)

    rows = [
        row("device KV (tokens)", lambda r: r.capacity_tokens, ","),
        row("sessions' KV / device KV", lambda r: r.kv_tokens_seen / r.capacity_tokens if r.capacity_tokens
            else None, ".1f"),
        row("turns answered / failed / not sent", lambda r: f"{r.answered} / {r.failed} / {r.not_sent}"),
        row("output tokens/s", lambda r: r.output_tokens_per_s, ".1f"),
        row("TTFT p50 first turns (ms)", ms(False, 50), ".0f"),
        row("TTFT p90 first turns (ms)", ms(False, 90), ".0f"),
        row("TTFT p50 later turns (ms)", ms(True, 50), ".0f"),
        row("TTFT p90 later turns (ms)", ms(True, 90), ".0f"),
        row("prompt tokens looked up", hits(lambda p: p.queried), ","),
        row("prefix-hit tokens", hits(lambda p: p.hit), ","),
        row("  of which from device", hits(lambda p: p.hit_device), ","),
        row(f"  of which from host{tier_note}", hits(lambda p: p.hit_host), ","),
        row("prefix hit rate", lambda r: None if r.prefix is None or not r.prefix.queried else
            f"{r.prefix.hit / r.prefix.queried:.0%}"),
        row("host tier: blocks copied out / back", lambda r: None if r.copies is None else
            f"{r.copies.blocks_to_host:,} / {r.copies.blocks_to_device:,}"),
        row("host tier: copy seconds out / back", lambda r: None if r.copies is None else
            f"{r.copies.seconds_to_host:.2f} / {r.copies.seconds_to_device:.2f}"),
        row("host tier: blocks dropped", lambda r: None if r.copies is None else r.copies.dropped, ","),
        row("prompt_cache_key sent", lambda r: "yes" if r.session_keys else "no (400: dropped)"),
        row("makespan (s)", lambda r: r.makespan_s, ".1f"),
    ]
    for r in results:
        if r.unavailable:
            rows.append([f"{r.label}: not run", r.unavailable] + [""] * (len(results) - 1))
    return header, rows


def console_table(header: list[str], rows: list[Row]) -> str:
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths, strict=False))) for line in lines)


def markdown_table(header: list[str], rows: list[Row]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|:---|" + "---:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]


def write_plot(path: Path, results: Sequence[ConfigResult], title: str) -> None:
    """TTFT p50 (solid) and p90 (dotted) by turn, one color per configuration that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 4.2))
    colors = ("tab:gray", "tab:blue", "tab:orange", "tab:green")
    for result, color in zip([r for r in results if not r.unavailable], colors, strict=False):
        by_turn = ttft_by_turn(result.records)
        turns = [t + 1 for t in by_turn]
        axis.plot(turns, [percentile(v, 50) * 1000 for v in by_turn.values()], color=color, marker="o",
                  label=f"{result.label} p50")
        axis.plot(turns, [percentile(v, 90) * 1000 for v in by_turn.values()], color=color, linestyle=":",
                  label=f"{result.label} p90")
    axis.set_xlabel("turn of the session")
    axis.set_ylabel("TTFT (ms)")
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
