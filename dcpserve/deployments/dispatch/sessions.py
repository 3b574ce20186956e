"""One choice's way through the app, from the ingress: admission (the queue's grant, with the prompt's prefix blocks
for prefix-aware routing), dispatch to the granted replica (refused or unreachable: the grant goes back and the
request waits at the head again), the stream of deltas with TTFT / ITL, the per-request deadline, and the release of
the grant however it ends. `Sessions.open` is what OpenAIIngress admits each choice with.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from ray.serve import context as serve_context

from dcpserve.deployments.config import AppArgs
from dcpserve.deployments.dispatch.admit import AdmitSettings, Dispatched, Taken, Unreachable, admit
from dcpserve.deployments.dispatch.streams import DeltaLinks, Item, StreamLost
from dcpserve.deployments.messages import (
    DEFAULT_POOL,
    Accepted,
    Acquire,
    AcquireReply,
    ApiError,
    EngineRequest,
    Granted,
    Need,
    PoolNeed,
    PrefixAsk,
    Refused,
    Rejected,
    ReplicaQuery,
    ServiceLevel,
)
from dcpserve.deployments.metrics import POOL_TAG, IngressMetrics, level_tags
from dcpserve.engine.core.prefix_cache import prompt_hashes
from dcpserve.engine.protocol import ModelLimits, RequestDelta
from dcpserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")

def _call_as_own_request(call: Callable[[], Any]) -> Any:
    """Makes a Serve handle call with an internal request id of its own. A child call inherits its HTTP request's
    id, and Serve's router keeps its pending requests in a dict by that id: the choices of one request (n > 1, a
    batch of prompts), dispatched together, shared one entry, so all but one waited out dispatch_timeout_s."""
    context = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(
        dataclasses.replace(context, _internal_request_id=uuid.uuid4().hex))  # type: ignore[arg-type]  # Ray declares it ContextVar[None]
    try:
        return call()
    finally:
        serve_context._serve_request_context.reset(token)



class AdmissionHandle:
    """KvAdmission's handle as the admission loop's port (dcpserve/deployments/dispatch/admit.py AdmissionPort)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def acquire(self, request: Acquire) -> AcquireReply:
        reply: AcquireReply = await self.handle.acquire.remote(request)
        return reply

    async def refused(self, ticket: str, replica_id: str, free_blocks: int) -> None:
        await self.handle.refused.remote(ticket, replica_id, free_blocks)

    async def unreachable(self, ticket: str, replica_id: str) -> None:
        await self.handle.unreachable.remote(ticket, replica_id)


