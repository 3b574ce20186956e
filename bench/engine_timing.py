"""The harness of bench/engine.py: timing hooks that wrap a ModelRunner's execute and its model's forward (instance
attributes only: the engine code is untouched), in this process or inside the rank actors; engines driven step by
step so that only steps in which every sequence decodes are sampled; transformers' generate on the same weights,
alternating with them step by step; the configs and how their engines are made."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dcpserve.engine.args import EngineArgs
from dcpserve.engine.config import ModelConfig
from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.worker.executor import InProcessExecutor

# label -> (backend, tensor_parallel_size, decode_context_parallel_size). --backend picks the rows: native (default)
# the native layouts; vllm vLLM's (dcp=1: vLLM's CPU attention cannot shard KV); both adds native tp=2 dcp=1 so the
# two backends are side by side at tp=1 and tp=2.
CONFIGS: dict[str, tuple[Literal["native", "vllm"], int, int]] = {
    "tp=1": ("native", 1, 1),
    "tp=1 eager": ("native", 1, 1),  # enforce_eager: on CUDA beside "tp=1", which replays decode CUDA graphs
    "tp=2": ("native", 2, 1),
    "tp=2 dcp=2": ("native", 2, 2),
    "vllm tp=1": ("vllm", 1, 1),
    "vllm tp=2": ("vllm", 2, 1),
}
BACKEND_CONFIGS = {
    "native": ["tp=1", "tp=2 dcp=2"],
    "vllm": ["vllm tp=1", "vllm tp=2"],
    "both": ["tp=1", "vllm tp=1", "tp=2", "vllm tp=2", "tp=2 dcp=2"],
}


@dataclass
class Samples:
    """Per decode step times of one engine config at one batch size, pooled over rounds (seconds)."""

    step: list[float] = field(default_factory=list)  # LLMEngine.step() wall time (or HF's gap between tokens)
    runner: list[float] = field(default_factory=list)  # ModelRunner.execute on rank 0 (ours only)
    forward: list[float] = field(default_factory=list)  # model forward + LM head (rank 0 for ours)
    lm_head: list[float] = field(default_factory=list)  # of forward, the LM head (compute_logits; ours only)
    prefill: list[float] = field(default_factory=list)  # per round: the steps before every sequence decodes (HF: its
    # first forward)

    def extend(self, other: Samples) -> None:
        self.step += other.step
        self.runner += other.runner
        self.forward += other.forward
        self.lm_head += other.lm_head
        self.prefill += other.prefill


def timed(fn: Callable[..., Any], record: Callable[[float], None], device: torch.device) -> Callable[..., Any]:
    """`fn` that passes each call's wall time to `record` (on CUDA synchronized before and after the call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call(*args: Any, **kwargs: Any) -> Any:
        sync()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        sync()
        record(time.perf_counter() - start)
        return result

    return call


def instrument_runner(runner: Any) -> None:
    """Wraps a ModelRunner's execute, its model's forward and its LM head (compute_logits) so each execute call
    appends (execute seconds, forward + LM head seconds, LM head seconds; 0.0 when not run) to runner.bench_records:
    transformers' forward, which the HF columns time, includes its LM head too. Runs in this process (tp=1) or
    inside a rank actor (tp>1)."""
    records: list[tuple[float, float, float]] = []
    last = [0.0, 0.0]  # this execute's forward, LM head

    def add(index: int) -> Callable[[float], None]:
        return lambda seconds: last.__setitem__(index, last[index] + seconds)

    runner.model.forward = timed(runner.model.forward, add(0), runner.device)
    runner.model.compute_logits = timed(runner.model.compute_logits, add(1), runner.device)
    execute = timed(runner.execute, lambda s: records.append((s, last[0] + last[1], last[1])), torch.device("cpu"))

    def execute_and_reset(output: Any) -> Any:
        last[:] = [0.0, 0.0]  # an empty step runs no forward
        return execute(output)

    runner.execute, runner.bench_records = execute_and_reset, records


def take_records(runner: Any) -> list[tuple[float, float, float]]:
    records = list(runner.bench_records)
    runner.bench_records.clear()
    return records


