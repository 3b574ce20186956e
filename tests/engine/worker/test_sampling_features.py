"""Client-compatibility sampling features end to end: logprobs, prompt logprobs, presence / frequency / repetition
penalties, logit_bias, min_tokens, include_stop_str_in_output, skip_special_tokens.

Logprobs are checked against log_softmax of transformers' logits on the same random weights (tp = 1 in process,
tp = 2 x dcp = 2 on the Ray worker group, and the vLLM backend), with prompts chunked over several steps and a
1-token prompt. Penalties and logit_bias are checked against a reference written here: greedy decoding step by step
with transformers' logits and the documented adjustment applied, token for token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpserve.cluster.tiny_model import BOS_TOKEN, write_tiny_model
from dcpserve.engine.core.request import RequestOutput
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.protocol import TokenLogprob
from dcpserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from dcpserve.engine.tokenizer import TextStream, load_tokenizer
from tests.engine.llm_parts import engine_of

LOGPROB_ATOL = 1e-4  # fp32, as the model-vs-transformers logits
# 1 token, a long one cut into chunks of the small token budget (crossing logical blocks), a short one.
PROMPTS = [[7], list(range(10, 55)), [300, 301, 302]]
MAX_TOKENS = 8
SMALL_BUDGET = {"max_num_batched_tokens": 16}
# The vLLM backend on CPU: pages of 32 tokens, a pool that holds one max_model_len request.
VLLM_ARGS = dict(backend="vllm", dtype="float32", device="cpu", block_size=32, kv_cache_memory_bytes=1 << 20,
                 max_model_len=1024)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def hf(tiny: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def hf_logprobs(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: log_softmax of transformers' logits; row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check_entry(entry: TokenLogprob, expected: torch.Tensor, token: int, num_top: int, where: str) -> None:
    """One TokenLogprob against transformers' logprob row: the token's logprob, its rank (ties within the
    tolerance may go either way) and the top alternatives (values best first; each id's own logprob)."""
    assert entry.token_id == token, where
    assert abs(entry.logprob - float(expected[token])) <= LOGPROB_ATOL, f"{where}: {entry.logprob} vs {expected[token]}"
    higher = int((expected > expected[token] + LOGPROB_ATOL).sum())
    not_lower = int((expected > expected[token] - LOGPROB_ATOL).sum())
    assert 1 + higher <= entry.rank <= 1 + not_lower, f"{where}: rank {entry.rank}, expected {1 + higher}"
    assert len(entry.top) == num_top, where
    top_values = expected.topk(num_top).values.tolist() if num_top else []
    for (top_id, value), best in zip(entry.top, top_values, strict=True):
        assert abs(value - best) <= LOGPROB_ATOL, f"{where}: top {entry.top} vs {top_values}"
        assert abs(value - float(expected[top_id])) <= LOGPROB_ATOL, f"{where}: top token {top_id}"


def check_logprobs(hf: torch.nn.Module, prompt: list[int], output: RequestOutput, params: SamplingParams,
                   where: str) -> None:
    """Every sampled token's and every prompt token's TokenLogprob against transformers."""
    tokens = output.outputs[0].token_ids
    expected = hf_logprobs(hf, prompt + tokens)
    logprobs = output.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == len(tokens), where
    for j, (entry, token) in enumerate(zip(logprobs, tokens, strict=True)):
        check_entry(entry, expected[len(prompt) - 1 + j], token, params.logprobs or 0, f"{where}, output {j}")
    prompt_logprobs = output.prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt), where
    assert prompt_logprobs[0] is None, where
    for i in range(1, len(prompt)):
        prompt_entry = prompt_logprobs[i]
        assert prompt_entry is not None, where
        check_entry(prompt_entry, expected[i - 1], prompt[i], params.prompt_logprobs or 0, f"{where}, prompt {i}")


# Temperature and top-k change the draw, not the reported (raw) logprobs; sampled tokens also show ranks > 1.
LOGPROB_PARAMS = SamplingParams(temperature=0.8, top_k=40, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True,
                                logprobs=3, prompt_logprobs=2)


