"""Long context: the native engine's model code vs Hugging Face transformers at a 32,768-token prompt, at every
(tp, dcp) layout the suite's model tests cover, for a Llama (GQA) and a DeepSeek-V2 (MLA) tiny random model.

The model tests beside this one (test_model_vs_hf, test_mla_vs_hf) run prompts of a few dozen tokens; long-context
drift under DCP (reported for other stacks) could hide there. Here one prompt of 32,768 seeded random token ids is
prefilled in 8 chunks of 4,096 (the last chunk attends over 28,672 cached tokens) and then decodes 8 greedy tokens,
through bench/harness/model_harness.py's PagedRunner (its cache sized to the scenario): NaN-poisoned pages, so
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

The checkpoints, the prompt and the check are bench/harness/long_context.py's: bench/long_context.py runs them at 128k.

The ranks of the multi-rank tests run in the session's spawn pool (tests/spawn_pool.py: no fresh interpreter per rank
per layout), and each transformers reference is computed once per session, shared by the xdist workers (`reference`).

Cost, on 2 cores: about 220 CPU-s for the module alone (`-n 0`; 250 when every layout spawned its ranks afresh),
almost all of it our engine and transformers at 32k (110 s wall on an idle machine, measured before the pool).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

import pytest
import torch

from bench.harness.long_context import (
    BLOCK_SIZE,
    CASE,
    LLAMA_GQA,
    LLAMA_MQA,
    MLA,
    ReferenceLogits,
    check_long_against_hf,
    hf_logits,
    scenario,
    write_checkpoints,
)
from bench.harness.model_harness import Job, free_port, run_job, run_rank
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.worker.parallel import ParallelState
from tests.engine.models.test_model_vs_hf import one_torch_thread  # noqa: F401 - its autouse fixture, here too
from tests.spawn_pool import SpawnPool

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


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_checkpoints(tmp_path_factory.mktemp("long_context_checkpoints"), CASE)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> ReferenceLogits:
    """hf_logits, each result computed once per pytest session and shared by its xdist workers (a 32k forward is
    5-6 s, and every layout of a model needs the same one): saved under the session's temporary root, keyed by the
    checkpoint's bytes and the forward's arguments, one process computing it while the others wait on its lock."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base  # xdist: <root>/popen-gwN per worker
    cache = root / "long_context_hf_logits"
    cache.mkdir(exist_ok=True)

    def cached(model_dir: str, tokens: tuple[int, ...], keep: int, first_position: int) -> torch.Tensor:
        key = hashlib.sha256(repr((tokens, keep, first_position)).encode())
        for path in sorted(Path(model_dir).iterdir()):
            key.update(path.name.encode() + path.read_bytes())
        path = cache / f"{key.hexdigest()}.pt"
        with open(cache / f"{path.stem}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                partial = path.with_suffix(".partial")
                torch.save(hf_logits(model_dir, tokens, keep, first_position), partial)
                partial.rename(path)
            return torch.load(path)

    return cached


@pytest.mark.parametrize("name", [LLAMA_GQA, MLA])
def test_single_rank_long_context_matches_transformers(
    name: str, checkpoints: dict[str, Path], reference: ReferenceLogits, tmp_path: Path
) -> None:
    """tp = dcp = 1 in this process: the fused CPU kernels over one rank's whole 32k cache."""
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), (scenario(checkpoints[name]),))
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    assert results["kernels"] == ["cpu"]
    check_long_against_hf(job, results, reference)


@pytest.mark.parametrize("name", [LLAMA_GQA, MLA])
def test_single_rank_triton_kernels_long_context_match_transformers(
    name: str, checkpoints: dict[str, Path], reference: ReferenceLogits, device: torch.device, tmp_path: Path
) -> None:
    """The Triton kernels at 32k: decode splits each sequence over up to 64 programs (flash-decoding), which only a
    long context fills with many key tiles each. CUDA only: Triton's CPU interpreter is far too slow at this length."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device: Triton's CPU interpreter is far too slow at 32k tokens")
    config = ModelConfig.from_pretrained(checkpoints[name])
    job = Job(name, str(checkpoints[name]), (scenario(checkpoints[name]),), kernels="triton", device=str(device))
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    assert results["kernels"] == ["triton"]
    check_long_against_hf(job, results, reference)


@pytest.mark.parametrize("tp,dcp,interleave", list(MULTI_RANK_LAYOUTS))
def test_multi_rank_long_context_matches_transformers(
    tp: int, dcp: int, interleave: int, checkpoints: dict[str, Path], reference: ReferenceLogits, tmp_path: Path,
    spawn_pool: SpawnPool,
) -> None:
    """Real processes over gloo, one spawn per layout for all its models; every rank's tokens and logits are the
    same, bit for bit, and rank 0's are checked against transformers."""
    names = MULTI_RANK_LAYOUTS[tp, dcp, interleave]
    for name in names:
        ParallelConfig(tp, dcp).validate(ModelConfig.from_pretrained(checkpoints[name]))
    jobs = [Job(name, str(checkpoints[name]), (scenario(checkpoints[name]),)) for name in names]
    spawn_pool.spawn(run_rank, (tp, dcp, interleave, free_port(), jobs, str(tmp_path), BLOCK_SIZE), tp)
    for job in jobs:
        per_rank = [torch.load(tmp_path / job.result_file(r)) for r in range(tp)]
        check_long_against_hf(job, per_rank[0], reference)
        for rank, other in enumerate(per_rank[1:], start=1):
            assert other["tokens"] == per_rank[0]["tokens"], f"{job.name}: rank {rank} sampled other tokens"
            for a, b in zip(other["logits"], per_rank[0]["logits"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{job.name}: rank {rank} logits differ")


@pytest.mark.parametrize("tp,dcp,pcp", list(PCP_LAYOUTS))
def test_prefill_context_parallel_long_context_matches_transformers(
    tp: int, dcp: int, pcp: int, checkpoints: dict[str, Path], reference: ReferenceLogits, tmp_path: Path,
    spawn_pool: SpawnPool,
) -> None:
    """PCP at 32k: each chunk's parts are spread over the PCP groups, whose segments attend to up to 32k tokens of
    context. Rank 0's tokens and logits against transformers'; every rank bit-identical to rank 0."""
    names = PCP_LAYOUTS[tp, dcp, pcp]
    for name in names:
        ParallelConfig(tp, dcp, pcp).validate(ModelConfig.from_pretrained(checkpoints[name]))
    jobs = [Job(name, str(checkpoints[name]), (scenario(checkpoints[name]),)) for name in names]
    spawn_pool.spawn(run_rank, (tp, dcp, 1, free_port(), jobs, str(tmp_path), BLOCK_SIZE, pcp), tp * pcp)
    for job in jobs:
        per_rank = [torch.load(tmp_path / job.result_file(r)) for r in range(tp * pcp)]
        check_long_against_hf(job, per_rank[0], reference)
        for rank, other in enumerate(per_rank[1:], start=1):
            assert other["tokens"] == per_rank[0]["tokens"], f"{job.name}: rank {rank} sampled other tokens"
            for a, b in zip(other["logits"], per_rank[0]["logits"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{job.name}: rank {rank} logits differ")
