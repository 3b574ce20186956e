"""vLLM as the second backend of the engine protocol: vLLM's AsyncLLM inside one Serve replica.

vLLM runs the model (its kernels, CUDA graphs, its own `-dcp`); this adapter gives it the same face as the native
engine (dcpserve.engine.protocol.EngineClient), so admission, routing, autoscaling and metrics above it are unchanged:

- KV capacity comes from vLLM after it sized its cache: `num_gpu_blocks` per rank minus the null block, each a
  logical block of block_size * dcp tokens (one page on every rank of the DCP group, as in the native engine).
- The ledger (what accept / refuse and the admission queue count) is kept here, per request, with the same rules
  and functions as the native scheduler (block_manager.admission_blocks / headroom_blocks): "full" commits prompt
  + max_tokens, so what this replica accepts always fits vLLM's pool at once and vLLM never has to preempt;
  "usage" commits prompt + outputs so far plus the headroom, and vLLM preempts (recomputes) when decode runs out,
  as the native engine does.
- Running / waiting / KV usage / preemptions / prefix cache queries and hits come from a vLLM stat logger of ours
  (dcpserve/engine/backends/vllm/stats.py: `StatsRecorder`); with kv_host_tier (vLLM's CPU offloading) the host
  tier's figures come from that and the KV events (stats.py: `VllmHostTier`).
- Prefix caching is vLLM's own. Which blocks it caches we learn from its KV cache events: its engine core (another
  process) publishes them over ZeroMQ to a SUB socket of ours bound on loopback
  (dcpserve/engine/backends/vllm/prefix.py: `KvEventSubscriber`), and `VllmPrefixCache` names each stored block with our
  chained hash (dcpserve.engine.core.prefix_cache: vLLM's block of block_size * dcp tokens is our logical block) for the
  PrefixReports the app routes by, and for the ledger, which charges a cached block shared by several requests held here
  to one of them only.
- Executors: on CPU vLLM's multiprocessing executor, one core per TP rank (VLLM_CPU_OMP_THREADS_BIND); on CUDA with
  tp > 1 vLLM's Ray executor in the replica's own placement group (one {GPU: 1} bundle per TP rank).

vllm is imported only here, in dcpserve/engine/backends/vllm/args.py (its arguments and pre-start checks) and in
dcpserve/engine/backends/vllm/prefix.py (its KV events), and only when a vLLM engine is started or validated.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from dcpserve.engine.backends.vllm.args import (
    set_cpu_threads_bind,
    to_vllm_sampling_params,
    validate_vllm_args,
    vllm_engine_kwargs,
)
from dcpserve.engine.backends.vllm.prefix import HeldRequest, KvEventSubscriber, VllmPrefixCache
from dcpserve.engine.backends.vllm.reaper import EngineCoreReaper, descendants
from dcpserve.engine.backends.vllm.stats import StatsRecorder, VllmHostTier, offloaded_block_bytes, stat_logger_factory
from dcpserve.engine.core.block_manager import admission_blocks, blocks_needed, check_fits, headroom_blocks
from dcpserve.engine.core.prefix_cache import PrefixReport
from dcpserve.engine.core.request import resolve_prompt_token_ids
from dcpserve.engine.protocol import (
    DeltaSink,
    EngineDeadError,
    EngineStats,
    KvLedger,
    RankKvStats,
    RequestDelta,
    RequestError,
    TokenLogprob,
)
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.tokenizer import TextStream, Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from dcpserve.engine.args import EngineArgs

logger = logging.getLogger(__name__)

class VllmEngine:
    """The vLLM backend of dcpserve.engine.protocol.EngineClient."""

    backend = "vllm"

    def __init__(self, args: EngineArgs, on_step: Callable[[EngineStats], None] | None = None) -> None:
        device = args.device or _default_device()
        validate_vllm_args(args, device)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.args = args
        self.device = device
        self.on_step = on_step
        self.admission = args.admission
        self.dead_error: BaseException | None = None
        self._held: dict[str, HeldRequest] = {}
        self._relays: dict[str, asyncio.Task[None]] = {}  # submit_to()'s requests: the task relaying each to its sink
        self._recorder = StatsRecorder()
        self.prefix: VllmPrefixCache | None = None
        self._app_tokens_per_block = 0  # block_size * dcp: the blocks the ingress hashes prompts in
        # Bound before vLLM starts, so its engine core's publisher connects to it from its first event.
        self._events = KvEventSubscriber() if args.enable_prefix_caching else None
        try:
            kwargs = vllm_engine_kwargs(args, device, self._events.endpoint if self._events else None,
                                        self._events.topic if self._events else "")
            if device == "cpu":
                set_cpu_threads_bind(args.tensor_parallel_size)
            engine_args = AsyncEngineArgs(**kwargs)
            vllm_config = engine_args.create_engine_config()
            if kwargs.get("distributed_executor_backend") == "ray":
                # The replica's own placement group: one {GPU: 1} bundle per TP rank (vLLM skips the CPU bundle).
                import ray

                vllm_config.parallel_config.placement_group = ray.util.get_current_placement_group()
            before = set(descendants(os.getpid()))
            self.llm = AsyncLLM.from_vllm_config(
                vllm_config, stat_loggers=[stat_logger_factory(self._recorder, self._on_record)],
                disable_log_stats=False,
            )
            # vLLM's engine core (and its workers) must not outlive this process, however it ends.
            self._reaper = EngineCoreReaper()
            not_vllms = before | process_services()
            self._reaper.watch([pid for pid in descendants(os.getpid()) if pid not in not_vllms])
        except BaseException:
            if self._events is not None:
                self._events.close()
            raise
        self.vllm_config = self.llm.vllm_config
        cache = self.vllm_config.cache_config
        dcp = self.vllm_config.parallel_config.decode_context_parallel_size
        self.tp = self.vllm_config.parallel_config.tensor_parallel_size
        self.dcp = dcp
        self.block_size = cache.block_size
        self.tokens_per_block = cache.block_size * dcp
        self.num_blocks = int(cache.num_gpu_blocks) - 1  # vLLM's pool keeps one null block that holds no KV
        self.max_model_len = int(self.vllm_config.model_config.max_model_len)
        self.vocab_size = int(self.vllm_config.model_config.get_vocab_size())
        self.num_kv_heads = int(self.vllm_config.model_config.get_total_num_kv_heads())
        self._tokenizer = load_tokenizer(args.model, (), trust_remote_code=args.trust_remote_code)
        if self._events is not None:
            if not cache.enable_prefix_caching:
                # validate_vllm_args refuses the configurations known to do this; any other one serves uncached.
                logger.warning("vLLM turned prefix caching off for this model and platform: this replica serves "
                               "without it and reports no cached prefixes")
                self._events.close()
                self._events = None
            else:
                if self.tokens_per_block != args.block_size * args.decode_context_parallel_size:
                    logger.warning("vLLM caches blocks of %d tokens, not block_size * dcp = %d: the app's prefix "
                                   "hashes match none of this replica's", self.tokens_per_block,
                                   args.block_size * args.decode_context_parallel_size)
                self.prefix = VllmPrefixCache(self.tokens_per_block, args.prefix_hash_seed())
                self._app_tokens_per_block = args.block_size * args.decode_context_parallel_size
                self._events.start(self.prefix)
        # kv_host_tier: vLLM's CPU offloading of kv_offloading_size GiB over the replica's ranks (stats.py).
        self._host_tier = VllmHostTier(int(float(kwargs["kv_offloading_size"]) * (1 << 30)),
                                       offloaded_block_bytes(self.vllm_config), self.tokens_per_block) if (
            "kv_offloading_size" in kwargs) else None
        logger.info("vLLM engine: tp=%d dcp=%d, %d KV blocks of %d tokens (%d tokens), max_model_len %d",
                    self.tp, dcp, self.num_blocks, self.tokens_per_block, self.num_blocks * self.tokens_per_block,
                    self.max_model_len)

    # ---- requests ---------------------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    def _encode(self, prompt: str) -> list[int]:
        if self._tokenizer is None:
            raise ValueError(f"the model directory {self.args.model} has no tokenizer: pass prompt_token_ids")
        return self._tokenizer.encode(prompt)

    def admission_blocks(self, num_prompt_tokens: int, max_tokens: int) -> int:
        return admission_blocks(self.admission, num_prompt_tokens, max_tokens, self.tokens_per_block)

    async def admission_need(self, prompt_token_ids: list[int], max_tokens: int) -> int:
        return self._admission_need(prompt_token_ids, max_tokens)

    def _admission_need(self, prompt_token_ids: list[int], max_tokens: int) -> int:
        """The blocks this request would add here now: admission_blocks less the blocks of its cached prefix (the
        longest cached run before its last token) that requests held here reference, shared rather than added."""
        need = self.admission_blocks(len(prompt_token_ids), max_tokens)
        return need - (self.prefix.pinned_hits(prompt_token_ids) if self.prefix is not None else 0)

    async def prefix_report(self, reader_epoch: str | None, reader_version: int) -> PrefixReport | None:
        """vLLM's cached prefix blocks (as our hashes) since the reader's (epoch, version), or all of them; None
        when prefix caching is off."""
        return None if self.prefix is None else self.prefix.report(reader_epoch, reader_version)

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises RequestRejected if a request of this size could never be served here (the native rules)."""
        check_fits(self.admission, num_prompt_tokens, max_tokens, self.max_model_len, self.num_blocks,
                   self.tokens_per_block)

    async def submit(self, sampling_params: SamplingParams | None = None,
                     prompt_token_ids: list[int] | None = None, request_id: str | None = None, check_kv: bool = False,
                     prompt: str | None = None, prompt_hashes: Sequence[int] = ()) -> AsyncGenerator[RequestDelta]:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        params = sampling_params or SamplingParams()
        prompt_token_ids = resolve_prompt_token_ids(prompt, prompt_token_ids, self._encode, self.vocab_size, params)
        self.check_request(len(prompt_token_ids), params.max_tokens)
        if request_id is None:
            raise ValueError("the vLLM backend needs a request_id")
        if request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already in use")
        if check_kv:
            self.kv_ledger().require(self._admission_need(prompt_token_ids, params.max_tokens))
        held = HeldRequest(len(prompt_token_ids), params.max_tokens, token_ids=list(prompt_token_ids))
        if self.prefix is not None and self.tokens_per_block == self._app_tokens_per_block:
            # The ingress hashed the prompt in blocks of block_size * dcp; only vLLM's own block size may differ.
            held.block_hashes = list(prompt_hashes[:len(prompt_token_ids) // self.tokens_per_block])
        self._held[request_id] = held
        if self.prefix is not None:
            self.prefix.hold(request_id, held)
        return self._stream(request_id, list(prompt_token_ids), params)

    async def submit_to(self, sink: DeltaSink, sampling_params: SamplingParams, prompt_token_ids: list[int],
                        request_id: str, check_kv: bool = False, *, prompt_hashes: Sequence[int] = ()) -> None:
        """submit(), the deltas delivered to `sink`. vLLM streams each request on its own (its OutputProcessor splits
        a step's outputs per request, its one place for that), so a task per request relays its stream to the
        sink as it comes; abort() cancels it."""
        stream = await self.submit(sampling_params, prompt_token_ids, request_id, check_kv,
                                   prompt_hashes=prompt_hashes)
        # A fresh context: the relay belongs to the engine, not to the call that submitted the request.
        self._relays[request_id] = asyncio.get_running_loop().create_task(
            self._relay(request_id, stream, sink), context=contextvars.Context())

    async def _relay(self, request_id: str, stream: AsyncGenerator[RequestDelta], sink: DeltaSink) -> None:
        try:
            async for delta in stream:
                sink.deliver((delta,))
        except asyncio.CancelledError:
            pass  # aborted: the cancellation ended the stream, whose end aborted the request in vLLM
        except Exception as err:  # noqa: BLE001 - the request's error goes to its sink
            sink.fail(request_id, err)
        finally:
            if self._relays.get(request_id) is asyncio.current_task():
                del self._relays[request_id]

    async def _stream(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> AsyncGenerator[RequestDelta]:
        from vllm.inputs import TokensPrompt

        held = self._held[request_id]
        # Our text and stop strings, as the native engine's (vLLM's detokenizer would also emit undecodable prompt
        # bytes in the first delta): vLLM only generates tokens.
        text = TextStream.for_params(self._tokenizer, prompt_token_ids, params)
        finished = vllm_finished = False
        try:
            async for output in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_token_ids),
                                                  to_vllm_sampling_params(params), request_id):
                completion = output.outputs[0]
                new_ids = list(completion.token_ids)
                held.num_output_tokens += len(new_ids)
                if held.num_cached_tokens is None and output.num_cached_tokens is not None:
                    held.num_cached_tokens = int(output.num_cached_tokens)
                if self.prefix is not None and new_ids:
                    held.token_ids += new_ids
                    self.prefix.hold(request_id, held)
                finished = vllm_finished = output.finished
                new_text, stopped = text.push(new_ids, finished)
                reason = completion.finish_reason if finished else None
                if stopped and not finished:
                    finished, reason = True, "stop"  # the stream's end aborts the request inside vLLM
                if finished and reason not in ("stop", "length", "abort"):
                    reason = "stop"
                yield RequestDelta(
                    request_id=request_id,
                    new_token_ids=new_ids,
                    new_text=new_text,
                    finished=finished,
                    finish_reason=reason,
                    num_prompt_tokens=held.num_prompt_tokens,
                    num_output_tokens=held.num_output_tokens,
                    logprobs=(None if params.logprobs is None or completion.logprobs is None else
                              [_token_logprob(t, position, params.logprobs)
                               for t, position in zip(new_ids, completion.logprobs, strict=True)]),
                    prompt_logprobs=(None if params.prompt_logprobs is None or not output.prompt_logprobs else
                                     [None] + [_token_logprob(t, position, params.prompt_logprobs)
                                               for t, position in zip(prompt_token_ids[1:],
                                                                      list(output.prompt_logprobs)[1:], strict=True)]),
                )
                if finished:
                    break
        except Exception as err:
            if _is_vllm_client_error(err):
                raise RequestError(str(err)) from None  # vLLM's validation: the client's error (an OpenAI 400)
            if not self.llm.errored:
                raise
            self.dead_error = err
            raise EngineDeadError(f"the engine failed: {err!r}") from err
        finally:
            self._release(request_id)
            if not vllm_finished:
                self.abort(request_id)  # the client went away, or a stop string ended it before vLLM did

    def _release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None and self.prefix is not None:
            self.prefix.release(request_id, held)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._held

    def abort(self, request_id: str) -> None:
        """Drops the request from the ledger now and from vLLM at the next turn of the event loop. Idempotent."""
        self._release(request_id)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        relay = self._relays.pop(request_id, None)
        if relay is not None and relay is not asyncio.current_task():
            relay.cancel()
        # A fresh context: the abort belongs to the engine, not to the (possibly cancelled) request that asked.
        loop.create_task(self._abort(request_id), context=contextvars.Context())

    async def _abort(self, request_id: str) -> None:
        try:
            await self.llm.abort(request_id)
        except Exception as err:  # noqa: BLE001 - an unknown or finished id; nothing to free
            logger.debug("vLLM abort of %s: %r", request_id, err)

    # ---- state --------------------------------------------------------------------------------------------------

    def _committed(self, held: HeldRequest) -> int:
        if self.admission == "full":
            return blocks_needed(held.num_prompt_tokens + held.max_tokens, self.tokens_per_block)
        return blocks_needed(held.num_prompt_tokens + held.num_output_tokens, self.tokens_per_block)

    def _used_blocks(self) -> int:
        return round(self._recorder.kv_cache_usage * self.num_blocks)

    def _per_request(self) -> dict[str, int]:
        """Each held request's blocks under the policy, less the cached blocks it shares that are charged to another
        held request (so a block several requests read is counted once)."""
        shared = self.prefix.shared_blocks(self._held) if self.prefix is not None else {}
        return {rid: self._committed(held) - shared.get(rid, 0) for rid, held in self._held.items()}

    def kv_ledger(self) -> KvLedger:
        per_request = self._per_request()
        return KvLedger(
            admission=self.admission,
            capacity_blocks=self.num_blocks,
            tokens_per_block=self.tokens_per_block,
            used_blocks=self._used_blocks(),
            committed_blocks=sum(per_request.values()),
            headroom_blocks=headroom_blocks(self.admission, self.args.kv_headroom, self.num_blocks, len(per_request)),
            per_request=per_request,
            prefill_tokens=sum(held.num_prompt_tokens for held in self._held.values() if not held.num_output_tokens),
        )

    def stats(self) -> EngineStats:
        rec = self._recorder
        used = self._used_blocks()
        reserved = min(self.num_blocks, max(used, sum(self._per_request().values())))
        per_rank = tuple(
            RankKvStats(rank=rank, dcp_rank=rank % self.dcp, pages_total=self.num_blocks, pages_used=used,
                        tokens_capacity=self.num_blocks * self.block_size,
                        tokens_used=min(used * self.block_size, self.num_blocks * self.block_size))
            for rank in range(self.tp)
        )
        return EngineStats(
            backend="vllm",
            tp=self.tp,
            dcp=self.dcp,
            num_kv_heads=self.num_kv_heads,
            admission=self.admission,
            kv_blocks_total=self.num_blocks,
            kv_block_size_tokens=self.tokens_per_block,
            kv_blocks_used=used,
            kv_blocks_reserved=reserved,
            num_running=rec.num_running,
            num_waiting=rec.num_waiting,
            num_pending=max(0, len(self._held) - rec.num_running - rec.num_waiting),
            num_preemptions=rec.num_preemptions,
            tokens_computed=rec.num_prompt_tokens + rec.num_generation_tokens,
            generation_tokens=rec.num_generation_tokens,
            num_steps=rec.num_records,
            last_step_seconds=rec.step_seconds,
            last_step_tokens=rec.step_tokens,
            last_step_prompt_tokens=rec.step_prompt_tokens,
            healthy=self.dead_error is None and not self.llm.errored,
            prefix_caching=self.prefix is not None,
            prefix_cache_queries=rec.prefix_cache_queries,
            prefix_cache_hits=rec.prefix_cache_hits + rec.host_hit_tokens,  # as natively: the host tier's hits too
            kv_blocks_cached=self.prefix.num_cached_blocks if self.prefix is not None else 0,
            prefix_cache_evictions=self.prefix.num_evictions if self.prefix is not None else 0,
            per_rank=per_rank,
            host_tier=self._host_tier.stats(self.prefix, rec) if self._host_tier is not None else None,
        )

    def _on_record(self) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.stats())
            except Exception as err:  # noqa: BLE001 - a metrics hook must never stop vLLM's output loop
                logger.warning("on_step failed: %r", err)

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        try:
            await self.llm.check_health()
        except Exception as err:
            self.dead_error = err
            raise EngineDeadError(f"the vLLM engine is dead: {err!r}") from err

    async def shutdown(self) -> None:
        """vLLM's own shutdown with a grace that fits its engine core's teardown; whatever that leaves (or a failure
        of vLLM's force-kill path) the reaper ends."""
        try:
            await asyncio.to_thread(self.llm.shutdown, process_shutdown_grace_s())
        except Exception as err:  # noqa: BLE001 - the reaper below ends what vLLM's shutdown left
            logger.warning("vLLM's shutdown failed (%r); ending its remaining processes", err)
        finally:
            await asyncio.to_thread(self._reaper.close)
            if self._events is not None:
                await asyncio.to_thread(self._events.close)


