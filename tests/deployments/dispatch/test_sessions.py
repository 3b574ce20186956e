"""Sessions' dispatch of a choice to its replica (dcpserve/deployments/dispatch/sessions.py), with a stand-in for the
engine handle."""

from __future__ import annotations

import asyncio
import dataclasses
import types
from typing import Any, cast

from ray.serve import context as serve_context

from dcpserve.deployments.config import AppArgs
from dcpserve.deployments.dispatch.admit import Taken
from dcpserve.deployments.dispatch.sessions import Sessions
from dcpserve.deployments.dispatch.streams import DeltaLinks
from dcpserve.deployments.messages import Accepted, EngineRequest, Subscribed


class _RecordingEngine:
    """The engine deployment's handle: each generate() call records the Serve request context it was made in;
    deltas() opens a delta stream that says Subscribed and then waits."""

    def __init__(self) -> None:
        self.internal_ids: list[str] = []
        self.stream_contexts: list[str] = []

    def options(self, **_: Any) -> _RecordingEngine:
        return self

    @property
    def generate(self) -> Any:
        return types.SimpleNamespace(remote=self._generate)

    @property
    def deltas(self) -> Any:
        return types.SimpleNamespace(remote=self._deltas)

    def _generate(self, request: Any) -> Any:
        self.internal_ids.append(serve_context._get_serve_request_context()._internal_request_id)

        async def answer() -> Any:
            return Accepted("r")

        return _Response(answer())

    def _deltas(self, query: Any, subscriber: str) -> Any:
        self.stream_contexts.append(serve_context._get_serve_request_context()._internal_request_id)
        items: asyncio.Queue[Any] = asyncio.Queue()
        items.put_nowait(Subscribed(query.target_replica))
        return types.SimpleNamespace(__anext__=items.get, cancel=lambda: None)


class _Response:
    """A unary DeploymentResponse: awaitable, cancellable."""

    def __init__(self, coro: Any) -> None:
        self._coro = coro

    def __await__(self) -> Any:
        return self._coro.__await__()

    def cancel(self) -> None:
        self._coro.close()


def test_the_choices_of_one_request_are_dispatched_as_calls_of_their_own() -> None:
    """Serve's router keeps pending calls in a dict by their internal request id, which a child call inherits from
    its HTTP request: the choices of one request (n > 1, batched prompts), dispatched together, shared one entry and
    all but one waited out dispatch_timeout_s. Each dispatch must carry an id of its own. The replica's delta stream,
    shared by every request of this ingress there, is opened once, outside any request's context (a request's
    cancellation must not end it)."""
    engine = _RecordingEngine()
    sessions = object.__new__(Sessions)  # _dispatch reads the engine handle, the links and the dispatch timeout
    sessions._engines = {"default": engine}
    sessions.args = cast(AppArgs, types.SimpleNamespace(dispatch_timeout_s=5.0))

    async def run() -> None:
        sessions.links = DeltaLinks(sessions._open_delta_stream, sessions._renew_delta_stream)
        parent = dataclasses.replace(serve_context._get_serve_request_context(), _internal_request_id="http-request")
        serve_context._serve_request_context.set(parent)  # type: ignore[arg-type]  # Ray declares it ContextVar[None]
        results = await asyncio.gather(
            *(sessions._dispatch(cast(EngineRequest, types.SimpleNamespace(ticket=f"t{i}", attempt=0)), "r")
              for i in range(4)))
        assert all(isinstance(result, Taken) for result in results)
        assert serve_context._get_serve_request_context()._internal_request_id == "http-request"  # restored
        sessions.links.close()
        await asyncio.sleep(0)

    asyncio.run(run())
    assert len(set(engine.internal_ids)) == 4 and "http-request" not in engine.internal_ids, engine.internal_ids
    assert engine.stream_contexts == [""], engine.stream_contexts


def test_the_release_of_a_grant_runs_outside_its_request_so_a_disconnect_cannot_cancel_it() -> None:
    """Serve cancels the calls a cancelled request made (a client disconnect cancels its HTTP request): a release
    made in the request's context was cancelled with it, and the grant leaked until the queue's leak reconciliation.
    The release runs in a fresh context, and a cancelled request does not cancel it."""
    seen: list[str] = []
    released = asyncio.Event()

    async def release(ticket: str, ttft_s: float | None, itl_s: float | None) -> None:
        seen.append(serve_context._get_serve_request_context()._internal_request_id)
        await asyncio.sleep(0.05)  # still running when the request's task is cancelled below
        released.set()

    sessions = object.__new__(Sessions)
    sessions.admission = types.SimpleNamespace(release=types.SimpleNamespace(remote=release))
    sessions._background = set()

    async def run() -> None:
        async def request() -> None:
            serve_context._serve_request_context.set(dataclasses.replace(  # type: ignore[arg-type]  # Ray declares it ContextVar[None]
                serve_context._get_serve_request_context(), _internal_request_id="http-request"))
            sessions._release("ticket-1")
            await asyncio.sleep(10)

        task = asyncio.create_task(request())
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away
        await asyncio.wait_for(released.wait(), timeout=5)

    asyncio.run(run())
    assert seen == [""], seen  # no request context: Serve ties nothing to the request it came from


def test_an_unfinished_request_gives_its_grant_back_only_after_its_replica_aborted_it() -> None:
    """A client that goes away mid-request: the replica aborts the request (its KV freed at the core's next turn,
    before any request sent after it), and only then does the grant go back to the queue. Released first, the
    queue granted the KV the replica still held to a waiting request, which the replica refused."""
    calls: list[str] = []

    async def abort(query: object, ticket: str, attempt: int) -> bool:
        calls.append("abort started")
        await asyncio.sleep(0.05)
        calls.append("abort done")
        return True

    async def release(ticket: str, ttft_s: float | None, itl_s: float | None) -> None:
        calls.append(f"release {ticket} ttft={ttft_s}")

    sessions = object.__new__(Sessions)
    sessions.args = cast(AppArgs, types.SimpleNamespace(dispatch_timeout_s=5.0))
    engine = types.SimpleNamespace(abort=types.SimpleNamespace(remote=abort))
    sessions._engines = {"default": engine}
    sessions.admission = types.SimpleNamespace(release=types.SimpleNamespace(remote=release))

    asyncio.run(sessions._abort_then_release("r1", "t1", 0, 0.5, None))
    assert calls == ["abort started", "abort done", "release t1 ttft=0.5"]
