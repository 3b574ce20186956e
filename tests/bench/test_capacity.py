"""`python -m bench capacity --stream-intervals` without a cluster: its options, its workload (dcp=4 at ~32
sequences), the tokens per chunk and per stream item, its tables and verdict, and its docs section beside the capacity
section (the runs themselves faked)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import pytest

from bench import capacity, capacity_layouts, capacity_stream
from bench.capacity_layouts import WORKLOADS, LayoutResult, Workload, chosen_workload
from bench.harness import compare
from bench.harness.compare import RequestRecord
from bench.harness.docs_section import DocsSection


def parse(*argv: str) -> argparse.Namespace:
    return capacity.COMPARISON.parse_args("test", "quick", list(argv), extra=capacity_layouts.add_options)


def test_intervals_option() -> None:
    assert parse().stream_intervals is None
    assert parse("--stream-intervals", "0,0.05").stream_intervals == [0.0, 0.05]
    for bad in ("-1", "0,0", "x", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            capacity_layouts.intervals_arg(bad)


def test_the_stream_workload_reaches_batch_32_and_the_default_stays() -> None:
    for quick in (False, True):
        args = parse(*(["--quick"] if quick else []))
        assert chosen_workload(args) == Workload(*WORKLOADS[quick])  # unchanged without the option
        stream = chosen_workload(parse("--stream-intervals", "0", *(["--quick"] if quick else [])))
        assert stream.dcp1_sequences * 4 == 32 and stream.num_requests >= 32
    overridden = chosen_workload(parse("--stream-intervals", "0", "--requests", "40", "--max-tokens", "16"))
    assert (overridden.num_requests, overridden.max_tokens) == (40, 16)


def test_app_config_sets_the_interval_only_when_given() -> None:
    args = compare.app_config(4, 4, 16, 1 << 20, 2048, "full", 8)["applications"][0]["args"]
    assert "stream_interval_s" not in args
    args = compare.app_config(4, 4, 16, 1 << 20, 2048, "full", 8, stream_interval_s=0.05)["applications"][0]["args"]
    assert args["stream_interval_s"] == 0.05


def result(dcp: int, interval: float, items: int, tok_s: float) -> LayoutResult:
    records = [RequestRecord(sent=0.0, first_token=1.0, last_token=2.0 + i, completion_tokens=64, chunks=64 // k)
               for i, k in enumerate((1, 2, 4))]
    r = LayoutResult(f"dcp={dcp}@{interval:g}s", 100, 10.0, records=records, timeline=[(0.0, 8 * dcp)],
                     makespan_s=192 / tok_s, dcp=dcp, tokens_per_block=16 * dcp, stream_interval_s=interval,
                     stream_items=items, stream_tokens=192)
    return r


def test_tokens_per_chunk_and_item() -> None:
    assert RequestRecord(sent=0.0).tokens_per_chunk is None
    r = result(4, 0.05, 48, 100.0)
    assert r.tokens_per_chunk_median == 2.0  # 1, 2, 4 tokens per chunk
    assert r.tokens_per_item == 4.0


def runs() -> list[LayoutResult]:
    return [result(1, 0, 192, 50.0), result(4, 0, 192, 100.0), result(1, 0.05, 48, 50.0), result(4, 0.05, 48, 110.0)]


def test_tables_and_verdict() -> None:
    workload = Workload(64, 64, 3, 8)
    header, rows = capacity_stream.stream_table(runs(), workload)
    assert len(rows) == 4 and all(len(row) == len(header) for row in rows)
    assert rows[3][:2] == ("dcp=4", "0.05") and rows[3][header.index("replica tokens per stream item")] == "4.00"
    _, ratios = capacity_stream.ratio_table(runs(), [0, 0.05])
    assert ratios == [("0", "4.00x", "4.00x", "2.00x"), ("0.05", "4.00x", "4.00x", "2.20x")]
    verdict = capacity_stream.stream_verdict(runs(), [0, 0.05])
    assert "4.00 tokens per stream item" in verdict[0] and ": met" in verdict[0]
    assert "(not lower)" in verdict[1]


def test_main_writes_its_own_section_beside_the_capacity_section(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n<!-- bench/capacity.py:begin -->\nthe capacity table\n"
                    "<!-- bench/capacity.py:end -->\n")
    fake = iter(runs())
    monkeypatch.setattr(capacity_stream, "DocsSection", lambda key: DocsSection(key, docs))
    monkeypatch.setattr(capacity_stream, "measure_layout", lambda *args, **kwargs: next(fake))
    monkeypatch.setattr(compare, "serve_head", lambda *args: contextlib.nullcontext())
    monkeypatch.setattr(compare, "environment_line", lambda: "environment")
    assert capacity.main(["--stream-intervals", "0,0.05", "--quick", "--write-docs"]) == 0
    text = docs.read_text()
    assert "<!-- bench/capacity.py:begin -->\nthe capacity table\n<!-- bench/capacity.py:end -->" in text
    begin, end = (text.index(f"<!-- {capacity_layouts.STREAM_SECTION}:{m} -->") for m in ("begin", "end"))
    section = text[begin:end]
    assert "Command: `python -m bench capacity --stream-intervals 0,0.05 --quick --write-docs`" in section
    assert "| dcp=4 | 0.05 |" in section
