"""The long-context exactness check the suite (tests/engine/models/test_long_context.py, at 32,768 tokens) and the
benchmark (bench/long_context.py, at 128k) share: tiny random checkpoints whose positions reach past the prompt (a
Llama with GQA and with one KV head, llama3 RoPE scaled 4x; a DeepSeek-V2 MLA, YaRN 4x), one long seeded prompt
prefilled in chunks, and the check against transformers' fp32 forward (sdpa).

The reference: one forward over the prompt and our tokens but the last (teacher forcing: while ours are its argmax,
its greedy continuation is ours); MLA's values are zero-padded to the keys' width so torch's fused CPU attention
takes them (`_sdpa_values_padded`). The test module's docstring says what was measured and why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.harness.model_harness import Job, Scenario
from bench.harness.random_models import COMMON, LOGITS_ATOL, randomize_norms_and_biases
from dcpserve.cluster.tiny_model import TinyMlaSpec, write_tiny_mla_model
from dcpserve.engine.config import ModelConfig

MAX_NEW_TOKENS = 8  # logits at the last prompt position, then 7 decode steps
BLOCK_SIZE = 16  # the engine's default page size
FAR_CONTEXT_MIN_EFFECT = 0.1  # 1000 x LOGITS_ATOL (check_long_against_hf)


@dataclass(frozen=True)
class LongCase:
    """A prompt length, its prefill chunk, and the checkpoints' positions: max_position_embeddings, with RoPE scaled
    4x from a quarter of it (as long-context checkpoints are), which the prompt runs well past."""

    prompt_tokens: int
    prefill_chunk: int
    max_positions: int

    @property
    def original_positions(self) -> int:
        return self.max_positions // 4


# The suite's case: 8 chunks, the last one's context 28,672 tokens. bench/long_context.py runs longer ones.
CASE = LongCase(prompt_tokens=32_768, prefill_chunk=4_096, max_positions=40_960)

LLAMA_GQA = "llama_gqa_long"
LLAMA_MQA = "llama_mqa_long"
MLA = "deepseek_v2_mla_long"
# Llama shapes (COMMON otherwise): 4 heads, the fewest that tp = 4 allows. GQA (2 KV heads) runs
# DCP only at tp 4 (dcp <= tp / kv_heads); one KV head (MQA: one group of 4) takes dcp = tp.
LLAMA: dict[str, dict[str, Any]] = {
    LLAMA_GQA: dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True),
    LLAMA_MQA: dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8),
}


def mla_spec(case: LongCase) -> TinyMlaSpec:
    return TinyMlaSpec(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=24,
        qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1,
        max_position_embeddings=case.max_positions, initializer_range=0.15, q_lora_rank=None, yarn_factor=4.0,
        yarn_original_max_position_embeddings=case.original_positions, yarn_mscale=0.9, yarn_mscale_all_dim=0.7,
    )


def make_llama_checkpoint(name: str, directory: Path, case: LongCase) -> Path:
    """A random tiny LlamaForCausalLM (the model tests' shape and init, norms and biases random too) whose
    positions reach the case's max_positions."""
    import transformers

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": case.original_positions}
    config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": case.max_positions}, **LLAMA[name],
                                      tie_word_embeddings=False, rope_parameters=rope)
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_norms_and_biases(model)
    path = directory / name
    model.save_pretrained(path)
    return path


def write_checkpoints(root: Path, case: LongCase) -> dict[str, Path]:
    """Every model of the check (LLAMA and MLA), with positions for the case, under root."""
    paths = {name: make_llama_checkpoint(name, root, case) for name in LLAMA}
    paths[MLA] = write_tiny_mla_model(root / MLA, seed=7, spec=mla_spec(case))
    return paths


