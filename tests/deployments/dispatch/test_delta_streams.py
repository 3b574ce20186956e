"""The replica -> ingress delta stream (dcpserve.deployments.dispatch.streams) on a virtual clock: what reaches the
ingress, and when, is a function of when the engine produced each token, never of how fast this machine is.

The engine stand-in delivers a step's deltas the way AsyncEngine does: the outbox is the sink of every request, and
each step's deltas of all of them reach it in one call."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from dcpserve.deployments.dispatch.streams import DeltaLinks, StreamLost
from dcpserve.deployments.messages import DeltaBatch, Subscribed
from dcpserve.deployments.replica.outbox import Outbox
from dcpserve.engine.protocol import RequestDelta, TokenLogprob, merge_deltas
from dcpserve.simulator.clock import run_simulated


def _delta(request_id: str, i: int, finished: bool) -> RequestDelta:
    return RequestDelta(request_id, [i], f"t{i} ", finished, "length" if finished else None, 7, i + 1,
                        [TokenLogprob(i, -0.5 * i, 1)], [None, TokenLogprob(3, -1.0, 2)] if i == 0 else None)


class _Engine:
    """A batch of requests decoded together: every `step_s` one token for each, request r finishing after
    `lengths[r]` tokens; failing requests fail after `fail_after` tokens. Like AsyncEngine it delivers a step's
    deltas to each sink in one call. Records each step's time and the requests aborted before they finished."""

    def __init__(self, lengths: dict[str, int], step_s: float, fail_after: dict[str, int] | None = None) -> None:
        self.lengths = lengths
        self.step_s = step_s
        self.fail_after = fail_after or {}
        self.step_at: list[float] = []
        self.closed_early: set[str] = set()
        self.sinks: dict[str, Outbox] = {}
        self.deliveries = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        step = 0
        while any(step < n for n in self.lengths.values()):
            await asyncio.sleep(self.step_s)
            self.step_at.append(loop.time())
            by_sink: dict[int, tuple[Outbox, list[RequestDelta]]] = {}
            for request_id, n in self.lengths.items():  # one pass: every request's delta of this step
                sink = self.sinks.get(request_id)
                if sink is None or step >= n:
                    continue
                if self.fail_after.get(request_id) == step:
                    del self.sinks[request_id]
                    sink.fail(request_id, RuntimeError(f"{request_id} failed in the engine"))
                    continue
                if step == n - 1:
                    del self.sinks[request_id]
                by_sink.setdefault(id(sink), (sink, []))[1].append(_delta(request_id, step, step == n - 1))
            for sink, deltas in by_sink.values():
                self.deliveries += 1
                sink.deliver(deltas)
            step += 1

    def abort(self, request_id: str) -> None:
        if self.sinks.pop(request_id, None) is not None:
            self.closed_early.add(request_id)


async def _forward_all(engine: _Engine, outbox: Outbox, ended: dict[str, bool]) -> None:
    """Every request of the engine submitted with the outbox as its sink, on_end as the replica's (_forwarded)."""

    def on_end(request_id: str, finished: bool) -> None:
        ended[request_id] = finished
        if not finished:
            engine.abort(request_id)

    for request_id in engine.lengths:
        outbox.expect(request_id, on_end)
        engine.sinks[request_id] = outbox


async def _collect(engine: _Engine, interval_s: float) -> tuple[list[tuple[float, DeltaBatch]], dict[str, bool]]:
    """Runs the batch to the end through one outbox; returns (when each item went out, the item), and on_end's
    verdict per request."""
    loop = asyncio.get_running_loop()
    outbox = Outbox("ingress")
    ended: dict[str, bool] = {}
    await _forward_all(engine, outbox, ended)
    stepping = loop.create_task(engine.run())
    received: list[tuple[float, DeltaBatch]] = []
    batches = outbox.batches(interval_s)
    while len(ended) < len(engine.lengths) or outbox._pending or outbox._errors:
        item = await batches.__anext__()
        received.append((loop.time(), item))
    await stepping
    await batches.aclose()
    return received, ended


def _per_request(received: list[tuple[float, DeltaBatch]]) -> dict[str, RequestDelta]:
    by_request: dict[str, list[RequestDelta]] = {}
    for _, batch in received:
        for delta in batch.deltas:
            by_request.setdefault(delta.request_id, []).append(delta)
    return {r: merge_deltas(deltas) for r, deltas in by_request.items()}


