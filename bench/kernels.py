"""Benchmark of paged decode attention over context length x batch, printed as a table.

Each row: median time per call and KV bytes read per second; on a GPU also the fraction of this device's
measured copy bandwidth, our time over torch SDPA's on the same data (dense K/V gathered once), the combine
kernel's share of the decode time, and the error against the torch reference, checked before timing.
Model shapes (--shape): "gqa", one DCP rank of an MQA/GQA model (1 KV head, 8 query heads, head_dim 128, K and V
caches); "mla", one DCP rank of DeepSeek's multi-head latent attention (1 latent KV head of 512 + 64 = 576 values,
16 query heads absorbed into the latent space, the values the latent's 512 channels of the same cache). 16-token
pages. Without CUDA it times the torch reference at small sizes only: a smoke run, not a kernel measurement.

    python -m bench kernels                # full table; on CUDA it also updates docs/benchmarks.md
    python -m bench kernels --shape mla    # the MLA decode case (its own section of docs/benchmarks.md)
    python -m bench kernels --quick        # a short subset; writes the docs only with --write-docs
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.kernels._triton import HAS_TRITON, triton
from dcpserve.kernels.combine import combine_lse, combine_lse_ref
from dcpserve.kernels.decode_attention import default_num_splits, paged_decode_attention, paged_decode_attention_ref

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    """One DCP rank's decode attention: its KV heads, query heads and head widths, and whether V has a cache of its
    own (v_head_dim None) or is the first v_head_dim channels of the key cache (MLA)."""

    name: str
    description: str
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    v_head_dim: int | None = None

    @property
    def out_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def kv_bytes_read(self, batch: int, context: int, dtype: torch.dtype) -> int:
        caches = 2 if self.v_head_dim is None else 1
        return caches * batch * context * self.num_kv_heads * self.head_dim * dtype.itemsize


SHAPES = {
    "gqa": Shape("gqa", "1 KV head, 8 query heads, head_dim 128, K and V caches", 1, 8, 128),
    "mla": Shape("mla", "MLA: 1 latent KV head of 512 + 64 = 576 values, 16 query heads, values = the latent's 512 "
                 "channels of the same cache (no V cache)", 1, 16, 576, 512),
}
SIZES = {  # (on_gpu, quick) -> (contexts, batches, repeats)
    (True, False): ([4096, 8192, 16384, 32768, 65536, 131072], [1, 8, 32, 64], 50),
    (True, True): ([4096, 32768, 131072], [1, 8], 20),
    (False, False): ([512, 1024, 2048], [1, 4], 20),
    (False, True): ([512, 2048], [1, 4], 10),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
OUT_RTOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}  # times the reference's max |out|
LSE_ATOL = 1e-3
CHECK_SEQS = 4  # sequences of each row compared with the reference before timing
DCP_PARTS = 4  # combine width on CPU, where the reference decode does not split: a 4-rank DCP merge
COPY_BYTES, FLUSH_BYTES = 2 << 30, 512 << 20
TARGET_FRACTION, TARGET_MIN_CONTEXT, TARGET_MIN_BATCH = 0.8, 32768, 8
TARGET_TEXT = (
    f">= {TARGET_FRACTION:.0%} of measured copy bandwidth at context >= {TARGET_MIN_CONTEXT} "
    f"and batch >= {TARGET_MIN_BATCH}"
)
DOCS = {"gqa": DocsSection("bench/kernels.py"), "mla": DocsSection("bench/kernels.py --shape mla")}
COLUMNS = ("context", "batch", "time (us)", "KV GB/s", "% copy BW", "ours/SDPA", "combine", "max abs err", "target")
WIDTHS = (8, 6, 11, 9, 10, 10, 13, 11, 7)
DecodeArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, float]


@dataclass
class Row:
    context: int
    batch: int
    seconds: float
    kv_bytes: int
    combine_seconds: float
    combine_parts: int
    copy_bps: float | None = None  # GPU only from here on
    sdpa_seconds: float | None = None
    max_err: float | None = None
    correct: bool = True

    def meets_target(self) -> bool | None:
        if self.copy_bps is None or self.context < TARGET_MIN_CONTEXT or self.batch < TARGET_MIN_BATCH:
            return None
        return self.kv_bytes / self.seconds >= TARGET_FRACTION * self.copy_bps

    def cells(self) -> list[str]:
        gbps = self.kv_bytes / self.seconds / 1e9
        return [
            str(self.context),
            str(self.batch),
            f"{self.seconds * 1e6:.1f}",
            f"{gbps:.1f}" if gbps >= 10 else f"{gbps:.3f}",
            f"{100 * gbps * 1e9 / self.copy_bps:.1f}%" if self.copy_bps else "n/a",
            f"{self.seconds / self.sdpa_seconds:.2f}" if self.sdpa_seconds else "n/a",
            f"{100 * self.combine_seconds / self.seconds:.1f}% (N={self.combine_parts})",
            "n/a" if self.max_err is None else f"{self.max_err:.1e}" + ("" if self.correct else " WRONG"),
            {None: "-" if self.copy_bps else "n/a", True: "met", False: "MISSED"}[self.meets_target()],
        ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parses the options and fills the defaults that depend on the device and on --quick."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", help="context lengths (tokens per sequence)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (sequences per call)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--repeats", type=int, help="timed calls per row (default 50 on CUDA, 20 on CPU)")
    parser.add_argument("--max-kv-gib", type=float, help="skip rows whose paged KV exceeds this "
                        "(default 40 on CUDA, 1 on CPU); the dense copy for SDPA doubles the peak")
    parser.add_argument("--write-docs", action=argparse.BooleanOptionalAction, default=None,
                        help="update this benchmark's section of docs/benchmarks.md (default: on CUDA unless --quick)")
    parser.add_argument("--quick", action="store_true", help="a short subset of contexts, batches and repeats")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gqa",
                        help="gqa: K and V caches of head_dim 128; mla: DeepSeek's 576-wide latent cache (default gqa)")
    args = parser.parse_args(argv)
    optional = [value for value in (args.repeats, args.max_kv_gib) if value is not None]
    if not all(value > 0 for value in [*(args.contexts or []), *(args.batches or []), *optional]):
        parser.error("--contexts, --batches, --repeats and --max-kv-gib take positive numbers")
    on_gpu = torch.cuda.is_available()
    if on_gpu and not HAS_TRITON:
        parser.error("CUDA is available but Triton is not installed: the kernels cannot run")
    contexts, batches, repeats = SIZES[(on_gpu, args.quick)]
    args.device = torch.device("cuda" if on_gpu else "cpu")
    args.contexts, args.batches = args.contexts or contexts, args.batches or batches
    args.repeats = args.repeats or repeats
    args.dtype = DTYPES[args.dtype or ("bfloat16" if on_gpu else "float32")]
    args.max_kv_bytes = (args.max_kv_gib or (40.0 if on_gpu else 1.0)) * 2**30
    args.write_docs = args.write_docs if args.write_docs is not None else on_gpu and not args.quick
    args.shape = SHAPES[args.shape]
    return args


def median_seconds(
    fn: Callable[[], object], repeats: int, device: torch.device, flush: torch.Tensor | None = None
) -> float:
    """Median time of one call after warmup. On CUDA by events; `flush` is zeroed before each call, which
    evicts L2 and keeps the GPU busy while the call launches, so launch overhead is not timed."""
    for _ in range(max(2, repeats // 10)):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for begin, end in events:
        if flush is not None:
            flush.zero_()
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(begin.elapsed_time(end) for begin, end in events) / 1e3


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second of a same-device tensor copy, counting both the read and the write."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), repeats, device)


def make_paged_inputs(shape: Shape, batch: int, context: int, dtype: torch.dtype, device: torch.device) -> DecodeArgs:
    """(q, k_cache, v_cache, block_table, local_seq_lens, scale): random data in exactly the pages needed,
    handed to the sequences in a random permutation so the kernel's gather is non-contiguous; v_cache None for
    MLA (the values are read from the key cache)."""
    pages_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * pages_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    return (
        torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device),
        torch.randn(cache_shape, dtype=dtype, device=device),
        torch.randn(cache_shape, dtype=dtype, device=device) if shape.v_head_dim is None else None,
        torch.randperm(num_blocks, device=device).view(batch, pages_per_seq).to(torch.int32),
        torch.full((batch,), context, dtype=torch.int32, device=device),
        shape.head_dim**-0.5,
    )


def dense_kv(cache: torch.Tensor, block_table: torch.Tensor, context: int) -> torch.Tensor:
    """[batch, kv_heads, context, head_dim] contiguous copy of each sequence's first `context` cached slots."""
    gathered = cache[block_table.long()].reshape(block_table.shape[0], -1, cache.shape[2], cache.shape[3])
    return gathered[:, :context].transpose(1, 2).contiguous()


