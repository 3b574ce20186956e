"""What the host KV tier's exactness tests share (tests/engine/test_host_tier_exact.py: tp=1 and ranks as processes;
tests/engine/test_host_tier_ray.py: the Ray worker group): the two phases run on an engine with a tiny device pool,
and their check against a cold engine's run and transformers'.

- prefix: A, then B (its blocks evict A's cached tail into the tier), then A's first five blocks and a new tail:
  A's head is still on the device, the rest is reloaded (swap-ins), and only the tokens after the hit are computed;
- preempt: two requests that outgrow the pool together under admission "usage": the newer is preempted, the older's
  growth evicts the newer's cached blocks into the tier, and the newer, readmitted once the older finishes, reloads
  them (swap-ins during its readmission).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dcpserve.engine.args import EngineArgs
from dcpserve.engine.config import EngineConfig
from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.core.host_tier import tier_layout, with_host_tier
from dcpserve.engine.sampling_params import SamplingParams
from tests.engine.llm_checks import hf_greedy

BLOCK_SIZE = 4
POOL_BLOCKS = 8  # logical blocks of the device pool
HOST_SLOTS = 64
PREFIX_TOKENS = 4  # max_tokens of the prefix phase's requests; the preempt phase's: preempt_tokens


def preempt_tokens(tpb: int) -> int:
    """Outputs of each preempt-phase request: 7 blocks with its prompt (fits the pool alone, not beside another)."""
    return 4 * tpb + 2


def prompts_for(tpb: int) -> dict[str, list[int]]:
    """The phases' prompts, in logical blocks of tpb tokens (module docstring)."""
    gen = torch.Generator().manual_seed(7)

    def fresh(n: int) -> list[int]:
        return torch.randint(5, 500, (n,), generator=gen).tolist()

    a, b = fresh(5 * tpb + 1), fresh(5 * tpb + 1)
    return {"A": a, "B": b, "A2": a[:5 * tpb] + fresh(3), "R1": fresh(2 * tpb + 1), "R2": fresh(2 * tpb + 1)}


def engine_args(model: str, tp: int, dcp: int, pcp: int, tier: bool) -> EngineArgs:
    """The phases' engine: the tier on (prefix caching on), or off with a cold cache (prefix caching off)."""
    return EngineArgs(model=model, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                      prefill_context_parallel_size=pcp, block_size=BLOCK_SIZE, max_num_seqs=2, device="cpu",
                      rank_transport="gloo", enable_prefix_caching=tier, admission="usage",
                      kv_host_tier="1MiB" if tier else None)  # resized by tier_config


def tier_config(config: EngineConfig) -> EngineConfig:
    """A device pool of POOL_BLOCKS blocks and a tier of HOST_SLOTS slots, in bytes of this layout's pages."""
    page = tier_layout(config).bytes_per_block
    cache = replace(config.cache, kv_cache_memory_bytes=POOL_BLOCKS * page)
    if cache.host_tier_bytes is not None:
        cache = replace(cache, host_tier_bytes=HOST_SLOTS * page)
    return with_host_tier(replace(config, cache=cache))


def run_together(engine: LLMEngine, requests: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    """Runs the requests together to the end; their generated tokens. Request ids are the engine's own (the ranks
    learn of a request's finish only with the next step, which the last request of an engine never sends)."""
    tokens: dict[str, list[int]] = {name: [] for name in requests}
    for name, (prompt, max_tokens) in requests.items():
        engine.add_request(prompt_token_ids=prompt, request_id=f"{id(engine)}-{name}",
                           sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id.split("-", 1)[1]] += delta.new_token_ids
    engine.step()  # tells the ranks of the last finishes: the next engine starts on an empty batch
    return tokens


def run_phases(engine: LLMEngine, tpb: int) -> dict[str, Any]:
    """The two phases (module docstring) on one engine: tokens, the tokens computed for each prefix-phase request,
    and the copy counters around each request."""
    prompts = prompts_for(tpb)
    result: dict[str, Any] = {"tokens": {}, "computed": {}, "blocks_in": {}, "host_hits": {}, "hits": {}}
    for name in ("A", "B", "A2"):
        before_tokens, before_in = engine.num_tokens_computed, engine.copies.blocks_in
        before_hits = engine.block_manager.num_host_hit_tokens
        before_all_hits = engine.block_manager.num_hit_tokens
        result["tokens"].update(run_together(engine, {name: (prompts[name], PREFIX_TOKENS)}))
        result["computed"][name] = engine.num_tokens_computed - before_tokens
        result["blocks_in"][name] = engine.copies.blocks_in - before_in
        result["host_hits"][name] = engine.block_manager.num_host_hit_tokens - before_hits
        result["hits"][name] = engine.block_manager.num_hit_tokens - before_all_hits
    before_in, before_preemptions = engine.copies.blocks_in, engine.scheduler.num_preemptions
    result["tokens"].update(run_together(engine, {name: (prompts[name], preempt_tokens(tpb)) for name in ("R1", "R2")}))
    result["blocks_in"]["preempt"] = engine.copies.blocks_in - before_in
    result["preemptions"] = engine.scheduler.num_preemptions - before_preemptions
    stats = engine.stats()
    result["host_tier"] = stats.host_tier
    return result


def check(tier: dict[str, Any], off: dict[str, Any], hf: dict[tuple[int, ...], list[int]], tpb: int) -> None:
    """The tier's run against the cold one and transformers, and the mechanism of each phase."""
    prompts = prompts_for(tpb)
    assert tier["tokens"] == off["tokens"]
    for name, prompt in prompts.items():
        assert tier["tokens"][name] == hf[tuple(prompt)], name
    # prefix: A2 reloads A's blocks the tier kept, and computes only what follows its hit.
    assert tier["blocks_in"]["A"] == tier["blocks_in"]["B"] == 0
    assert tier["blocks_in"]["A2"] > 0 and tier["host_hits"]["A2"] == tier["blocks_in"]["A2"] * tpb
    # A2's head is still on the device, the rest of A's blocks come from the tier, and only what follows is computed.
    assert 0 < tier["host_hits"]["A2"] < tier["hits"]["A2"] == 5 * tpb
    assert tier["computed"]["A2"] == off["computed"]["A2"] - tier["hits"]["A2"]
    assert off["computed"]["A2"] == len(prompts["A2"]) + PREFIX_TOKENS - 1  # cold: the whole prompt
    # preempt: the newer request was preempted and reloaded its blocks from the tier when readmitted.
    assert tier["preemptions"] > 0 and off["preemptions"] > 0
    assert tier["blocks_in"]["preempt"] > 0
    stats = tier["host_tier"]
    assert stats.blocks_in > 0 and stats.blocks_out > 0 and stats.hit_tokens_host > 0
    assert stats.bytes_in > 0 and stats.evictions_to_host >= stats.blocks_out
    assert stats.reload_seconds_per_block > 0
    assert off["host_tier"] is None


def hf_tokens(model: Path, tpb: int) -> dict[tuple[int, ...], list[int]]:
    prompts = prompts_for(tpb)
    expected = hf_greedy(model, [prompts[n] for n in ("A", "B", "A2")], PREFIX_TOKENS)
    expected.update(hf_greedy(model, [prompts[n] for n in ("R1", "R2")], preempt_tokens(tpb)))
    return expected