@pytest.mark.parametrize("step_s", [0.003, 0.01, 0.04, 0.2])
def test_one_item_carries_a_whole_step_of_every_request(step_s: float) -> None:
    """32 requests decoding together: each item carries every request's tokens since the last, so at batch 32 the
    stream carries at least 4 tokens per item whatever the step time; nothing is lost or reordered."""
    lengths = {f"r{i}": 60 for i in range(32)}
    engine = _Engine(lengths, step_s)
    received, ended = run_simulated(_collect(engine, 0.05))
    full = {r: merge_deltas([_delta(r, i, i == n - 1) for i in range(n)]) for r, n in lengths.items()}
    assert _per_request(received) == full
    assert ended == {r: True for r in lengths}
    tokens = sum(batch.num_tokens for _, batch in received)
    assert tokens == 32 * 60 and tokens / len(received) >= 4 * 4  # far above 1 token per item per request
    assert len(received) <= 60 + 1  # never more than one item per step (the first step's and the last's included)
    assert engine.deliveries == 60  # the engine handed the outbox each step's deltas of all 32 requests at once
    assert received[0][0] == engine.step_at[0] and received[-1][0] == engine.step_at[-1]  # first and last at once
    times = [t for t, _ in received]
    if step_s >= 0.05:
        assert len(received) == 60  # one item per step
    else:  # faster steps: at most one item per interval between the first and the last
        gaps = [b - a for a, b in zip(times[1:], times[2:-1], strict=False)]
        assert all(gap >= 0.05 - 1e-9 for gap in gaps), gaps
        assert len(received) <= 3 + math.ceil((engine.step_at[-1] - engine.step_at[0]) / 0.05)


def test_a_first_and_a_finishing_delta_go_out_at_once() -> None:
    """Requests that start and end at different steps (EOS at unpredictable lengths): each one's first token and its
    finish leave in the item of the step that made them, never held for the interval."""
    lengths = {f"r{i}": 3 + 7 * i for i in range(8)}
    engine = _Engine(lengths, 0.01)
    received, _ = run_simulated(_collect(engine, 0.5))  # an interval far longer than the requests
    first_at: dict[str, float] = {}
    for t, batch in received:
        for delta in batch.deltas:
            first_at.setdefault(delta.request_id, t)
            if delta.finished:
                assert t == engine.step_at[lengths[delta.request_id] - 1], delta.request_id
    assert all(t == engine.step_at[0] for t in first_at.values())


def test_interval_zero_sends_every_step() -> None:
    lengths = {"a": 10, "b": 5}
    engine = _Engine(lengths, 0.01)
    received, _ = run_simulated(_collect(engine, 0.0))
    assert [t for t, _ in received] == engine.step_at
    assert [len(batch.deltas) for _, batch in received] == [2] * 5 + [1] * 5


def test_a_failing_request_gets_its_error_after_its_tokens_and_the_others_go_on() -> None:
    lengths = {"ok": 6, "bad": 6}
    engine = _Engine(lengths, 0.01, fail_after={"bad": 3})
    received, ended = run_simulated(_collect(engine, 0.0))
    errors = [(t, e) for t, batch in received for e in batch.errors]
    assert [e for _, e in errors] == [("bad", "RuntimeError: bad failed in the engine")]
    bad_tokens_before = [d for t, b in received if t < errors[0][0] for d in b.deltas if d.request_id == "bad"]
    assert merge_deltas(bad_tokens_before).new_token_ids == [0, 1, 2]
    assert _per_request(received)["ok"].new_token_ids == list(range(6))
    assert ended == {"ok": True, "bad": False}  # on_end aborts the failed one in the engine


def test_cancel_and_close_end_the_engine_streams_and_report_them_unfinished() -> None:
    """abort() of one request ends it in the outbox; the ingress' stream going away closes the outbox, which ends
    every request still there: on_end reports each unfinished, and the replica aborts it in the engine."""
    lengths = {f"r{i}": 1000 for i in range(4)}

    async def main() -> tuple[_Engine, dict[str, bool], bool]:
        engine = _Engine(lengths, 0.01)
        outbox = Outbox("ingress")
        ended: dict[str, bool] = {}
        await _forward_all(engine, outbox, ended)
        stepping = asyncio.get_running_loop().create_task(engine.run())
        batches = outbox.batches(0.05)
        for _ in range(3):
            await batches.__anext__()
        assert outbox.cancel("r0") and not outbox.cancel("unknown")
        await asyncio.sleep(0.1)
        assert ended == {"r0": False}
        outbox.close()
        await asyncio.sleep(0.1)
        stepping.cancel()
        return engine, ended, outbox.closed

    engine, ended, closed = run_simulated(main())
    assert closed and ended == {r: False for r in lengths}
    assert engine.closed_early == set(lengths)


