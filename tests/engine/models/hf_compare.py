"""Comparing the engine with transformers on the same random weights: the prompts (token 0 among them), the
scenarios of the paged harness (bench/harness/model_harness.py), transformers' greedy reference and the check of ours
against it. The model tests of every family share them."""

from __future__ import annotations

import functools
from typing import Any

import torch

from bench.harness.model_harness import Job, Scenario
from bench.harness.random_models import LOGITS_ATOL, VOCAB

BLOCK_SIZE = 4
MAX_NEW_TOKENS = 32


def prompt(length: int) -> tuple[int, ...]:
    """Random tokens, those of 3 or more with token 0 (the pad id the reference is called with) in the middle: a
    prompt may hold it."""
    tokens = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    if length >= 3:
        tokens[length // 2] = 0
    return tuple(tokens)


def scenarios(dcp: int) -> tuple[Scenario, ...]:
    """One batch: prompts of 1 token, exactly one logical block, 3 tokens, and two long ones (several logical
    blocks) prefilled in chunks of block + 1 tokens, which cut blocks; their later chunks run in the same steps as
    the short prompts' decodes. Then every sequence decodes, all in one batch."""
    block = BLOCK_SIZE * dcp
    prompts = (prompt(1), prompt(block), prompt(3), prompt(2 * block + 3), prompt(3 * block + 1))
    return (Scenario(prompts, prefill_chunk=block + 1, max_new_tokens=MAX_NEW_TOKENS),)


@functools.cache
def hf_model(model_dir: str, dtype: str = "float32") -> Any:  # transformers types from_pretrained(...).eval() as Any
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


@functools.cache
def hf_reference(model_dir: str, tokens: tuple[int, ...], max_new_tokens: int,
                 dtype: str = "float32") -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, and its full-forward logits (as fp32) at every position that chose one of them,
    with its weights in `dtype`."""
    model = hf_model(model_dir, dtype)
    with torch.no_grad():
        # eos_token_id=None: the harness decodes exactly max_new_tokens, so the reference must not stop at an EOS.
        # An explicit attention mask: without one, transformers masks every prompt token equal to pad_token_id (the
        # prompts hold token 0 on purpose, an ordinary token such as "!" in Llama 3 and Qwen).
        out = model.generate(torch.tensor([tokens]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(tokens), dtype=torch.long), eos_token_id=None)
        generated = out[0, len(tokens) :].tolist()
        assert len(generated) == max_new_tokens
        full = torch.tensor([list(tokens) + generated[:-1]])
        logits = model(full).logits[0, len(tokens) - 1 :].float()
    return generated, logits


# bf16 logits of these models are about 5 in magnitude, where bf16 values are 1 / 32 apart: ours and transformers'
# (the same bf16 weights and ops, attention paged here, dense there) measured at most 0.08 apart (2.5 steps).
BF16_LOGITS_ATOL = 0.125


def check_against_hf(job: Job, results: dict[str, list], atol: float = LOGITS_ATOL, near_ties: bool = False) -> None:
    """Every sequence of every scenario against transformers in the job's dtype: logits within `atol` up to where
    the greedy tokens first differ (after it the prefixes differ), then the tokens. Exact (fp32): identical tokens.
    near_ties (low precision, vLLM's check_logprobs_close rule): they may differ only at a near-tie, our token one of
    transformers' top 2 and its logit within `atol` of the top one."""
    name = f"{job.name} ({job.dtype}, {', '.join(results['kernels'])} kernels)"
    index = 0
    for scenario in job.scenarios:
        for tokens in scenario.prompts:
            ref_tokens, ref_logits = hf_reference(job.model_dir, tokens, scenario.max_new_tokens, job.dtype)
            ours_tokens, ours_logits = results["tokens"][index], results["logits"][index]
            index += 1
            where = f"{name}, prompt of {len(tokens)} tokens in a batch of {len(scenario.prompts)}"
            same = next((i for i, (a, b) in enumerate(zip(ours_tokens, ref_tokens, strict=False)) if a != b),
                        len(ref_tokens))
            steps = min(same + 1, len(ref_tokens))
            error = (ours_logits[:steps] - ref_logits[:steps]).abs().amax(dim=-1)
            assert float(error.max()) <= atol, f"{where}: logits differ by {error.tolist()} per step"
            if same == len(ref_tokens):
                continue
            ours, top2 = ours_tokens[same], ref_logits[same].topk(2)
            near_tie = ours in top2.indices.tolist() and float(top2.values[0] - ref_logits[same, ours]) <= atol
            if not (near_ties and near_tie):
                raise AssertionError(
                    f"{where}: greedy tokens diverge at step {same} ({ours} vs transformers' {ref_tokens[same]}; "
                    f"transformers' top-2 logit gap there is {float(top2.values[0] - top2.values[1]):.2e})"
                )
    assert index == len(results["tokens"])
