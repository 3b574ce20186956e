"""The replica's measured prefill price (dcpserve/deployments/replica/prefill_rate.py) and the step counts it reads
(SchedulerOutput.num_prompt_tokens, EngineStats.last_step_prompt_tokens)."""

from __future__ import annotations

import pytest

from dcpserve.deployments.replica.prefill_rate import DECAY, PrefillRate
from dcpserve.engine.core.step import ScheduledRequest, SchedulerOutput


def test_decode_steps_do_not_move_the_price_and_it_is_zero_until_a_prompt_step() -> None:
    rate = PrefillRate()
    rate.observe(0.004, 0, 64)  # 64 decodes
    assert rate.seconds_per_token == 0.0
    rate.observe(0.5, 8000, 8064)  # a chunk and the decodes riding with it
    assert rate.seconds_per_token == pytest.approx(0.5 / 8064)
    rate.observe(0.004, 0, 64)
    rate.observe(0.0, 100, 100)  # no time measured
    assert rate.seconds_per_token == pytest.approx(0.5 / 8064)


def test_the_price_is_weighted_by_tokens_and_follows_the_recent_steps() -> None:
    rate = PrefillRate()
    rate.observe(1.0, 8000, 8000)  # a long chunk: 125 us a token
    rate.observe(0.01, 10, 20)  # a short prompt's step: 500 us a token, but 20 tokens
    expected = (DECAY * 1.0 + 0.01) / (DECAY * 8000 + 20)
    assert rate.seconds_per_token == pytest.approx(expected)
    assert rate.seconds_per_token < 2 * 1.0 / 8000  # the long chunk dominates
    for _ in range(200):  # the replica now serves short contexts: the old steps fade
        rate.observe(0.2, 8000, 8000)
    assert rate.seconds_per_token == pytest.approx(0.2 / 8000, rel=1e-6)


def _entry(rid: str, tokens: int, outputs: int) -> ScheduledRequest:
    return ScheduledRequest(rid, list(range(tokens)), 0, [], True, outputs)


def test_a_steps_prompt_tokens_are_every_row_but_the_decodes() -> None:
    output = SchedulerOutput([_entry("decode", 1, 5), _entry("chunk", 96, 0), _entry("recompute", 40, 3),
                              _entry("one-token prompt", 1, 0)])
    assert (output.num_tokens, output.num_prompt_tokens) == (138, 137)
    assert SchedulerOutput([_entry("decode", 1, 1)]).num_prompt_tokens == 0


def test_the_native_engine_reports_each_steps_prompt_tokens_and_the_replicas_price_reads_them(tmp_path) -> None:
    from dcpserve.cluster.tiny_model import write_tiny_model
    from dcpserve.engine.args import EngineArgs
    from dcpserve.engine.core.engine import LLMEngine
    from dcpserve.engine.sampling_params import SamplingParams

    tiny = write_tiny_model(tmp_path / "tiny", seed=0)
    engine = LLMEngine(EngineArgs(model=str(tiny), max_num_batched_tokens=64).create_engine_config())
    rate = PrefillRate()
    seen: list[tuple[int, int]] = []
    try:
        engine.add_request(sampling_params=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                           prompt_token_ids=[5 + i % 400 for i in range(100)], request_id="r")
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.stats()
            seen.append((stats.last_step_tokens, stats.last_step_prompt_tokens))
            rate.observe(stats.last_step_seconds, stats.last_step_prompt_tokens, stats.last_step_tokens)
            if stats.last_step_prompt_tokens == 0:
                assert rate.seconds_per_token > 0  # the price stays what the two chunks measured
    finally:
        engine.shutdown()
    assert seen == [(64, 64), (36, 36), (1, 0), (1, 0)]  # two chunks (the second samples), then two decodes
