"""The PNG plots `dcpserve simulate --out` writes: a run's timeline, and a sweep's points.

matplotlib is imported inside each function, so the command line starts without it. The figures are drawn on
matplotlib's Agg canvas through `Figure`, not pyplot: pyplot keeps every figure in a process-wide registry until it
is closed, and would switch the backend of a process that imports this module. A `Figure` nothing else refers to is
garbage once the function returns, so there is nothing to close.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# A run's periodic samples, as the simulation's Recorder keeps them (dcpserve/simulator/metrics.py):
# (simulated time in s, replicas up, KV utilization of their pools as a fraction, sequences they hold, queued requests).
Sample = tuple[float, int, float, int, int]

DPI = 110


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One point of a sweep as its plot shows it."""

    label: str  # "concurrency 64", "tp=8 dcp=4"
    tokens_per_s_per_gpu: float  # steady output tok/s per GPU (dcpserve/simulator/cli.py `throughput`)
    itl_p50_s: float
    frontier: bool  # no other point has more tok/s per GPU and a lower ITL p50
    concurrency: int | None = None  # the closed loop's clients; None in open loop


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _title(figure: Figure, headline: str, facts: Mapping[str, Any]) -> None:
    """The headline, then the model's shape (facts["model"], wrapped: it is a sentence) in smaller type."""
    model = textwrap.fill(f"model: {facts['model']}", width=110)
    figure.suptitle(f"{headline}\n{model}", fontsize=9)


def _setup(facts: Mapping[str, Any]) -> str:
    replicas = facts["replicas"]
    return f"{facts['layout']}, {replicas} replica{'' if replicas == 1 else 's'}, {facts['gpu']} x {facts['gpus']}"


def _y_from_zero(axes: Axes, values: Sequence[float]) -> None:
    """The y axis from 0 to a little above the largest value (fixing only the bottom would freeze the top where
    autoscaling left it, cutting off the highest marker)."""
    top = max(values, default=0.0)
    axes.set_ylim(0.0, top * 1.1 if top > 0 else 1.0)


def write_timeline(path: Path, samples: Sequence[Sample], facts: Mapping[str, Any], label: str | None = None) -> None:
    """A run over simulated time: KV utilization, replicas up, sequences held and requests queued (a panel for each kind
    of quantity). `facts` is the run's setup (dcpserve/simulator/build.py `build`); `label` names a sweep's point."""
    from matplotlib.ticker import MaxNLocator

    times = [sample[0] for sample in samples]
    figure = _new_figure(9.0, 7.5)
    kv_axes, replica_axes, load_axes = figure.subplots(3, 1, sharex=True)
    kv_axes.plot(times, [sample[2] for sample in samples], color="tab:blue")
    kv_axes.set_ylim(0.0, 1.05)
    kv_axes.set_ylabel("KV utilization\n(fraction of the pools)")
    replicas = [sample[1] for sample in samples]
    replica_axes.step(times, replicas, where="post", color="tab:green")
    _y_from_zero(replica_axes, replicas)
    replica_axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    replica_axes.set_ylabel("replicas up")
    sequences, queued = [sample[3] for sample in samples], [sample[4] for sample in samples]
    load_axes.step(times, sequences, where="post", color="tab:orange", label="sequences the replicas hold")
    load_axes.step(times, queued, where="post", color="tab:red", label="requests queued for admission")
    _y_from_zero(load_axes, sequences + queued)
    load_axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    load_axes.set_ylabel("requests")
    load_axes.legend(loc="upper right", fontsize=8)
    load_axes.set_xlabel("simulated time (s)")
    for axes in (kv_axes, replica_axes, load_axes):
        axes.grid(alpha=0.3)
    headline = f"{label}: {_setup(facts)}" if label else _setup(facts)
    _title(figure, headline, facts)
    figure.savefig(path, dpi=DPI)


