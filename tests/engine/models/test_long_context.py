"""Long context: the native engine's model code vs Hugging Face transformers at a 32,768-token prompt, at every
(tp, dcp) layout the suite's model tests cover, for a Llama (GQA) and a DeepSeek-V2 (MLA) tiny random model.

The model tests beside this one (test_model_vs_hf, test_mla_vs_hf) run prompts of a few dozen tokens; long-context
drift under DCP (reported for other stacks) could hide there. Here one prompt of 32,768 seeded random token ids is
prefilled in 8 chunks of 4,096 (the last chunk attends over 28,672 cached tokens) and then decodes 8 greedy tokens,
through tests/engine/model_harness.py's PagedRunner (its cache sized to the scenario): NaN-poisoned pages, so
reading a slot no token was written to turns the logits NaN; unused block-table columns naming a page past the
cache; shuffled pages; pages of 16 slots (the engine's default). Layouts: (tp, dcp) = (1, 1) in this process, and as
gloo processes (2, 1), (2, 2), (4, 2) with interleave 2, (4, 4): test_model_vs_hf's and test_mla_vs_hf's
MULTI_RANK_LAYOUTS, each model where the layout is valid for it (GQA with 2 KV heads takes dcp > 1 only at tp 4, so
(2, 2) and (4, 4) run a Llama with one KV head); and with prefill context parallelism, (tp, dcp, pcp) = (1, 1, 2),
(1, 2, 2), (2, 1, 2), (2, 2, 2), (2, 4, 2) (PCP_LAYOUTS: each chunk's 4,096 tokens split over the PCP groups, MLA
among them at dcp = 1, pcp and tp * pcp). Models, with positions up to 40,960:
- Llama GQA: 4 heads over 2 KV heads, q/k/v/o bias, llama3 RoPE scaling 4x from 10,240 (the prompt's positions run
  through the scaled, smoothed and unscaled frequency bands); and the same with one KV head (MQA) and no bias;
- DeepSeek-V2 MLA: the project's generator (dcpserve/cluster/tiny_model.py), latent 24 + 6, YaRN 4x from 10,240 with
  mscale != mscale_all_dim, a dense layer then a MoE layer.

Checked, at the last prompt position and each decode step: greedy tokens equal transformers', logits within LOGITS_ATOL
= 1e-4 (fp32, test_model_vs_hf's bound); every rank's tokens and logits bit-identical to rank 0's. Measured on this
suite's 2-core CPU machine: ours vs transformers at most 2.1e-5 over every layout (1.0e-5 at tp = 1; 3.4e-6 to 2.1e-5 at
the PCP layouts, every rank). The one-KV-head Llama at 2k / 8k / 32k tokens: 5e-6 / 2.4e-5 / 2.1e-5 at (2, 2), 5e-6 /
9e-6 / 7e-6 at (1, 1); MLA 3e-6 to 4e-6 at both. That is fp32 rounding of the shards' partial outputs and log-sum-exps,
flat in length (merging them in fp64 changed nothing), not a drift. And the test has teeth: transformers' own logits
move by 0.8 to 4.8 (at least FAR_CONTEXT_MIN_EFFECT, checked every run) when the tokens before the last chunk are
dropped; and, tried once each, a last chunk that skips the chunk before it (0.09 to 0.35 off), one DCP rank leaving out
one of 32,775 tokens in decode (up to 6.5e-3 off), RoPE positions rounded to bf16 (0.2 to 1.3), the exchanged LSE
rounded to bf16 (up to 0.023), local lengths of the wrong interleave (0.37) and a decode reading one slot past its
length (NaN, from the poisoned cache) each failed these tests.

The reference: transformers in fp32 on the same checkpoint, one forward over the prompt and our tokens but the last
(teacher forcing: while ours are its argmax, its greedy continuation is ours), attn_implementation "sdpa": torch's
fused CPU attention never builds the 32k x 32k scores that "eager" would (4 GiB per head). Measured, one thread:
each model's 32k forward takes 5-6 s and under 0.6 GB. MLA's values (10 wide) are narrower than its keys (18), which
sends plain "sdpa" to torch's math path: it asked for 17 GB for one layer's scores. `_sdpa_values_padded` pads the
values with zero channels to the keys' width (exact: a value channel only feeds the same output channel) and cuts the
output back. A float64 reference of our own would have been a second implementation of every model detail (llama3 /
YaRN RoPE, MLA, MoE routing) to keep in step with transformers, which is fast enough.

On CUDA, the single-rank run repeats with the Triton kernels (skipped elsewhere: the interpreter is far too slow).

Cost, on 2 cores: about 110 s for the module alone (each test 11-25 s), 140 s under `-n 2` beside itself.
"""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from dcpserve.cluster.tiny_model import TinyMlaSpec, write_tiny_mla_model
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.worker.parallel import ParallelState
from tests.engine.model_harness import Job, Scenario, run_job, run_rank
from tests.engine.models.test_model_vs_hf import (
    COMMON,
    LOGITS_ATOL,
    one_torch_thread,  # noqa: F401 - its autouse fixture, here too
    randomize_norms_and_biases,
)

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
# Llama shapes (test_model_vs_hf's COMMON otherwise): 4 heads, the fewest that tp = 4 allows. GQA (2 KV heads) runs
# DCP only at tp 4 (dcp <= tp / kv_heads); one KV head (MQA: one group of 4) takes dcp = tp.
LLAMA: dict[str, dict[str, Any]] = {
    LLAMA_GQA: dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True),
    LLAMA_MQA: dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8),
}
# (tp, dcp, interleave) -> the models run there: MULTI_RANK_LAYOUTS of test_model_vs_hf (Llama; (4, 2) with
# interleave 2) and test_mla_vs_hf (MLA), each Llama layout on a model it is valid for.
MULTI_RANK_LAYOUTS: dict[tuple[int, int, int], list[str]] = {
    (2, 1, 1): [LLAMA_GQA, MLA],
    (2, 2, 1): [LLAMA_MQA, MLA],
    (4, 2, 2): [LLAMA_GQA],
    (4, 4, 1): [LLAMA_MQA, MLA],
}

