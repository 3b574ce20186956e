"""Benchmark of long-context prefill and decode on CPU: the engine's attention kernels vs transformers' forward.

A batch of equal random prompts (fixed seed) prefills and then decodes greedily on the tiny model (or --model),
through LLMEngine.step() at tp=1 and through transformers' forward with its KV cache on the same weights, one
after the other in each round. Prefill is the wall time until every sequence has its first token (one step when
the token budget holds the whole batch, which is the default here; --max-num-batched-tokens chunks it); a decode
step is one LLMEngine.step() in which every sequence decodes. HF's prefill is one forward over the batch
(logits of the last position only, as generate does), its decode step one forward of one token per sequence.
Medians over --rounds (prefill) and over every decode step of every round.

    python bench/long_context.py                            # 8 x 4096 tokens, 16 decode steps, 2 threads
    python bench/long_context.py --kernels ref              # the exact torch references instead
    python bench/long_context.py --batch 1 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# `python bench/long_context.py` puts bench/ first on sys.path, where bench/engine.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from engine.args import EngineArgs  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.executor import InProcessExecutor  # noqa: E402
from engine.layers.attention import KERNEL_BACKENDS, Attention  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tiny_model import write_tiny_model  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parses the options; the token budget defaults to the whole batch's prompts (one prefill step)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: the tiny model, written to a temp dir)")
    parser.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    parser.add_argument("--prompt-len", type=int, default=4096, help="prompt tokens per sequence (default 4096)")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per round (default 16)")
    parser.add_argument("--rounds", type=int, default=3, help="prefill + decode rounds (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--kernels", choices=sorted(KERNEL_BACKENDS), default=None,
                        help="the engine's attention kernels (default: what the engine selects on CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="engine token budget per step (default batch * prompt-len: prefill in one step)")
    parser.add_argument("--skip-hf", action="store_true", help="only the engine")
    args = parser.parse_args(argv)
    if not all(v > 0 for v in (args.batch, args.prompt_len, args.decode_steps, args.rounds, args.threads)):
        parser.error("--batch, --prompt-len, --decode-steps, --rounds and --threads take positive numbers")
    return args


def engine_round(engine: LLMEngine, prompts: list[list[int]], decode_steps: int) -> tuple[float, list[float]]:
    """(prefill seconds, decode step seconds) of one greedy generation of `prompts`."""
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
    started: set[str] = set()
    start = time.perf_counter()
    while len(started) < len(ids):
        started.update(delta.request_id for delta in engine.step())
    prefill = time.perf_counter() - start
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return prefill, steps


def hf_round(model: Any, prompts: list[list[int]], decode_steps: int) -> tuple[float, list[float]]:
    """(prefill seconds, decode step seconds) of transformers' forward with its KV cache, greedy."""
    # transformers 5 names the cache argument and output `cache`; older versions `past_key_values`.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    input_ids = torch.tensor(prompts, dtype=torch.long)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - start
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = []
        for _ in range(decode_steps):
            start = time.perf_counter()
            out = model(token, use_cache=True, **{cache_arg: out[cache_arg]})
            steps.append(time.perf_counter() - start)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, steps


def main(argv: list[str] | None = None) -> None:
    """Runs the rounds and prints medians."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="dcpserve-long-") as tmp:
        model_dir = args.model or write_tiny_model(Path(tmp) / "tiny")
        vocab = 256  # byte tokens: valid in every model this runs on
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=gen).tolist()
        budget = args.max_num_batched_tokens or args.batch * args.prompt_len
        engine = LLMEngine(EngineArgs(
            model=str(model_dir), device="cpu", max_model_len=args.prompt_len + args.decode_steps + 1,
            max_num_batched_tokens=budget, max_num_seqs=max(args.batch, 1), seed=0,
        ).create_engine_config())
        if not isinstance(engine.executor, InProcessExecutor):
            raise RuntimeError("this benchmark runs tp=1 in process")
        attention = [m for m in engine.executor.runner.model.modules() if isinstance(m, Attention)]
        if args.kernels is not None:
            for module in attention:
                module.select_kernels(args.kernels)
        hf = None
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ours_prefill, ours_steps, hf_prefill, hf_steps = [], [], [], []
        for _ in range(args.rounds):
            prefill, steps = engine_round(engine, prompts, args.decode_steps)
            ours_prefill.append(prefill)
            ours_steps += steps
            if hf is not None:
                prefill, steps = hf_round(hf, prompts, args.decode_steps)
                hf_prefill.append(prefill)
                hf_steps += steps
        engine.shutdown()
    print(f"batch {args.batch} x {args.prompt_len} tokens, {args.threads} threads, token budget {budget}, "
          f"kernels {attention[0].kernels}, torch {torch.__version__}")
    print(f"{'':8} {'prefill s':>10} {'decode step ms':>15}")
    rows = [("engine", ours_prefill, ours_steps)] + ([("HF", hf_prefill, hf_steps)] if hf is not None else [])
    for name, prefill, steps in rows:
        print(f"{name:8} {statistics.median(prefill):10.3f} {1e3 * statistics.median(steps):15.2f}")
    if hf is not None:
        print(f"{'ours/HF':8} {statistics.median(ours_prefill) / statistics.median(hf_prefill):10.2f} "
              f"{statistics.median(ours_steps) / statistics.median(hf_steps):15.2f}")


if __name__ == "__main__":
    main()
