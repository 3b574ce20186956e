"""What the prefix caching tests share at tp = 1 (test_prefix_cache.py) and on the Ray worker group
(test_prefix_cache_ray.py): the exactness scenario, a model of which blocks a cache must hit, and the comparison of
a cached run with an uncached one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.core.outputs import ModelRunnerOutput
from dcpserve.engine.core.request import RequestOutput
from dcpserve.engine.core.step import SchedulerOutput
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.protocol import TokenLogprob
from dcpserve.engine.sampling_params import SamplingParams
from tests.engine.llm_parts import engine_of

LOGPROB_ATOL = 1e-4  # fp32, as the model-vs-transformers tests (test_sampling_features.py)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
PENALIZED = dataclasses.replace(GREEDY, repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.3)
PROMPT_LOGPROBS = dataclasses.replace(GREEDY, prompt_logprobs=2)  # needs every prompt row: never looked up


@dataclass
class CacheModel:
    """The token runs a cache with room for everything holds: every full block of every request's computed
    tokens (prompt + outputs but the last one, never computed), named by its whole run from the start."""

    tokens_per_block: int
    runs: set[tuple[int, ...]] = field(default_factory=set)

    def add(self, prompt: list[int], outputs: list[int]) -> None:
        computed = prompt + outputs[:-1]
        for end in range(self.tokens_per_block, len(computed) + 1, self.tokens_per_block):
            self.runs.add(tuple(computed[:end]))

    def hit_tokens(self, prompt: list[int]) -> int:
        """Tokens a new request with this prompt must find cached: its longest cached run of whole blocks before
        its last token."""
        hits = 0
        for end in range(self.tokens_per_block, len(prompt), self.tokens_per_block):  # ends before the last token
            if tuple(prompt[:end]) not in self.runs:
                break
            hits = end
        return hits


# A step of the scenario: (the first request's (prompt, outputs), if it ran) -> (what it is, prompt, params).
ScenarioStep = Callable[[list[tuple[list[int], list[int]]]], tuple[str, list[int], SamplingParams]]


def exactness_scenario(tpb: int, seed: int = 0) -> list[ScenarioStep]:
    """Requests that run one after another on the cached engine, each finding what the ones before it left cached
    (tpb = block_size * dcp, the logical block); each is a kind of hit the engine must serve exactly."""
    gen = torch.Generator().manual_seed(seed)

    def fresh(n: int) -> list[int]:
        return torch.randint(5, 500, (n,), generator=gen).tolist()

    base = fresh(3 * tpb + tpb // 2 + 1)  # 3 full blocks and a part
    tails = [fresh(n) for n in (tpb + 3, 5, 4, 3 * tpb + 2, 3, 2)]
    return [
        lambda h: ("warm: nothing cached", base, GREEDY),
        lambda h: ("prefix ends inside a block", base[:2 * tpb + tpb // 2] + tails[0], GREEDY),
        lambda h: ("prefix ends on a block boundary", base[:3 * tpb] + tails[1], GREEDY),
        lambda h: ("the prompt is all cached prefix: its last block computed again", base[:3 * tpb], GREEDY),
        lambda h: ("one token after the cached run (a 1-token prefill)", base[:3 * tpb + 1], GREEDY),
        lambda h: ("chunked prefill after the hit", base[:2 * tpb] + tails[3], GREEDY),
        lambda h: ("prompt logprobs: the whole prompt computed", base[:3 * tpb] + tails[1], PROMPT_LOGPROBS),
        # The cached run goes on into the first request's generated tokens; its prompt and outputs are what greedy
        # decoding repeats, so penalties on the cached prefix change the tokens.
        lambda h: ("a prefix into generated tokens", h[0][0] + h[0][1][:4] + tails[2], GREEDY),
        lambda h: ("penalties over a cached prefix", h[0][0] + h[0][1][:3] + tails[4], PENALIZED),
        lambda h: ("penalties, the prompt all cached prefix", h[0][0] + h[0][1], PENALIZED),
        lambda h: ("penalties, a 1-token prefill", one_after_blocks(h[0][0] + h[0][1], tpb), PENALIZED),
    ]


def one_after_blocks(tokens: list[int], tpb: int) -> list[int]:
    """The longest prefix of tokens that is whole blocks and one token more."""
    return tokens[:(len(tokens) - 1) // tpb * tpb + 1]


def generate_one(llm: LLM, prompt: list[int], params: SamplingParams) -> RequestOutput:
    return llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]


def run_reference(llm: LLM, steps: list[ScenarioStep]) -> list[tuple[str, list[int], SamplingParams, RequestOutput]]:
    """The scenario on an uncached engine: the concrete prompts (later ones made of the first request's outputs)
    and their outputs; the later requests in one batch (nothing is cached to depend on their order)."""
    what, prompt, params = steps[0]([])
    first = generate_one(llm, prompt, params)
    done = [(what, prompt, params, first)]
    history = [(prompt, first.outputs[0].token_ids)]
    rest = [step(history) for step in steps[1:]]
    outputs = llm.generate(prompt_token_ids=[p for _, p, _ in rest], sampling_params=[p for _, _, p in rest])
    done += [(what, prompt, params, output) for (what, prompt, params), output in zip(rest, outputs, strict=True)]
    stats = engine_of(llm).stats()
    assert not stats.prefix_caching and stats.prefix_cache_queries == stats.prefix_cache_hits == 0
    assert stats.kv_blocks_cached == 0
    return done


def run_cached_and_compare(llm: LLM, reference: list[tuple[str, list[int], SamplingParams, RequestOutput]],
                           where: str) -> int:
    """The same prompts, one after another, on an engine with prefix caching: each request hits exactly the
    tokens CacheModel says (stats().prefix_cache_hits), and gives the reference's tokens and logprobs. Returns the
    tokens hit in all."""
    model = CacheModel(engine_of(llm).block_manager.tokens_per_block)
    total = 0
    for what, prompt, params, expected in reference:
        before = engine_of(llm).stats()
        output = generate_one(llm, prompt, params)
        after = engine_of(llm).stats()
        looked_up = params.prompt_logprobs is None
        hits = model.hit_tokens(prompt) if looked_up else 0
        queried = len(prompt) if looked_up else 0
        assert after.prefix_cache_queries - before.prefix_cache_queries == queried, f"{where}, {what}"
        assert after.prefix_cache_hits - before.prefix_cache_hits == hits, f"{where}, {what}: hit tokens"
        # Only the tokens after the hit ran through the model (prefill and decodes, not the last output).
        computed = len(prompt) + len(output.outputs[0].token_ids) - 1 - hits
        assert after.tokens_computed - before.tokens_computed == computed, f"{where}, {what}: tokens computed"
        assert_same_output(output, expected, f"{where}, {what} ({hits} tokens hit)")
        model.add(prompt, output.outputs[0].token_ids)
        total += hits
    stats = engine_of(llm).stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_reserved == 0 and stats.kv_blocks_cached > 0
    return total


def assert_same_output(output: RequestOutput, expected: RequestOutput, where: str) -> None:
    """Same tokens; each token's logprob and its top alternatives within LOGPROB_ATOL (the prompt's too, when
    asked)."""
    got, want = output.outputs[0], expected.outputs[0]
    assert got.token_ids == want.token_ids, f"{where}: tokens differ"
    assert got.logprobs is not None and want.logprobs is not None
    assert_same_logprobs(got.logprobs, want.logprobs, f"{where}, output")
    assert (output.prompt_logprobs is None) == (expected.prompt_logprobs is None), where
    if expected.prompt_logprobs is not None:
        assert output.prompt_logprobs is not None
        assert output.prompt_logprobs[0] is None and expected.prompt_logprobs[0] is None
        assert_same_logprobs(output.prompt_logprobs[1:], expected.prompt_logprobs[1:], f"{where}, prompt")


def assert_same_logprobs(got: Sequence[TokenLogprob | None], want: Sequence[TokenLogprob | None], where: str) -> None:
    assert len(got) == len(want), where
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a is not None and b is not None, f"{where} {j}"
        assert a.token_id == b.token_id and a.rank == b.rank, f"{where} {j}"
        assert abs(a.logprob - b.logprob) <= LOGPROB_ATOL, f"{where} {j}: {a.logprob} vs {b.logprob}"
        assert [t for t, _ in a.top] == [t for t, _ in b.top], f"{where} {j}: top tokens"
        for (_, x), (_, y) in zip(a.top, b.top, strict=True):
            assert abs(x - y) <= LOGPROB_ATOL, f"{where} {j}: top logprobs {a.top} vs {b.top}"


def spy_steps(engine: LLMEngine) -> list[SchedulerOutput]:
    """Records every SchedulerOutput the engine executes (on the driver, before the ranks see it)."""
    seen: list[SchedulerOutput] = []
    execute = engine.executor.execute

    def recording(output: SchedulerOutput) -> ModelRunnerOutput:
        seen.append(output)
        return execute(output)

    engine.executor.execute = recording  # type: ignore[method-assign]  # wrapped, to record each step
    return seen


PREEMPTION_POOL_BLOCKS = 8


def preemption_workload(tpb: int) -> tuple[list[list[int]], SamplingParams]:
    """Two requests on a pool of 8 blocks (usage admission, no headroom): an old one of 1 block growing to 6 and a
    new one of 2 growing to 7. Together they outgrow the pool when the new one holds 5 blocks: it is preempted, the
    old one takes 2 more (evicting the new one's blocks from the end of its run), finishes, and the new one comes
    back to find its first blocks still cached."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 500, (n * tpb,), generator=gen).tolist() for n in (1, 2)]
    return prompts, dataclasses.replace(GREEDY, max_tokens=5 * tpb)


def readmissions_with_hits(steps: list[SchedulerOutput]) -> list[tuple[str, int]]:
    """(request, start position) of each entry that brings a preempted request back to the ranks after a cached
    run of blocks (the ones it computed before it was preempted)."""
    preempted: set[str] = set()
    found = []
    for step in steps:
        for entry in step.scheduled:
            if entry.is_new and entry.request_id in preempted and entry.start_position > 0:
                found.append((entry.request_id, entry.start_position))
        preempted.update(step.preempted_request_ids)
    return found


def check_preempted_request_hits_its_own_blocks(model: Path, block_size: int, tp: int = 1, dcp: int = 1,
                                                pcp: int = 1) -> None:
    """The preemption workload under usage admission, cached against uncached: the preempted new request (req-1)
    comes back starting after its 2 prompt blocks, still cached, and every request gives the uncached engine's
    tokens. 512 bytes per token per rank (2 layers, 1 KV head of 32 on every rank, K and V, fp32)."""
    tpb = block_size * dcp
    prompts, params = preemption_workload(tpb)
    args = dict(tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp,
                block_size=block_size, kv_cache_memory_bytes=PREEMPTION_POOL_BLOCKS * block_size * 512,
                admission="usage", kv_headroom=0.0)
    with LLM(model, enable_prefix_caching=False, **args) as llm:
        expected = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert engine_of(llm).stats().num_preemptions > 0
    with LLM(model, **args) as llm:
        steps = spy_steps(engine_of(llm))
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        stats = engine_of(llm).stats()
    assert stats.kv_blocks_total == PREEMPTION_POOL_BLOCKS and stats.num_preemptions > 0, stats
    assert readmissions_with_hits(steps) == [("req-1", 2 * tpb)]
    for output, want in zip(outputs, expected, strict=True):
        assert_same_output(output, want, f"tp={tp} dcp={dcp} pcp={pcp}, prompt of {len(output.prompt_token_ids)}")
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_reserved == 0