# (tp, dcp, pcp) -> the models run there: every PCP layout of test_model_vs_hf / test_mla_vs_hf, each on a model it is
# valid for, MLA at pcp with dcp = 1, with dcp = pcp and with dcp = tp * pcp.
PCP_LAYOUTS: dict[tuple[int, int, int], list[str]] = {
    (1, 1, 2): [LLAMA_GQA, MLA],
    (1, 2, 2): [LLAMA_MQA],
    (2, 1, 2): [LLAMA_GQA],
    (2, 2, 2): [MLA],
    (2, 4, 2): [LLAMA_MQA, MLA],
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
    """A random tiny LlamaForCausalLM (test_model_vs_hf's shape and init, norms and biases random too) whose
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
    """Every model of this module, with positions for the case, under root."""
    paths = {name: make_llama_checkpoint(name, root, case) for name in LLAMA}
    paths[MLA] = write_tiny_mla_model(root / MLA, seed=7, spec=mla_spec(case))
    return paths


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_checkpoints(tmp_path_factory.mktemp("long_context_checkpoints"), CASE)


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


def check_long_against_hf(job: Job, results: dict[str, list]) -> float:
    """Our greedy tokens are transformers' and our logits within LOGITS_ATOL of its, at the last prompt position and
    every decode step; returns the largest logit difference. The reference is one full forward over the prompt and
    our tokens but the last (teacher forcing): while our tokens are its argmax, its greedy tokens are ours, so it
    checks both at once."""
    (prompt,) = job.scenarios[0].prompts
    ours_tokens, ours_logits = results["tokens"][0], results["logits"][0]
    assert len(ours_tokens) == MAX_NEW_TOKENS and ours_logits.shape[0] == MAX_NEW_TOKENS
    tokens = prompt + tuple(ours_tokens[:-1])
    ref_logits = hf_logits(job.model_dir, tokens, MAX_NEW_TOKENS)
    # The test has teeth only if the far context matters: the same last tokens without all but the last chunk's
    # context (at their own positions) must give other logits, by far more than the tolerance.
    chunk = job.scenarios[0].prefill_chunk
    window = chunk + MAX_NEW_TOKENS - 1
    near_only = hf_logits(job.model_dir, tokens[-window:], MAX_NEW_TOKENS, len(tokens) - window)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", [LLAMA_GQA, MLA])
def test_single_rank_long_context_matches_transformers(
    name: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """tp = dcp = 1 in this process: the fused CPU kernels over one rank's whole 32k cache."""
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), (scenario(checkpoints[name]),))
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    assert results["kernels"] == ["cpu"]
    check_long_against_hf(job, results)