def sdpa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch SDPA for one query token per sequence: q [batch, q_heads, head_dim] -> [batch, q_heads, 1, head_dim]."""
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True)


def check_against_reference(inputs: DecodeArgs, v_head_dim: int | None) -> tuple[float, bool]:
    """Max |out error| of the Triton kernel on the row's own inputs, over its first sequences, and whether
    out and lse are within tolerance of paged_decode_attention_ref."""
    out, lse = paged_decode_attention(*inputs, v_head_dim=v_head_dim)
    q, k_cache, v_cache, block_table, lens, scale = inputs
    n = min(CHECK_SEQS, q.shape[0])
    ref_out, ref_lse = paged_decode_attention_ref(q[:n], k_cache, v_cache, block_table[:n], lens[:n], scale,
                                                  v_head_dim=v_head_dim)
    err = (out[:n].float() - ref_out.float()).abs().max().item()
    lse_err = (lse[:n] - ref_lse).abs().max().item()
    tolerance = OUT_RTOL[q.dtype] * max(ref_out.float().abs().max().item(), 1e-6)
    return err, err <= tolerance and lse_err <= LSE_ATOL


def combine_seconds(
    shape: Shape, batch: int, parts: int, device: torch.device, repeats: int, flush: torch.Tensor | None = None
) -> float:
    """Time of one combine of `parts` fp32 partials [parts, batch, q_heads, out_dim], as the decode merges them."""
    outs = torch.randn(parts, batch, shape.num_q_heads, shape.out_dim, device=device)
    lses = torch.randn(parts, batch, shape.num_q_heads, device=device) + 10.0
    combine = combine_lse if device.type == "cuda" else combine_lse_ref
    return median_seconds(lambda: combine(outs, lses), repeats, device, flush)


def measure_row(
    shape: Shape, context: int, batch: int, dtype: torch.dtype, repeats: int, flush: torch.Tensor | None,
    copy_bps: float | None,
) -> Row:
    """On CUDA: checks the Triton kernel against the reference, then times it, its combine, and SDPA on dense
    K/V. On CPU (flush is None): times the torch reference and a DCP-like combine_lse_ref merge."""
    device = torch.device("cpu") if flush is None else flush.device
    inputs = make_paged_inputs(shape, batch, context, dtype, device)
    q, k_cache, v_cache, block_table, _, scale = inputs
    kv_bytes = shape.kv_bytes_read(batch, context, dtype)
    v_head_dim = shape.v_head_dim
    if flush is None:
        seconds = median_seconds(lambda: paged_decode_attention_ref(*inputs, v_head_dim=v_head_dim), repeats, device)
        combine = combine_seconds(shape, batch, DCP_PARTS, device, repeats)
        return Row(context, batch, seconds, kv_bytes, combine, DCP_PARTS)
    max_err, correct = check_against_reference(inputs, v_head_dim)
    seconds = median_seconds(lambda: paged_decode_attention(*inputs, v_head_dim=v_head_dim), repeats, device, flush)
    parts = default_num_splits(q, shape.num_kv_heads)
    combine = combine_seconds(shape, batch, parts, device, repeats, flush)
    try:  # SDPA may fall back to a backend that expands the KV heads; then its column reads n/a
        keys = dense_kv(k_cache, block_table, context)
        # MLA: the values are the keys' first channels, contiguous as SDPA's kernels want them.
        if v_cache is not None:
            values = dense_kv(v_cache, block_table, context)
        else:
            values = keys[..., : shape.out_dim].contiguous()
        sdpa: float | None = median_seconds(lambda: sdpa_decode(q, keys, values, scale), repeats, device, flush)
    except (torch.OutOfMemoryError, RuntimeError):  # RuntimeError: no SDPA backend for this shape
        sdpa = None
    return Row(context, batch, seconds, kv_bytes, combine, parts, copy_bps, sdpa, max_err, correct)


def measure_rows(args: argparse.Namespace, copy_bps: float | None) -> tuple[list[Row], list[str]]:
    """Measures every (context, batch) within the KV budget, printing each row (or why it was skipped)."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=args.device) if copy_bps is not None else None
    rows: list[Row] = []
    skipped: list[str] = []
    for context in args.contexts:
        for batch in args.batches:
            kv_gib = args.shape.kv_bytes_read(batch, context, args.dtype) / 2**30
            row, reason = None, f"KV {kv_gib:.3g} GiB > --max-kv-gib {args.max_kv_bytes / 2**30:g}"
            try:
                if kv_gib * 2**30 <= args.max_kv_bytes:
                    row = measure_row(args.shape, context, batch, args.dtype, args.repeats, flush, copy_bps)
            except torch.OutOfMemoryError:
                reason = f"out of memory with KV {kv_gib:.3g} GiB"
            if flush is not None:
                torch.cuda.empty_cache()
            if row is not None:
                rows.append(row)
            else:
                skipped.append(f"skipped context {context} batch {batch}: {reason}")
            print(console_line(row.cells()) if row is not None else skipped[-1], flush=True)
    return rows, skipped


