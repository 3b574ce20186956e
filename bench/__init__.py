"""The benchmarks as one command: `python -m bench NAME [ARGS...]` runs benchmark NAME, `python -m bench` lists them.

Each benchmark is a module of this package with a `main(argv)`; run from the repository root (bench/ is not part of
the installed dcpserve). A module of bench/ that BENCHMARKS does not name is a part of one benchmark (engine_timing.py
and engine_sweep.py of engine, capacity_*.py of capacity, soak_*.py of soak, served_replay.py of simulate_validate).
What the benchmarks share with each other and with the tests is bench/harness/; nothing in bench/ imports tests/.
"""

from __future__ import annotations

# name -> what it measures, in one line (`python -m bench` prints these).
BENCHMARKS: dict[str, str] = {
    "admission": "admission full vs usage on one burst of early-stopping requests through the deployed app",
    "admission_scale": "admission's cost per request: the queue's grant at 8-64 replicas, the core's burst check",
    "agentic": "multi-turn agentic sessions through the deployed app: the host KV tier off vs on, TTFT by turn",
    "burst": "a burst of long sampled requests against a running `make serve`: statuses, then responsiveness",
    "capacity": "KV capacity and throughput of dcp=1 vs dcp=4 through the deployed app (the claim DCP exists for)",
    "engine": "engine decode tokens/s and per-step overhead vs transformers' generate (tp=1, tp=2 x dcp=2)",
    "fairness": "service levels under overload: a flooding tenant vs a light one and priority bands, vs FIFO",
    "gpu_check": "everything that needs a GPU in one run on a CUDA device: kernel and model tests, kernels, engine",
    "grammar_engines": "xgrammar vs llguidance on the test schemas: compile and mask time, invalid JSON let through",
    "kernels": "paged decode attention over context x batch: time, KV GB/s, share of copy bandwidth (GPU)",
    "moe": "the grouped MoE layer vs the old one-expert-at-a-time loop at batch 1, 8, 32 (tiny MoE shapes, CPU)",
    "long_context": "exactness at 128k tokens: the model code vs transformers at the covered (tp, dcp, pcp) layouts",
    "pcp": "time to first token of 4k-32k-token prompts at pcp=1 vs pcp=2",
    "pools": "layout pools through the deployed app: a pooled app vs two homogeneous ones on one burst",
    "prefix": "prefix caching and prefix-aware routing through the deployed app with 2 replicas",
    "rank_transport": "the rank transport: collectives over shared memory vs gloo; the step channel vs Ray's",
    "simulate_bound": "the admission TTFT bound in the simulator: later turns' TTFT misses with it vs without",
    "simulate_pools": "layout pools at up to 512 simulated GPUs: goodput of pooled splits vs single layouts",
    "simulate_published": "dcpserve simulate against published TP-vs-DCP results (vLLM's blog, ROCm ATOM #847)",
    "simulate_scale": "dcpserve simulate's wall time per simulated request from 1 to 64 nodes",
    "simulate_tier": "the host KV tier in the simulator: prefix hits, goodput, TTFT of first and later turns",
    "simulate_validate": "dcpserve simulate against the real app on this machine, the same traces both ways",
    "soak": "minutes of mixed traffic with one SIGKILL of each kind on a cluster of its own",
    "step_fit": "fits dcpserve simulate's linear step model to this engine's measured or recorded steps",
    "structured": "structured outputs' cost: decode tokens/s with a JSON schema vs unconstrained, compile times",
    "tls": "the price of Ray's mutual TLS: `make serve` with TLS on vs off on one burst, and both clusters' start",
}