@pytest.mark.parametrize("name", [LLAMA_GQA, MLA])
def test_single_rank_triton_kernels_long_context_match_transformers(
    name: str, checkpoints: dict[str, Path], device: torch.device, tmp_path: Path
) -> None:
    """The Triton kernels at 32k: decode splits each sequence over up to 64 programs (flash-decoding), which only a
    long context fills with many key tiles each. CUDA only: Triton's CPU interpreter is far too slow at this length."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device: Triton's CPU interpreter is far too slow at 32k tokens")
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), (scenario(checkpoints[name]),), kernels="triton", device=str(device))
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    assert results["kernels"] == ["triton"]
    check_long_against_hf(job, results)


@pytest.mark.parametrize("tp,dcp,interleave", list(MULTI_RANK_LAYOUTS))
def test_multi_rank_long_context_matches_transformers(
    tp: int, dcp: int, interleave: int, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Real processes over gloo, one spawn per layout for all its models; every rank's tokens and logits are the
    same, bit for bit, and rank 0's are checked against transformers."""
    names = MULTI_RANK_LAYOUTS[tp, dcp, interleave]
    for name in names:
        ParallelConfig(tp, dcp).validate(ModelConfig.from_pretrained(checkpoints[name]))
    jobs = [Job(name, str(checkpoints[name]), (scenario(checkpoints[name]),)) for name in names]
    mp.spawn(run_rank, args=(tp, dcp, interleave, _free_port(), jobs, str(tmp_path), BLOCK_SIZE), nprocs=tp,
             join=True)
    for job in jobs:
        per_rank = [torch.load(tmp_path / job.result_file(r)) for r in range(tp)]
        check_long_against_hf(job, per_rank[0])
        for rank, other in enumerate(per_rank[1:], start=1):
            assert other["tokens"] == per_rank[0]["tokens"], f"{job.name}: rank {rank} sampled other tokens"
            for a, b in zip(other["logits"], per_rank[0]["logits"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{job.name}: rank {rank} logits differ")


@pytest.mark.parametrize("tp,dcp,pcp", list(PCP_LAYOUTS))
def test_prefill_context_parallel_long_context_matches_transformers(
    tp: int, dcp: int, pcp: int, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """PCP at 32k: each chunk's parts are spread over the PCP groups, whose segments attend to up to 32k tokens of
    context. Rank 0's tokens and logits against transformers'; every rank bit-identical to rank 0."""
    names = PCP_LAYOUTS[tp, dcp, pcp]
    for name in names:
        ParallelConfig(tp, dcp, pcp).validate(ModelConfig.from_pretrained(checkpoints[name]))
    jobs = [Job(name, str(checkpoints[name]), (scenario(checkpoints[name]),)) for name in names]
    mp.spawn(run_rank, args=(tp, dcp, 1, _free_port(), jobs, str(tmp_path), BLOCK_SIZE, pcp), nprocs=tp * pcp,
             join=True)
    for job in jobs:
        per_rank = [torch.load(tmp_path / job.result_file(r)) for r in range(tp * pcp)]
        check_long_against_hf(job, per_rank[0])
        for rank, other in enumerate(per_rank[1:], start=1):
            assert other["tokens"] == per_rank[0]["tokens"], f"{job.name}: rank {rank} sampled other tokens"
            for a, b in zip(other["logits"], per_rank[0]["logits"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{job.name}: rank {rank} logits differ")
