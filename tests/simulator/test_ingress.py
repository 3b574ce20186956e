"""The ingress' part of a simulated request (dcpserve/simulator/ingress.py): the need and prefix ask the queue gets,
in each pool's block size, and the trace's units as the clients send them."""

from __future__ import annotations

from dcpserve.deployments.messages import PoolNeed
from dcpserve.engine.config import SchedulerConfig
from dcpserve.simulator.ingress import request_need, sessions_of
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.tokens import trace_block_hashes
from dcpserve.simulator.trace import TraceRequest


def _shape(dcp: int, admission: str = "usage", prefix: bool = True) -> ReplicaShape:
    scheduler = SchedulerConfig(max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=1024,
                                admission=admission)  # type: ignore[arg-type]  # a Literal the test spells out
    return ReplicaShape(tp=1, dcp=dcp, num_blocks=1000, block_size=16, scheduler=scheduler,
                        enable_prefix_caching=prefix)


REQUEST = TraceRequest(None, input_length=1000, output_length=50, hash_ids=tuple(range(2)))


def test_one_pool_asks_its_blocks_and_the_prompts_full_blocks() -> None:
    need = request_need({"default": _shape(1)}, REQUEST, max_tokens=100, trace_block_tokens=512)
    assert need.need == -(-1000 // 16)  # usage admission: the prompt's blocks
    names = trace_block_hashes(REQUEST.hash_ids, 1000, 512, 16)
    assert need.block_names == {"default": names}
    assert need.ask is not None
    # The prefix ask stops before the prompt's last token (the one the engine computes for the first output).
    assert need.ask.hashes == tuple(names[:999 // 16]) and need.ask.tokens_per_block == 16


def test_full_admission_and_no_prefix_caching() -> None:
    need = request_need({"default": _shape(1, "full", prefix=False)}, REQUEST, max_tokens=100,
                        trace_block_tokens=512)
    assert need.need == -(-1100 // 16) and need.ask is None


def test_pools_each_get_their_own_block_size() -> None:
    need = request_need({"chat": _shape(1), "long": _shape(4)}, REQUEST, max_tokens=100, trace_block_tokens=512)
    assert need.ask is None and isinstance(need.need, dict)
    chat, long = need.need["chat"], need.need["long"]
    assert isinstance(chat, PoolNeed) and isinstance(long, PoolNeed)
    assert (chat.blocks, chat.total_blocks) == (-(-1000 // 16), -(-1100 // 16))
    assert (long.blocks, long.total_blocks) == (-(-1000 // 64), -(-1100 // 64))
    assert need.block_names["long"] == trace_block_hashes(REQUEST.hash_ids, 1000, 512, 64)
    assert long.ask is not None and long.ask.hashes == tuple(need.block_names["long"][:999 // 64])


def test_sessions_of_keeps_a_sessions_turns_together_in_trace_order() -> None:
    a0, b0, lone, a1 = (TraceRequest(0.0, 10, 1, (0,), "a"), TraceRequest(1.0, 10, 1, (1,), "b"),
                        TraceRequest(2.0, 10, 1, (2,)), TraceRequest(None, 20, 1, (0,), "a", delay_ms=5.0))
    assert sessions_of([a0, b0, lone, a1]) == [[a0, a1], [b0], [lone]]