def test_logprobs_and_prompt_logprobs_equal_transformers(tiny: Path, hf: torch.nn.Module) -> None:
    other = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)  # asks for none, in the same batch
    params = [LOGPROB_PARAMS, LOGPROB_PARAMS, LOGPROB_PARAMS, other,
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0, prompt_logprobs=MAX_LOGPROBS)]
    prompts = PROMPTS + [[5, 6], list(range(60, 80))]
    with LLM(tiny, **SMALL_BUDGET) as llm:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, output, p in zip(prompts, outputs, params, strict=True):
        if p is other:
            assert output.outputs[0].logprobs is None and output.prompt_logprobs is None
            continue
        check_logprobs(hf, prompt, output, p, f"prompt of {len(prompt)}")
    assert any(entry.rank > 1 for entry in outputs[1].outputs[0].logprobs or []), "sampled tokens are not all argmax"


@pytest.mark.xdist_group("ray")
@pytest.mark.timeout(300)
def test_logprobs_equal_transformers_at_tp2_dcp2(tiny: Path, hf: torch.nn.Module, ray_cluster) -> None:
    """The vocab-parallel LM head gathers the prompt rows on every rank; rank 0's logprobs cross the Ray return
    path. Penalties on the driver rank as at tp = 1."""
    if ray_cluster.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs 2 (logical) GPUs")
    penalized = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.8,
                               presence_penalty=1.0, frequency_penalty=0.5, logit_bias={9: 0.05})
    with LLM(tiny, tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4, **SMALL_BUDGET) as llm:
        outputs = llm.generate(prompt_token_ids=PROMPTS + [PROMPTS[1]],
                               sampling_params=[LOGPROB_PARAMS] * len(PROMPTS) + [penalized])
    for prompt, output in zip(PROMPTS, outputs, strict=False):
        check_logprobs(hf, prompt, output, LOGPROB_PARAMS, f"tp=2 dcp=2, prompt of {len(prompt)}")
    assert outputs[-1].outputs[0].token_ids == reference_greedy(hf, PROMPTS[1], penalized)


# ---- penalties and logit_bias ----------------------------------------------------------------------------------