def write_concurrency_sweep(path: Path, points: Sequence[SweepPoint], facts: Mapping[str, Any]) -> None:
    """Steady tok/s per GPU and ITL p50 against the closed loop's concurrency, side by side. `facts` is one point's
    setup: the points differ in concurrency only."""
    from matplotlib.ticker import NullLocator, ScalarFormatter

    concurrency_of = {point.label: point.concurrency for point in points}
    if any(value is None or value < 1 for value in concurrency_of.values()):
        raise ValueError(f"a concurrency sweep's points each need a concurrency of 1 or more, got {concurrency_of}")
    ordered = sorted(points, key=lambda point: point.concurrency or 0)
    concurrency = [point.concurrency or 0 for point in ordered]
    figure = _new_figure(10.0, 4.5)
    throughput_axes, itl_axes = figure.subplots(1, 2)
    throughput = [point.tokens_per_s_per_gpu for point in ordered]
    throughput_axes.plot(concurrency, throughput, "o-", color="tab:blue")
    throughput_axes.set_ylabel("output tok/s per GPU (steady window)")
    _y_from_zero(throughput_axes, throughput)
    itl_ms = [point.itl_p50_s * 1e3 for point in ordered]
    itl_axes.plot(concurrency, itl_ms, "o-", color="tab:red")
    itl_axes.set_ylabel("ITL p50 (ms)")
    _y_from_zero(itl_axes, itl_ms)
    for axes in (throughput_axes, itl_axes):
        # Concurrencies are usually doublings: a log2 axis spaces them evenly, ticked at the values run.
        axes.set_xscale("log", base=2)
        axes.set_xticks(concurrency)
        axes.xaxis.set_major_formatter(ScalarFormatter())
        axes.xaxis.set_minor_locator(NullLocator())
        axes.set_xlabel("concurrency (closed-loop clients)")
        axes.grid(alpha=0.3)
    _title(figure, f"concurrency sweep: {_setup(facts)}", facts)
    figure.savefig(path, dpi=DPI)


def write_layout_sweep(path: Path, points: Sequence[SweepPoint], facts: Mapping[str, Any]) -> None:
    """Steady tok/s per GPU against ITL p50, one labelled point per layout; the frontier's points filled and joined.
    `facts` is one point's setup (the model and GPU; the layouts and replicas differ)."""
    figure = _new_figure(8.0, 6.0)
    axes = figure.subplots()
    dominated = [point for point in points if not point.frontier]
    frontier = sorted((point for point in points if point.frontier), key=lambda point: point.itl_p50_s)
    if dominated:
        axes.scatter([p.itl_p50_s * 1e3 for p in dominated], [p.tokens_per_s_per_gpu for p in dominated],
                     marker="o", facecolors="none", edgecolors="tab:gray", s=50, label="dominated")
    axes.plot([p.itl_p50_s * 1e3 for p in frontier], [p.tokens_per_s_per_gpu for p in frontier], "--",
              color="tab:red", linewidth=1)
    axes.scatter([p.itl_p50_s * 1e3 for p in frontier], [p.tokens_per_s_per_gpu for p in frontier],
                 marker="*", color="tab:red", s=160, zorder=3,
                 label="frontier (no point has more tok/s per GPU and a lower ITL)")
    for point in points:
        axes.annotate(point.label, (point.itl_p50_s * 1e3, point.tokens_per_s_per_gpu), xytext=(6, 4),
                      textcoords="offset points", fontsize=8)
    axes.set_xlabel("ITL p50 (ms)")
    axes.set_ylabel("output tok/s per GPU (steady window)")
    # From zero, with room right of the last point for its label.
    right = max((p.itl_p50_s * 1e3 for p in points), default=0.0) * 1.25
    axes.set_xlim(0.0, right if right > 0 else 1.0)
    _y_from_zero(axes, [p.tokens_per_s_per_gpu for p in points])
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    axes.text(0.02, 0.97, "better: up and to the left", transform=axes.transAxes, va="top", fontsize=8,
              color="tab:gray")
    _title(figure, f"layout sweep: {facts['gpu']} x {facts['gpus']}, as many replicas as the GPUs hold", facts)
    figure.savefig(path, dpi=DPI)