class Sessions:
    """Admits, dispatches and streams the choices of the ingress' requests (the ingress parses and answers)."""

    def __init__(self, args: AppArgs, engine: Any, admission: Any, metrics: IngressMetrics,
                 limits: ModelLimits) -> None:
        self.args = args
        # The engine deployment's handle, or with layout pools each pool's (dcpserve/deployments/admission/pools.py).
        self._engines: dict[str, Any] = engine if isinstance(engine, dict) else {DEFAULT_POOL: engine}
        self._replica_pools: dict[str, str] = {}  # replica id -> its pool, from the grants
        self.admission = admission
        self.queue = AdmissionHandle(admission)
        self.admit_settings = AdmitSettings(args.queue_timeout_s, args.retry_after_s)
        self.metrics = metrics
        self.tokens_per_block = limits.tokens_per_block
        self.pool_layouts = args.pool_layouts()
        self.prefix_caching = limits.prefix_caching
        self.prefix_hash_seed = limits.prefix_hash_seed
        self._background: set[asyncio.Task[Any]] = set()
        # The delta streams from the engine replicas (dcpserve.deployments.dispatch.streams), opened on a replica's
        # first request.
        self.links = DeltaLinks(self._open_delta_stream, self._renew_delta_stream,
                                subscribe_timeout_s=args.dispatch_timeout_s, on_lost=self._replica_lost)

    def _engine(self, replica_id: str) -> Any:
        """The handle of the deployment the replica belongs to."""
        if len(self._engines) == 1:
            return next(iter(self._engines.values()))
        return self._engines[self._replica_pools[replica_id]]

    def _open_delta_stream(self, replica_id: str, subscriber: str) -> Any:
        return self._engine(replica_id).options(stream=True).deltas.remote(ReplicaQuery(replica_id), subscriber)

    async def _renew_delta_stream(self, replica_id: str, subscriber: str) -> bool:
        response = self._engine(replica_id).renew.remote(ReplicaQuery(replica_id), subscriber)
        try:
            return bool(await response)
        except asyncio.CancelledError:
            response.cancel()
            raise

    def _replica_lost(self, replica_id: str) -> None:
        """A delta stream from the replica failed: the admission queue forgets it at once, its capacity and its
        grants (AdmissionQueue.replica_lost), instead of after replica_ttl_s without its reports; a replica that is
        alive after all comes back by reporting again, grantable once Serve has probed it since."""
        self._in_background(self._replica_lost_async(replica_id))

    async def _replica_lost_async(self, replica_id: str) -> None:
        try:
            await asyncio.wait_for(self.admission.replica_lost.remote(replica_id), self.args.dispatch_timeout_s)
        except Exception as err:  # noqa: BLE001 - the queue still learns of it when the replica's reports stop
            logger.warning("telling the admission queue replica %s is lost failed: %r", replica_id, err)

    def close(self) -> None:
        """Ends this ingress' delta streams: each replica aborts the requests of this ingress it still runs."""
        self.links.close()

    async def open(self, ticket: str, token_ids: list[int], params: SamplingParams, need: Need,
                   level: ServiceLevel | None = None) -> AsyncGenerator[RequestDelta]:
        """Admits the request at its service level (first yield, a delta without tokens, once a replica accepted
        it), then yields its deltas. Its finally frees everything, whichever way the request ends, and hands the
        queue the request's TTFT and mean ITL with the release (the service-level autoscaling window)."""
        level = level or ServiceLevel()
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        queue: asyncio.Queue[Item] | None = None  # the request's deltas, once a replica accepted it
        replica_id = ""
        attempt = 0
        finished = False
        num_generated = 0
        last_token_at = arrived
        first_token_at: float | None = None
        ask = self._prefix_ask(token_ids, params, self.tokens_per_block)
        if not isinstance(need, int):  # layout pools: the prompt's block hashes in each pool's block size
            need = {pool: PoolNeed(n.blocks, self._prefix_ask(token_ids, params, self.pool_layouts[pool]))
                    for pool, n in need.items()}
        try:
            async def dispatch(grant: Granted, attempt: int) -> Dispatched[asyncio.Queue[Item]]:
                pool = self._replica_pools[grant.replica_id] = grant.pool
                granted_ask = ask if isinstance(need, int) else need[pool].ask  # hashes in that pool's block size
                request = EngineRequest(ticket, token_ids, params, grant.need, target_replica=grant.replica_id,
                                        reply_to=self.links.subscriber, attempt=attempt,
                                        prompt_hashes=granted_ask.hashes if granted_ask is not None else ())
                return await self._dispatch(request, grant.replica_id)

            admitted = await admit(ticket, need, ask=ask, level=level, arrived=arrived, admission=self.queue,
                                   dispatch=dispatch, settings=self.admit_settings)
            replica_id, attempt, queue = admitted.grant.replica_id, admitted.attempt, admitted.stream
            pool = admitted.grant.pool
            self.metrics.prompt_tokens.inc(len(token_ids))
            latency_tags = {POOL_TAG: pool, **level_tags(level)}  # the pool of the replica that took it
            yield RequestDelta(ticket, [], "", finished=False, finish_reason=None,  # admitted: no tokens yet
                               num_prompt_tokens=len(token_ids), num_output_tokens=0)
            timeout_s = self.args.request_timeout_for(level.tenant)
            request_deadline = arrived + timeout_s
            while True:
                try:
                    delta = await asyncio.wait_for(queue.get(), timeout=max(request_deadline - loop.time(), 0))
                except TimeoutError:
                    raise ApiError(504, f"the request ran past request_timeout_s={timeout_s:g} after "
                                   f"{num_generated} tokens; its KV was freed", code="request_timeout") from None
                if isinstance(delta, BaseException):  # the replica's stream failed, or the request's engine stream
                    raise delta
                now = loop.time()
                if delta.new_token_ids:
                    # TTFT from arrival (admission wait included); ITL between a request's consecutive tokens.
                    latency = self.metrics.itl if num_generated else self.metrics.ttft
                    latency.observe(now - last_token_at, tags=latency_tags)
                    if first_token_at is None:
                        first_token_at = now
                    num_generated += len(delta.new_token_ids)
                    last_token_at = now
                if delta.finished:
                    self.metrics.e2e.observe(now - arrived, tags=latency_tags)
                yield delta
                if delta.finished:
                    finished = True
                    break
        except ApiError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as err:  # an engine failure becomes an OpenAI error (logged with its traceback)
            logger.exception("request %s failed", ticket)
            raise ApiError(500 if queue is not None else 503, f"the engine failed: {err}") from None
        finally:
            aborting = False
            if queue is not None:
                # The replica stops an unfinished request and frees its KV. Not when the stream from it was lost:
                # then the replica is gone, or it aborted every request of this ingress when the stream ended.
                aborting = not finished and self.links.is_open(replica_id)
                self.links.unregister(replica_id, ticket)
            if num_generated:
                self.metrics.generation_tokens.inc(num_generated)
            ttft = None if first_token_at is None else first_token_at - arrived
            itl = None
            if first_token_at is not None and num_generated > 1:
                itl = (last_token_at - first_token_at) / (num_generated - 1)
            if aborting:  # the release after the abort: the queue frees the KV once the replica has
                self._in_background(self._abort_then_release(replica_id, ticket, attempt, ttft, itl))
            else:
                self._release(ticket, ttft, itl)

    async def _abort_then_release(self, replica_id: str, ticket: str, attempt: int, ttft_s: float | None,
                                  itl_s: float | None) -> None:
        """An unfinished request's end: the replica aborts it (its KV freed), then the grant goes back. Released
        first, the queue granted KV the replica still held to a waiting request, which the replica then refused
        (bench/soak.py saw the queue count those blocks twice for a report period)."""
        try:
            await self._abort_async(replica_id, ticket, attempt)
        finally:
            await self._release_async(ticket, ttft_s, itl_s)

    def _prefix_ask(self, token_ids: list[int], params: SamplingParams, tokens_per_block: int) -> PrefixAsk | None:
        """The prompt's blocks as the replicas' prefix caches name them, for prefix-aware admission; None with
        caching off, or for a request asking for prompt logprobs (it computes its whole prompt)."""
        if not self.prefix_caching or params.prompt_logprobs is not None:
            return None
        hashes = prompt_hashes(token_ids, tokens_per_block, self.prefix_hash_seed)
        return PrefixAsk(tuple(hashes), tokens_per_block, self.prefix_hash_seed, len(token_ids))

    async def _dispatch(self, request: EngineRequest, replica_id: str) -> Dispatched[asyncio.Queue[Item]]:
        """Sends a granted request to its replica, over this ingress' delta stream from it (opened now if there is
        none), and waits at most dispatch_timeout_s for the stream and the answer: Taken (with the queue its deltas
        arrive in), the replica's Refused or Rejected, or Unreachable when the call did not reach it in time or failed
        (the replica is still starting, draining, or gone)."""
        loop = asyncio.get_running_loop()
        timeout = self.args.dispatch_timeout_s
        deadline = loop.time() + timeout
        queue, subscribed = self.links.register(replica_id, request.ticket)
        accepted = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(subscribed), timeout)
            except TimeoutError:
                return self._unreachable(request, f"did not open a delta stream within dispatch_timeout_s={timeout:g}s")
            except StreamLost as lost:
                return self._unreachable(request, str(lost))
            response = _call_as_own_request(lambda: self._engine(replica_id).generate.remote(request))
            try:
                first = await asyncio.wait_for(response, timeout=max(deadline - loop.time(), 0.0))
            except TimeoutError:
                response.cancel()
                self._abort(replica_id, request.ticket, request.attempt)  # in case it took it after all
                return self._unreachable(request, f"did not take it within dispatch_timeout_s={timeout:g}s")
            except asyncio.CancelledError:
                response.cancel()
                self._abort(replica_id, request.ticket, request.attempt)
                raise
            except Exception as err:  # noqa: BLE001 - the replica died or Serve could not reach it
                return self._unreachable(request, f"failed the call ({type(err).__name__}: {err})")
            if isinstance(first, Accepted):
                accepted = True
                return Taken(first, queue)
            if isinstance(first, Refused | Rejected):
                return first
            return self._unreachable(request, f"answered {type(first).__name__} instead of an admission")
        finally:
            if not accepted:
                self.links.unregister(replica_id, request.ticket)

    @staticmethod
    def _unreachable(request: EngineRequest, why: str) -> Unreachable:
        logger.warning("ticket %s: granted replica %s %s; re-queued at the head", request.ticket,
                       request.target_replica, why)
        return Unreachable(why)

    def _abort(self, replica_id: str, ticket: str, attempt: int) -> None:
        """Tells the replica to stop a request this ingress is done with (fire-and-forget, in a fresh context like
        _release: a client disconnect must not cancel it). If it never arrives, the request still ends: when this
        ingress' delta stream from the replica closes, the replica aborts every request of it still running."""
        self._in_background(self._abort_async(replica_id, ticket, attempt))

    async def _abort_async(self, replica_id: str, ticket: str, attempt: int) -> None:
        response = self._engine(replica_id).abort.remote(ReplicaQuery(replica_id), ticket, attempt)
        try:
            await asyncio.wait_for(response, self.args.dispatch_timeout_s)
        except TimeoutError:
            response.cancel()
            logger.warning("aborting ticket %s on replica %s: no answer within dispatch_timeout_s=%gs", ticket,
                           replica_id, self.args.dispatch_timeout_s)
        except Exception as err:  # noqa: BLE001 - the replica is gone (its KV with it) or the stream's close aborts it
            logger.warning("aborting ticket %s on replica %s failed: %r", ticket, replica_id, err)

    def _release(self, ticket: str, ttft_s: float | None = None, itl_s: float | None = None) -> None:
        """Fire-and-forget release that survives the caller's cancellation. It runs in a fresh, empty context: a
        copy of the request's would carry Serve's request context, and Serve cancels the calls a cancelled request
        made (a client disconnect), so the release itself would be cancelled and the grant leak until the queue's
        leak reconciliation (leak_grace_s)."""
        self._in_background(self._release_async(ticket, ttft_s, itl_s))

    def _in_background(self, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(call, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_async(self, ticket: str, ttft_s: float | None, itl_s: float | None) -> None:
        try:
            await self.admission.release.remote(ticket, ttft_s, itl_s)
        except Exception as err:  # noqa: BLE001 - the queue's leak reconciliation reclaims the grant
            logger.warning("releasing ticket %s failed: %r", ticket, err)
