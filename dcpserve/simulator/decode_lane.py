"""The decode lane: the engine's Scheduler, with the decodes that nothing can change advanced in bulk.

A simulated replica's step costs the real scheduler's per-row work: an entry, an update, a stop check and a token for
every running request. At hundreds of sequences per replica and tens of replicas that is most of a large
simulation's time (about 10 us of CPU per output token), while a decode step of a simulated request is known in
advance: its token is FILLER_TOKEN until the trace's output length, it computes one token, it needs a new block every
tokens_per_block steps, and it names a full block the step after it fills one.

`LaneScheduler` keeps such requests in a lane and does only what changes something, at the step it happens, in the
order the real scheduler would do it:
- a request joins the lane after a step in which it sampled a token that did not finish it (it is then a decode),
  when its sampling has nothing the lane cannot know (no stop ids, no grammar) and its next token is not its last;
- each step, a lane request counts one row in the step's work (`lane_rows`, `lane_context_tokens`: the step-time
  model's inputs, as StepWork.from_rows would sum them) and one token of the budget; its allocation (every
  tokens_per_block steps, `_allocate_or_preempt` as the real loop calls it, preemptions included) and its block's
  naming (`cache_computed`) happen at their steps, merged by admission order with the other requests' own;
- its computed tokens and outputs are brought up to date (`_materialize`) only when something reads or changes them
  one by one: those two events, and when it leaves the lane (its last token's step, a preemption, an abort), after
  which the real code handles it as any other request.
What every report, ledger, sample and autoscaling decision reads (block tables, charges, promises, the prefix cache
and its reporter, the host tier's copies) is therefore the same at every step as with the real scheduler alone, and
the lane's tokens are counted per step (`lane_tokens`) and per request when it leaves (`lane_left`). A run with the
lane and one without it give the same records (tests/simulator/test_decode_lane.py). Not a model of the engine:
the real engine never skips a row.

The lane relies on the scheduler's order: running requests are scheduled oldest first, so decodes (older) come
before the one prefill that is chunking (the newest: nothing is admitted behind a prompt that took the rest of the
budget). When a step breaks that, or the running requests exceed the token budget (some decodes would wait), every
request leaves the lane and the step is the real scheduler's.
"""

from __future__ import annotations

from collections import defaultdict

from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.request import FinishReason, Request, RequestStatus
from dcpserve.engine.core.scheduler import Scheduler, TokenUpdate
from dcpserve.engine.core.step import ScheduledRequest, SchedulerOutput


class _Member:
    """A request in the lane: its computed tokens and outputs are up to date as of `base_step` steps; it gains one of
    each per step since."""

    __slots__ = ("request", "seq", "base_step", "join_outputs", "exit_step", "next_alloc", "next_cache")

    def __init__(self, request: Request, seq: int, base_step: int, exit_step: int, next_alloc: int,
                 next_cache: int) -> None:
        self.request = request
        self.seq = seq
        self.base_step = base_step
        self.join_outputs = len(request.output_token_ids)
        self.exit_step = exit_step  # the step that samples its last token: it leaves the lane before it
        self.next_alloc = next_alloc  # the step whose schedule allocates its next block
        self.next_cache = next_cache  # the step after whose update it names its next full block