def header_lines(
    shape: Shape, device: torch.device, dtype: torch.dtype, repeats: int, copy_bps: float | None
) -> list[str]:
    """What the table was measured on and how, for the console and the docs."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        name = f"CPU {platform.machine()}, torch threads: {torch.get_num_threads()}"
    lines = [
        f"device: {name}",
        f"torch {torch.__version__}, triton {triton.__version__ if HAS_TRITON else 'not installed'}, dtype "
        f"{str(dtype).removeprefix('torch.')}, date {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"shape ({shape.name}): {shape.description}, block_size {BLOCK_SIZE}; block tables are random page "
        f"permutations; KV GB/s counts the cache bytes read (K and V; MLA: the one latent cache)",
    ]
    if copy_bps is None:
        return lines + [
            "CPU REFERENCE RUN: times are of paged_decode_attention_ref (torch) on CPU, NOT a kernel measurement; "
            f"GPU-only columns are n/a; combine = combine_lse_ref of a {DCP_PARTS}-way DCP merge",
            f"time: median of {repeats} calls after warmup (time.perf_counter)",
        ]
    return lines + [
        f"copy bandwidth ({COPY_BYTES >> 30} GiB device-to-device copy, read + write): {copy_bps / 1e9:.0f} GB/s",
        f"time: median of {repeats} calls after warmup, CUDA events, L2 flushed before each call",
        "ours/SDPA: our time / F.scaled_dot_product_attention's on dense K/V; combine: combine_lse on the "
        "decode's N split partials, as a share of the decode time",
        f"max abs err: our out vs paged_decode_attention_ref on each row's first {CHECK_SEQS} sequences, checked "
        "before timing",
        f"H200 target: {TARGET_TEXT}",
    ]


def console_line(cells: list[str] | tuple[str, ...]) -> str:
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, WIDTHS, strict=False))


def markdown_section(shape: Shape, command: str, info: list[str], rows: list[Row], notes: list[str]) -> str:
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    table += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    bullets = [f"- {line}" for line in info + notes]
    title = "## Paged decode attention" + (", MLA latent cache" if shape.v_head_dim is not None else "")
    return "\n".join([title, "", f"Command: `{command}`", "", *bullets, "", *table])






def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = args.device.type == "cuda"
    docs = DOCS[args.shape.name]
    if args.write_docs:
        docs.check()  # fail now, not after a long run
    torch.manual_seed(0)
    if on_gpu:
        print("measuring copy bandwidth ...", flush=True)
    copy_bps = copy_bandwidth(args.device, COPY_BYTES, 10) if on_gpu else None
    info = header_lines(args.shape, args.device, args.dtype, args.repeats, copy_bps)
    print("\n".join(info) + "\n\n" + console_line(COLUMNS), flush=True)
    rows, notes = measure_rows(args, copy_bps)
    graded = [met for met in (row.meets_target() for row in rows) if met is not None]
    summary = [f"target ({TARGET_TEXT}) met on {sum(graded)} of {len(graded)} qualifying rows"] if on_gpu else []
    wrong = [row for row in rows if not row.correct]
    if wrong:
        summary.append(f"WRONG RESULTS in {len(wrong)} row(s): the kernel disagrees with the reference")
    print("".join(f"\n{line}" for line in summary), flush=True)
    if args.write_docs and wrong:
        print(f"{docs.path} not updated: a kernel result was wrong")
    elif args.write_docs:
        command = bench_command("kernels", argv)
        docs.write(markdown_section(args.shape, command, info, rows, notes + summary))
        print(f"updated {docs.path}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
