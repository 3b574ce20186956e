"""The ingress' part of a simulated request (dcpserve/simulator/run.py, step 2), and what its clients send.

- `sessions_of`: the trace's units as the clients send them (a session's turns together, every other request alone).
- `request_need`: the request's admission blocks in each pool's block size, with the one function every part of the
  app counts them with (dcpserve.engine.core.block_manager.admission_blocks), and its prompt's block names for prefix
  routing (the ingress' request_need and prefix asks).
- `session_level`: the service level a request is admitted with (its session key, where the queue takes one).
- `SimAdmission`: the in-process AdmissionQueue as the admission loop's port (dispatch/admit.py's `AdmissionPort`).
- `served_latencies`: what the ingress hands the queue with a request's release.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import Acquire, AcquireReply, Need, PoolNeed, PrefixAsk, ServiceLevel
from dcpserve.engine.core.block_manager import admission_blocks
from dcpserve.engine.core.prefix_cache import max_hit_blocks
from dcpserve.simulator.metrics import RequestRecord, mean_itl_s
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.tokens import trace_block_hashes
from dcpserve.simulator.trace import TraceRequest


@dataclass(frozen=True)
class RequestNeed:
    """What the ingress asks the queue for one request: its need (blocks, or each pool's with layout pools), its
    prefix ask (None with pools: each pool's is in its PoolNeed), and its prompt's block names in each pool's block
    size (the replica's prefix cache keys)."""

    need: Need
    ask: PrefixAsk | None
    block_names: Mapping[str, list[int]]  # pool name -> the prompt's block names in that pool's block size


def request_need(shapes: Mapping[str, ReplicaShape], trace_request: TraceRequest, max_tokens: int,
                 trace_block_tokens: int) -> RequestNeed:
    """The request's need and prefix ask for the queue, in each pool's block size (one pool: the plain need)."""
    per_pool: dict[str, PoolNeed] = {}
    names_by_pool: dict[str, list[int]] = {}
    for name, shape in shapes.items():
        tokens_per_block = shape.tokens_per_block
        blocks = admission_blocks(shape.scheduler.admission, trace_request.input_length, max_tokens,
                                  tokens_per_block)
        names = trace_block_hashes(trace_request.hash_ids, trace_request.input_length, trace_block_tokens,
                                   tokens_per_block)
        pool_ask = None
        if shape.enable_prefix_caching:
            hit_limit = max_hit_blocks(trace_request.input_length, tokens_per_block)
            pool_ask = PrefixAsk(tuple(names[:hit_limit]), tokens_per_block, b"", trace_request.input_length)
        total = -(-(trace_request.input_length + max_tokens) // tokens_per_block)
        per_pool[name] = PoolNeed(blocks, pool_ask, total)
        names_by_pool[name] = names
    if len(per_pool) == 1:
        [only] = per_pool.values()
        return RequestNeed(only.blocks, only.ask, names_by_pool)
    return RequestNeed(per_pool, None, names_by_pool)


def sessions_of(trace: Sequence[TraceRequest]) -> list[list[TraceRequest]]:
    """The trace's units in order: a session's turns together (in trace order), every other request alone."""
    units: list[list[TraceRequest]] = []
    by_session: dict[str, list[TraceRequest]] = {}
    for request in trace:
        if request.session_id is None:
            units.append([request])
        elif request.session_id in by_session:
            by_session[request.session_id].append(request)
        else:
            turns = by_session[request.session_id] = [request]
            units.append(turns)
    return units


# The queue's session key (ServiceLevel.session: the ingress' prompt_cache_key or X-Session-Id), where this version of
# the queue has one: a trace's session_id is the key its client would send.
_QUEUE_TAKES_SESSIONS = "session" in {f.name for f in dataclasses.fields(ServiceLevel)}


def session_level(session_id: str | None) -> ServiceLevel:
    """The service level a request of that session is admitted with: the default one, keyed by its session."""
    if session_id is None or not _QUEUE_TAKES_SESSIONS:
        return ServiceLevel()
    return ServiceLevel(session=session_id)


def served_latencies(record: RequestRecord) -> tuple[float | None, float | None]:
    """What the ingress hands the queue with a request's release: its TTFT from arrival (None without a token) and
    its mean inter-token latency (None with fewer than two tokens: a single token has no gap to measure)."""
    if record.first_token_at is None:
        return None, None
    return record.first_token_at - record.arrival, mean_itl_s(record) if record.num_output_tokens > 1 else None


class SimAdmission:
    """The in-process AdmissionQueue as the admission loop's port (KvAdmission's calls, without the network)."""

    def __init__(self, queue: AdmissionQueue, retry_after_s: int) -> None:
        self.queue = queue
        self.retry_after_s = retry_after_s

    async def acquire(self, request: Acquire) -> AcquireReply:
        return await self.queue.acquire_reply(request, self.retry_after_s)

    async def refused(self, ticket: str, replica_id: str, free_blocks: int) -> None:
        self.queue.refused(ticket, replica_id, free_blocks)

    async def unreachable(self, ticket: str, replica_id: str) -> None:
        self.queue.unreachable(ticket, replica_id)
