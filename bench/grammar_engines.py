"""xgrammar against llguidance on this project's vocabulary and schemas: compile time, per-token mask time, and
whether what each lets through is valid JSON (why dcpserve/engine/structured_output.py uses llguidance).

Each engine walks every schema of bench/harness/json_schemas.py `--walks` times: at each step it fills the
allowed-token bitmask, random logits (seeded: the same draws for both engines) are masked with it, a token is sampled,
and the engine advances, until it accepts a stop token or `--max-tokens`. The walk's text must then parse with Python's
strict json.loads (RFC 8259: no raw control characters in strings) and validate with jsonschema. Random logits are
harsher than any model: every token the grammar allows gets drawn sooner or later.

    python -m bench grammar_engines [--model DIR] [--walks 20] [--write-docs]

Without --model it generates the tiny test model's tokenizer (byte-level BPE, 512 tokens) in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import torch

from bench.harness.docs_section import DocsSection, bench_command
from bench.harness.json_schemas import SCHEMAS
from dcpserve.engine.structured_output import no_additional_properties


class XgrammarEngine:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class LlguidanceEngine:
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.fill_bitmask = llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=stop_ids)
        self.vocab_size = vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        # additionalProperties: false where unset, as xgrammar's strict_mode (its default) does.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            no_additional_properties(schema), defaults={"whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # compiles and checks the grammar
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self.fill_bitmask(matcher, bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


def walk(engine: Any, compiled: Any, seed: int, max_tokens: int, tokenizer: Any, stop_ids: list[int]
         ) -> tuple[str, int, list[float]]:
    """One random walk: (text, tokens, per-step mask seconds)."""
    generator = torch.Generator().manual_seed(seed)
    matcher = engine.matcher(compiled)
    bitmask = torch.zeros((1, (engine.vocab_size + 31) // 32), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    tokens: list[int] = []
    fills: list[float] = []
    for _ in range(max_tokens):
        start = time.perf_counter()
        engine.fill(matcher, bitmask)
        fills.append(time.perf_counter() - start)
        allowed = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).bool().reshape(-1)[:engine.vocab_size]
        logits = torch.randn(engine.vocab_size, generator=generator).masked_fill(~allowed, float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if not engine.accept(matcher, token):
            raise RuntimeError(f"{engine.name} refused token {token} its own mask allowed")
        if token not in stop_ids:
            tokens.append(token)
        if engine.done(matcher):  # xgrammar: after a stop token; llguidance: also when nothing can follow
            break
    return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens), fills


def valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def measure(engine: Any, tokenizer: Any, walks: int, max_tokens: int, stop_ids: list[int]) -> dict[str, Any]:
    compile_s: list[float] = []
    fill_s: list[float] = []
    examples: list[str] = []
    bad = total = 0
    for i, schema in enumerate(SCHEMAS):
        start = time.perf_counter()
        compiled = engine.compile(schema)
        compile_s.append(time.perf_counter() - start)
        for w in range(walks):
            text, _, fills = walk(engine, compiled, 1000 * i + w, max_tokens, tokenizer, stop_ids)
            fill_s.extend(fills)
            total += 1
            if not valid(text, schema):
                bad += 1
                if len(examples) < 3:
                    examples.append(f"schema {i + 1}: {text[:80]!r}")
    return {"engine": engine.name, "compile_ms_median": 1e3 * statistics.median(compile_s),
            "compile_ms_max": 1e3 * max(compile_s), "mask_us_median": 1e6 * statistics.median(fill_s),
            "mask_us_p99": 1e6 * float(np.percentile(fill_s, 99)), "invalid": bad, "walks": total,
            "examples": examples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory with a tokenizer (default: the tiny model's)")
    parser.add_argument("--walks", type=int, default=20, help="random walks per schema per engine")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from dcpserve.cluster.tiny_model import write_tiny_model

            model = write_tiny_model(Path(tmp) / "tiny", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
        config = json.loads((Path(model) / "config.json").read_text())
        vocab_size = int(config["vocab_size"])
        eos = config.get("eos_token_id")
        stop_ids = [int(t) for t in (eos if isinstance(eos, list) else [eos])]
        rows = []
        for engine_class in (XgrammarEngine, LlguidanceEngine):
            start = time.perf_counter()
            engine = engine_class(tokenizer, vocab_size, stop_ids)
            setup_ms = 1e3 * (time.perf_counter() - start)
            row = measure(engine, tokenizer, args.walks, args.max_tokens, stop_ids)
            row["setup_ms"] = setup_ms
            rows.append(row)
    header = ("| engine | vocabulary setup | compile median / max | mask per token median / p99 | invalid JSON "
              "outputs |\n|---|---|---|---|---|")
    lines = [header] + [
        f"| {r['engine']} | {r['setup_ms']:.0f} ms | {r['compile_ms_median']:.2f} / {r['compile_ms_max']:.2f} ms | "
        f"{r['mask_us_median']:.0f} / {r['mask_us_p99']:.0f} us | {r['invalid']} of {r['walks']} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    for r in rows:
        for example in r["examples"]:
            print(f"  {r['engine']} invalid: {example}")
    if args.write_docs:
        command = bench_command("grammar_engines", ["--walks", str(args.walks)])
        DocsSection("grammar_engines").write(f"Command: `{command}` ({len(SCHEMAS)} schemas, random logits, vocabulary "
                                             f"{vocab_size}).\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