class Instrumented:
    """An LLMEngine with rank 0's runner instrumented and the driver's executor calls classified."""

    def __init__(self, engine: LLMEngine, threads: int) -> None:
        self.engine = engine
        executor = engine.executor
        self.runner = executor.runner if isinstance(executor, InProcessExecutor) else None
        self.rank0: Any = None  # rank 0's actor handle, when the ranks are Ray actors
        if self.runner is not None:
            instrument_runner(self.runner)
        else:
            import ray
            import ray.cloudpickle

            from dcpserve.engine.worker.ray_executor import RayWorkerGroup

            assert isinstance(executor, RayWorkerGroup)
            self.rank0 = executor.workers[0]
            # The hooks travel to the rank actors by value: bench/ need not be importable there.
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            ray.get(self.rank0.__ray_call__.remote(lambda worker: instrument_runner(worker.runner)))
            # The worker group gives each rank Ray's CPUs / tp threads; every rank gets --threads instead.
            def set_threads(worker: object) -> None:
                torch.set_num_threads(threads)

            ray.get([worker.__ray_call__.remote(set_threads) for worker in executor.workers])
        self.decode_calls: list[bool] = []  # per executor call: every sequence of the batch decodes
        self.step_seconds: list[float] = []  # per step that ran the model
        self.batch = 0
        self.ids: list[str] = []
        self.tokens: dict[str, list[int]] = {}
        execute = engine.executor.execute

        def classify(output: Any) -> Any:
            rows = output.scheduled
            self.decode_calls.append(len(rows) == self.batch and all(row.is_decode for row in rows))
            return execute(output)

        engine.executor.execute = classify  # type: ignore[method-assign]  # wrapped, to classify each call

    def records(self) -> list[tuple[float, float, float]]:
        if self.runner is not None:
            return take_records(self.runner)
        import ray

        return ray.get(self.rank0.__ray_call__.remote(lambda worker: take_records(worker.runner)))

    def start(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Queues greedy requests for `prompts`; step() then advances them one engine step at a time."""
        # Token ids only, as HF's generate and the vLLM rows (detokenize=False) return.
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        self.batch, self.decode_calls, self.step_seconds = len(prompts), [], []
        self.records()  # drop what earlier runs left
        self.ids = [self.engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
        self.tokens = {rid: [] for rid in self.ids}

    def step(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        calls = len(self.decode_calls)
        start = time.perf_counter()
        deltas = self.engine.step()
        elapsed = time.perf_counter() - start
        if len(self.decode_calls) > calls:  # the step ran the model (one executor call per step)
            self.step_seconds.append(elapsed)
        for delta in deltas:
            self.tokens[delta.request_id] += delta.new_token_ids

    def finish(self) -> tuple[list[list[int]], Samples]:
        """Runs what is left; greedy tokens per prompt and the times of the steps in which every sequence decoded."""
        while self.engine.has_unfinished_requests():
            self.step()
        records = self.records()
        if len(records) != len(self.step_seconds):
            raise RuntimeError(f"{len(records)} rank-0 executes for {len(self.step_seconds)} steps: timings misaligned")
        samples = Samples()
        samples.prefill.append(sum(seconds for decode, seconds in
                                   zip(self.decode_calls, self.step_seconds, strict=False) if not decode))
        for decode, seconds, (runner, forward, lm_head) in zip(self.decode_calls, self.step_seconds, records,
                                                               strict=False):
            if decode:
                samples.step.append(seconds)
                samples.runner.append(runner)
                samples.forward.append(forward)
                samples.lm_head.append(lm_head)
        return [self.tokens[rid] for rid in self.ids], samples


class VllmInstrumented:
    """vLLM's synchronous engine (the backend's engine with the same arguments,
    dcpserve.engine.backends.vllm.engine.vllm_engine_kwargs). vLLM's engine core runs steps in a process of its own,
    ahead of LLMEngine.step() (which only collects outputs), so its steps cannot be timed one by one: finish() runs the
    whole generation alone (step() during the alternation does nothing) and records one sample per round, the mean
    decode step = (time of the last token - time of the first) / (decode steps). Its runner / forward split is not
    observable."""

    def __init__(self, args: Any) -> None:
        import os

        import vllm

        from dcpserve.engine.backends.vllm.args import vllm_engine_kwargs

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu":  # one core per rank, as the native ranks get --threads 1 each
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r) for r in range(args.tensor_parallel_size))
        self.engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**vllm_engine_kwargs(args, device)))
        self.ids: list[str] = []
        self.tokens: dict[str, list[int]] = {}
        self.max_tokens = 0
        self._count = 0

    def start(self, prompts: list[list[int]], max_tokens: int) -> None:
        self.ids = [f"bench-{self._count}-{i}" for i in range(len(prompts))]
        self.tokens = {rid: [] for rid in self.ids}
        self.prompts, self.max_tokens = prompts, max_tokens
        self._count += 1

    def step(self) -> None:
        return None  # see the class docstring: the generation runs in finish(), alone

    def finish(self) -> tuple[list[list[int]], Samples]:
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = VllmParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
        for rid, prompt in zip(self.ids, self.prompts, strict=True):
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        first_done: float | None = None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id in self.tokens:
                    self.tokens[out.request_id] += list(out.outputs[0].token_ids)
            if first_done is None and all(self.tokens[rid] for rid in self.ids):
                first_done = time.perf_counter()  # every sequence has its prefill token
        end = time.perf_counter()
        samples = Samples()
        if first_done is not None and self.max_tokens > 1:
            samples.step.append((end - first_done) / (self.max_tokens - 1))
        return [self.tokens[rid] for rid in self.ids], samples

    def shutdown(self) -> None:
        self.engine.engine_core.shutdown()


# ---- runs: HF and the engines side by side ----------------------------------------------------------------------


def load_hf(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The same checkpoint in transformers, with EOS removed from its generation config: like ignore_eos, it
    neither stops at nor suppresses EOS (min_new_tokens alone would mask EOS logits and change greedy tokens)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps'd PreTrainedModel.to: mypy binds no self
    model.generation_config.eos_token_id = None
    model.bench_forward = []
    model.forward = timed(model.forward, model.bench_forward.append, device)
    return model


def hf_generate(
    model: Any, prompts: list[list[int]], max_tokens: int, between_steps: Callable[[], None]
) -> tuple[list[list[int]], Samples]:
    """Batched greedy generate (no padding: equal-length prompts) that calls `between_steps` after each token from
    a stopping criterion, which HF calls once per token. Its decode step times are the gaps from one call's return
    to the next call, so the time spent in `between_steps` is not counted."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    called: list[float] = []
    returned: list[float] = []

    class Interleave(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            called.append(time.perf_counter())
            between_steps()
            returned.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    device = next(model.parameters()).device
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    model.bench_forward.clear()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([Interleave()]),
        )
    if out.shape[1] != input_ids.shape[1] + max_tokens or len(called) != max_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - input_ids.shape[1]} tokens, not {max_tokens}")
    steps = [next_call - back for back, next_call in zip(returned, called[1:], strict=False)]
    return out[:, input_ids.shape[1] :].tolist(), Samples(step=steps, forward=model.bench_forward[1:],
                                                          prefill=model.bench_forward[:1])


