"""The scheduler with hand-made runner outputs: budgets, admission, preemption, finishing, no leaks."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.request import FinishReason, Request, RequestRejected, RequestStatus
from dcpserve.engine.core.scheduler import Scheduler
from dcpserve.engine.core.step import SchedulerOutput
from dcpserve.engine.sampling_params import SamplingParams

EOS = 0


def make(num_blocks: int = 16, block_size: int = 4, dcp: int = 1, **config: Any) -> Scheduler:
    settings = {"max_model_len": 4096, "max_num_batched_tokens": 64, "admission": "full", **config}
    return Scheduler(SchedulerConfig(**settings), BlockManager(num_blocks, block_size, dcp), frozenset({EOS}))


def req(name: str, prompt: int, max_tokens: int = 4, **params: Any) -> Request:
    return Request(name, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, **params))


def run_step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """One step with a fake runner that samples `token` for every row that samples."""
    output = scheduler.schedule()
    assert output.num_tokens == sum(len(s.token_ids) for s in output.scheduled)  # the budget the step used
    scheduler.update(output, {s.request_id: token for s in output.scheduled if s.sample})
    check_invariants(scheduler)
    return output


def check_invariants(scheduler: Scheduler) -> None:
    usage = scheduler.usage()
    assert usage.used <= usage.reserved <= usage.total  # never over-committed
    held = [b for r in scheduler.running for b in r.block_ids]
    assert len(held) == len(set(held)) == usage.used  # no double allocation, no leak
    for r in scheduler.running:
        assert r.num_computed_tokens <= r.num_tokens
        assert len(r.block_ids) * scheduler.block_manager.tokens_per_block >= r.num_computed_tokens
    for r in scheduler.waiting:
        assert r.block_ids == [] and r.status == RequestStatus.WAITING


def test_chunked_prefill_then_decode_follows_the_invariant() -> None:
    scheduler = make(max_num_batched_tokens=8)
    scheduler.add_request(req("a", prompt=20, max_tokens=3))
    chunks = [run_step(scheduler).scheduled[0] for _ in range(3)]
    assert [(c.start_position, len(c.token_ids), c.sample) for c in chunks] == [
        (0, 8, False), (8, 8, False), (16, 4, True)]
    decode = run_step(scheduler).scheduled[0]
    assert decode.is_decode and decode.start_position == 20 and decode.token_ids == [7]
    run_step(scheduler)
    assert not scheduler.has_unfinished  # 3 tokens: length
    assert scheduler.usage().used == 0


def test_decodes_come_first_and_budget_is_shared() -> None:
    scheduler = make(max_num_batched_tokens=10)
    scheduler.add_request(req("a", prompt=3, max_tokens=10))
    run_step(scheduler)  # a prefilled
    scheduler.add_request(req("b", prompt=30, max_tokens=2))
    output = run_step(scheduler)
    assert [s.request_id for s in output.scheduled] == ["a", "b"]
    assert output.scheduled[0].is_decode and len(output.scheduled[1].token_ids) == 9


def test_full_reservation_never_over_commits_and_queues_fifo() -> None:
    scheduler = make(num_blocks=10, block_size=4)  # 40 tokens
    scheduler.add_request(req("a", prompt=12, max_tokens=12))  # 6 blocks reserved
    scheduler.add_request(req("big", prompt=16, max_tokens=8))  # 6 blocks: must wait
    scheduler.add_request(req("small", prompt=2, max_tokens=2))  # 1 block: fits, but must not jump the queue
    output = run_step(scheduler)
    assert [s.request_id for s in output.scheduled] == ["a"]
    assert scheduler.usage().reserved == 6
    while "a" in scheduler.requests:
        run_step(scheduler)
    output = run_step(scheduler)
    assert {s.request_id for s in output.scheduled} == {"big", "small"}


def test_never_fits_is_rejected_at_once() -> None:
    scheduler = make(num_blocks=4, block_size=4, max_model_len=100)  # 16 tokens of KV
    with pytest.raises(RequestRejected, match=r"exceeds max_model_len=100"):
        scheduler.add_request(req("x", prompt=90, max_tokens=20))
    with pytest.raises(RequestRejected, match=r"needs 5 KV blocks of 4 tokens but the replica holds 4 \(16 tokens\)"):
        scheduler.add_request(req("y", prompt=10, max_tokens=10))
    with pytest.raises(RequestRejected, match="prompt is empty"):
        scheduler.add_request(Request("z", [], SamplingParams()))
    assert not scheduler.has_unfinished


def test_usage_admission_preempts_newest_and_recomputes() -> None:
    scheduler = make(num_blocks=6, block_size=2, admission="usage")  # 12 tokens
    scheduler.add_request(req("old", prompt=4, max_tokens=6))
    scheduler.add_request(req("new", prompt=4, max_tokens=6))
    run_step(scheduler)  # both prefilled: 4 blocks used
    preempted = []
    for _ in range(12):
        output = run_step(scheduler)
        preempted += output.preempted_request_ids
        if not scheduler.has_unfinished:
            break
    assert preempted and preempted[0] == "new"
    assert not scheduler.has_unfinished
    assert scheduler.usage().used == 0 and scheduler.usage().reserved == 0


def test_finish_on_eos_stop_token_and_ignore_eos() -> None:
    scheduler = make()
    scheduler.add_request(req("eos", prompt=2, max_tokens=10))
    scheduler.add_request(req("stop", prompt=2, max_tokens=10, stop_token_ids=(9,)))
    scheduler.add_request(req("ignore", prompt=2, max_tokens=2, ignore_eos=True))
    output = scheduler.schedule()
    updates = scheduler.update(output, {"eos": EOS, "stop": 9, "ignore": EOS})
    assert {u.request.request_id: u.request.finish_reason for u in updates if u.finished} == {
        "eos": FinishReason.STOP, "stop": FinishReason.STOP}
    run_step(scheduler, token=EOS)
    assert not scheduler.has_unfinished  # "ignore" ran to max_tokens


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    scheduler = make(num_blocks=4, block_size=4)
    scheduler.add_request(req("run", prompt=8, max_tokens=4))
    scheduler.add_request(req("wait", prompt=8, max_tokens=8))
    output = scheduler.schedule()
    assert scheduler.abort_request("run")  # aborted while its step is in flight
    scheduler.update(output, {"run": 5})
    assert scheduler.abort_request("wait")
    assert not scheduler.abort_request("wait")
    assert scheduler.usage().used == 0 and scheduler.usage().reserved == 0
    assert scheduler.schedule().finished_request_ids == ["run", "wait"]


@pytest.mark.parametrize("admission", ["full", "usage"])
def test_random_workload_never_leaks_over_commits_or_loses_a_request(admission: str) -> None:
    """Random adds, aborts and EOS over a small pool: never over-committed, and every request ends exactly once,
    with all its tokens: an EOS last, or max_tokens of them, or (usage) as many as the whole pool holds."""
    rng = random.Random(admission)
    scheduler = make(num_blocks=12, block_size=2, dcp=2, admission=admission, max_num_batched_tokens=16,
                     max_num_seqs=5, max_model_len=64)
    names = iter(range(10**6))
    added: dict[str, Request] = {}
    aborted: set[str] = set()
    ended: list[str] = []

    def step() -> None:
        output = run_step(scheduler, token=rng.choice([EOS, 3, 4, 5, 6, 7, 8]))
        ended.extend(output.finished_request_ids)

    for _ in range(400):
        if rng.random() < 0.3:
            # Under "full" prompt + max_tokens must fit the 48-token pool; under "usage" only the prompt must.
            prompt = rng.randint(1, 20)
            max_tokens = rng.randint(1, 48 - prompt if admission == "full" else 44)
            request = req(f"r{next(names)}", prompt=prompt, max_tokens=max_tokens)
            scheduler.add_request(request)
            added[request.request_id] = request
        if rng.random() < 0.03 and scheduler.requests:
            name = rng.choice(list(scheduler.requests))
            assert scheduler.abort_request(name)
            aborted.add(name)
        step()
    for _ in range(2000):  # drain: everything left runs to its end
        if not scheduler.has_unfinished and not scheduler.has_pending_finishes:
            break
        step()
    assert not scheduler.has_unfinished
    assert sorted(ended) == sorted(added)  # each request ended exactly once
    pool_tokens = scheduler.block_manager.capacity_tokens
    for name, request in added.items():
        if name in aborted:
            assert request.finish_reason == FinishReason.ABORT
            continue
        outputs = request.output_token_ids
        if request.finish_reason == FinishReason.STOP:
            assert outputs[-1] == EOS and EOS not in outputs[:-1]
        else:
            assert request.finish_reason == FinishReason.LENGTH and EOS not in outputs
            assert len(outputs) == request.sampling_params.max_tokens or (
                admission == "usage" and request.num_tokens + 1 > pool_tokens), (name, len(outputs))
    if admission == "usage":
        assert scheduler.num_preemptions > 0  # the workload did exercise preemption
    else:
        assert scheduler.num_preemptions == 0
    assert scheduler.usage().used == 0 and scheduler.usage().reserved == 0


def test_preemption_keeps_every_token_a_deterministic_runner_would_give() -> None:
    """With a runner whose token depends only on (request, output index), as seeded and greedy sampling do, a run
    that preempts gives each request exactly the tokens of a run with room for all."""

    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        scheduler = make(num_blocks=num_blocks, block_size=2, admission="usage", kv_headroom=0.0,
                         max_num_batched_tokens=32)
        requests = [req(f"r{i}", prompt=3 + i, max_tokens=12 + 3 * i) for i in range(5)]
        for request in requests:
            scheduler.add_request(request)
        for _ in range(500):
            if not scheduler.has_unfinished:
                break
            output = scheduler.schedule()
            sampled = {}
            for s in output.scheduled:
                if s.sample:
                    sampled[s.request_id] = 1 + (int(s.request_id[1:]) * 7 + s.num_output_tokens * 3) % 13
            scheduler.update(output, sampled)
            check_invariants(scheduler)
        assert not scheduler.has_unfinished
        return {r.request_id: r.output_token_ids for r in requests}, scheduler.num_preemptions

    roomy, none = run(num_blocks=64)
    tight, preemptions = run(num_blocks=16)  # 32 tokens: the longest request (7 + 24) alone fits
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_usage_admission_leaves_headroom_for_running_sequences() -> None:
    scheduler = make(num_blocks=20, block_size=2, admission="usage", kv_headroom=0.25)  # headroom: 5 blocks
    scheduler.add_request(req("a", prompt=10, max_tokens=50))  # 5 blocks; nothing runs yet: no headroom
    scheduler.add_request(req("b", prompt=10, max_tokens=50))  # 5 more: 10 free - 5 headroom = 5: fits
    scheduler.add_request(req("c", prompt=12, max_tokens=50))  # 6 more: 10 free - 5 headroom = 5: waits
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert scheduler.headroom_blocks() == 5
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_usage_never_fits_counts_the_prompt_and_a_request_ends_at_the_pool() -> None:
    scheduler = make(num_blocks=4, block_size=2, admission="usage")  # 8 tokens
    with pytest.raises(RequestRejected, match=r"the prompt \(9\) tokens needs 5 KV blocks"):
        scheduler.add_request(req("big", prompt=9, max_tokens=1))
    scheduler.add_request(req("long", prompt=3, max_tokens=100))  # fits to start; ends when the pool is full
    for _ in range(20):
        run_step(scheduler)
    assert not scheduler.has_unfinished
    full = make(num_blocks=4, block_size=2, admission="full")
    with pytest.raises(RequestRejected, match=r"prompt \(3 tokens\) \+ max_tokens \(100\) = 103 tokens needs 52"):
        full.add_request(req("long", prompt=3, max_tokens=100))


def test_the_ledger_counts_the_prompt_tokens_still_to_compute() -> None:
    """KvLedger.prefill_tokens: what a new request would queue behind. A prefill chunk takes its tokens off; a waiting
    request whose prefix is cached counts only the rest."""
    scheduler = Scheduler(SchedulerConfig(max_model_len=4096, max_num_batched_tokens=8, admission="full"),
                          BlockManager(32, 4, 1, enable_prefix_caching=True), frozenset({EOS}))
    scheduler.add_request(req("a", prompt=20, max_tokens=2))
    scheduler.add_request(Request("b", list(range(100, 106)), SamplingParams(max_tokens=2)))  # shares nothing with a
    assert scheduler.kv_ledger().prefill_tokens == 26
    run_step(scheduler)  # a: 8 of 20
    assert scheduler.kv_ledger().prefill_tokens == 18
    while scheduler.has_unfinished:
        run_step(scheduler)
    assert scheduler.kv_ledger().prefill_tokens == 0
    # a's 20 prompt tokens are cached now, five full blocks of 4: c, which starts with them, computes only 2
    scheduler.add_request(req("c", prompt=22, max_tokens=2))
    assert scheduler.kv_ledger().prefill_tokens == 2