class _Replica:
    """What DeltaLinks sees of an engine replica's deltas() call: Subscribed, then what the test sends."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.items: asyncio.Queue[Any] = asyncio.Queue()
        self.opened = 0
        self.cancelled = 0

    def open(self) -> Any:
        self.opened += 1
        items = self.items

        async def anext() -> Any:
            item = await items.get()
            if isinstance(item, BaseException):
                raise item
            return item

        self.items.put_nowait(Subscribed(self.replica_id))
        return _Stream(anext, self)


class _Stream:
    def __init__(self, anext: Any, replica: _Replica) -> None:
        self.__anext__ = anext
        self._replica = replica

    def cancel(self) -> None:
        self._replica.cancelled += 1


async def _close(links: DeltaLinks) -> None:
    """Ends the test's links and lets their readers finish before the loop closes."""
    links.close()
    await asyncio.sleep(0.01)


async def _held(replica_id: str, subscriber: str) -> bool:
    return True


def _links(replicas: dict[str, _Replica], idle_s: float = 2.0, lost: list[str] | None = None) -> DeltaLinks:
    return DeltaLinks(lambda replica_id, subscriber: replicas[replica_id].open(), _held, idle_s=idle_s,
                      on_lost=None if lost is None else lost.append)


def test_the_ingress_demultiplexes_each_batch_into_its_requests() -> None:
    """One stream per replica however many requests; each request's queue gets exactly its own deltas (even those
    that come before generate() answered: the queue exists from before the call), and deltas of requests this
    ingress no longer waits for are dropped."""
    replicas = {"A": _Replica("A"), "B": _Replica("B")}

    async def main() -> dict[str, list[Any]]:
        links = _links(replicas)
        queues = {}
        for request_id, replica_id in (("a1", "A"), ("a2", "A"), ("b1", "B")):
            queue, subscribed = links.register(replica_id, request_id)
            await subscribed
            queues[request_id] = queue
        replicas["A"].items.put_nowait(DeltaBatch((_delta("a1", 0, False), _delta("a2", 0, False),
                                                   _delta("gone", 0, False))))
        replicas["B"].items.put_nowait(DeltaBatch((_delta("b1", 0, True),), (("nothing", "x"),)))
        replicas["A"].items.put_nowait(DeltaBatch((_delta("a1", 1, True),), (("a2", "RuntimeError: boom"),)))
        await asyncio.sleep(0.01)
        got = {r: [q.get_nowait() for _ in range(q.qsize())] for r, q in queues.items()}
        await _close(links)
        return got

    got = run_simulated(main())
    assert got["a1"] == [_delta("a1", 0, False), _delta("a1", 1, True)]
    assert got["a2"][0] == _delta("a2", 0, False) and str(got["a2"][1]) == "RuntimeError: boom"
    assert got["b1"] == [_delta("b1", 0, True)]
    assert replicas["A"].opened == 1 and replicas["B"].opened == 1


def test_a_lost_stream_fails_every_request_on_it_at_once_and_the_next_request_opens_a_new_one() -> None:
    replicas = {"A": _Replica("A")}

    lost: list[str] = []

    async def main() -> tuple[list[Any], int]:
        links = _links(replicas, lost=lost)
        waiting = []
        for request_id in ("r1", "r2", "r3"):
            queue, subscribed = links.register("A", request_id)
            await subscribed
            waiting.append(queue)
        replicas["A"].items.put_nowait(ConnectionError("the replica's actor died"))
        got = [await queue.get() for queue in waiting]
        assert links.num_links() == 0
        assert lost == ["A"]  # the admission queue is told at once (Sessions._replica_lost)
        _, subscribed = links.register("A", "r4")
        await subscribed
        num_links = links.num_links()
        await _close(links)
        return got, num_links

    got, num_links = run_simulated(main())
    assert all(isinstance(err, StreamLost) and "actor died" in str(err) for err in got), got
    assert num_links == 1 and replicas["A"].opened == 2
    assert lost == ["A"]  # closing the links at the end is not a loss


def test_a_stream_the_replica_ends_or_the_ingress_closes_idle_is_not_a_lost_replica() -> None:
    replicas = {"A": _Replica("A"), "B": _Replica("B")}
    lost: list[str] = []

    async def main() -> None:
        links = _links(replicas, idle_s=1.0, lost=lost)
        for replica_id in ("A", "B"):
            _, subscribed = links.register(replica_id, f"{replica_id}1")
            await subscribed
        replicas["A"].items.put_nowait(StopAsyncIteration())  # the replica ended it (draining, lease over)
        links.unregister("B", "B1")
        await asyncio.sleep(1.5)  # B closes idle
        assert links.num_links() == 0
        await _close(links)

    run_simulated(main())
    assert lost == []


