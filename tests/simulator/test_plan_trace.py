"""`dcpserve plan --trace` (dcpserve/simulator/plan.py) and goodput (dcpserve/simulator/metrics.py): the capacity table
unchanged, then the layouts ranked by simulated goodput; the goodput rule on hand-made requests (targets are inclusive,
refused requests never meet them, a one-token request has no gap to miss); bad input stopped with the flag or line
named. With --gpu-budget (dcpserve/simulator/pool_split.py): the splits tried, the layouts and splits ranked together,
each split's row its own pooled run, and the best split's serve config valid app args."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest
import yaml

from dcpserve.cli import build_parser, main
from dcpserve.cluster.planner import PlanRequest, format_plan, plan_layouts
from dcpserve.cluster.published_models import model_spec
from dcpserve.deployments.config import parse_args
from dcpserve.simulator.build import PoolOption, build
from dcpserve.simulator.cli import DEFAULT_MAX_NUM_SEQS
from dcpserve.simulator.gpus import H100
from dcpserve.simulator.metrics import Goodput, RequestRecord, goodput, mean_itl_s, meets_slo, span_s
from dcpserve.simulator.plan import (
    DEFAULT_ITL_TARGET_S,
    DEFAULT_TTFT_TARGET_S,
    LayoutResult,
    rank,
    simulate_args,
    with_trace_defaults,
)
from dcpserve.simulator.pool_split import SHARES, Split, serve_config_snippet, split_candidates
from dcpserve.simulator.synth import parse_preset_or_path


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int | str | None, str, str]:
    """dcpserve plan in this process: (status or SystemExit message, stdout, stderr)."""
    try:
        status: int | str | None = main(["plan", *args])
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def main_args(*args: str) -> argparse.Namespace:
    """dcpserve plan's parsed arguments."""
    return build_parser().parse_args(["plan", *args])


