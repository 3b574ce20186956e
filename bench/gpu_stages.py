"""The in-process stages of bench/gpu_check.py: each measures one thing on the device and returns a StageReport (its key
numbers for the summary table, its lines for docs/benchmarks.md, whether it passed). bench/gpu_check.py runs each in a
process of its own (`python -m bench.gpu_check --stage NAME`), under the stage's time limit; none imports Ray or vLLM.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.gpu_dcp import GPU_CASES, LLAMA3_8B, DcpCase, DcpResult, Heads, check_case, markdown_rows
from bench.gpu_perf import (
    LLAMA3_8B_ATTENTION,
    PREFILL_ROWS,
    decode_markdown,
    decode_rates,
    gpu_spec,
    measured_copy_bps,
    prefill_flops,
    prefill_seconds,
    versions,
)
from dcpserve.cluster.tiny_model import TinyModelSpec


@dataclass(frozen=True)
class StageReport:
    """What one stage found: `key` (one line, for the summary table), `lines` (markdown, for the docs), `passed`."""

    key: str
    lines: list[str]
    passed: bool

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> StageReport:
        data = json.loads(path.read_text())
        return cls(str(data["key"]), [str(line) for line in data["lines"]], bool(data["passed"]))


def versions_stage(device: torch.device) -> StageReport:
    """torch, triton, CUDA, driver, the GPU and its memory; a large device-to-device copy's GB/s."""
    info = versions()
    copy_bps = measured_copy_bps(device)
    spec = gpu_spec(info["device"])
    share = f" = {100 * copy_bps / spec.memory_bps:.0f}% of {spec.name}'s {spec.memory_bps / 1e12:.2f} TB/s" \
        if spec is not None else ""
    lines = [f"- {name}: {value}" for name, value in info.items()]
    lines.append(f"- copy bandwidth (2 GiB device-to-device copy, read + write, median of 10): "
                 f"{copy_bps / 1e9:.0f} GB/s{share}")
    key = (f"{info['device']}; torch {info['torch']}, triton {info['triton']}, CUDA {info['CUDA']}, driver "
           f"{info.get('driver', 'n/a')}; copy {copy_bps / 1e9:.0f} GB/s")
    return StageReport(key, lines, True)


def dcp_kernels_stage(device: torch.device, cases: Sequence[DcpCase] = GPU_CASES, heads: Heads = LLAMA3_8B,
                      dtype: torch.dtype = torch.bfloat16) -> StageReport:
    """Every case sharded over its dcp, the shards' partials merged by combine_lse, against the unsharded reference;
    a case that runs out of memory is reported and the next one still runs."""
    results: list[DcpResult] = []
    failures: list[str] = []
    for case in cases:
        try:
            result = check_case(case, heads, dtype, device, "triton")
            results.append(result)
            note = f"out err {result.out_rel_err:.1e}, lse err {result.lse_err:.1e}" + \
                ("" if result.passed else " WRONG")
        except torch.OutOfMemoryError:
            note = "out of memory"
            failures.append(f"{case.label}: {note}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{case.label}: {note}", flush=True)
    passed = sum(r.passed for r in results)
    worst_out = max((r.out_rel_err for r in results), default=float("nan"))
    worst_lse = max((r.lse_err for r in results), default=float("nan"))
    key = (f"{passed}/{len(cases)} cases within tolerance; worst out err {worst_out:.1e} of max |out|, lse "
           f"{worst_lse:.1e}")
    lines = [f"- {str(dtype).removeprefix('torch.')}, heads {heads.num_q_heads} over {heads.num_kv_heads} KV of "
             f"{heads.head_dim}; Triton kernels and combine_lse vs the unsharded torch reference",
             *(f"- {line}" for line in failures), "", *markdown_rows(results, dtype)]
    return StageReport(key, lines, passed == len(cases))


def attention_perf_stage(device: torch.device) -> StageReport:
    """Decode attention's KV GB/s (share of spec and of measured copy bandwidth), prefill attention's TFLOP/s."""
    name = torch.cuda.get_device_name(device)
    spec = gpu_spec(name)
    copy_bps = measured_copy_bps(device)
    rates = decode_rates(device, copy_bps, spec)
    prefill = []
    for context, new in PREFILL_ROWS:
        seconds = prefill_seconds(context, new, LLAMA3_8B_ATTENTION, device)
        prefill.append((context, new, seconds, prefill_flops(context, new, LLAMA3_8B_ATTENTION) / seconds))
    best = max(rates, key=lambda r: r.kv_bps)
    spec_text = f"{100 * best.spec_share:.0f}% of spec, " if best.spec_share is not None else ""
    key = (f"decode up to {best.kv_bps / 1e9:.0f} GB/s ({spec_text}{100 * best.copy_share:.0f}% of copy, "
           f"ctx {best.context} x{best.batch}); prefill " +
           ", ".join(f"{flops / 1e12:.0f} TFLOP/s ({ctx}+{new})" for ctx, new, _, flops in prefill))
    peak = spec.bf16_flops if spec is not None else None
    lines = [f"- {LLAMA3_8B_ATTENTION.description}; bf16; block_size 16, random page permutations",
             f"- measured copy bandwidth {copy_bps / 1e9:.0f} GB/s; spec: "
             + (f"{spec.name}, {spec.memory_bps / 1e12:.2f} TB/s, {spec.bf16_flops / 1e12:.0f} TFLOP/s bf16 dense"
                if spec is not None else f"{name} is not in bench/gpu_perf.py's GPU_SPECS"),
             "- decode: bench/kernels.py's rows (checked against the reference, then timed with L2 flushed)", "",
             *decode_markdown(rates, spec), "",
             "| prefill: cached context | new tokens | time (ms) | TFLOP/s | % of spec bf16 dense |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {ctx} | {new} | {1e3 * s:.2f} | {flops / 1e12:.0f} | "
              + (f"{100 * flops / peak:.0f}% |" if peak else "n/a |") for ctx, new, s, flops in prefill]
    return StageReport(key, lines, all(r.correct for r in rates))


def model_stage(device: torch.device, spec: TinyModelSpec | None = None,
                batches: tuple[int, ...] = (1, 8, 32), rounds: int = 2) -> StageReport:
    """The bf16 model of `spec`'s widths (default Llama-3-8B's) at tp=1: graphs vs eager tokens and step times, then
    the KV sizing."""
    from bench.gpu_model import LLAMA3_8B_WIDTHS, kv_sizing, markdown, step_rows, write_bf16_model  # the engine

    spec = spec or LLAMA3_8B_WIDTHS
    with tempfile.TemporaryDirectory(prefix="gpu-check-model-") as directory:
        model_dir = write_bf16_model(Path(directory) / "model", spec)
        rows = step_rows(model_dir, batches, rounds)
        sizing = kv_sizing(model_dir, device.type)
    equal = sum(r.tokens_equal for r in rows)
    key = (f"KV {sizing.capacity_tokens} tokens ({sizing.num_blocks} pages); tokens graphs = eager at {equal}/"
           f"{len(rows)} batches; step ms graphs/eager " +
           ", ".join(f"b{r.batch} {r.graphs_ms:.2f}/{r.eager_ms:.2f}" for r in rows))
    graphed = device.type != "cuda" or all(r.graph_replays > 0 for r in rows)
    return StageReport(key, markdown(spec, sizing, rows), equal == len(rows) and graphed)


STAGE_FUNCTIONS: dict[str, Callable[[torch.device], StageReport]] = {
    "versions": versions_stage,
    "dcp_kernels": dcp_kernels_stage,
    "attention_perf": attention_perf_stage,
    "model": model_stage,
}
