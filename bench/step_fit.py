"""Fit dcpserve simulate's linear step model to this engine's measured steps, and say how well it fits.

Runs one replica of the native engine (the tiny model by default; tp = 1 in process, tp > 1 on a local Ray worker
group) on a mixed load: waves of requests with prompts of 16-1,500 tokens and 8-96 output tokens, so the steps
cover prefill chunks, decodes at batch 1-32 and mixes of both. It times every step (`LLMEngine.step`: schedule,
execute, update, the part the simulator's step model replaces plus the host work around it), turns each step's
scheduler output into the simulator's `StepWork`, and fits `LinearStepModel` on the even steps. The error it
prints is on the odd ones, which the fit never saw. The fit is written as JSON for `dcpserve simulate --step-model`.

With --from-steps it runs nothing and fits the steps an engine recorded with `step_trace_path` instead: the served
app's own steps, each with the host's gap before it (the engine core's inputs and outputs, the replica's other
threads), which the simulator's back-to-back steps otherwise leave out.

    python -m bench step_fit --out fits/tiny_tp1.json
    python -m bench step_fit --tp 2 --dcp 2 --out fits/tiny_tp2_dcp2.json
    python -m bench step_fit --from-steps /tmp/steps.jsonl --out fits/served.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.core.step import SchedulerOutput
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.simulator.step_fit import LinearStepModel, read_step_trace
from dcpserve.simulator.step_time import StepWork

WARMUP_STEPS = 5


def measure(model: str, tp: int, dcp: int, requests: int, seed: int) -> list[tuple[StepWork, float]]:
    """(the step's work, its seconds) for every step of the load after the warm-up."""
    rng = random.Random(seed)
    samples: list[tuple[StepWork, float]] = []
    with LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, seed=seed) as llm:
        engine = llm.engine
        assert engine is not None  # the native backend
        vocab = engine.model_config.vocab_size
        scheduler = engine.scheduler
        schedule = scheduler.schedule
        outputs: list[SchedulerOutput] = []

        def recording_schedule() -> SchedulerOutput:
            output = schedule()
            outputs.append(output)
            return output

        scheduler.schedule = recording_schedule  # type: ignore[method-assign]  # the bench watches each step's batch
        sent = steps = 0
        while sent < requests or engine.has_unfinished_requests():
            if sent < requests and len(scheduler.requests) < rng.randint(1, 32):
                for _ in range(min(rng.randint(1, 8), requests - sent)):
                    prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 1500))]
                    params = SamplingParams(max_tokens=rng.randint(8, 96), temperature=0.0, ignore_eos=True,
                                            detokenize=False)
                    engine.add_request(prompt_token_ids=prompt, sampling_params=params)
                    sent += 1
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            output = outputs[-1]
            steps += 1
            if steps > WARMUP_STEPS and not output.is_empty:
                rows = ((entry.start_position, len(entry.token_ids)) for entry in output.scheduled)
                samples.append((StepWork.from_rows(rows), seconds))
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model, in a temp dir)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--requests", type=int, default=300, help="requests of the load (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="where to write the fitted model's JSON")
    parser.add_argument("--from-steps", default=None, metavar="FILE",
                        help="fit an engine's step trace (step_trace_path) instead of running a load")
    args = parser.parse_args(argv)
    if args.from_steps:
        samples = read_step_trace(args.from_steps)
        source = args.from_steps
    else:
        with tempfile.TemporaryDirectory() as scratch:
            model = args.model
            if model is None:
                model = str(Path(scratch) / "tiny")
                write_tiny_model(model)
            samples = measure(model, args.tp, args.dcp, args.requests, args.seed)
        source = f"tp={args.tp} dcp={args.dcp}"
    fitted, train = LinearStepModel.fit(samples[0::2])
    held_out = samples[1::2]
    errors = [abs(fitted.step_seconds(work) - seconds) / seconds for work, seconds in held_out]
    errors.sort()
    print(f"{source}: {len(samples)} steps, {len(samples[0::2])} fitted, {len(held_out)} held out")
    print(f"model: {fitted.describe()}")
    print(f"held-out relative error: median {statistics.median(errors):.1%}, "
          f"p90 {errors[int(0.9 * (len(errors) - 1))]:.1%}")
    print(f"training: {train.format()}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(fitted.to_json() + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