def run_round(
    engines: dict[str, Instrumented], hf: Any, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[str, list[list[int]]], dict[str, Samples], list[list[int]], Samples]:
    """One generation of `prompts` on every engine and on HF, step by step in alternation: after each HF step,
    one LLMEngine.step() of each engine. Returns (our tokens, our samples, HF tokens, HF samples)."""
    for engine in engines.values():
        engine.start(prompts, max_tokens)

    def step_engines() -> None:
        for engine in engines.values():
            engine.step()

    hf_tokens, hf_samples = hf_generate(hf, prompts, max_tokens, step_engines)
    tokens, samples = {}, {}
    for label, engine in engines.items():
        tokens[label], samples[label] = engine.finish()
    return tokens, samples, hf_tokens, hf_samples


def run_alone(engines: dict[str, Instrumented], prompts: list[list[int]],
              max_tokens: int) -> tuple[dict[str, list[list[int]]], dict[str, Samples]]:
    """One generation on every engine without HF (contexts past --hf-max-context), still step by step in turn."""
    for engine in engines.values():
        engine.start(prompts, max_tokens)
    while any(engine.engine.has_unfinished_requests() for engine in engines.values()):
        for engine in engines.values():
            engine.step()
    tokens, samples = {}, {}
    for label, engine in engines.items():
        tokens[label], samples[label] = engine.finish()
    return tokens, samples


def make_engines(args: argparse.Namespace, model_dir: Path, configs: list[str], batch: int, prompt_len: int,
                 max_tokens: int) -> dict[str, Instrumented]:
    """One engine per config, with a KV budget sized for `batch` sequences (so engines can share a GPU) and a token
    budget that prefills every prompt in one step (up to 16k tokens; longer prompts are prefilled in chunks)."""
    mc = ModelConfig.from_pretrained(model_dir)
    tokens = batch * (prompt_len + max_tokens + 64)  # + a block's rounding per sequence
    kv_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4  # per token, fp32 at most
    engines: dict[str, Any] = {}
    for label in configs:
        backend, tp, dcp = CONFIGS[label]
        engine_args = EngineArgs(
            str(model_dir), backend=backend, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
            kv_cache_memory_bytes=2 * tokens * kv_bytes + (1 << 20),
            max_num_batched_tokens=min(16384, max(2048, batch * prompt_len)),
            block_size=32,  # vLLM's CPU attention needs multiples of 32; the same page for both backends
            max_model_len=min(mc.max_position_embeddings, max(4096, prompt_len + max_tokens + 64)),
            max_num_seqs=max(256, batch),
            enforce_eager=label.endswith("eager"),
        )
        if backend == "vllm":
            engines[label] = VllmInstrumented(engine_args)
            engines[label].start([[1] * args.prompt_len] * 2, 4)  # warmup (vLLM's first steps compile)
            engines[label].finish()
            continue
        engines[label] = Instrumented(LLMEngine(engine_args.create_engine_config()), args.threads)
        engines[label].start([[1] * args.prompt_len] * 2, 4)  # warmup
        engines[label].finish()
    return engines


def console_line(cells: list[str] | tuple[str, ...], widths: tuple[int, ...]) -> str:
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=False))