def test_an_idle_stream_closes_after_idle_s_and_a_waiting_request_keeps_it_open() -> None:
    """A draining replica's graceful shutdown waits for its calls: the ingress closes a stream nobody waits on."""
    replicas = {"A": _Replica("A")}

    async def main() -> list[tuple[int, int]]:
        links = _links(replicas, idle_s=2.0)
        seen = []
        _, subscribed = links.register("A", "r1")
        await subscribed
        links.unregister("A", "r1")
        await asyncio.sleep(1.5)
        links.register("A", "r2")  # arrives within idle_s: the same stream, and the close is called off
        await asyncio.sleep(1.0)
        seen.append((links.num_links(), replicas["A"].cancelled))
        links.unregister("A", "r2")
        await asyncio.sleep(2.1)
        seen.append((links.num_links(), replicas["A"].cancelled))
        await _close(links)
        return seen

    assert run_simulated(main()) == [(1, 0), (0, 1)]
    assert replicas["A"].opened == 1


def test_a_stream_that_answers_from_the_wrong_replica_fails_its_requests() -> None:
    replicas = {"A": _Replica("B")}

    async def main() -> BaseException | None:
        links = _links(replicas)
        _, subscribed = links.register("A", "r1")
        try:
            await subscribed
        except StreamLost as lost:
            return lost
        finally:
            await _close(links)
        return None

    lost = run_simulated(main())
    assert lost is not None and "asked replica A" in str(lost)


def test_a_stream_that_never_opens_is_given_up_after_subscribe_timeout_s() -> None:
    """A call Serve cannot route (the replica is gone) must not keep a link, and the requests behind it, waiting."""
    cancelled = []

    class _Silent:
        async def __anext__(self) -> Any:
            await asyncio.sleep(3600)

        def cancel(self) -> None:
            cancelled.append(True)

    async def main() -> tuple[float, BaseException | None, bool]:
        links = DeltaLinks(lambda replica_id, subscriber: _Silent(), _held, subscribe_timeout_s=10.0)
        start = asyncio.get_running_loop().time()
        _, subscribed = links.register("A", "r1")
        try:
            await subscribed
            error = None
        except StreamLost as lost:
            error = lost
        waited = asyncio.get_running_loop().time() - start
        await asyncio.sleep(0)
        open_after = links.is_open("A")
        await _close(links)
        return waited, error, open_after

    waited, error, open_after = run_simulated(main())
    assert waited == pytest.approx(10.0) and error is not None and "within 10s" in str(error)
    assert not open_after and cancelled == [True]


@pytest.mark.parametrize("renewed", [True, False])
def test_a_stream_whose_ingress_stops_renewing_ends_and_aborts_its_requests(renewed: bool) -> None:
    """Ray does not end a streaming call whose caller died: the lease does. Renewed every RENEW_S the stream lives
    on; not renewed (the ingress was killed) it ends LEASE_S after the last renewal, and its requests are aborted."""
    from dcpserve.deployments.messages import LEASE_S, RENEW_S

    async def main() -> tuple[float, dict[str, bool], int]:
        loop = asyncio.get_running_loop()
        engine = _Engine({"r0": 10_000}, 0.5)
        outbox = Outbox("ingress")
        ended: dict[str, bool] = {}
        await _forward_all(engine, outbox, ended)
        stepping = loop.create_task(engine.run())

        async def renewing() -> None:
            while renewed:
                await asyncio.sleep(RENEW_S)
                outbox.renew()

        renewer = loop.create_task(renewing())
        items = 0
        start = loop.time()
        async for _ in outbox.batches(0.05):
            items += 1
            if loop.time() - start > 4 * LEASE_S:
                break
        lasted = loop.time() - start
        outbox.close()
        await asyncio.sleep(0)
        renewer.cancel()
        stepping.cancel()
        return lasted, ended, items

    lasted, ended, items = run_simulated(main())
    if renewed:
        assert lasted > 4 * LEASE_S and items > 100
    else:
        assert lasted == pytest.approx(LEASE_S, abs=0.6) and items > 20  # it streamed until the lease ran out
    assert ended == {"r0": False}  # aborted in the engine either way (here by the close that follows)


def test_the_ingress_renews_each_stream_and_ends_one_the_replica_no_longer_has() -> None:
    from dcpserve.deployments.messages import RENEW_S

    replicas = {"A": _Replica("A")}
    renewals: list[float] = []
    held = [True]

    async def renew(replica_id: str, subscriber: str) -> bool:
        renewals.append(asyncio.get_running_loop().time())
        return held[0]

    async def main() -> BaseException:
        links = DeltaLinks(lambda replica_id, subscriber: replicas[replica_id].open(), renew)
        queue, subscribed = links.register("A", "r1")
        await subscribed
        await asyncio.sleep(3.5 * RENEW_S)
        held[0] = False  # the replica ended the stream (its lease ran out while this ingress was stalled)
        error = await queue.get()
        await _close(links)
        assert isinstance(error, BaseException)
        return error

    error = run_simulated(main())
    assert isinstance(error, StreamLost) and "no longer has" in str(error)
    assert [round(t / RENEW_S) for t in renewals] == [1, 2, 3, 4]