def reference_greedy(hf: torch.nn.Module, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding, one full transformers forward per token, with the documented adjustments to the raw
    logits: logit_bias added; the repetition penalty for every token of prompt + output (positive logit divided,
    negative multiplied); presence (once) and frequency (per occurrence) penalties for the output tokens."""
    tokens, output = list(prompt), list[int]()
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1].float().clone()
        for token, bias in params.logit_bias_map().items():
            logits[token] += bias
        for token in set(tokens):
            value = logits[token]
            logits[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        for token in set(output):
            logits[token] -= params.presence_penalty
        for token in output:
            logits[token] -= params.frequency_penalty
        top2 = logits.topk(2)
        assert float(top2.values[0] - top2.values[1]) > 1e-4, "a near tie: pick another prompt"
        output.append(int(top2.indices[0]))
        tokens.append(output[-1])
    return output


def penalty_cases() -> list[tuple[list[int], SamplingParams]]:
    greedy: dict[str, Any] = dict(temperature=0, max_tokens=16, ignore_eos=True)
    return [
        (PROMPTS[0], SamplingParams(**greedy, presence_penalty=1.5)),
        (PROMPTS[1], SamplingParams(**greedy, frequency_penalty=1.0)),
        (PROMPTS[2], SamplingParams(**greedy, repetition_penalty=1.8)),
        (list(range(200, 230)), SamplingParams(**greedy, repetition_penalty=0.7, presence_penalty=-0.5,
                                               frequency_penalty=0.4, logit_bias={9: 0.3, 77: -1.0, 150: 0.2})),
        ([40, 41], SamplingParams(**greedy, logit_bias={326: -0.3, 468: 0.2})),
        ([42, 43, 44], SamplingParams(**greedy)),  # nothing: in the same batch, unchanged
    ]


def test_penalties_and_logit_bias_equal_a_reference(tiny: Path, hf: torch.nn.Module) -> None:
    cases = penalty_cases()
    with LLM(tiny, **SMALL_BUDGET) as llm:
        outputs = llm.generate(prompt_token_ids=[p for p, _ in cases], sampling_params=[s for _, s in cases])
        plain = llm.generate(prompt_token_ids=[p for p, _ in cases],
                             sampling_params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for (prompt, params), output, unpenalized in zip(cases, outputs, plain, strict=True):
        tokens = output.outputs[0].token_ids
        assert tokens == reference_greedy(hf, prompt, params), f"prompt of {len(prompt)}: {params}"
        if params != SamplingParams(temperature=0, max_tokens=16, ignore_eos=True):
            assert tokens != unpenalized.outputs[0].token_ids, f"the adjustment changed nothing: {params}"


def test_penalties_survive_preemption(tiny: Path, hf: torch.nn.Module) -> None:
    """A preempted request recomputes from position 0; its token history is rebuilt from the recomputed chunks."""
    cases = penalty_cases()[:4]
    # block_size 4: 64 KiB = 128 tokens, against 17 + 61 + 19 + 46 tokens at the end.
    tight = {"block_size": 4, "kv_cache_memory_bytes": 64 << 10, "admission": "usage", "kv_headroom": 0.0}
    with LLM(tiny, **tight, **SMALL_BUDGET) as llm:
        outputs = llm.generate(prompt_token_ids=[p for p, _ in cases], sampling_params=[s for _, s in cases])
        assert engine_of(llm).stats().num_preemptions > 0
    for (prompt, params), output in zip(cases, outputs, strict=True):
        assert output.outputs[0].token_ids == reference_greedy(hf, prompt, params), f"prompt of {len(prompt)}"


def test_logit_bias_forces_and_forbids_tokens(tiny: Path) -> None:
    with LLM(tiny) as llm:
        forced = llm.generate("def main():", SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                                                            logit_bias={123: 100}))[0]
        free = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        first = free.outputs[0].token_ids[0]
        banned = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                            logit_bias={first: -100}))[0]
    assert forced.outputs[0].token_ids == [123] * 6
    assert first not in banned.outputs[0].token_ids


def test_min_tokens_masks_eos_and_stop_tokens(tiny: Path) -> None:
    """EOS (and a stop token id) pushed to the top by logit_bias still cannot be sampled before min_tokens."""
    with LLM(tiny) as llm:
        tokenizer = llm.tokenizer
        eos = min(tokenizer.eos_token_ids)
        eos_first = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100})
        assert llm.generate("hello", eos_first)[0].outputs[0].token_ids == [eos]
        held = llm.generate("hello", SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100},
                                                    min_tokens=5))[0].outputs[0]
        assert len(held.token_ids) == 6 and eos not in held.token_ids[:5] and held.token_ids[5] == eos
        assert held.finish_reason == "stop"
        stop_first = SamplingParams(temperature=1.0, seed=1, max_tokens=20, stop_token_ids=(77,), logit_bias={77: 100},
                                    min_tokens=3)
        stopped = llm.generate("hello", stop_first)[0].outputs[0]
        assert len(stopped.token_ids) == 4 and 77 not in stopped.token_ids[:3] and stopped.token_ids[3] == 77
        assert stopped.finish_reason == "stop"
        # min_tokens == max_tokens: never a stop token, always max_tokens tokens.
        full = llm.generate("hello", SamplingParams(temperature=0, max_tokens=7, min_tokens=7,
                                                    logit_bias={eos: 100}))[0].outputs[0]
        assert len(full.token_ids) == 7 and eos not in full.token_ids and full.finish_reason == "length"


def test_include_stop_str_in_output(tiny: Path) -> None:
    with LLM(tiny) as llm:
        free = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        text = free.outputs[0].text
        stop = text[3:6]
        assert len(stop) == 3
        cut = text.find(stop)
        kept = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=24, stop=(stop,),
                                                          include_stop_str_in_output=True))[0].outputs[0]
        dropped = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=24, stop=(stop,)))[0].outputs[0]
    assert kept.text == text[: cut + len(stop)] and kept.finish_reason == "stop"
    assert dropped.text == text[:cut] and dropped.finish_reason == "stop"


def test_skip_special_tokens(tiny: Path) -> None:
    """A special token (BOS, which does not end the request) forced into the output: dropped from the text unless
    skip_special_tokens=False."""
    with LLM(tiny) as llm:
        bos = llm.tokenizer.bos_token_id
        base: dict[str, Any] = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={bos: 100})
        skipped = llm.generate("hi", SamplingParams(**base))[0].outputs[0]
        shown = llm.generate("hi", SamplingParams(**base, skip_special_tokens=False))[0].outputs[0]
    assert skipped.token_ids == shown.token_ids == [bos] * 3
    assert skipped.text == "" and shown.text == BOS_TOKEN * 3


def test_detokenize_false_gives_the_same_tokens_and_no_text(tiny: Path) -> None:
    """vLLM's detokenize=False: the same tokens (and finish), no text; EOS and stop_token_ids still end the request."""
    with LLM(tiny) as llm:
        for base in (dict(temperature=0, max_tokens=12, ignore_eos=True), dict(temperature=1.0, seed=3, max_tokens=40),
                     dict(temperature=1.0, seed=4, max_tokens=40, stop_token_ids=[7, 11, 30, 99])):
            text, ids = (llm.generate("hello there", SamplingParams(**base, detokenize=flag))[0].outputs[0]
                         for flag in (True, False))
            assert ids.token_ids == text.token_ids and ids.finish_reason == text.finish_reason
            assert ids.text == "" and text.text != ""


def test_text_stream_stop_strings_with_min_tokens_and_include(tiny: Path) -> None:
    """A stop string only counts once it ends after the first min_tokens tokens' text (vLLM's rule)."""
    tokenizer = load_tokenizer(tiny)
    assert tokenizer is not None
    ids = tokenizer.encode("x = 1\nx = 2\nx = 3", add_special_tokens=False)
    text = tokenizer.decode(ids)

    def run(**options: Any) -> tuple[str, bool]:
        stream = TextStream(tokenizer, [], ["x ="], **options)
        pieces, stopped = [], False
        for i, token in enumerate(ids):
            piece, stopped = stream.push([token], i == len(ids) - 1)
            pieces.append(piece)
            if stopped:
                break
        return "".join(pieces), stopped

    assert run() == ("", True)
    assert run(include_stop_str_in_output=True) == ("x =", True)
    first_line = len(tokenizer.encode("x = 1\n", add_special_tokens=False))
    assert run(min_tokens=first_line) == (text[: text.index("x = 2")], True)
    assert run(min_tokens=first_line, include_stop_str_in_output=True) == (text[: text.index("x = 2") + 3], True)
    assert run(min_tokens=len(ids)) == (text, False)


# ---- a seeded request without the new fields samples what it did before them --------------------------------

# Tokens of these seeded requests from the sampler as it was before logprobs / penalties / logit_bias /
# min_tokens existed (tiny model, seed 0; one batch, token budget 16).
SEEDED_PROMPTS = [[7, 8, 9], list(range(10, 42)), [300, 301]]
SEEDED_PARAMS = [
    SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=1234, ignore_eos=True),
    SamplingParams(temperature=0.7, max_tokens=10, seed=7, ignore_eos=True),
    SamplingParams(temperature=1.3, top_k=5, max_tokens=10, seed=99, ignore_eos=True),
]
SEEDED_EXPECTED = [
    [485, 215, 301, 144, 20, 74, 35, 201, 123, 136],
    [200, 343, 118, 445, 374, 170, 501, 42, 487, 307],
    [73, 73, 223, 73, 401, 78, 477, 497, 121, 49],
]


