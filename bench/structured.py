"""Structured outputs' cost in the native engine: decode tokens/s with a JSON schema on every request against the
same batch unconstrained, and what a grammar costs to compile and to start.

The batch (32 by default) runs in one LLM at tp=1, in alternating rounds, so machine noise hits both alike:
- unconstrained: greedy, ignore_eos, max_tokens = the constrained outputs' length;
- json_schema: every request constrained to an array of exactly --items integers in [0, 9] (a fixed-length output,
  so both sides generate the same tokens per request), greedy.
tokens/s counts generated tokens over each generate() call's wall time (one prefill step and the decode), after
one unconstrained warm-up batch.

    python -m bench structured [--batch 32] [--items 60] [--rounds 5] [--write-docs]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.docs_section import DocsSection, bench_command
from bench.harness.json_schemas import SCHEMAS
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.structured_output import Grammars, StructuredOutput


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def compile_times(grammars: Grammars) -> tuple[list[float], list[float]]:
    """Cold compile seconds of each of the 30 schemas, then seconds to start a request's state from the cache."""
    cold, cached = [], []
    for schema in SCHEMAS:
        constraint = StructuredOutput.json(schema)
        start = time.perf_counter()
        grammars.compile(constraint)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammars.start(constraint)
        cached.append(time.perf_counter() - start)
    return cold, cached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--items", type=int, default=60, help="integers in each constrained output's array")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", seed=0)
        prompts = [[(7 * i + 3 * j) % 400 + 20 for j in range(args.prompt_tokens)] for i in range(args.batch)]
        schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": args.items, "maxItems": args.items}
        constrained = SamplingParams(temperature=0, max_tokens=4 * args.items + 8,
                                     structured_output=StructuredOutput.json(schema))
        with LLM(model, max_num_seqs=args.batch) as llm:
            length = len(llm.generate(prompt_token_ids=prompts[:1], sampling_params=constrained)[0]
                         .outputs[0].token_ids)
            free = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
            run(llm, prompts, free)  # warm-up: the first batch of this size pays one-time costs
            rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
            for _ in range(args.rounds):
                for name, params in (("unconstrained", free), ("json_schema", constrained)):
                    elapsed, tokens = run(llm, prompts, params)
                    rates[name].append(tokens / elapsed)
            engine = llm.engine
            assert engine is not None
            cold, cached = compile_times(engine.grammars())
    free_rate, json_rate = (statistics.median(rates[k]) for k in ("unconstrained", "json_schema"))
    ratios = [j / f for f, j in zip(rates["unconstrained"], rates["json_schema"], strict=True)]
    table = "\n".join([
        "| requests | tokens per request | unconstrained tokens/s | json_schema tokens/s | ratio (median of rounds) |",
        "|---|---|---|---|---|",
        f"| {args.batch} | {length} | {free_rate:.0f} | {json_rate:.0f} | {statistics.median(ratios):.2f}x |",
        "",
        "| grammar | median | max |",
        "|---|---|---|",
        f"| compile, cold (30 schemas) | {1e3 * statistics.median(cold):.2f} ms | {1e3 * max(cold):.2f} ms |",
        f"| start a request's state from the cache | {1e3 * statistics.median(cached):.2f} ms | "
        f"{1e3 * max(cached):.2f} ms |",
    ])
    print(table)
    if args.write_docs:
        # The options that shape the table, whatever else the run was given.
        command = bench_command("structured", ["--batch", str(args.batch), "--items", str(args.items), "--rounds",
                                               str(args.rounds)])
        DocsSection("bench/structured.py").write(
            f"Command: `{command}` (the tiny model, tp=1, CPU; {args.rounds} alternating rounds).\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