class LaneScheduler(Scheduler):
    """Scheduler with a decode lane (module doc). `output_lengths`: request id -> the trace's output length (the
    simulated replica's own dict: a request samples FILLER until its last token); `filler_token`: that token."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: frozenset[int],
                 output_lengths: dict[str, int], filler_token: int) -> None:
        super().__init__(config, block_manager, eos_token_ids)
        self._output_lengths = output_lengths
        self._filler = filler_token
        self.steps_done = 0  # steps whose update has run
        self._seq: dict[str, int] = {}  # running request id -> its place in the running order (admission order)
        self._next_seq = 0
        self._lane: dict[str, _Member] = {}
        self._lane_offset = 0  # sum over members of (computed tokens - base_step): a row's start is that + the step
        self._lane_max_seq = -1  # at least the largest seq in the lane
        self._outside: dict[str, Request] = {}  # running requests not in the lane
        self._exits: defaultdict[int, list[_Member]] = defaultdict(list)
        self._allocs: defaultdict[int, list[_Member]] = defaultdict(list)
        self._caches: defaultdict[int, list[_Member]] = defaultdict(list)
        self._num_running = 0  # len(self.running) after the running part of this step's schedule
        self.lane_rows = 0  # this step's lane decodes (rows of one token)
        self.lane_context_tokens = 0  # the sum of their context after the step (start + 1)
        self.lane_tokens = 0  # tokens the lane sampled in the last update
        self.lane_left: list[tuple[Request, int]] = []  # (request, tokens it sampled in the lane), until drained

    @property
    def lane_size(self) -> int:
        return len(self._lane)

    def drain_left(self) -> list[tuple[Request, int]]:
        """The requests that left the lane since the last call, with the tokens each sampled there."""
        left, self.lane_left = self.lane_left, []
        return left

    # ---- membership -------------------------------------------------------------------------------------------

    def _materialize(self, member: _Member, step: int) -> None:
        """Brings the request's computed tokens and outputs up to `step` steps."""
        count = step - member.base_step
        if count > 0:
            request = member.request
            request.num_computed_tokens += count
            tokens = [self._filler] * count
            request.output_token_ids.extend(tokens)
            request.all_token_ids.extend(tokens)
            member.base_step = step

    def _leave(self, member: _Member, step: int) -> None:
        request = member.request
        self._materialize(member, step)
        del self._lane[request.request_id]
        self._lane_offset -= request.num_computed_tokens - member.base_step
        self._outside[request.request_id] = request
        self.lane_left.append((request, len(request.output_token_ids) - member.join_outputs))

    def _join(self, request: Request) -> None:
        """After an update: the request joins if its next token is not its last and nothing but the trace decides
        its tokens."""
        request_id = request.request_id
        length = self._output_lengths.get(request_id)
        params = request.sampling_params
        if (length is None or request.status is not RequestStatus.RUNNING or request_id in self._lane
                or request.num_tokens - request.num_computed_tokens != 1 or request.grammar is not None
                or params.stop_token_ids):
            return
        outputs, tokens = len(request.output_token_ids), request.num_tokens
        # Steps from now to the one that samples its last token (_stop_reason's, and the trace's EOS).
        steps = min(length - outputs - 1, params.max_tokens - outputs - 1, self.config.max_model_len - tokens - 1,
                    self.block_manager.capacity_tokens - tokens)
        if steps < 1:
            return
        now, computed = self.steps_done, request.num_computed_tokens
        tokens_per_block = self.block_manager.tokens_per_block
        member = _Member(request, self._seq[request_id], now, now + steps,
                         now + max(0, len(request.block_ids) * tokens_per_block - computed),
                         now + (-(computed + 1)) % tokens_per_block)
        del self._outside[request_id]
        self._lane[request_id] = member
        self._lane_offset += computed - now
        self._lane_max_seq = max(self._lane_max_seq, member.seq)
        self._exits[member.exit_step].append(member)
        self._allocs[member.next_alloc].append(member)
        self._caches[member.next_cache].append(member)

    def _forget(self, request: Request) -> None:
        member = self._lane.get(request.request_id)
        if member is not None:
            self._leave(member, self.steps_done)
        self._outside.pop(request.request_id, None)
        self._seq.pop(request.request_id, None)

    def _preempt(self, request: Request) -> None:
        self._forget(request)
        super()._preempt(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.RUNNING:
            self._forget(request)
        super()._finish(request, reason)

    # ---- one step ---------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = super().schedule()
        for request in self.running[self._num_running:]:  # admitted this step: the newest
            self._seq[request.request_id] = self._next_seq
            self._next_seq += 1
            self._outside[request.request_id] = request
        return output

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest], preempted: list[str]) -> int:
        step, lane, seq = self.steps_done, self._lane, self._seq
        for member in self._exits.pop(step, ()):
            if lane.get(member.request.request_id) is member:
                self._leave(member, step)
        # The members that allocate this step (popped whether or not the lane has members left: no stale steps kept).
        allocating = [m for m in self._allocs.pop(step, ()) if lane.get(m.request.request_id) is m]
        outside = sorted(self._outside.values(), key=lambda r: seq[r.request_id])
        decodes = [r for r in outside if r.num_tokens - r.num_computed_tokens <= 1]
        chunks = [r for r in outside if r.num_tokens - r.num_computed_tokens > 1]
        if lane and (len(self.running) > budget or (chunks and seq[chunks[0].request_id] < self._lane_max_seq)):
            for member in list(lane.values()):  # a decode would wait, or a prompt is older than a decode
                self._leave(member, step)
        if not lane:
            self._lane_max_seq = -1
            self.lane_rows = self.lane_context_tokens = 0
            budget = super()._schedule_running(budget, scheduled, preempted)
            self._num_running = len(self.running)
            return budget
        # The decodes that do something this step (allocate), the lane's and the others', in the running order.
        actors: list[tuple[int, _Member | Request]] = [(m.seq, m) for m in allocating]
        actors += [(seq[r.request_id], r) for r in decodes]
        actors.sort(key=lambda actor: actor[0])
        for _, actor in actors:
            if isinstance(actor, _Member):
                if lane.get(actor.request.request_id) is actor:  # not preempted earlier in this loop
                    self._allocate(actor, step, preempted)
            else:
                budget = self._schedule_requests([actor], budget, scheduled, preempted)
        self.lane_rows = len(lane)
        self.lane_context_tokens = self._lane_offset + len(lane) * (step + 1)
        budget = self._schedule_requests(chunks, budget - len(lane), scheduled, preempted)
        self._num_running = len(self.running)
        return budget

    def _allocate(self, member: _Member, step: int, preempted: list[str]) -> None:
        """The member's next block, as the real loop allocates it (it may preempt the newest requests, itself too)."""
        request = member.request
        self._materialize(member, step)
        tokens_per_block = self.block_manager.tokens_per_block
        if (request.num_computed_tokens + 1 > len(request.block_ids) * tokens_per_block
                and not self._allocate_or_preempt(request, request.num_computed_tokens + 1, preempted)):
            return  # preempted itself: it left the lane
        member.next_alloc = step + max(1, len(request.block_ids) * tokens_per_block - request.num_computed_tokens)
        self._allocs[member.next_alloc].append(member)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[TokenUpdate]:
        step, lane, seq = self.steps_done, self._lane, self._seq
        naming = [m for m in self._caches.pop(step, ()) if lane.get(m.request.request_id) is m]
        if not naming:
            updates = super().update(output, sampled)
        else:
            # The real update's order: decodes (the lane's among them, by running order), then prompt chunks.
            entries = output.scheduled
            decodes = [e for e in entries if len(e.token_ids) == 1]
            actors: list[tuple[int, _Member | ScheduledRequest]] = [(m.seq, m) for m in naming]
            actors += [(seq.get(e.request_id, -1), e) for e in decodes]
            actors.sort(key=lambda actor: actor[0])
            updates = []
            for _, actor in actors:
                if isinstance(actor, _Member):
                    self._materialize(actor, step + 1)
                    self.block_manager.cache_computed(actor.request)
                    actor.next_cache = step + self.block_manager.tokens_per_block
                    self._caches[actor.next_cache].append(actor)
                else:
                    updates += super().update(SchedulerOutput([actor]), sampled)
            if len(decodes) < len(entries):
                updates += super().update(SchedulerOutput(entries[len(decodes):]), sampled)
        self.lane_tokens = len(lane)
        self.steps_done = step + 1
        for update in updates:
            if not update.finished:
                self._join(update.request)
        return updates
