"""The engine core: one thread that alone owns a replica's LLMEngine (scheduler, block manager, prefix cache,
executor) and runs its steps.

Nothing else reads or writes that state. The serving front (dcpserve.engine.frontend.async_engine.AsyncEngine, on the
replica's event loop) talks to the core only through typed messages: `AddRequest`, `AbortRequest`, the queries
(`AdmissionNeedQuery`, `PrefixReportQuery`, `CallQuery`) and `Shutdown` go in through one queue; `CoreOutputs`
come back, one batch per step (every request's new tokens, logprobs and finish reason) or per batch of inputs
applied (each add's admission: accepted with its KV need, or refused and why; each query's reply), each with a
`CoreSnapshot`: the ledger, the stats and the requests' states at one instant, immutable, so the front answers
kv_ledger() and stats() without touching the core.

A thread, not a process (docs/structure.md, "Decisions"): a step is torch work that releases the GIL or, at
tp > 1, a wait on the Ray worker group; a process would add a serialization of every input and output batch on the
hot path and a second copy of the scheduler's inputs, and buy nothing the worker group does not already have.

An add with check_kv is checked against the ledger in the core, in input order, just before the scheduler takes
it: two adds can never both take the same free blocks, and the check sees every abort and finish applied before it.
If the core's loop raises, its last batch carries the error; the front fails every request in flight with it and
the replica's health check fails from then on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.core.request import Request
from dcpserve.engine.protocol import EngineStats, KvFull, KvLedger, RequestDelta

logger = logging.getLogger(__name__)

# How long the core waits before stepping again after a step that could schedule nothing (unless an input wakes it
# first): waiting requests no KV or seat can take now.
IDLE_RETRY_S = 0.1


# ---- inputs ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A new request, its prompt already token ids checked against the vocabulary. From the moment it is sent only
    the core touches `request`. With check_kv the core first checks its admission need against the ledger and
    refuses it (KvFull) when it does not fit now."""

    request: Request
    check_kv: bool = False


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request wherever it is and free its KV; an unknown or finished id is ignored."""

    request_id: str


@dataclass(frozen=True, slots=True)
class AdmissionNeedQuery:
    """What a prompt would add to the ledger now (LLMEngine.admission_need): an int, in the reply to query_id."""

    query_id: int
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class PrefixReportQuery:
    """The prefix cache's changes since the reader's (epoch, version): a PrefixReport or None (caching off)."""

    query_id: int
    reader_epoch: str | None
    reader_version: int


@dataclass(frozen=True, slots=True)
class CallQuery:
    """fn(engine) on the core's thread, its result in the reply: for tests and debugging tools that must look at
    or change the engine where it lives."""

    query_id: int
    fn: Callable[[LLMEngine], object]


Query = AdmissionNeedQuery | PrefixReportQuery | CallQuery


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the loop after the inputs before it."""


CoreInput = AddRequest | AbortRequest | AdmissionNeedQuery | PrefixReportQuery | CallQuery | Shutdown


# ---- outputs -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admission:
    """The core's answer to one AddRequest: taken (error None) with its admission need in blocks, or refused."""

    request_id: str
    need: int
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class CoreSnapshot:
    """The core's state at one instant, between two steps: the ledger and stats the serving layer reads, and which
    requests are where (finished: in the batch this snapshot closes)."""

    ledger: KvLedger
    stats: EngineStats
    running: frozenset[str]
    waiting: frozenset[str]
    finished: frozenset[str]


@dataclass(frozen=True, slots=True)
class CoreOutputs:
    """One batch out of the core: a step's deltas (stepped) or the answers to the inputs it just applied."""

    snapshot: CoreSnapshot
    deltas: tuple[RequestDelta, ...] = ()
    admissions: tuple[Admission, ...] = ()
    replies: tuple[tuple[int, object], ...] = ()
    stepped: bool = False
    # Set on the last batch of a core whose loop failed: every request in flight ends with it.
    error: BaseException | None = None


def snapshot(engine: LLMEngine, finished: frozenset[str] = frozenset()) -> CoreSnapshot:
    """The engine's state now. Only the thread that owns `engine` may call it."""
    scheduler = engine.scheduler
    return CoreSnapshot(
        ledger=engine.kv_ledger(),
        stats=engine.stats(),
        running=frozenset(r.request_id for r in scheduler.running),
        waiting=frozenset(r.request_id for r in scheduler.waiting),
        finished=finished,
    )


