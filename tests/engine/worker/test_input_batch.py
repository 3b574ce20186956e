"""The incremental step protocol: a rank's persistent batch (dcpserve/engine/worker/input_batch.py), fed only what
changed each step, builds exactly the inputs a full rebuild from every request's whole block table builds, whatever the
sequence of adds, finishes, preemptions and aborts; and what a step sends does not grow with the context."""

from __future__ import annotations

import pickle
from typing import Literal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.request import Request
from dcpserve.engine.core.scheduler import Scheduler
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.worker.input_batch import InputBatch, StepInputs, rebuild_step_inputs

EOS = 0
MAX_MODEL_LEN = 96


def assert_same_inputs(got: StepInputs, want: StepInputs) -> None:
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.positions, want.positions)
    assert got.sample_rows == want.sample_rows
    a, b = got.metadata, want.metadata
    assert a.num_decode_tokens == b.num_decode_tokens
    assert a.prefill_max_query_len == b.prefill_max_query_len
    assert a.all_slots_owned == b.all_slots_owned and a.finite_tail == b.finite_tail
    for name in ("slot_mapping", "decode_block_table", "decode_local_seq_lens", "prefill_block_table",
                 "prefill_query_start_loc", "prefill_local_context_lens"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


# One action per step: (kind, request index / token choice).
actions = st.lists(
    st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort", "eos"]), st.integers(0, 1000)),
    min_size=1, max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=actions, dcp=st.sampled_from([1, 2, 4]), admission=st.sampled_from(["full", "usage"]),
       block_size=st.sampled_from([2, 4]))
def test_incremental_batch_equals_a_full_rebuild(actions: list[tuple[str, int]], dcp: int,
                                                 admission: Literal["full", "usage"],
                                                 block_size: int) -> None:
    # A pool small enough that "usage" preempts, a budget small enough that prompts are cut into chunks.
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16, max_num_seqs=6,
                             admission=admission, kv_headroom=0.0)
    scheduler = Scheduler(config, BlockManager(12, block_size, dcp), frozenset({EOS}))
    tokens_per_block = block_size * dcp
    batches = [InputBatch(6, -(-MAX_MODEL_LEN // tokens_per_block), block_size, dcp, rank, torch.device("cpu"))
               for rank in range(dcp)]
    added = 0
    for kind, value in actions + [("step", 0)] * 40:
        if kind == "add":
            prompt = [1 + (value + i) % 50 for i in range(1 + value % 30)]
            max_tokens = 1 + value % 20
            request = Request(f"r{added}", prompt, SamplingParams(max_tokens=max_tokens, seed=value))
            added += 1
            try:
                scheduler.add_request(request)
            except ValueError:
                pass  # never fits this pool: refused before it reaches the ranks
            continue
        if kind == "abort" and scheduler.requests:
            ids = sorted(scheduler.requests)
            scheduler.abort_request(ids[value % len(ids)])
            continue
        output = scheduler.schedule()
        tables = {e.request_id: list(scheduler.requests[e.request_id].block_ids) for e in output.scheduled}
        for rank, batch in enumerate(batches):
            got = batch.prepare(output)
            assert_same_inputs(got, rebuild_step_inputs(output.scheduled, tables, block_size, dcp, rank))
            assert set(batch.requests) == {r.request_id for r in scheduler.running}
        token = EOS if kind == "eos" else 1 + value % 50
        scheduler.update(output, {e.request_id: token for e in output.scheduled if e.sample})


def test_a_decode_step_sends_the_same_bytes_at_any_context_length() -> None:
    """After a request's first step, its entries carry one token and the blocks allocated since, not its prompt or
    block table: a decode step of 4 sequences pickles to about the same size at 64 and at 4,000
    tokens of context."""
    sizes = {}
    for context in (64, 4000):
        config = SchedulerConfig(max_model_len=8192, max_num_batched_tokens=16384, max_num_seqs=8)
        scheduler = Scheduler(config, BlockManager(4096, 4, 1), frozenset({EOS}))
        for i in range(4):
            scheduler.add_request(Request(f"r{i}", [5] * context, SamplingParams(max_tokens=8)))
        first = scheduler.schedule()
        assert all(e.is_new and len(e.new_block_ids) == context // 4 for e in first.scheduled)
        scheduler.update(first, {e.request_id: 7 for e in first.scheduled})
        decode = scheduler.schedule()
        assert all(not e.is_new and e.token_ids == [7] and len(e.new_block_ids) == 1
                   for e in decode.scheduled)
        sizes[context] = len(pickle.dumps(decode))
        # The entries pickle by position (ScheduledRequest.__reduce__): every field comes back, the first step's too.
        assert pickle.loads(pickle.dumps(first)) == first and pickle.loads(pickle.dumps(decode)) == decode
    # Integers pickle in 1, 2 or 4 bytes by size, so the two differ by a few bytes either way, not by the context.
    assert abs(sizes[4000] - sizes[64]) < 64, sizes


def test_a_step_for_a_request_the_rank_never_learned_is_an_error() -> None:
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64), BlockManager(16, 4, 1),
                          frozenset({EOS}))
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4)))
    first = scheduler.schedule()
    scheduler.update(first, {"a": 7})
    second = scheduler.schedule()
    batch = InputBatch(4, 16, 4, 1, 0, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="never learned it"):
        batch.prepare(second)  # the first step never reached this rank
