"""The OpenAI-compatible HTTP front (FastAPI through Serve): validate, tokenize, count KV, admit, stream.

Request path: API key (401) and body size (413) -> parse and validate the body (400) -> tokenize (chat template
for chat, with the tools: dcpserve/deployments/api/tool_calls.py) -> compile the output constraint, if any (400 naming
the field the grammar engine refuses: dcpserve/deployments/api/structured.py) -> max_tokens (unset: the rest of the
context, max_model_len minus the prompt) and check max_model_len (400) -> need = admission_blocks under the app's policy
(prompt + max_tokens for "full", the prompt for "usage") -> KvAdmission.acquire: a granted replica, or 400 never-fits /
429 queue full or timed out / 503 no healthy replica -> EngineReplica.generate through the KV-aware router to that
replica, its deltas to come on this ingress' delta stream from it (dcpserve/deployments/dispatch/streams.py) -> a
refusal, or a replica that does not take the request within dispatch_timeout_s (still starting, draining, gone), gives
the grant back and re-queues the request at the head -> deltas back as JSON or SSE, every body and chunk shaped by the
request's shaper (dcpserve/deployments/api/responses.py). Whatever ends the request (finish, error, client disconnect,
request_timeout_s) aborts it on its replica if it did not finish (which frees its KV) and releases the grant.
"""

# No `from __future__ import annotations` here: serve.ingress rebuilds the route methods' signatures, and FastAPI
# must see `request: Request` as the class itself, not a string it can no longer resolve (it answers 422).
import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from dcpserve.deployments.admission.pools import request_need
from dcpserve.deployments.api import openapi, protocol
from dcpserve.deployments.api.http_edge import api, authorize, error_response, read_body, validation_message
from dcpserve.deployments.api.reasoning import reasoning_format
from dcpserve.deployments.api.responses import ChatShaper, CompletionShaper, ResponseShaper
from dcpserve.deployments.api.structured import FieldError, check_constraint
from dcpserve.deployments.api.tool_calls import ToolPlan, builtin_messages
from dcpserve.deployments.config import AppArgs
from dcpserve.deployments.dispatch.sessions import Sessions
from dcpserve.deployments.messages import AdmissionStats, ApiError, Need, ServiceLevel
from dcpserve.deployments.metrics import IngressMetrics
from dcpserve.engine.backends import model_limits
from dcpserve.engine.generation_defaults import read_generation_defaults
from dcpserve.engine.protocol import RequestDelta
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.structured_output import Grammars
from dcpserve.engine.tokenizer import ChatTemplateKwargsError, load_tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlannedChoice:
    """One sequence a request asks for (choice k: prompt k // per_prompt), with its own ticket and KV need: each
    choice is admitted on its own; choice j of a seeded request samples with seed + j, so it equals a one-choice
    request with that seed."""

    prompt_ids: list[int]
    params: SamplingParams
    need: Need  # KV blocks admission counts for it (per pool with layout pools: admission/pools.py)