# vLLM's engine core, on SIGTERM, waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5) for its workers to exit, then this long
# again after sending them SIGTERM (multiproc_executor._ensure_worker_termination), before it exits itself.
_VLLM_WORKER_SIGTERM_WAIT_S = 4.0
_ENGINE_CORE_EXIT_S = 5.0  # the engine core's own exit after its workers': its queues, ZeroMQ, the interpreter


def process_shutdown_grace_s() -> float:
    """How long vLLM's process manager waits for the engine core to exit after SIGTERM before it force-kills it.

    vLLM's default, 5 s, is shorter than the engine core's own teardown of its workers: a tp=2 engine on CPU took
    4.3-5.0 s to exit on an idle 2-core machine and longer on a loaded one. It was then force-killed mid-teardown,
    and vLLM's force-kill (kill_process_tree) raised psutil.NoSuchProcess for a worker that exited between being
    listed and being named, so the shutdown failed with the engine core not yet killed. A process that exits on time
    ends the wait at once; this only bounds a stuck one."""
    from vllm import envs

    return envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS + _VLLM_WORKER_SIGTERM_WAIT_S + _ENGINE_CORE_EXIT_S


def process_services() -> set[int]:
    """Processes below this one that vLLM's start may have started but that serve the whole process, not vLLM's
    engine: multiprocessing's resource tracker (started by the first spawn). It ignores SIGTERM and cleans up the
    process's shared memory and semaphores after the process exits, so the reaper must not end it: it used to, with
    SIGKILL after the grace period, which added 5 s to every shutdown and left multiprocessing to relaunch it
    ("resource_tracker: process died unexpectedly ... Some resources might leak")."""
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid is not None else set()


def _token_logprob(token_id: int, position: Any, num_top: int) -> TokenLogprob:
    """One position of vLLM's logprobs ({token_id: Logprob}: the chosen token first, then the top-k by rank; the
    chosen one appears once when it is among them) as a TokenLogprob."""
    items = list(position.items())
    chosen = position[token_id]
    top = items[1:] if len(items) > num_top else items
    top = sorted(top, key=lambda item: item[1].rank)[:num_top]
    return TokenLogprob(token_id=int(token_id), logprob=float(chosen.logprob), rank=int(chosen.rank),
                        top=tuple((int(t), float(lp.logprob)) for t, lp in top))


def _is_vllm_client_error(err: BaseException) -> bool:
    """vLLM's request validation errors (bad token ids, too long): the client's error, not the engine's."""
    if isinstance(err, ValueError):
        return True
    return type(err).__name__ in ("VLLMClientError", "VLLMValidationError", "GracefulHTTPError")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