def long_prompt(vocab_size: int, tokens: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(tokens)
    return tuple(torch.randint(0, vocab_size, (tokens,), generator=generator).tolist())


def scenario(model_dir: Path, case: LongCase = CASE) -> Scenario:
    vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
    return Scenario((long_prompt(vocab_size, case.prompt_tokens),), prefill_chunk=case.prefill_chunk,
                    max_new_tokens=MAX_NEW_TOKENS)


def _sdpa_values_padded(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' "sdpa" attention with the values zero-padded to the keys' width and the output cut back: MLA's
    values (10 wide) are narrower than its keys (18), and torch's fused CPU attention needs one width, so plain sdpa
    falls back to the math path, which materializes every head's 32k x 32k scores (17 GB here)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    width = value.shape[-1]
    if width < key.shape[-1]:
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - width))
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out[..., :width], None


@functools.cache
def hf_long_model(model_dir: str) -> Any:  # transformers types from_pretrained(...).eval() as Any
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("sdpa_values_padded", _sdpa_values_padded)
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa_values_padded").eval()


@functools.cache
def hf_logits(model_dir: str, tokens: tuple[int, ...], keep: int, first_position: int = 0) -> torch.Tensor:
    """transformers' fp32 logits at the last `keep` positions of one forward over `tokens`, the first of them at
    position first_position."""
    model = hf_long_model(model_dir)
    positions = torch.arange(first_position, first_position + len(tokens))[None]
    with torch.no_grad():
        return model(torch.tensor([tokens]), position_ids=positions, logits_to_keep=keep).logits[0].float()


# hf_logits' signature: (model_dir, tokens, keep, first_position) -> logits
ReferenceLogits = Callable[[str, tuple[int, ...], int, int], torch.Tensor]


def check_long_against_hf(job: Job, results: dict[str, list], reference: ReferenceLogits = hf_logits) -> float:
    """Our greedy tokens are transformers' and our logits within LOGITS_ATOL of its, at the last prompt position and
    every decode step; returns the largest logit difference. The reference is one full forward over the prompt and
    our tokens but the last (teacher forcing): while our tokens are its argmax, its greedy tokens are ours, so it
    checks both at once. `reference` computes it: hf_logits, or a cache of its results that processes share."""
    (prompt,) = job.scenarios[0].prompts
    ours_tokens, ours_logits = results["tokens"][0], results["logits"][0]
    assert len(ours_tokens) == MAX_NEW_TOKENS and ours_logits.shape[0] == MAX_NEW_TOKENS
    tokens = prompt + tuple(ours_tokens[:-1])
    ref_logits = reference(job.model_dir, tokens, MAX_NEW_TOKENS, 0)
    # The test has teeth only if the far context matters: the same last tokens without all but the last chunk's
    # context (at their own positions) must give other logits, by far more than the tolerance.
    chunk = job.scenarios[0].prefill_chunk
    window = chunk + MAX_NEW_TOKENS - 1
    near_only = reference(job.model_dir, tokens[-window:], MAX_NEW_TOKENS, len(tokens) - window)
    far_effect = float((ref_logits - near_only).abs().amax())
    assert far_effect >= FAR_CONTEXT_MIN_EFFECT, (
        f"{job.name}: the context before the last chunk moves transformers' logits by {far_effect:.2e} only: this "
        f"model and prompt could not tell a long-context error from none"
    )
    ref_tokens = ref_logits.argmax(dim=-1).tolist()
    same = next((i for i, (a, b) in enumerate(zip(ours_tokens, ref_tokens, strict=True)) if a != b), MAX_NEW_TOKENS)
    # Up to the first divergence (after it our prefix is no longer transformers' greedy one).
    steps = min(same + 1, MAX_NEW_TOKENS)
    error = (ours_logits[:steps] - ref_logits[:steps]).abs().amax(dim=-1)
    where = f"{job.name}, a {len(prompt)}-token prompt in chunks of {chunk}"
    assert float(error.max()) <= LOGITS_ATOL, f"{where}: logits differ from transformers' by {error.tolist()} per step"
    if same < MAX_NEW_TOKENS:
        top2 = ref_logits[same].topk(2)
        raise AssertionError(
            f"{where}: greedy tokens diverge at step {same} ({ours_tokens[same]} vs transformers' {ref_tokens[same]}; "
            f"transformers' top-2 logit gap there is {float(top2.values[0] - top2.values[1]):.2e})"
        )
    return float(error.max())