class EngineCore:
    """Runs `engine` on a thread of its own; `deliver(outputs)` is called on that thread for every output batch (the
    front hands it to its event loop)."""

    def __init__(self, engine: LLMEngine, deliver: Callable[[CoreOutputs], None]) -> None:
        self.engine = engine
        self._deliver = deliver
        self._inputs: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dcpserve-engine-core", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def send(self, message: CoreInput) -> None:
        """Queues an input (any thread); the core applies inputs in order, between steps."""
        self._inputs.put(message)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the loop to end (after Shutdown); True if it did."""
        if self.started:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the loop (the core's thread only) -----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        last_step_idle = False
        try:
            while True:
                busy = engine.has_unfinished_requests() or engine.scheduler.has_pending_finishes
                if not busy:
                    inputs = self._take(block=True, timeout=None)
                elif last_step_idle:
                    # Unfinished requests but nothing could be scheduled: wait for an input (or a short while)
                    # instead of stepping again at once, which would busy-loop a core and the GIL.
                    inputs = self._take(block=True, timeout=IDLE_RETRY_S)
                else:
                    inputs = self._take(block=False, timeout=None)
                stop = any(isinstance(message, Shutdown) for message in inputs)
                if inputs:
                    answered = self._apply(inputs)
                    if answered is not None:
                        self._deliver(answered)
                if stop:
                    return
                if not (engine.has_unfinished_requests() or engine.scheduler.has_pending_finishes):
                    continue
                deltas = engine.step()
                last_step_idle = engine.last_step_idle
                if last_step_idle:
                    continue
                finished = frozenset(d.request_id for d in deltas if d.finished)
                self._deliver(CoreOutputs(snapshot(engine, finished), deltas=tuple(deltas), stepped=True))
        except BaseException as err:
            self.error = err
            logger.exception("the engine core failed")
            try:
                self._deliver(CoreOutputs(self._last_words(), error=err))
            except BaseException:
                logger.exception("could not report the engine core's failure")

    def _last_words(self) -> CoreSnapshot:
        try:
            return snapshot(self.engine)
        except BaseException:  # noqa: BLE001 - the state may be what broke; report an empty one
            ledger = KvLedger(admission=self.engine.config.scheduler.admission, capacity_blocks=0,
                              tokens_per_block=0, used_blocks=0, committed_blocks=0, headroom_blocks=0,
                              per_request={})
            return CoreSnapshot(ledger, _empty_stats(self.engine), frozenset(), frozenset(), frozenset())

    def _take(self, block: bool, timeout: float | None) -> list[CoreInput]:
        """Every input queued now; with block, waits (up to timeout) for the first one."""
        inputs: list[CoreInput] = []
        try:
            if block:
                inputs.append(self._inputs.get(timeout=timeout))
            while True:
                inputs.append(self._inputs.get_nowait())
        except queue.Empty:
            pass
        return inputs

    def _apply(self, inputs: list[CoreInput]) -> CoreOutputs | None:
        """Applies inputs in order; the batch of answers (admissions, replies) if any was asked, or a fresh snapshot
        when only aborts came (so the ledger the front reads drops them now, not after the next step)."""
        engine = self.engine
        admissions: list[Admission] = []
        replies: list[tuple[int, object]] = []
        changed = False
        ledger: KvLedger | None = None  # the ledger as of the last add of this batch (rebuilt after anything else)
        for message in inputs:
            if isinstance(message, AddRequest):
                admission, ledger = self._add(message, ledger)
                admissions.append(admission)
                changed = True
            elif isinstance(message, AbortRequest):
                if engine.abort_request(message.request_id):
                    changed, ledger = True, None
            elif isinstance(message, (AdmissionNeedQuery, PrefixReportQuery, CallQuery)):
                replies.append((message.query_id, self._answer(message)))
                if isinstance(message, CallQuery):
                    ledger = None  # it may change anything
        if not (admissions or replies or changed):
            return None
        return CoreOutputs(snapshot(engine), admissions=tuple(admissions), replies=tuple(replies))

    def _add(self, message: AddRequest, ledger: KvLedger | None) -> tuple[Admission, KvLedger | None]:
        """Adds the request if its need fits the ledger (`ledger`: the one after this batch's adds so far, None to
        build it); the answer, and the ledger after it. A burst of adds in one batch builds the ledger once."""
        engine = self.engine
        request = message.request
        try:
            need = engine.admission_need(request)
            if message.check_kv:
                ledger = ledger or engine.kv_ledger()
                ledger.require(need)
            engine.add(request)
        except (KvFull, ValueError) as err:  # RequestRejected is a ValueError: the caller's answer, not a failure
            return Admission(request.request_id, 0, err), None  # rebuilt at the next add: rare
        return Admission(request.request_id, need), (None if ledger is None
                                                     else engine.scheduler.ledger_with(ledger, request, need))

    def _answer(self, message: Query) -> object:
        engine = self.engine
        try:
            if isinstance(message, AdmissionNeedQuery):
                return engine.admission_need(engine.probe_request(message.prompt_token_ids, message.max_tokens))
            if isinstance(message, PrefixReportQuery):
                return engine.prefix_report(message.reader_epoch, message.reader_version)
            return message.fn(engine)
        except Exception as err:  # noqa: BLE001 - the asker's error, raised where it awaits the reply
            return _QueryFailed(err)


@dataclass(frozen=True, slots=True)
class _QueryFailed:
    """A query's reply when answering it raised: the front raises `error` to the asker."""

    error: BaseException


def query_error(reply: object) -> BaseException | None:
    """The error a reply carries, if answering the query raised."""
    return reply.error if isinstance(reply, _QueryFailed) else None


def _empty_stats(engine: LLMEngine) -> EngineStats:
    config = engine.config
    return EngineStats(
        backend="native", tp=config.parallel.tp, dcp=config.parallel.dcp,
        num_kv_heads=engine.model_config.num_key_value_heads, admission=config.scheduler.admission,
        kv_blocks_total=0, kv_block_size_tokens=0, kv_blocks_used=0, kv_blocks_reserved=0, num_running=0,
        num_waiting=0, healthy=False,
    )
