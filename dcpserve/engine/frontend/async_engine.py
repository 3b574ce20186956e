"""asyncio front of the engine core, for the serving layer.

The core (dcpserve.engine.core.core.EngineCore, a thread of its own) alone owns the LLMEngine: its scheduler, block
manager, prefix cache and executor. This front, on the replica's event loop, only sends it typed inputs (add, abort,
queries) and takes its output batches: token deltas go to one asyncio.Queue per request, admissions and query replies to
the futures awaiting them, and each batch's snapshot becomes what kv_ledger() and stats() return. A stream whose
consumer goes away (client disconnect, cancellation) aborts its request, which frees its KV at the core's next turn.

A batch's deltas are split once, by sink (dcpserve.engine.protocol.DeltaSink): a request submitted with submit_to()
shares its sink with the other requests bound for the same reader, and the sink gets the step's deltas of all of them
in one call; submit() and generate() give a request a sink of its own, a queue read as its stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from dcpserve.engine.config import EngineConfig
from dcpserve.engine.core.block_manager import admission_blocks
from dcpserve.engine.core.core import (
    AbortRequest,
    AddRequest,
    Admission,
    AdmissionNeedQuery,
    CallQuery,
    CoreOutputs,
    CoreSnapshot,
    EngineCore,
    PrefixReportQuery,
    Query,
    Shutdown,
    query_error,
    snapshot,
)
from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.core.prefix_cache import PrefixReport
from dcpserve.engine.core.request import Request
from dcpserve.engine.protocol import DeltaSink, EngineDeadError, EngineStats, KvLedger, RequestDelta
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.tokenizer import Tokenizer

# How long shutdown() waits for the core to finish its step and stop before it stops the executor under it.
CORE_STOP_TIMEOUT_S = 30.0


class _RequestStream:
    """The sink of one request submitted with submit(): its deltas queued for the stream that reads them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()

    def deliver(self, deltas: Sequence[RequestDelta]) -> None:
        for delta in deltas:
            self.queue.put_nowait(delta)

    def fail(self, request_id: str, error: BaseException) -> None:
        self.queue.put_nowait(error)


