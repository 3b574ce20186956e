"""The engine end to end on one process (tp = 1): LLM and AsyncEngine against Hugging Face transformers on
the same tiny random-weight checkpoints, plus sampling, stopping, aborting and input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpserve.cluster.tiny_model import TinyModelSpec, write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.core.request import RequestRejected
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from tests.engine.llm_parts import engine_of, runner_of


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(num_attention_heads=4, num_key_value_heads=2)
    return write_tiny_model(tmp_path_factory.mktemp("tiny_gqa"), seed=1, spec=spec)


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def prompts(block_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    lengths = [1, block_size, 3 * block_size + 5, 2]
    return [torch.randint(5, 500, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
@pytest.mark.parametrize("model_name", ["tiny", "tiny_gqa"])
def test_greedy_batch_equals_transformers(model_name: str, chunked: bool, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model_name)
    batch = prompts(16)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # A small token budget forces chunked prefill across steps, mixed with decodes of the short prompts.
    options = {"max_num_batched_tokens": 24} if chunked else {"enable_chunked_prefill": False, "max_model_len": 512}
    with LLM(model_dir, **options) as llm:
        outputs = llm.generate(prompt_token_ids=batch, sampling_params=greedy)
    for tokens, output in zip(batch, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, tokens, 32)
        assert output.outputs[0].finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_batch(tiny: Path) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    with LLM(tiny) as llm:
        alone = llm.generate("the quick brown fox", seeded)[0].outputs[0].token_ids
        batched = llm.generate(["hello", "the quick brown fox", "lorem ipsum"], [other, seeded, other])
        again = llm.generate("the quick brown fox", seeded)[0].outputs[0].token_ids
    assert batched[1].outputs[0].token_ids == alone == again
    assert len(alone) == 12


def test_stop_strings_stop_tokens_and_text(tiny: Path) -> None:
    with LLM(tiny) as llm:
        free = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        text = free.outputs[0].text
        assert len(text) > 6
        stop = text[3:6]
        stopped = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=24, stop=(stop,)))[0].outputs[0]
        assert stopped.finish_reason == "stop"
        assert stopped.text == text[: text.find(stop)]
        token = free.outputs[0].token_ids[4]
        by_id = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(token,)))[0]
        assert by_id.outputs[0].token_ids == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(token) + 1]
        assert by_id.outputs[0].finish_reason == "stop"


def test_bad_input_gives_clear_errors(tiny: Path, tiny_gqa: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dcp=2 must divide tp=1"):
        LLM(tiny, decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="dcp=2 needs tp > kv_heads: model has 2 KV heads, tp=2"):
        EngineArgs(str(tiny_gqa), tensor_parallel_size=2, decode_context_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match=r"dcp=4 must be <= tp // kv_heads = 4 // 2 = 2"):
        EngineArgs(str(tiny_gqa), tensor_parallel_size=4, decode_context_parallel_size=4).create_engine_config()
    with pytest.raises(ValueError, match="tp=3 must divide the model's 4 attention heads"):
        EngineArgs(str(tiny), tensor_parallel_size=3).create_engine_config()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(tmp_path / "empty")
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds the model's max_position_embeddings"):
        LLM(tiny, max_model_len=100000)
    with LLM(tiny, max_model_len=64) as llm:
        with pytest.raises(RequestRejected, match="exceeds max_model_len=64"):
            llm.generate(prompt_token_ids=[[5] * 60], sampling_params=SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match=r"prompt_token_ids must be integers in \[0, 512\)"):
            llm.generate(prompt_token_ids=[[5, 99999]])
        # Nothing was queued by the failed calls: the engine still serves.
        assert not engine_of(llm).has_unfinished_requests()
        assert len(llm.generate("ok", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_preempted_requests_recompute_to_the_same_tokens(tiny: Path) -> None:
    """usage admission over a pool too small for every sequence at its end: requests are preempted and recomputed
    from prompt + outputs so far. Greedy tokens equal transformers'; seeded sampled tokens equal a run with room."""
    batch = [[7], list(range(10, 42)), list(range(100, 171)), [300, 301, 302]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(4)]
    # block_size 4: 64 KiB = 128 tokens = 32 blocks, against 25 + 56 + 95 + 27 tokens at the end.
    tight = {"block_size": 4, "kv_cache_memory_bytes": 64 << 10, "admission": "usage", "kv_headroom": 0.0}
    with LLM(tiny, **tight) as llm:
        greedy_out = llm.generate(prompt_token_ids=batch, sampling_params=greedy)
        greedy_preemptions = engine_of(llm).stats().num_preemptions
        sampled_out = llm.generate(prompt_token_ids=batch, sampling_params=sampled)
        stats = engine_of(llm).stats()
    assert greedy_preemptions > 0 and stats.num_preemptions > greedy_preemptions
    assert stats.num_recomputed_tokens > 0
    for tokens, output in zip(batch, greedy_out, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(tiny, tokens, 24)
    with LLM(tiny, block_size=4) as roomy:  # 128 MiB: no preemption
        expected = roomy.generate(prompt_token_ids=batch, sampling_params=sampled)
        assert engine_of(roomy).stats().num_preemptions == 0
    assert [o.outputs[0].token_ids for o in sampled_out] == [o.outputs[0].token_ids for o in expected]


def test_the_profiling_step_leaves_no_trace(tiny: Path) -> None:
    """The largest step the scheduler can send runs on a scratch cache (on CUDA it measures the activation peak
    before the KV cache is sized; here it proves the step builds): the runner's cache, batch and sampler are as
    before, and greedy tokens still equal transformers'."""
    prompt = list(range(3, 40))
    with LLM(tiny, max_num_batched_tokens=300, max_model_len=128, max_num_seqs=4) as llm:
        runner = runner_of(llm)
        caches, blocks = runner.kv_caches, runner.num_blocks
        assert runner.profile_run() == 0  # no CUDA peak to measure on CPU
        assert runner.kv_caches is caches and runner.num_blocks == blocks and len(runner.batch) == 0
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        output = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert output.outputs[0].token_ids == hf_greedy(tiny, prompt, 12)


def test_stale_or_poisoned_kv_never_reaches_another_request(tiny: Path) -> None:
    """The CPU decode kernel masks the slots past each sequence's length without zeroing them first (finite_tail):
    the runner zeroes every page it hands out fresh, and a row's padding columns repeat the row's own last page. So
    a pool full of NaN (what a finished request may leave) changes no token, and a running request whose own KV
    turns to NaN changes no other request's tokens."""
    # 1, 5, 7 and 1 blocks of 4: the 20- and 27-token rows decode in one batched call
    # (dcpserve/kernels/cpu_attention.py's pieces), where the shorter row has padding columns.
    batch = [[7, 8, 9], list(range(10, 30)), list(range(100, 127)), [300, 301, 302]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = {"block_size": 4, "max_model_len": 256}
    with LLM(tiny, **options) as clean:
        expected = [o.outputs[0].token_ids for o in clean.generate(prompt_token_ids=batch, sampling_params=greedy)]
    with LLM(tiny, **options) as llm:
        caches = runner_of(llm).kv_caches
        for k_cache, v_cache in caches:
            k_cache.fill_(float("nan"))
            v_cache.fill_(float("nan"))
        outputs = llm.generate(prompt_token_ids=batch, sampling_params=greedy)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    with LLM(tiny, **options) as llm:  # a fresh pool: the first request admitted gets page 0
        engine = engine_of(llm)
        caches = runner_of(engine).kv_caches
        ids = [engine.add_request(prompt_token_ids=p, sampling_params=greedy) for p in batch]
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}

        def step() -> None:
            for delta in engine.step():
                tokens[delta.request_id] += delta.new_token_ids

        for _ in range(3):  # the prefill and two decodes
            step()
        # The victim holds page 0, which padding columns named before they repeated their row's last page.
        victim = next(r for r in engine.scheduler.running if 0 in r.block_ids)
        for k_cache, v_cache in caches:
            k_cache[victim.block_ids] = float("nan")
            v_cache[victim.block_ids] = float("nan")
        while engine.has_unfinished_requests():
            step()
    for request_id, want in zip(ids, expected, strict=True):
        if request_id != victim.request_id:
            assert tokens[request_id] == want, request_id