def ranked_rows(stdout: str) -> list[list[str]]:
    """The ranked table's rows (after its header), split into cells; skipped rows start with '-'."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["rank", "layout", "replicas"])
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


# ---- goodput on hand-made requests ------------------------------------------------------------------------------

def record(arrival: float, first: float | None, last: float | None, tokens: int,
           outcome: str = "finished") -> RequestRecord:
    return RequestRecord(arrival=arrival, input_length=100, first_token_at=first, last_token_at=last,
                         num_output_tokens=tokens, finished_at=last, outcome=outcome)


def test_goodput_counts_requests_that_meet_both_targets_exactly_at_the_target_included() -> None:
    """TTFT 2 s and mean ITL 50 ms are the targets; every value here is exact in binary floating point, so the
    boundary cases sit exactly on the target."""
    records = {
        "at both targets": record(1.0, 3.0, 3.5, 11),  # TTFT 2.0, mean ITL 0.5 / 10 = 0.05: met
        "ttft over": record(1.0, 3.0 + 2**-20, 3.5, 11),  # TTFT a hair over: missed
        "itl over": record(1.0, 2.0, 2.5 + 2**-20, 11),  # mean ITL a hair over: missed
        "one token": record(0.0, 1.5, 1.5, 1),  # no gap: the ITL target holds trivially: met
        "one token, late": record(0.0, 2.5, 2.5, 1),  # but its TTFT still counts: missed
        "four tokens": record(0.0, 1.0, 1.125, 4),  # mean ITL 0.125 / 3 = 0.042: met
        "refused": record(0.0, None, None, 0, outcome="queue_full"),  # never answered: missed
        "timed out": record(0.0, 0.5, 0.75, 6, outcome="request_timeout"),  # tokens that would meet, cut off: missed
        "finished, no token": record(0.0, None, None, 0),  # no first token: missed
    }
    met = {name for name, r in records.items() if meets_slo(r, 2.0, 0.05)}
    assert met == {"at both targets", "one token", "four tokens"}
    assert mean_itl_s(records["at both targets"]) == 0.05
    assert mean_itl_s(records["one token"]) == 0.0 and mean_itl_s(records["refused"]) is None

    result = goodput(records.values(), duration_s=10.0, gpu_seconds=40.0, ttft_target_s=2.0, itl_target_s=0.05)
    assert result == Goodput(ttft_target_s=2.0, itl_target_s=0.05, requests=9, met=3, requests_per_s=0.3,
                             requests_per_s_per_gpu=3 / 40)
    assert result.fraction_met == 3 / 9  # the refused and timed-out requests count in the denominator
    assert goodput([], 1.0, 0.0, 2.0, 0.05).fraction_met == 0.0  # no requests, no GPU time: zeros, not errors
    assert goodput(records.values(), 10.0, 0.0, 2.0, 0.05).requests_per_s_per_gpu == 0.0
    assert goodput(records.values(), 0.0, 0.0, 2.0, 0.05).requests_per_s == 0.0


def test_the_run_spans_to_the_last_request_refused_or_finished() -> None:
    """A refusal after the last finished request still belongs to the run goodput is a rate over."""
    refused_late = record(4.0, None, None, 0, outcome="queue_timeout")
    refused_late.finished_at = 9.0
    assert span_s([record(1.0, 2.0, 3.0, 2), refused_late]) == 8.0
    assert span_s([]) == 0.0


@pytest.mark.parametrize("kwargs,message", [
    ({"ttft_target_s": 0.0}, "ttft_target_s must be > 0, got 0.0"),
    ({"itl_target_s": -0.01}, "itl_target_s must be > 0, got -0.01"),
    ({"ttft_target_s": math.nan}, "ttft_target_s must be > 0, got nan"),
    ({"duration_s": -1.0}, "duration_s must be >= 0, got -1.0"),
])
def test_goodput_rejects_targets_that_are_not_positive(kwargs: dict[str, float], message: str) -> None:
    arguments = {"duration_s": 1.0, "gpu_seconds": 1.0, "ttft_target_s": 2.0, "itl_target_s": 0.05, **kwargs}
    with pytest.raises(ValueError, match=message):
        goodput([record(0.0, 1.0, 1.0, 1)], **arguments)


def test_rank_orders_by_goodput_per_gpu_then_slo_share_then_latency() -> None:
    def ran(label: str, per_gpu: float, met: int, itl_p90: float) -> LayoutResult:
        good = Goodput(2.0, 0.05, requests=10, met=met, requests_per_s=per_gpu * 8, requests_per_s_per_gpu=per_gpu)
        summary = {"itl_s": {"p90": itl_p90}, "ttft_s": {"p90": 0.1}}
        return LayoutResult(label, 1, summary, good)

    results = [ran("a", 0.1, 5, 0.01), LayoutResult("skipped", skipped="weights"), ran("b", 0.2, 5, 0.02),
               ran("c", 0.1, 6, 0.03), ran("d", 0.1, 6, 0.02)]
    assert [r.label for r in rank(results)] == ["b", "d", "c", "a"]


# ---- the command ------------------------------------------------------------------------------------------------

DSV2_ON_TWO_H100 = ("--model", "deepseek-v2-lite", "--gpus-per-node", "2", "--context", "32k")


def test_plan_without_a_trace_is_the_capacity_table_alone(capsys: pytest.CaptureFixture[str]) -> None:
    status, stdout, stderr = plan(capsys, *DSV2_ON_TWO_H100, "--gpu-memory", "80GiB")
    assert status == 0, stderr
    spec = model_spec("deepseek-v2-lite")
    request = PlanRequest(gpus_per_node=2, gpu_memory_bytes=80 << 30, context_len=32768)
    assert stdout == format_plan(spec, request, plan_layouts(spec, request), model_name="deepseek-v2-lite") + "\n"
    assert stderr == ""


def test_plan_with_a_trace_prints_the_capacity_table_then_the_layouts_ranked_by_goodput(
        capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V2-Lite on two H100s, a closed loop of 16 chat clients: the capacity table exactly as plan prints it
    for the H100's memory, then tp=1, tp=2 and tp=2 x dcp=2 ranked by goodput per GPU; each row's numbers are the
    goodput of that layout's own simulate run."""
    trace_args = ("--trace", "chat", "--requests", "40", "--concurrency", "16", "--gpu", "h100",
                  "--ttft-target-s", "0.5", "--itl-target-s", "0.004")
    status, stdout, stderr = plan(capsys, *DSV2_ON_TWO_H100, *trace_args)
    assert status == 0, stderr
    status, table, _ = plan(capsys, *DSV2_ON_TWO_H100, "--gpu-memory", str(H100.memory_bytes))
    assert status == 0
    assert stdout.startswith(table + "\n")
    ranking = stdout[len(table) + 1:]
    assert "SLO: TTFT <= 0.5 s and mean ITL <= 4 ms" in ranking
    rows = ranked_rows(ranking)
    assert [row[0] for row in rows] == ["1", "2", "3"]
    assert sorted(f"{row[1]} {row[2]}" for row in rows) == ["tp=1 dcp=1", "tp=2 dcp=1", "tp=2 dcp=2"]
    per_gpu = [float(row[5]) for row in rows]
    assert per_gpu == sorted(per_gpu, reverse=True)
    assert len(set(per_gpu)) > 1, "targets this tight should separate the layouts"
    for label in ("tp=1 dcp=1", "tp=2 dcp=1", "tp=2 dcp=2"):
        assert f"plan: {label}\n" in stderr

    # The best row against its layout run on its own through simulate's build, with the plan's values.
    best = rows[0]
    tp, dcp = int(best[1].removeprefix("tp=")), int(best[2].removeprefix("dcp="))
    args = with_trace_defaults(main_args(*DSV2_ON_TWO_H100, *trace_args), H100.memory_bytes)
    request = PlanRequest(gpus_per_node=2, gpu_memory_bytes=H100.memory_bytes, context_len=32768)
    point = simulate_args(args, request, (tp, dcp))
    assert (point.max_model_len, point.seed, point.step_model) == (32768, 0, "roofline")
    assert point.max_num_seqs == DEFAULT_MAX_NUM_SEQS and point.quiet is False  # simulate's default, plan's value
    point.quiet = True
    simulation, facts = build(point)
    summary = simulation.run(parse_preset_or_path("chat", 40, 0))
    records = simulation.recorder.records.values()
    good = goodput(records, span_s(records), summary["gpu_seconds"], 0.5, 0.004)
    assert best[3] == str(facts["replicas"])
    assert (best[4], best[5], best[6]) == (f"{good.requests_per_s:.3f}", f"{good.requests_per_s_per_gpu:.4f}",
                                           f"{good.fraction_met:.1%}")


