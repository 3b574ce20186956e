"""Continuous batching under a token budget, with KV admission and (optionally) preemption.

Invariant (vLLM's): every request has num_computed_tokens and num_tokens (prompt + output). Each step a
running request gets min(num_tokens - num_computed_tokens, remaining budget) tokens, oldest first; then
waiting requests are admitted in FIFO order while their KV fits. Chunked prefill, decode and recompute after
preemption all fall out of that. The scheduler never touches tensors: schedule() returns a plain dataclass,
the model runner executes it, update() applies the sampled tokens.

Admission policies (SchedulerConfig.admission):
- "full": admission reserves blocks for prompt + max_tokens, so a running request never waits for KV and
  nothing is preempted. Capacity is committed, not guessed.
- "usage": admission reserves the prompt (plus outputs so far) and leaves the headroom free: kv_headroom of the
  pool and at least one block per running sequence (none when nothing runs, so any prompt that fits the pool can
  start). Decode growth takes free blocks; when none are left the newest running request is preempted: its blocks
  are freed and it goes back to the head of the waiting queue (ahead of new arrivals), to recompute prompt +
  outputs so far. Its sampled tokens are kept, and per-request seeds depend on the output index, so a preempted
  request produces exactly the tokens it would have produced without preemption. A request whose next token
  would need more blocks than the whole pool finishes with "length" (the end of the context this replica holds).
The waiting queue is FIFO and its head blocks the rest, so a big request is never starved by small ones.
With prefix caching a preempted request's computed full blocks stay cached, and with the host KV tier they go to the
host when the pool hands them out, so its readmission reloads them instead of recomputing; each SchedulerOutput
carries the copies its admissions and allocations asked for (BlockManager.drain_copies).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace

from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.block_manager import BlockManager, BlockUsage, check_fits, headroom_blocks
from dcpserve.engine.core.request import FinishReason, Request, RequestStatus
from dcpserve.engine.core.step import ScheduledRequest, SchedulerOutput
from dcpserve.engine.protocol import KvLedger
from dcpserve.engine.structured_output import fill_bitmasks

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenUpdate:
    """A sampled token applied to a request, and whether that finished it."""

    request: Request
    token_id: int
    finished: bool


class Scheduler:
    """Decides which requests compute which tokens each step, within the token budget and the KV pool."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens thrown away by preemption (computed again later)
        # This step's constrained sampling rows (entry, request, min_tokens' stop tokens), masked at its end.
        self._constrained: list[tuple[ScheduledRequest, Request, tuple[int, ...]]] = []

    # ---- requests in and out -------------------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises RequestRejected when the request could never be served, naming the numbers: prompt + max_tokens
        past max_model_len, or more KV than the pool holds (prompt + max_tokens under "full", the prompt under
        "usage", where a request that outgrows the pool finishes with "length")."""
        check_fits(self.config.admission, num_prompt_tokens, max_tokens, self.config.max_model_len,
                   self.block_manager.num_blocks, self.block_manager.tokens_per_block)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.sampling_params.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request wherever it is and frees its KV. False if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """Finishes a request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        """Frees the request's KV and puts it first in line; it will recompute prompt + outputs so far."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_block_ids_sent = 0
        request.status = RequestStatus.WAITING
        self.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- one step --------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, preempted)

        # Admission: FIFO, head-of-line blocking (no starvation); none after a preemption this step.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            full = self.config.admission == "full"
            reserve_tokens = request.max_total_tokens if full else request.num_tokens
            if not self.config.enable_chunked_prefill:
                # Its whole uncached rest must fit this step's budget: a request that waits for budget must not
                # take its cached blocks and give them back (that counts a lookup and reorders the LRU each step).
                hit_blocks = self.block_manager.hit_blocks(request)
                if request.num_tokens - hit_blocks * self.block_manager.tokens_per_block > budget:
                    break
            # Takes the longest cached run of the request's blocks: its computed tokens start after them.
            if not self.block_manager.admit(request, reserve_tokens, 0 if full else self.headroom_blocks()):
                break
            remaining = request.num_tokens - request.num_computed_tokens
            count = min(remaining, budget)
            if ((count < remaining and not self.config.enable_chunked_prefill)
                    or not self.block_manager.allocate(request, request.num_computed_tokens + count)):
                self.block_manager.free(request)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_block_ids_sent = 0  # the ranks learn it (again) with this entry
            self.running.append(request)
            scheduled.append(self._entry(request, count))
            budget -= count

        if self._constrained:  # every constrained row's bitmask, filled in one call (min_tokens' stops folded in)
            states = [r.grammar for _, r, _ in self._constrained if r.grammar is not None]
            masks = fill_bitmasks(states, [b for _, _, b in self._constrained])
            for (entry, _, _), mask in zip(self._constrained, masks, strict=True):
                entry.allowed_token_bitmask = mask
            self._constrained = []
        # Decodes first, each part in scheduling order (running requests, then admitted ones).
        decodes = [entry for entry in scheduled if len(entry.token_ids) == 1]
        if len(decodes) < len(scheduled):
            scheduled = decodes + [entry for entry in scheduled if len(entry.token_ids) != 1]
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        output = SchedulerOutput(scheduled, finished, preempted, self.config.max_num_batched_tokens - budget)
        copies = self.block_manager.drain_copies()
        if copies is not None:
            output.swap_out, output.swap_in = copies.swap_out, copies.swap_in
        return output

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest], preempted: list[str]) -> int:
        """Schedules the running requests; returns the budget left. (The simulator's decode lane,
        dcpserve/simulator/decode_lane.py, advances most decodes in bulk instead.)"""
        return self._schedule_requests(list(self.running), budget, scheduled, preempted)

    def _schedule_requests(self, requests: list[Request], budget: int, scheduled: list[ScheduledRequest],
                           preempted: list[str]) -> int:
        """Schedules running requests in the given (oldest first) order, each min(its uncomputed tokens, the budget
        left), allocating or preempting as it goes; returns the budget left."""
        tokens_per_block = self.block_manager.tokens_per_block
        for request in requests:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if count <= 0:
                continue
            # Most steps' tokens fit the blocks the request holds (a decode needs a new one every tokens_per_block
            # steps): the allocation is then a no-op, skipped without its calls.
            if (request.num_computed_tokens + count > len(request.block_ids) * tokens_per_block
                    and not self._allocate_or_preempt(request, request.num_computed_tokens + count, preempted)):
                continue
            scheduled.append(self._entry(request, count))
            budget -= count
        return budget

    def _allocate_or_preempt(self, request: Request, num_tokens: int, preempted: list[str]) -> bool:
        """Blocks for num_tokens tokens of a running request, preempting the newest requests if needed.
        Under admission="full" the promise always covers it; False means the request itself was preempted."""
        while not self.block_manager.allocate(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _entry(self, request: Request, count: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + count
        all_token_ids = request.all_token_ids
        sample = end == len(all_token_ids)
        params = request.sampling_params
        num_outputs = len(request.output_token_ids)
        # vLLM's min_tokens: EOS is masked too when ignore_eos is set (it would not stop the request anyway).
        blocked = (tuple(sorted(self.eos_token_ids | set(params.stop_token_ids or ())))
                   if sample and num_outputs < params.min_tokens else ())
        constrained = sample and request.grammar is not None
        # No block sent yet = the ranks do not know the request (every scheduled entry holds at least one block).
        block_ids = request.block_ids
        sent, request.num_block_ids_sent = request.num_block_ids_sent, len(block_ids)
        if sent:  # the common entry (a running request's decode): positional, the step builds one per request
            entry = ScheduledRequest(request.request_id, all_token_ids[start:end], start,
                                     block_ids[sent:], sample, num_outputs, None,
                                     None if sample else all_token_ids[end], () if constrained else blocked, None)
            if constrained:
                self._constrained.append((entry, request, blocked))
            return entry
        entry = ScheduledRequest(
            request_id=request.request_id,
            token_ids=all_token_ids[start:end],
            start_position=start,
            new_block_ids=list(block_ids),
            sample=sample,
            num_output_tokens=num_outputs,
            sampling_params=params,
            next_token_id=None if sample else all_token_ids[end],
            blocked_token_ids=() if constrained else blocked,
            prefix_token_ids=all_token_ids[:start] if start and params.has_penalties else None,
        )
        if constrained:
            self._constrained.append((entry, request, blocked))
        return entry

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[TokenUpdate]:
        """Applies a step's results: advances computed tokens, appends sampled tokens, finishes requests."""
        updates: list[TokenUpdate] = []
        # Bound once: this loop runs once per request per step.
        requests, running = self.requests, RequestStatus.RUNNING
        cache_computed, stop_reason = self.block_manager.cache_computed, self._stop_reason
        for entry in output.scheduled:
            request = requests.get(entry.request_id)
            if request is None or request.status is not running:
                continue  # aborted while the step ran: its blocks are already free
            request.num_computed_tokens += len(entry.token_ids)
            cache_computed(request)
            if not entry.sample:
                continue
            token = sampled[entry.request_id]
            request.append_output(token)
            reason = stop_reason(request, token)
            grammar = request.grammar
            if grammar is not None:
                if not grammar.accept(token):  # the mask allows only tokens the grammar accepts: an engine bug
                    logger.error("request %s: token %d was sampled against its grammar; it ends here",
                                 request.request_id, token)
                    reason = reason or FinishReason.ABORT
                elif reason is None and grammar.is_terminated:
                    reason = FinishReason.STOP  # satisfied and stopped (ignore_eos cannot extend a finished grammar)
            if reason is not None:
                self._finish(request, reason)
            updates.append(TokenUpdate(request, token, reason is not None))
        return updates

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if params.stop_token_ids and token in params.stop_token_ids:
            return FinishReason.STOP
        num_tokens = len(request.all_token_ids)
        if len(request.output_token_ids) >= params.max_tokens or num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        if num_tokens > self.block_manager.capacity_tokens:
            return FinishReason.LENGTH  # the next token's KV would not fit even in the whole pool
        return None

    # ---- state -----------------------------------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_pending_finishes(self) -> bool:
        return bool(self._finished_since_last_step)

    def usage(self) -> BlockUsage:
        return self.block_manager.usage()

    def headroom_blocks(self, num_sequences: int | None = None) -> int:
        """Blocks "usage" admission leaves free as growth room for `num_sequences` sequences (default: the running
        ones): kv_headroom of the pool and at least one per sequence; none for no sequence (so any prompt that fits
        the pool can start), none under "full". The engine's ledger counts every sequence its replica holds."""
        count = len(self.running) if num_sequences is None else num_sequences
        return headroom_blocks(self.config.admission, self.config.kv_headroom, self.block_manager.num_blocks, count)

    def kv_ledger(self) -> KvLedger:
        """The KV ledger over the unfinished requests: what the replica accepts, refuses and reports with. A waiting
        request's cached run is looked up once for both its blocks and its prefill (the replica builds a ledger at
        every report and accept, over every request it holds)."""
        per_request: dict[str, int] = {}
        prefill_tokens = 0
        running = RequestStatus.RUNNING
        for request in self.requests.values():
            if request.status is running:
                per_request[request.request_id] = self.committed_blocks(request)
                prefill_tokens += self._prefill_left(request)
            else:
                hits, pinned = self.block_manager.cached_run(request)
                per_request[request.request_id] = self.committed_blocks(request, pinned)
                prefill_tokens += self._prefill_left(request, hits)
        return KvLedger(
            admission=self.config.admission,
            capacity_blocks=self.block_manager.num_blocks,
            tokens_per_block=self.block_manager.tokens_per_block,
            used_blocks=self.block_manager.usage().used,
            committed_blocks=sum(per_request.values()),
            headroom_blocks=self.headroom_blocks(num_sequences=len(per_request)),
            per_request=per_request,
            prefill_tokens=prefill_tokens,
        )

    def ledger_with(self, ledger: KvLedger, request: Request, need: int) -> KvLedger:
        """`ledger` (kv_ledger's, with nothing changed since but requests added) after add_request(request) with its
        `need` (committed_blocks): equal to kv_ledger() then, without walking every request again. Adding a waiting
        request changes no other entry (it allocates, pins and computes nothing), so only its own entry, the total,
        the headroom of one more sequence and its prefill change. A burst of adds checks each against the one
        before it in O(1) entries, not O(requests held) each."""
        per_request = dict(ledger.per_request)
        per_request[request.request_id] = need
        hits, _ = self.block_manager.cached_run(request)
        return replace(ledger, committed_blocks=ledger.committed_blocks + need,
                       headroom_blocks=self.headroom_blocks(num_sequences=len(per_request)),
                       per_request=per_request,
                       prefill_tokens=ledger.prefill_tokens + self._prefill_left(request, hits))

    def _prefill_left(self, request: Request, hit_blocks: int | None = None) -> int:
        """Prompt tokens the request has still to compute: a waiting one's cached prefix (on device or in the host
        tier, hit_blocks when the caller looked it up) is not computed again."""
        left = request.num_prompt_tokens - request.num_computed_tokens
        if left > 0 and request.num_computed_tokens == 0:
            hits = self.block_manager.hit_blocks(request) if hit_blocks is None else hit_blocks
            left -= hits * self.block_manager.tokens_per_block
        return max(left, 0)

    def committed_blocks(self, request: Request, pinned_hits: int | None = None) -> int:
        """The blocks the admission policy counts for an unfinished request: "full" its prompt + max_tokens; "usage"
        what it holds, or (waiting) what it needs to start: its prompt plus outputs so far. Less, with prefix
        caching, the cached blocks it shares: a running request those charged to another holder, a waiting one those
        of its cached prefix that running requests hold now (the blocks it would add, not the ones it would share)."""
        manager = self.block_manager
        running = request.status == RequestStatus.RUNNING
        if running:
            shared = manager.shared_blocks(request)
        else:  # pinned_hits: the caller looked the cache up already
            shared = manager.pinned_hits(request) if pinned_hits is None else pinned_hits
        if self.config.admission == "full":
            return manager.blocks_for(request.max_total_tokens) - shared
        held = max(request.reserved_blocks, len(request.block_ids))
        return (held if running else max(held, manager.blocks_for(request.num_tokens))) - shared