# Decorated here, at import, not in build_app: Serve pickles the app by reference, so each replica re-imports
# this module (and dcpserve.deployments.api.http_edge, where `api` lives), and the routes must be bound to the class
# there too.
@serve.ingress(api)
class OpenAIIngress:
    """Serve deployment class (build_app wraps it with serve.deployment): the OpenAI HTTP API."""

    def __init__(self, args: AppArgs, engine: Any, admission: Any) -> None:
        self.args = args
        self.engine = engine
        self.admission = admission
        engine_args = args.engine_args()
        limits = model_limits(engine_args)  # either backend: the replica stays the authority
        self.model_name = args.name
        self.model_root = str(args.model)  # /v1/models' root (`vllm bench serve` loads its tokenizer from it)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self.pool_layouts = args.pool_layouts()
        self.admission_policy = limits.admission
        self.tokenizer = load_tokenizer(limits.model, limits.eos_token_ids,
                                        trust_remote_code=engine_args.trust_remote_code)
        # The model's sampling defaults for the fields a request omits (generation_config: auto), both backends.
        self.generation_defaults = read_generation_defaults(limits.model, engine_args.generation_config)
        for name, value in self.generation_defaults.ignored:
            logger.warning("%s sets %s=%s, which this server does not apply (it has no %s sampler)",
                           self.generation_defaults.source, name, value, name)
        self.reasoning = reasoning_format(args.reasoning_parser)
        self._grammars: Grammars | None = None  # made at the first constrained request
        self._api_keys = [(name, key.encode()) for name, key in args.resolved_tenant_keys()]  # never logged
        self.metrics = IngressMetrics()
        self.sessions = Sessions(args, engine, admission, self.metrics, limits)

    async def __del__(self) -> None:
        # Serve awaits this when it stops the replica (after its requests drained): the engine replicas see the delta
        # streams end now, not when their leases run out.
        sessions = getattr(self, "sessions", None)
        if sessions is not None:
            sessions.close()
            await asyncio.sleep(0)  # the readers cancel their streams

    # ---- routes ---------------------------------------------------------------------------------------------

    @api.get("/health", responses={200: {"model": openapi.HealthResponse}, 503: {"model": openapi.ErrorResponse}})
    async def health(self) -> Response:
        """Open to load balancers: status and counts only (no replica ids, no keys, no request data)."""
        stats: AdmissionStats = await self.admission.stats.remote()
        replicas = list(stats.replicas.values())
        healthy = [r for r in replicas if r.healthy]
        if not healthy:
            return error_response(ApiError(503, "no healthy engine replica", code="no_replica"))
        return JSONResponse(openapi.HealthResponse(
            status="ok", replicas=len(replicas), healthy_replicas=len(healthy), queued=stats.num_queued,
            kv_capacity_blocks=sum(r.capacity for r in replicas),
            kv_granted_blocks=sum(r.granted for r in replicas),
            kv_external_blocks=sum(r.external for r in replicas),
            kv_free_blocks=sum(max(r.free, 0) for r in healthy),
            num_grants=sum(r.num_grants for r in replicas),
        ).model_dump())

    @api.get("/v1/models", responses={200: {"model": openapi.ModelList}, **openapi.ERROR_RESPONSES})
    async def models(self, request: Request) -> Response:
        try:
            authorize(request, self._api_keys)
        except ApiError as err:
            return error_response(err)
        return JSONResponse(openapi.ModelList(data=[openapi.ModelCard(
            id=self.model_name, created=int(time.time()), root=self.model_root,
            max_model_len=self.max_model_len)]).model_dump())

    @api.post("/v1/completions", openapi_extra=openapi.request_body_schema(protocol.CompletionRequest),
              responses={**openapi.ok_response(openapi.CompletionResponse, "the completion, or its SSE stream"),
                         **openapi.ERROR_RESPONSES})
    async def completions(self, request: Request) -> Response:
        try:
            body, tenant, session = await self._parse(request, protocol.CompletionRequest)
            prompts, echo_texts = [], []
            for prompt in body.prompts():
                ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
                prompts.append(ids)
                if body.echo:
                    echo_texts.append(prompt if isinstance(prompt, str) else self._decode(ids))
            shaper = CompletionShaper(body, self.model_name, self.tokenizer, prompts, echo_texts)
            response = await self._serve(body, tenant, session, prompts, shaper)
        except ApiError as err:
            response = error_response(err)
        self.metrics.response("completions", response.status_code)
        return response

    @api.post("/v1/chat/completions", openapi_extra=openapi.request_body_schema(protocol.ChatCompletionRequest),
              responses={**openapi.ok_response(openapi.ChatCompletionResponse, "the chat completion, or its SSE "
                                                 "stream"), **openapi.ERROR_RESPONSES})
    async def chat_completions(self, request: Request) -> Response:
        try:
            body, tenant, session = await self._parse(request, protocol.ChatCompletionRequest)
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: chat needs one; use /v1/completions with token ids")
            plan = self._tool_plan(body)
            messages = body.chat_messages()
            renders_tools = self.tokenizer.template_renders_tools
            try:
                token_ids = self.tokenizer.apply_chat_template(
                    messages if renders_tools else builtin_messages(messages, plan),
                    tools=plan.openai_tools() if plan is not None and renders_tools else None,
                    template_kwargs=body.chat_template_kwargs)
            except ChatTemplateKwargsError as err:
                raise ApiError(400, str(err), param="chat_template_kwargs") from None
            except ValueError as err:
                raise ApiError(400, str(err), param="messages") from None
            shaper = ChatShaper(body, self.model_name, self.tokenizer, token_ids, plan, self.reasoning)
            response = await self._serve(body, tenant, session, [token_ids], shaper)
        except ApiError as err:
            response = error_response(err)
        self.metrics.response("chat_completions", response.status_code)
        return response

    # ---- steps ----------------------------------------------------------------------------------------------

    async def _parse(self, request: Request, model: type[protocol._SamplingFields]) -> tuple[Any, str, str | None]:
        """The validated body, the request's tenant (its API key's name) and its session (prompt_cache_key, else the
        X-Session-Id header; 400 naming the one that is not a valid key)."""
        tenant = authorize(request, self._api_keys)
        try:
            raw = json.loads(await read_body(request, self.args.max_request_body_bytes))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            body = model.model_validate(raw)
        except ValidationError as err:
            message, param = validation_message(err)
            raise ApiError(400, message, param=param) from None
        if body.model != self.model_name:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        try:
            session = body.session(request.headers.get(protocol.SESSION_HEADER))
        except ValueError as err:
            raise ApiError(400, str(err), param=protocol.SESSION_HEADER) from None
        return body, tenant, session

    def _level(self, body: Any, tenant: str, session: str | None) -> ServiceLevel:
        """The request's service level: its tenant's weight, its priority (the key's default when it sends none;
        400 past the key's min_priority), its deadline (400 when it has passed) and its session."""
        settings = self.args.tenant(tenant)
        priority = settings.priority if body.priority is None else body.priority
        if settings.min_priority is not None and priority < settings.min_priority:
            raise ApiError(400, f"priority={priority} is more urgent than this API key allows (min_priority="
                           f"{settings.min_priority}); send a priority of at least {settings.min_priority}",
                           param="priority")
        try:
            deadline_s = body.deadline_s()
        except ValueError as err:
            raise ApiError(400, str(err), param="deadline") from None
        return ServiceLevel(tenant, priority, settings.weight, deadline_s, session=session)

    @staticmethod
    def _tool_plan(body: Any) -> ToolPlan | None:
        try:
            plan: ToolPlan | None = body.tool_plan()
        except FieldError as err:
            raise ApiError(400, str(err), param=err.param) from None
        return plan

    async def _check_constraint(self, body: Any) -> None:
        """400 naming the field when the request's output constraint is malformed or the grammar engine cannot
        compile it; compiled off the event loop (a new schema against a large vocabulary takes a while), cached."""
        try:
            constraint, param = body.constraint()
        except FieldError as err:
            raise ApiError(400, str(err), param=err.param) from None
        if constraint is None:
            return
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: structured outputs need one", param=param)
        if self._grammars is None:
            self._grammars = Grammars.for_tokenizer(self.tokenizer, self.vocab_size)
        try:
            await asyncio.to_thread(check_constraint, self._grammars, constraint, param or "")
        except FieldError as err:
            raise ApiError(400, str(err), param=err.param) from None

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return self.tokenizer.encode(text)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _check(self, token_ids: list[int], params: SamplingParams) -> Need:
        """Never-fits by length (400 naming the numbers) and bad token ids; returns the KV need in blocks."""
        if not token_ids:
            raise ApiError(400, "the prompt is empty: send at least one token", param="prompt")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}",
                           param="prompt")
        total = len(token_ids) + params.max_tokens
        if len(token_ids) >= self.max_model_len:
            raise ApiError(
                400, f"the prompt ({len(token_ids)} tokens) leaves no room to generate within max_model_len="
                f"{self.max_model_len}; shorten the prompt", param="prompt", code="context_length_exceeded")
        if total > self.max_model_len:
            raise ApiError(
                400,
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens to at most "
                f"{self.max_model_len - len(token_ids)}",
                param="max_tokens", code="context_length_exceeded",
            )
        return request_need(self.pool_layouts, self.admission_policy, len(token_ids), params.max_tokens)

    def _plan(self, body: Any, prompts: list[list[int]]) -> list[PlannedChoice]:
        """Every choice of the request (every prompt x n or best_of), each checked (400s name the field) and counted
        in KV blocks."""
        unknown = [k for k in (body.logit_bias or {}) if int(k) >= self.vocab_size]
        if unknown:
            raise ApiError(400, f"logit_bias has token ids outside the vocabulary [0, {self.vocab_size}): "
                           f"{unknown[:5]}", param="logit_bias")
        bad_stops = [t for t in body.stop_token_ids or () if t >= self.vocab_size]
        if bad_stops:
            raise ApiError(400, f"stop_token_ids outside the vocabulary [0, {self.vocab_size}): {bad_stops[:5]}",
                           param="stop_token_ids")
        per_prompt = body.num_choices()
        planned = []
        for ids in prompts:
            for j in range(per_prompt):
                try:
                    params = body.sampling_params(context_left=self.max_model_len - len(ids), choice=j,
                                                  defaults=self.generation_defaults)
                except ValueError as err:
                    raise ApiError(400, str(err)) from None
                planned.append(PlannedChoice(ids, params, self._check(ids, params)))
        return planned

    async def _admit(self, planned: list[PlannedChoice], level: ServiceLevel) -> list[AsyncGenerator[RequestDelta]]:
        """One admitted session per choice, or none: if any choice is refused (400 / 429 / 503), the others give
        their grants back and the first error is the answer."""
        sessions = [self.sessions.open(uuid.uuid4().hex, c.prompt_ids, c.params, c.need,
                                       dataclasses.replace(level, tokens=len(c.prompt_ids) + c.params.max_tokens))
                    for c in planned]
        results = await asyncio.gather(*(s.__anext__() for s in sessions), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(s.aclose() for s in sessions), return_exceptions=True)
            first = next((e for e in failed if isinstance(e, ApiError) and e.status == 400), failed[0])
            raise first
        return sessions

    async def _serve(self, body: Any, tenant: str, session: str | None, prompts: list[list[int]],
                     shaper: ResponseShaper) -> Response:
        level = self._level(body, tenant, session)
        await self._check_constraint(body)
        planned = self._plan(body, prompts)
        sessions = await self._admit(planned, level)  # before any byte is sent: errors are plain HTTP statuses
        if body.stream:
            return StreamingResponse(self._sse(shaper, sessions), media_type="text/event-stream")

        async def collect(k: int) -> None:
            async for delta in sessions[k]:
                shaper.add(k, delta)

        results = await asyncio.gather(*(collect(k) for k in range(len(sessions))), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(s.aclose() for s in sessions), return_exceptions=True)
            raise failed[0]
        return JSONResponse(shaper.body())

    @staticmethod
    async def _sse(shaper: ResponseShaper, sessions: list[AsyncGenerator[RequestDelta]]) -> AsyncIterator[str]:
        """The choices' deltas merged into one SSE stream, in the order they come, each turned into chunks by the
        shaper; an ApiError on the way (a deadline, a lost replica) ends it with an error event."""
        queue: asyncio.Queue[tuple[int, RequestDelta | None, BaseException | None]] = asyncio.Queue()

        async def pump(k: int) -> None:
            try:
                async for delta in sessions[k]:
                    await queue.put((k, delta, None))
                await queue.put((k, None, None))
            except BaseException as err:  # noqa: BLE001 - delivered to the stream below
                await queue.put((k, None, err))

        def event(chunk: dict[str, Any]) -> str:
            return f"data: {json.dumps(chunk)}\n\n"

        pumps = [asyncio.get_running_loop().create_task(pump(k)) for k in range(len(sessions))]
        try:
            for chunk in shaper.first_chunks():
                yield event(chunk)
            remaining = len(sessions)
            while remaining:
                k, delta, err = await queue.get()
                if err is not None:
                    raise err
                if delta is None:
                    remaining -= 1
                    continue
                for chunk in shaper.chunks(k, delta):
                    yield event(chunk)
            for chunk in shaper.last_chunks():
                yield event(chunk)
        except ApiError as err:
            yield event(shaper.error_chunk(err))
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await asyncio.gather(*(s.aclose() for s in sessions), return_exceptions=True)
        yield "data: [DONE]\n\n"
