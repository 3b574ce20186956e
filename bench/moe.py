"""The grouped MoE layer against the expert loop it replaced, side by side in one run, at batch 1, 8 and 32.

One MoE layer (router, routed experts, Qwen2-MoE's shared expert where the shape has one) at tp = 1 on CPU, fp32,
one torch thread, on the tiny models' shapes: the tiny Qwen3-MoE (dcpserve/cluster/tiny_moe.py: hidden 64, 8 experts
of 32, 2 per token) and the tiny DeepSeek-V2 (dcpserve/cluster/tiny_model.py --mla: hidden 128, 8 experts of 64, 2
per token, a shared expert). Variants: "loop", the old forward kept here as the baseline (experts one at a time,
each on the tokens that chose it, after torch.unique(...).tolist(): a host synchronisation per layer); "grouped_mm"
and "padded", the two methods of dcpserve/engine/layers/moe.py (no host synchronisation; the engine picks
grouped_mm wherever torch._grouped_mm runs the shape). Every variant runs the same weights and tokens, checked
equal first; the timed calls interleave the variants, and each figure is the median over rounds of the mean of a
round's calls.

    python -m bench moe
    python -m bench moe --batches 1 8 32 128 --rounds 50
    python -m bench moe --write-docs
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.engine.deepseek_config import MoeConfig
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.moe import DeepseekMoE, ExpertsMethod, TensorParallelExperts
from dcpserve.engine.models.qwen3_moe import QwenSparseMoE
from dcpserve.engine.qwen_moe_config import read_qwen_moe_fields
from dcpserve.engine.worker.parallel import ParallelState

SECTION = "bench/moe.py"
VARIANTS = ("loop", "grouped_mm", "padded")
CPU = torch.device("cpu")


class ExpertLoop(TensorParallelExperts):
    """The baseline: the routed experts' old forward, one expert at a time on the tokens that chose it."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == expert)
            gate, up = F.linear(x[tokens], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


def qwen3_moe_layer() -> EngineModule:
    """The tiny Qwen3-MoE's sparse layer (TinyQwenMoeSpec's defaults)."""
    moe = read_qwen_moe_fields(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, num_hidden_layers=3), "Qwen3MoeForCausalLM", "tiny")
    assert moe is not None
    return QwenSparseMoE(64, moe, ParallelState.single(1), torch.float32, CPU)


def deepseek_v2_layer() -> EngineModule:
    """The tiny DeepSeek-V2's MoE layer (TinyMlaSpec's defaults)."""
    moe = MoeConfig(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
                    first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=1.0, scoring_func="softmax",
                    topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False)
    return DeepseekMoE(128, moe, ParallelState.single(1), torch.float32, CPU)


# name -> (hidden size, the layer)
SHAPES: dict[str, tuple[int, Callable[[], EngineModule]]] = {
    "tiny Qwen3-MoE": (64, qwen3_moe_layer), "tiny DeepSeek-V2": (128, deepseek_v2_layer),
}


def with_experts(layer: EngineModule, variant: str) -> EngineModule:
    """The layer with its routed experts run by `variant`, the same weights."""
    old = layer.experts
    assert isinstance(old, TensorParallelExperts)
    hidden = old.w13.shape[2]
    args = (old.num_experts, hidden, old.intermediate_per_rank, ParallelState.single(1), torch.float32, CPU)
    if variant == "loop":
        experts: TensorParallelExperts = ExpertLoop(*args)
    else:
        method: ExpertsMethod = "grouped_mm" if variant == "grouped_mm" else "padded"
        experts = TensorParallelExperts(*args, method=method)
    experts.w13, experts.w2 = old.w13, old.w2
    layer.experts = experts
    return layer


def randomize(layer: EngineModule, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.15)


def time_variants(hidden: int, make: Callable[[], EngineModule], batch: int, rounds: int,
                  calls: int) -> dict[str, float]:
    """Median seconds per layer call of each variant at `batch` tokens (variants interleaved round by round)."""
    base = make()
    randomize(base, seed=batch)
    layers = {}
    for variant in VARIANTS:
        layer = make()
        layer.load_state_dict(base.state_dict(), strict=False)
        layers[variant] = with_experts(layer, variant)
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = layers["loop"](x)
        for variant, layer in layers.items():
            torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-5, msg=f"{variant} != loop")
        samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for _ in range(rounds):
            for variant, layer in layers.items():
                started = time.perf_counter()
                for _ in range(calls):
                    layer(x)
                samples[variant].append((time.perf_counter() - started) / calls)
    return {variant: statistics.median(times) for variant, times in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="tokens per call (1 8 32)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per variant and batch (default 30)")
    parser.add_argument("--calls", type=int, default=20, help="layer calls per round (default 20)")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    if min(args.batches) < 1 or args.rounds < 1 or args.calls < 1:
        parser.error("--batches, --rounds and --calls must be positive")
    docs = DocsSection(SECTION)
    if args.write_docs:
        docs.check()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]  # other processes' share of the cores shows in every variant alike
    rows = []
    for shape, (hidden, make) in SHAPES.items():
        for batch in args.batches:
            medians = time_variants(hidden, make, batch, args.rounds, args.calls)
            loop, grouped, padded = (medians[v] * 1e6 for v in VARIANTS)
            rows.append(f"| {shape} | {batch} | {loop:.0f} us | {grouped:.0f} us | {padded:.0f} us | "
                        f"{loop / grouped:.2f}x |")
            print(rows[-1], flush=True)
    section = "\n".join([
        "## MoE layer: grouped experts vs the expert loop (`python -m bench moe`)", "",
        f"`{bench_command('moe', argv)}`; torch {torch.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} cores (one torch thread; load average {load:.1f} at the start), date "
        f"{time.strftime('%Y-%m-%dT%H:%M:%S')}", "",
        "One MoE layer (router, routed experts, shared expert where the model has one) at tp = 1, fp32, CPU, on the "
        "tiny models' shapes (Qwen3-MoE: hidden 64, 8 experts of 32, 2 per token; DeepSeek-V2: hidden 128, 8 experts "
        "of 64, 2 per token, one shared expert). loop: the old forward (experts one at a time after a "
        "torch.unique(...).tolist(), a host synchronisation); grouped_mm and padded: dcpserve/engine/layers/moe.py's "
        "two sync-free methods (the engine uses grouped_mm wherever torch._grouped_mm runs the shape). Outputs "
        f"checked equal first; per call, the median over {args.rounds} interleaved rounds of {args.calls} calls.", "",
        "| shape | tokens | loop | grouped_mm | padded | loop / grouped_mm |", "|---|---|---|---|---|---|",
        *rows,
    ])
    print(section)
    if args.write_docs:
        docs.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