def test_seeded_tokens_unchanged_and_logprobs_do_not_perturb_them(tiny: Path) -> None:
    with LLM(tiny, **SMALL_BUDGET) as llm:
        plain = llm.generate(prompt_token_ids=SEEDED_PROMPTS, sampling_params=SEEDED_PARAMS)
        with_logprobs = llm.generate(prompt_token_ids=SEEDED_PROMPTS, sampling_params=[
            dataclasses.replace(p, logprobs=5, prompt_logprobs=1) for p in SEEDED_PARAMS])
    assert [o.outputs[0].token_ids for o in plain] == SEEDED_EXPECTED
    assert [o.outputs[0].token_ids for o in with_logprobs] == SEEDED_EXPECTED


@pytest.mark.parametrize("trial", range(40))
def test_batched_filtering_equals_the_row_by_row_filter_bit_for_bit(trial: int) -> None:
    """The sampler filters every random row at once; each row must equal the one-row filter exactly, or seeded
    requests would draw other tokens than before."""
    import random

    from dcpserve.engine.worker.sampler import filter_logits, filter_logits_batch

    rng = random.Random(trial)
    rows, vocab = rng.randrange(1, 9), rng.choice([7, 512, 1000])
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial)) * rng.choice([0.5, 3, 20])
    params = [SamplingParams(temperature=rng.choice([0.1, 0.7, 1.0, 1.3, 2.0]), top_k=rng.choice([0, 1, 5, 50, 2000]),
                             top_p=rng.choice([1.0, 0.9, 0.5, 0.01])) for _ in range(rows)]
    batched = filter_logits_batch(logits, params)
    for i in range(rows):
        row = filter_logits(logits[i], params[i])
        assert torch.equal(row, batched[i])
        assert torch.equal(torch.softmax(row, -1), torch.softmax(batched, -1)[i])


