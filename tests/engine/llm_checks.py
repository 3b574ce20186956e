"""Whole LLMs the engine tests check: transformers' greedy tokens as the reference, and DCP's KV capacity and
concurrency at tp=4 (the model on one rank, without the scheduler, is bench/harness/model_harness.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.llm_parts import engine_of


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy tokens for each prompt alone (exactly max_tokens of them), keyed by the prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = {}
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0)
        expected[tuple(prompt)] = out[0, len(prompt):].tolist()
    return expected


def dcp_capacity_and_concurrency(model_dir: Path, kv_cache_memory_bytes: int) -> tuple[dict[int, int], dict[int, int]]:
    """KV capacity (tokens) and peak running sequences at tp=4 with dcp=1 and dcp=4 on the same per-rank memory: 16
    requests of 100 + 28 tokens under admission "full" (the concurrency of sequences whose whole prompt +
    max_tokens fits), checking every step that reservations stay within the pool. Prefix caching off: every
    sequence holds KV of its own."""
    from dcpserve.engine.frontend.llm import LLM
    from dcpserve.engine.sampling_params import SamplingParams

    long_request = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    prompt = list(range(5, 105))  # 100 + 28 = 128 tokens per sequence
    capacity: dict[int, int] = {}
    concurrency: dict[int, int] = {}
    for dcp in (1, 4):
        # The 16 prompts are identical: with prefix caching they would share their prompt blocks and more of them
        # would fit at once. The claim is about distinct KV per sequence, so the cache is off.
        with LLM(model_dir, tensor_parallel_size=4, decode_context_parallel_size=dcp,
                 kv_cache_memory_bytes=kv_cache_memory_bytes, admission="full", enable_prefix_caching=False) as llm:
            capacity[dcp] = llm.kv_capacity_tokens
            engine = engine_of(llm)
            for _ in range(16):
                engine.add_request(prompt_token_ids=prompt, sampling_params=long_request)
            peak = 0
            while engine.has_unfinished_requests():
                engine.step()
                stats = engine.stats()
                assert stats.kv_blocks_reserved <= stats.kv_blocks_total
                peak = max(peak, stats.num_running)
            concurrency[dcp] = peak
    return capacity, concurrency
