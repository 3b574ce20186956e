"""The tiny Qwen3-MoE through the whole engine on a real local Ray cluster (logical GPUs): TP=2 x DCP=2 and TP=4 x
DCP=2 worker groups produce transformers' greedy tokens, with the chosen tokens' logprobs close to transformers'.

The models keep Qwen3-30B-A3B's 8 query heads per KV head: 8 and 1 at tp = 2 (dcp = 2 needs tp > KV heads), 16 and
2 at tp = 4 (each KV head on two ranks, which DCP shards the sequence over); 8 experts, 2 per token, renormalized,
each rank its slice of every expert (dcpserve/engine/layers/moe.py). The prompts hold token 0; transformers is called
with an all-ones attention mask and a pad id no prompt holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpserve.cluster.tiny_moe import TinyQwenMoeSpec, write_tiny_qwen_moe_model
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from tests.engine.models.test_mla_ray import skip_without_gpus

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(300)]

# 1 token (token 0 itself), 2 blocks of 16, 71 tokens, a short one; token 0 in each.
PROMPTS = [[0], [*range(10, 26), 0, *range(27, 42)], [*range(100, 135), 0, *range(136, 171)], [298, 0, 300]]
PAD_TOKEN = 7  # in no prompt
MAX_TOKENS = 16
LOGPROB_ATOL = 2e-4  # the logits' 1e-4, twice: a logprob is a logit less the log-sum-exp of all of them
LAYOUTS: dict[tuple[int, int], TinyQwenMoeSpec] = {
    (2, 2): TinyQwenMoeSpec(num_attention_heads=8, num_key_value_heads=1),
    (4, 2): TinyQwenMoeSpec(num_attention_heads=16, num_key_value_heads=2),
}


def hf_greedy_with_logprobs(model_dir: Path) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens (exactly MAX_TOKENS, no EOS stop) and each one's log-probability."""
    from transformers import AutoModelForCausalLM

    assert all(PAD_TOKEN not in prompt for prompt in PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=PAD_TOKEN,
                                 eos_token_id=None)
            tokens = out[0, len(prompt):].tolist()
            logits = model(out[:, :-1]).logits[0, len(prompt) - 1:].float()
            logprobs = logits.log_softmax(dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
            expected.append((tokens, logprobs))
    return expected


@pytest.mark.parametrize("tp,dcp", list(LAYOUTS))
def test_greedy_equals_transformers(tp: int, dcp: int, tmp_path: Path, ray_cluster) -> None:
    skip_without_gpus(ray_cluster, tp)
    model_dir = write_tiny_qwen_moe_model(tmp_path / "qwen3_moe", seed=tp, spec=LAYOUTS[(tp, dcp)])
    expected = hf_greedy_with_logprobs(model_dir)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(model_dir, tensor_parallel_size=tp, decode_context_parallel_size=dcp, max_num_batched_tokens=40) as llm:
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for prompt, output, (tokens, logprobs) in zip(PROMPTS, outputs, expected, strict=True):
        completion = output.outputs[0]
        assert completion.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        assert completion.logprobs is not None
        ours = [entry.logprob for entry in completion.logprobs]
        assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) <= LOGPROB_ATOL, (ours, logprobs)