def test_plan_with_a_trace_skips_layouts_whose_weights_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-3.1-70B on two H100s: tp=1 cannot hold its 131 GiB of weights (a skipped row that says so), tp=2 runs;
    the default targets are in the heading."""
    status, stdout, stderr = plan(capsys, "--model", "llama-3.1-70b", "--gpus-per-node", "2", "--context", "16k",
                                  "--trace", "chat", "--requests", "20", "--gpu", "h100")
    assert status == 0, stderr
    assert f"SLO: TTFT <= {DEFAULT_TTFT_TARGET_S:g} s and mean ITL <= {DEFAULT_ITL_TARGET_S * 1e3:g} ms" in stdout
    rows = ranked_rows(stdout)
    assert [row[:3] for row in rows] == [["1", "tp=2", "dcp=1"], ["-", "tp=1", "dcp=1"]]
    assert " ".join(rows[1][3:]).startswith("skipped: weights need 131.42 GiB per rank at tp=1")
    assert "plan: tp=1 dcp=1" not in stderr and "plan: tp=2 dcp=1" in stderr


def test_requests_longer_than_the_context_are_named_and_miss_the_slo(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 10, "input_length": 3000, "output_length": 5, "hash_ids": [3, 4, 5, 6, 7, 8]}\n'
                     '{"timestamp": 20, "input_length": 600, "output_length": 5, "hash_ids": [9, 10]}\n')
    status, stdout, stderr = plan(capsys, "--model", "deepseek-v2-lite", "--gpus-per-node", "1", "--context", "2k",
                                  "--trace", str(trace), "--gpu", "h100")
    assert status == 0, stderr
    said = "1 of 3 requests need more than --context 2,048 tokens (the longest 3,005)"
    assert said in stderr and said in stdout
    (row,) = ranked_rows(stdout)
    assert row[:3] == ["1", "tp=1", "dcp=1"]
    assert row[6] == "66.7%" and row[-1] == "1"  # SLO met: 2 of 3; refused: the long one


@pytest.mark.parametrize("args,fragment", [
    (("--trace", "chat", "--gpu", "h100", "--ttft-target-s", "0"), "argument --ttft-target-s: must be > 0, got 0"),
    (("--trace", "chat", "--gpu", "h100", "--itl-target-s", "-1"), "argument --itl-target-s: must be > 0, got -1"),
    (("--trace", "chat", "--gpu", "h100", "--requests", "0"), "argument --requests: must be > 0, got 0"),
    (("--trace", "chat"), "--trace needs --gpu"),
    (("--gpu-memory", "80GiB", "--gpu", "h100", "--seed", "1"), "--gpu, --seed given without --trace"),
    (("--gpu-memory", "80GiB", "--gpu-budget", "4"), "--gpu-budget given without --trace"),
    (("--trace", "chat", "--gpu", "h100", "--gpu-budget", "3"),
     "--gpu-budget 3 is not a multiple of --gpus-per-node 2: plan for whole nodes, for example --gpu-budget 4"),
    (("--trace", "chat", "--gpu", "h100", "--gpu-budget", "0"), "argument --gpu-budget: must be > 0, got 0"),
    ((), "the following arguments are required: --gpu-memory"),
    (("--trace", "chat", "--gpu", "h100", "--pcp", "2"), "--pcp 2 with --trace: the simulator's step model has no "
                                                          "prefill context parallelism yet"),
])
def test_bad_arguments_are_refused_naming_the_flag(capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                                                   fragment: str) -> None:
    status, stdout, stderr = plan(capsys, *DSV2_ON_TWO_H100, *args)
    assert status == 2 and fragment in stderr and stdout == ""


def test_bad_input_stops_before_anything_is_printed_or_simulated(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]\n')
    cases = [
        (("--trace", str(trace), "--gpu", "h100"), f"{trace}:2: not valid JSON"),
        (("--trace", "chat", "--gpu", "h100", "--gpu-memory", "80GiB"),
         "--gpu-memory 80.00 GiB is not the H100 SXM 80GB's 79.65 GiB"),
        (("--trace", "chat", "--gpu", "h100", "--step-model", str(tmp_path / "missing.json")), "missing.json"),
        (("--trace", "nonsense", "--gpu", "h100"), "no preset"),
    ]
    for args, fragment in cases:
        status, stdout, stderr = plan(capsys, *DSV2_ON_TWO_H100, *args)
        assert isinstance(status, str) and status.startswith("dcpserve plan: ") and fragment in status, status
        assert stdout == "" and "plan: tp=" not in stderr


# ---- --gpu-budget: two-pool splits ------------------------------------------------------------------------------

def replicas_of(splits: list[Split]) -> list[tuple[str, int, str, int]]:
    return [(a.name, a.replicas, b.name, b.replicas) for a, b in (split.pools for split in splits)]


def test_splits_take_about_a_quarter_a_half_and_three_quarters_in_whole_replicas() -> None:
    assert SHARES == (0.25, 0.5, 0.75)
    # tp=2 and tp=4 in 16 GPUs: exactly 4 + 12, 8 + 8 and 12 + 4 GPUs.
    assert replicas_of(split_candidates([(2, 1), (4, 4)], 16)) == [
        ("tp2-dcp1", 2, "tp4-dcp4", 3), ("tp2-dcp1", 4, "tp4-dcp4", 2), ("tp2-dcp1", 6, "tp4-dcp4", 1)]
    # tp=2 and tp=8 in 16: a quarter for tp=2 leaves 12 GPUs, one tp=8 replica, and tp=2 takes the 4 left over, the
    # split a half gives too (tried once); three quarters leave no room for a tp=8 replica.
    assert replicas_of(split_candidates([(2, 1), (8, 8)], 16)) == [("tp2-dcp1", 4, "tp8-dcp8", 1)]
    # Each pair once, in the layouts' order; a budget too small for one replica of each gives no split.
    three = split_candidates([(1, 1), (2, 1), (2, 2)], 4)
    assert [split.label for split in three] == ["tp=1 dcp=1 x2 + tp=2 dcp=1 x1", "tp=1 dcp=1 x2 + tp=2 dcp=2 x1",
                                                 "tp=2 dcp=1 x1 + tp=2 dcp=2 x1"]
    assert all(split.gpus == 4 for split in three)
    assert split_candidates([(1, 1), (2, 2)], 2) == [] and split_candidates([(8, 8)], 64) == []


def test_the_snippet_is_app_args_the_deploy_accepts() -> None:
    pools = (PoolOption("tp8-dcp1", 8, 1, 1), PoolOption("tp8-dcp8", 8, 8, 2))
    snippet = serve_config_snippet(pools, 24, 131072)
    assert "max_model_len: 131072" in snippet.splitlines()[0]  # a comment: the app's own key, not repeated here
    raw = yaml.safe_load(snippet)
    assert raw == {"gpu_budget": 24, "pools": [
        {"name": "tp8-dcp1", "tensor_parallel_size": 8, "decode_context_parallel_size": 1,
         "autoscaling": {"min_replicas": 1, "max_replicas": 1}},
        {"name": "tp8-dcp8", "tensor_parallel_size": 8, "decode_context_parallel_size": 8,
         "autoscaling": {"min_replicas": 2, "max_replicas": 2}},
    ]}
    app = parse_args({"model": "/models/kimi-k2", "max_model_len": 131072, **raw})
    assert [(pool.name, pool.min_gpus) for pool in app.pool_list()] == [("tp8-dcp1", 8), ("tp8-dcp8", 16)]
    with pytest.raises(ValueError, match="gpu_budget=16 cannot hold the pools' minimum replicas"):
        parse_args({"model": "/models/kimi-k2", **yaml.safe_load(serve_config_snippet(pools, 16, 131072))})


def budget_rows(stdout: str) -> list[list[str]]:
    """The --gpu-budget ranking's rows, split into cells at runs of two or more spaces."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:4] == ["rank", "layout", "replicas", "GPUs"])
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_plan_with_a_gpu_budget_ranks_layouts_and_splits_together_and_prints_the_best_split(
        capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V2-Lite, a budget of two nodes of two H100s: the three layouts with as many replicas as 4 GPUs hold,
    and the three splits of them, one ranking by goodput per GPU; the best split's row is its own pooled run, and
    its serve config is app args the deploy accepts."""
    trace_args = ("--trace", "chat", "--requests", "40", "--concurrency", "16", "--gpu", "h100",
                  "--ttft-target-s", "0.5", "--itl-target-s", "0.004")
    status, stdout, stderr = plan(capsys, *DSV2_ON_TWO_H100, *trace_args, "--gpu-budget", "4")
    assert status == 0, stderr
    status, table, _ = plan(capsys, *DSV2_ON_TWO_H100, "--gpu-memory", str(H100.memory_bytes))
    assert stdout.startswith(table + "\n")  # the capacity table as without a budget
    assert "on 4 x H100 SXM 80GB per layout or two-pool split" in stdout

    rows = budget_rows(stdout)
    assert [row[0] for row in rows] == ["1", "2", "3", "4", "5", "6"]
    assert sorted((row[1], row[2], row[3]) for row in rows) == sorted([
        ("tp=1 dcp=1", "4", "4"), ("tp=2 dcp=1", "2", "4"), ("tp=2 dcp=2", "2", "4"),
        ("tp=1 dcp=1 + tp=2 dcp=1", "2 + 1", "4"), ("tp=1 dcp=1 + tp=2 dcp=2", "2 + 1", "4"),
        ("tp=2 dcp=1 + tp=2 dcp=2", "1 + 1", "4")])
    per_gpu = [float(row[5]) for row in rows]
    assert per_gpu == sorted(per_gpu, reverse=True) and len(set(per_gpu)) > 1
    splits = [row for row in rows if "+" in row[1]]
    for row in rows:  # grants: each pool's share of a split's grants
        assert row[13] == "-" if "+" not in row[1] else re.fullmatch(r"\d+% \+ \d+%", row[13]), row
    marks = [row[14] if len(row) > 14 else "" for row in rows]
    assert marks[0].startswith("best") and marks.count("best split") + marks.count("best, best split") == 1
    best_split = splits[0]
    assert marks[rows.index(best_split)] in ("best split", "best, best split")

    assert "plan: 3 layouts and 3 two-pool splits of 4 GPUs to simulate" in stderr
    for index in range(1, 7):
        assert f"plan: [{index}/6] " in stderr
    assert "plan: [6/6] tp=2 dcp=1 x1 + tp=2 dcp=2 x1\n" in stderr

    # The best split's row against the same split run on its own, as a pooled simulate.
    (first, first_replicas), (second, second_replicas) = (
        (layout.split(), int(replicas)) for layout, replicas in zip(best_split[1].split(" + "),
                                                                     best_split[2].split(" + "), strict=True))
    pools = [PoolOption(f"tp{tp[3:]}-dcp{dcp[4:]}", int(tp[3:]), int(dcp[4:]), replicas)
             for (tp, dcp), replicas in ((first, first_replicas), (second, second_replicas))]
    args = with_trace_defaults(main_args(*DSV2_ON_TWO_H100, *trace_args, "--gpu-budget", "4"), H100.memory_bytes)
    request = PlanRequest(gpus_per_node=2, gpu_memory_bytes=H100.memory_bytes, context_len=32768)
    point = simulate_args(args, request, None, nodes=2, pools=pools)
    point.quiet = True
    simulation, facts = build(point)
    assert [pool["name"] for pool in facts["pools"]] == [pool.name for pool in pools]
    summary = simulation.run(parse_preset_or_path("chat", 40, 0))
    records = simulation.recorder.records.values()
    good = goodput(records, span_s(records), summary["gpu_seconds"], 0.5, 0.004)
    assert (best_split[4], best_split[5], best_split[6]) == (
        f"{good.requests_per_s:.3f}", f"{good.requests_per_s_per_gpu:.4f}", f"{good.fraction_met:.1%}")
    grants = [sum(n for key, n in summary["pool_grants"].items() if key.startswith(f"{pool.name}/")) for pool in pools]
    assert best_split[13] == " + ".join(f"{n / sum(grants):.0%}" for n in grants)

    # Its serve config: the split's pools, the budget, app args the deploy accepts.
    said = stdout[stdout.index("Best split: "):]
    best_single = next(row for row in rows if "+" not in row[1])
    assert said.startswith(f"Best split: {' + '.join(f'{p.layout} x{p.replicas}' for p in pools)} on 4 of "
                           f"4 GPUs, {good.requests_per_s_per_gpu:.4f} goodput req/s per GPU, against "
                           f"{best_single[5]} for the best layout alone ({best_single[1]} x{best_single[2]})")
    raw = yaml.safe_load(said[said.index("To deploy it:") + len("To deploy it:"):])
    assert raw == {"gpu_budget": 4, "pools": [
        {"name": pool.name, "tensor_parallel_size": pool.tp, "decode_context_parallel_size": pool.dcp,
         "autoscaling": {"min_replicas": pool.replicas, "max_replicas": pool.replicas}} for pool in pools]}
    app = parse_args({"model": "/models/deepseek-v2-lite", "max_model_len": 32768, **raw})
    assert sum(pool.min_gpus for pool in app.pool_list()) == 4


def test_a_budget_with_one_layout_that_fits_has_no_split(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-3.1-70B on two nodes of two H100s: tp=1 cannot hold the weights, so tp=2 (two replicas) is the only
    layout, and there is no pair to split the budget between."""
    status, stdout, stderr = plan(capsys, "--model", "llama-3.1-70b", "--gpus-per-node", "2", "--context", "16k",
                                  "--trace", "chat", "--requests", "20", "--gpu", "h100", "--gpu-budget", "4")
    assert status == 0, stderr
    rows = budget_rows(stdout)
    assert [row[:4] for row in rows[:1]] == [["1", "tp=2 dcp=1", "2", "4"]]
    assert rows[1][:2] == ["-", "tp=1 dcp=1"] and rows[1][2].startswith("skipped: weights need 131.42 GiB")
    assert stdout.rstrip().endswith("No split ran: fewer than two layouts fit the weights.")
    assert "plan: 1 layout and 0 two-pool splits of 4 GPUs to simulate" in stderr