class AsyncEngine:
    """The native backend of the engine protocol (dcpserve.engine.protocol.EngineClient): streams token deltas per
    request from the engine core."""

    backend = "native"

    def __init__(self, config: EngineConfig, on_step: Callable[[EngineStats], None] | None = None) -> None:
        """on_step(stats), when given, runs on the event loop after every engine step (the serving layer's metrics)."""
        self.engine = LLMEngine(config)  # the core's from start(): read here only its immutable config and tokenizer
        self.on_step = on_step
        self.config = config
        self._core: EngineCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[str, DeltaSink] = {}  # request id -> where its deltas go, until it finished or aborted
        self._admitting: dict[str, asyncio.Future[Admission]] = {}
        self._replies: dict[int, asyncio.Future[object]] = {}
        self._ids = itertools.count()
        self._query_ids = itertools.count()
        self._snapshot: CoreSnapshot = snapshot(self.engine)  # the core has not started: this thread may read it
        self.dead_error: BaseException | None = None

    # ---- public API ------------------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def kv_capacity_tokens(self) -> int:
        return self._snapshot.ledger.capacity_blocks * self._snapshot.ledger.tokens_per_block

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises RequestRejected if a request of this size could never be served here (config only)."""
        self.engine.scheduler.check_fits(num_prompt_tokens, max_tokens)

    async def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestDelta]:
        """Yields a RequestDelta per generated token until the request finishes. Invalid or never-fitting
        requests raise before anything is queued."""
        stream = await self.submit(sampling_params, prompt_token_ids, request_id, prompt=prompt)
        async for delta in stream:
            yield delta

    async def submit(
        self,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        check_kv: bool = False,
        prompt: str | None = None,
        prompt_hashes: Sequence[int] = (),
    ) -> AsyncGenerator[RequestDelta]:
        """Hands a request to the core and returns its stream of deltas once the core took it. With check_kv the
        core first checks its admission need against the ledger, in input order, and it raises KvFull when it does
        not fit now. A caller that never iterates the stream must abort(request_id). Invalid or never-fitting
        requests raise before anything is queued."""
        sink = _RequestStream()
        request_id = await self._add(sink, sampling_params, prompt_token_ids, request_id, check_kv, prompt,
                                     prompt_hashes)
        return self._stream(request_id, sink.queue)

    async def submit_to(self, sink: DeltaSink, sampling_params: SamplingParams, prompt_token_ids: list[int],
                        request_id: str, check_kv: bool = False, *, prompt_hashes: Sequence[int] = ()) -> None:
        """submit(), the request's deltas delivered to `sink` with those of its other requests of the same step
        (dcpserve.engine.protocol.EngineClient.submit_to)."""
        await self._add(sink, sampling_params, prompt_token_ids, request_id, check_kv, None, prompt_hashes)

    async def _add(self, sink: DeltaSink, sampling_params: SamplingParams | None, prompt_token_ids: list[int] | None,
                   request_id: str | None, check_kv: bool, prompt: str | None, prompt_hashes: Sequence[int]) -> str:
        """Hands a request to the core, its deltas bound for `sink`, and returns its id once the core took it."""
        self._check_alive()
        params = sampling_params or SamplingParams()
        prompt_token_ids = self.engine.prompt_token_ids(prompt, prompt_token_ids, params)
        self.check_request(len(prompt_token_ids), params.max_tokens)
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        if request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, prompt_token_ids, params, prompt=prompt)
        if prompt_hashes:
            tokens_per_block = self._snapshot.ledger.tokens_per_block
            if len(prompt_hashes) > len(prompt_token_ids) // tokens_per_block:
                raise ValueError(f"{len(prompt_hashes)} prompt block hashes for a prompt of {len(prompt_token_ids)} "
                                 f"tokens ({len(prompt_token_ids) // tokens_per_block} full blocks of "
                                 f"{tokens_per_block}): they were computed for another engine")
            request.block_hashes = list(prompt_hashes)
        core = self._ensure_core()
        admitted: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._sinks[request_id] = sink
        self._admitting[request_id] = admitted
        core.send(AddRequest(request, check_kv))
        try:
            admission = await admitted
        except BaseException:
            self.abort(request_id)  # cancelled while the core decided: whatever it decided, nobody will listen
            raise
        finally:
            self._admitting.pop(request_id, None)
        if admission.error is not None:
            self._sinks.pop(request_id, None)
            raise admission.error
        return request_id

    async def _stream(self, request_id: str,
                      queue: asyncio.Queue[RequestDelta | BaseException]) -> AsyncGenerator[RequestDelta]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether a request with this id is queued or running here (its stream not yet ended)."""
        return request_id in self._sinks

    def admission_blocks(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The blocks a request asks admission for under this engine's policy (block_manager.admission_blocks)."""
        return admission_blocks(self.config.scheduler.admission, num_prompt_tokens, max_tokens,
                                self._snapshot.ledger.tokens_per_block)

    async def admission_need(self, prompt_token_ids: list[int], max_tokens: int) -> int:
        """The blocks this request would add here now (admission_blocks less the cached prefix blocks held here)."""
        need = await self._query(lambda query_id: AdmissionNeedQuery(query_id, list(prompt_token_ids), max_tokens))
        assert isinstance(need, int)
        return need

    async def prefix_report(self, reader_epoch: str | None, reader_version: int) -> PrefixReport | None:
        report = await self._query(lambda query_id: PrefixReportQuery(query_id, reader_epoch, reader_version))
        assert report is None or isinstance(report, PrefixReport)
        return report

    async def call_in_core(self, fn: Callable[[LLMEngine], object]) -> object:
        """fn(engine) on the core's thread between two steps, and its result: for tests and debugging tools, the
        one way to look at or change the engine's state from outside."""
        return await self._query(lambda query_id: CallQuery(query_id, fn))

    def kv_ledger(self) -> KvLedger:
        """The replica's KV ledger as of the core's last output batch (every request it has taken, less those it
        has finished or aborted)."""
        return self._snapshot.ledger

    def snapshot(self) -> CoreSnapshot:
        """The core's last snapshot: ledger, stats and request states at one instant."""
        return self._snapshot

    def abort(self, request_id: str) -> None:
        """Stops a request (if still running) and frees its KV at the core's next turn. Idempotent."""
        self._sinks.pop(request_id, None)
        if self._core is not None and self.dead_error is None:
            self._core.send(AbortRequest(request_id))

    def stats(self) -> EngineStats:
        """The engine's stats as of the core's last output batch, plus requests sent to the core not yet taken."""
        return dataclasses.replace(self._snapshot.stats, num_pending=len(self._admitting),
                                   healthy=self.dead_error is None)

    async def check_health(self) -> None:
        """Raises if the core failed or a TP rank does not answer (the rank ping runs off the event loop; the
        executor's check_health only pings the ranks and reads no state of the core's)."""
        self._check_alive()
        await asyncio.to_thread(self.engine.executor.check_health)

    async def shutdown(self) -> None:
        core = self._core
        if core is not None and core.is_alive():
            core.send(Shutdown())
            await asyncio.to_thread(core.join, CORE_STOP_TIMEOUT_S)
        # The executor last: with the core stopped (or stuck past the timeout in a step on a dead rank, which
        # stopping the ranks ends) nothing else uses it.
        await asyncio.to_thread(self.engine.shutdown)

    # ---- the core --------------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        if self._core is not None and self._core.started and not self._core.is_alive():
            raise EngineDeadError("the engine core's thread has ended")

    def _ensure_core(self) -> EngineCore:
        if self._core is None:
            loop = asyncio.get_running_loop()
            self._loop = loop

            def deliver(outputs: CoreOutputs) -> None:  # on the core's thread
                loop.call_soon_threadsafe(self._on_outputs, outputs)

            self._core = EngineCore(self.engine, deliver)
            self._core.start()
        return self._core

    async def _query(self, make: Callable[[int], Query]) -> object:
        """Sends the query make(query_id) to the core and returns its reply (raises what answering it raised)."""
        self._check_alive()
        core = self._ensure_core()
        query_id = next(self._query_ids)
        reply: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._replies[query_id] = reply
        core.send(make(query_id))
        try:
            value = await reply
        finally:
            self._replies.pop(query_id, None)
        error = query_error(value)
        if error is not None:
            raise error
        return value

    def _on_outputs(self, outputs: CoreOutputs) -> None:
        """One batch from the core, on the event loop: the snapshot, then answers, then deltas."""
        self._snapshot = outputs.snapshot
        for admission in outputs.admissions:
            future = self._admitting.get(admission.request_id)
            if future is not None and not future.done():
                future.set_result(admission)
            elif admission.error is None:
                self.abort(admission.request_id)  # its submitter was cancelled meanwhile
        for query_id, value in outputs.replies:
            reply = self._replies.get(query_id)
            if reply is not None and not reply.done():
                reply.set_result(value)
        by_sink: dict[int, tuple[DeltaSink, list[RequestDelta]]] = {}
        for delta in outputs.deltas:  # the one split of a step's output: by the sink each request's deltas go to
            sink = self._sinks.get(delta.request_id)
            if sink is None:
                if not delta.finished:
                    self.abort(delta.request_id)  # nobody is listening any more
                continue
            if delta.finished:
                del self._sinks[delta.request_id]
            by_sink.setdefault(id(sink), (sink, []))[1].append(delta)
        for sink, deltas in by_sink.values():
            sink.deliver(deltas)
        if outputs.stepped and self.on_step is not None:
            self.on_step(self.stats())
        if outputs.error is not None:
            self._fail(outputs.error)

    def _fail(self, err: BaseException) -> None:
        """The core died: every request in flight, every pending add and query ends with the error, at once."""
        self.dead_error = err
        dead = EngineDeadError(f"the engine failed: {err!r}")
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink.fail(request_id, dead)
        pending: list[asyncio.Future[Any]] = [*self._admitting.values(), *self._replies.values()]
        for future in pending:
            if not future.done():
                future.set_exception(dead)