# ---- validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options,message", [
    ({"logprobs": MAX_LOGPROBS + 1}, r"logprobs must be None or an integer in \[0, 20\].*got 21"),
    ({"logprobs": -1}, r"logprobs must be None or an integer in \[0, 20\].*got -1"),
    ({"prompt_logprobs": True}, r"prompt_logprobs must be None or an integer in \[0, 20\].*got True"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be a number in \[-2, 2\], got -3"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be a number in \(0, 2\].*got 0"),
    ({"repetition_penalty": 2.5}, r"repetition_penalty must be a number in \(0, 2\].*got 2.5"),
    ({"repetition_penalty": float("nan")}, r"repetition_penalty must be a number in \(0, 2\].*got nan"),
    ({"logit_bias": {5: 100.5}}, r"logit_bias\[5\] must be a number in \[-100, 100\], got 100.5"),
    ({"logit_bias": {-1: 1.0}}, r"logit_bias keys must be token ids \(integers >= 0\), got -1"),
    ({"logit_bias": {"5": 1.0}}, r"logit_bias keys must be token ids \(integers >= 0\), got '5'"),
    ({"logit_bias": 3}, r"logit_bias must be a \{token_id: bias\} mapping"),
    ({"min_tokens": -1}, r"min_tokens must be an integer >= 0, got -1"),
    ({"min_tokens": 17}, r"min_tokens=17 must be <= max_tokens=16"),
    ({"include_stop_str_in_output": 1}, r"include_stop_str_in_output must be True or False, got 1"),
    ({"detokenize": "no"}, r"detokenize must be True or False, got 'no'"),
    ({"detokenize": False, "stop": ["\n"]}, r"stop strings \['\\n'\] are matched in the output text: they need "
                                             r"detokenize=True \(or use stop_token_ids\)"),
])
def test_invalid_values_name_the_field(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_logit_bias_is_stored_as_sorted_pairs_and_hashable() -> None:
    params = SamplingParams(logit_bias={9: 1, 3: -2.5})
    assert params.logit_bias == ((3, -2.5), (9, 1.0))
    assert params.logit_bias_map() == {3: -2.5, 9: 1.0}
    assert hash(params) == hash(SamplingParams(logit_bias=[(3, -2.5), (9, 1.0)]))  # type: ignore[arg-type]  # a list of pairs: taken, stored as a tuple


def test_unknown_logit_bias_id_is_refused_before_anything_is_queued(tiny: Path) -> None:
    with LLM(tiny) as llm:
        bad = SamplingParams(max_tokens=3, logit_bias={512: 1.0})
        with pytest.raises(ValueError, match=r"logit_bias names token ids \[512\].*\[0, 512\)"):
            llm.generate(prompt_token_ids=[[5, 6], [7]], sampling_params=[SamplingParams(max_tokens=3), bad])
        with pytest.raises(ValueError, match=r"logit_bias names token ids \[600\]"):
            engine_of(llm).add_request(prompt_token_ids=[5], sampling_params=SamplingParams(logit_bias={600: 1.0}))
        assert not engine_of(llm).has_unfinished_requests()


# ---- the vLLM backend ----------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_backend_logprobs_and_pass_through(tiny: Path, hf: torch.nn.Module) -> None:
    tokenizer = load_tokenizer(tiny)
    assert tokenizer is not None
    eos = min(tokenizer.eos_token_ids)
    cases = penalty_cases()[:4]
    # No seeds: vLLM 0.32's CPU runner dies rewinding a seeded CPU generator (set_offset) when a chunked prefill
    # discards its sample.
    unseeded = dataclasses.replace(LOGPROB_PARAMS, seed=None)
    with LLM(tiny, **VLLM_ARGS, max_num_seqs=8, **SMALL_BUDGET) as llm:  # vLLM: budget >= max_num_seqs
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=unseeded)
        penalized = llm.generate(prompt_token_ids=[p for p, _ in cases], sampling_params=[s for _, s in cases])
        forced = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(
            temperature=1.0, max_tokens=4, ignore_eos=True, logit_bias={123: 100}))[0]
        held = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(
            temperature=0, max_tokens=20, logit_bias={eos: 100}, min_tokens=5))[0].outputs[0]
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        check_logprobs(hf, prompt, output, unseeded, f"vLLM, prompt of {len(prompt)}")
    for (prompt, params), output in zip(cases, penalized, strict=True):
        assert output.outputs[0].token_ids == reference_greedy(hf, prompt, params), f"vLLM: {params}"
    assert forced.outputs[0].token_ids == [123] * 4
    assert len(held.token_ids) == 6 and held.token_ids[5] == eos and eos not in held.token_ids[:5]

