"""asyncio front of an LLMEngine, for the serving layer.

One background task owns the engine. Callers never touch it directly: generate() and abort() queue their
change, and the task applies queued changes between steps, then runs step() in a worker thread (a step may
block on the worker group, which must not stall the event loop). Token deltas go back through one
asyncio.Queue per request. A generate() whose consumer goes away (client disconnect, cancellation) aborts its
request, which frees its KV at the next step.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable

from engine.block_manager import admission_blocks
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.prefix_cache import PrefixReport
from engine.protocol import EngineDeadError, EngineStats, KvLedger, RequestDelta
from engine.request import Request
from engine.sampling_params import SamplingParams


# How long the loop waits before stepping again after a step that could schedule nothing (unless an add or abort
# wakes it first).
IDLE_RETRY_S = 0.1


class AsyncEngine:
    """The native backend of the engine protocol (engine.protocol.EngineClient): streams token deltas per request
    from a background engine loop."""

    backend = "native"

    def __init__(self, config: EngineConfig, on_step: Callable[[EngineStats], None] | None = None) -> None:
        """on_step(stats), when given, runs on the event loop after every engine step (the serving layer's metrics)."""
        self.engine = LLMEngine(config)
        self.on_step = on_step
        self.config = config
        self._queues: dict[str, asyncio.Queue[RequestDelta | BaseException]] = {}
        self._pending_adds: list[tuple[Request, str | None]] = []
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._stats: EngineStats = self.engine.stats()
        self.dead_error: BaseException | None = None

    # ---- public API ------------------------------------------------------------------------------------------

    @property
    def tokenizer(self):  # noqa: ANN201 - engine.tokenizer.Tokenizer | None
        return self.engine.tokenizer

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.kv_capacity_tokens

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises RequestRejected if a request of this size could never be served here."""
        self.engine.scheduler.check_fits(num_prompt_tokens, max_tokens)

    async def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Yields a RequestDelta per generated token until the request finishes. Invalid or never-fitting
        requests raise before anything is queued."""
        async for delta in self.submit(prompt, sampling_params, prompt_token_ids, request_id):
            yield delta

    def submit(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        check_kv: bool = False,
    ) -> AsyncIterator[RequestDelta]:
        """Queues a request now, synchronously, and returns its stream of deltas. With check_kv it first checks the
        KV ledger (pending requests included) and raises KvFull when the request's admission blocks do not fit, so
        two submits can never both take the same free blocks. A caller that never iterates the stream must
        abort(request_id). Invalid or never-fitting requests raise before anything is queued."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        params = sampling_params or SamplingParams()
        prompt_token_ids = self.engine.prompt_token_ids(prompt, prompt_token_ids, params)
        self.check_request(len(prompt_token_ids), params.max_tokens)
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, prompt_token_ids, params)
        if check_kv:
            self.kv_ledger().require(self.engine.admission_need(request))
        queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._pending_adds.append((request, prompt))
        self._ensure_loop()
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str,
                      queue: asyncio.Queue[RequestDelta | BaseException]) -> AsyncIterator[RequestDelta]:
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
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether a request with this id is queued or running here (its stream not yet ended)."""
        return request_id in self._queues

    def admission_blocks(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The blocks a request asks admission for under this engine's policy (block_manager.admission_blocks)."""
        return admission_blocks(self.config.scheduler.admission, num_prompt_tokens, max_tokens,
                                self.engine.block_manager.tokens_per_block)

    def admission_need(self, prompt_token_ids: list[int], max_tokens: int) -> int:
        """The blocks this request would add here now (admission_blocks less the cached prefix blocks held here)."""
        return self.engine.admission_need(Request("", list(prompt_token_ids), SamplingParams(max_tokens=max_tokens)))

    def prefix_report(self, reader_epoch: str | None, reader_version: int) -> PrefixReport | None:
        return self.engine.prefix_report(reader_epoch, reader_version)

    def kv_ledger(self) -> KvLedger:
        """The replica's KV ledger now: the scheduler's requests, requests queued for it, minus queued aborts."""
        return self.engine.kv_ledger(pending=[request for request, _ in self._pending_adds],
                                     exclude=set(self._pending_aborts))

    def abort(self, request_id: str) -> None:
        """Stops a request (if still running) and frees its KV at the next loop turn. Idempotent."""
        self._queues.pop(request_id, None)
        if request_id in self._pending_aborts:
            return
        self._pending_aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step, plus requests accepted but not yet handed to the scheduler."""
        return dataclasses.replace(self._stats, num_pending=len(self._pending_adds), healthy=self.dead_error is None)

    async def check_health(self) -> None:
        """Raises if the loop failed or a TP rank does not answer (the rank ping runs off the event loop)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        await asyncio.to_thread(self.engine.executor.check_health)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        await asyncio.to_thread(self.engine.shutdown)

    # ---- the loop ---------------------------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if self._loop_task is None or self._loop_task.done():
            # A fresh, empty context: the loop belongs to the engine, not to the request that happened to start it.
            # A copy of that request's context would carry Ray's async_task_id, so every worker-group call of
            # every later step would be a child of that request, and cancelling it (client disconnect) would
            # recursively cancel them and kill the engine with TaskCancelledError.
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), context=contextvars.Context())
        self._wakeup.set()

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        aborts, self._pending_aborts = self._pending_aborts, []
        for request, prompt in adds:
            if request.request_id in aborts:
                continue
            try:
                self.engine.add_request(prompt, request.sampling_params, request.prompt_token_ids, request.request_id)
            except Exception as err:  # noqa: BLE001 - delivered to the caller that made the request
                queue = self._queues.get(request.request_id)
                if queue is not None:
                    queue.put_nowait(err)
        for request_id in aborts:
            self.engine.abort_request(request_id)

    async def _run(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests() and not self.engine.scheduler.has_pending_finishes:
                    self._stats = self.engine.stats()
                    self._wakeup.clear()
                    if not self._pending_adds and not self._pending_aborts:
                        await self._wakeup.wait()
                    continue
                deltas = await asyncio.to_thread(self.engine.step)
                if self.engine.last_step_idle:
                    # Unfinished requests but nothing could be scheduled: wait for an add or abort (or a short
                    # while) instead of stepping again at once, which would busy-loop a core and the GIL.
                    self._wakeup.clear()
                    if not self._pending_adds and not self._pending_aborts:
                        try:
                            await asyncio.wait_for(self._wakeup.wait(), IDLE_RETRY_S)
                        except asyncio.TimeoutError:
                            pass
                    continue
                self._stats = self.engine.stats()
                if self.on_step is not None:
                    self.on_step(self._stats)
                for delta in deltas:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
                    elif not delta.finished:
                        self._pending_aborts.append(delta.request_id)  # nobody is listening any more
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - every waiting caller must hear about it
            self.dead_error = err
            for queue in self._queues.values():
                queue.put_nowait(EngineDeadError(f"the engine failed: {err!r}"))
            raise
