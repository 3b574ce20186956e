"""What the admission queue knows of one replica's prefix cache, for prefix-aware routing
(dcpserve/deployments/admission/queue.py makes the choice).

A request names its prompt by the hashes of its blocks (`PrefixAsk`, from the ingress). Each replica's
`ReplicaPrefix` holds the replica's reported cache (dcpserve.engine.core.prefix_cache.PrefixIndex, kept by its
PrefixReports) and the prompts of the grants in flight there: blocks being computed now, which count for routing but
never as KV a request may share. A finished grant's prompt stays until a report made after the finish says what the
replica caches, so a conversation's next turn, sent the moment the answer ends, still finds its replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import takewhile

from dcpserve.deployments.messages import PrefixAsk
from dcpserve.engine.core.prefix_cache import NO_MATCH, PrefixIndex, PrefixMatch

# A finished grant's prompt is dropped at the second report after the finish: the first may have left the replica
# before the request ended.
REPORTS_AFTER_FINISH = 2


@dataclass
class ReplicaPrefix:
    """One replica's cached prefixes as reported, and the prompts of the grants in flight there."""

    index: PrefixIndex = field(default_factory=PrefixIndex)  # the prefix blocks it reported cached
    inflight: dict[str, PrefixAsk] = field(default_factory=dict)  # ticket -> the prompt of its grant
    _inflight_blocks: dict[int, int] = field(default_factory=dict)  # hash -> grants in flight whose prompt has it
    _num_reports: int = 0
    _finished: dict[str, int] = field(default_factory=dict)  # ticket -> _num_reports when its request finished

    def add(self, ticket: str, ask: PrefixAsk | None) -> None:
        """A grant of this prompt here."""
        if ask is None or not ask.hashes:
            return
        self.inflight[ticket] = ask
        for block in ask.hashes:
            self._inflight_blocks[block] = self._inflight_blocks.get(block, 0) + 1

    def drop(self, ticket: str) -> None:
        """The grant went back (refused, unreachable, lost): its prompt is not being computed here."""
        self._finished.pop(ticket, None)
        ask = self.inflight.pop(ticket, None)
        for block in ask.hashes if ask is not None else ():
            count = self._inflight_blocks[block] - 1
            if count:
                self._inflight_blocks[block] = count
            else:
                del self._inflight_blocks[block]

    def retire(self, ticket: str) -> None:
        """The ticket's request finished here: its prompt stays until the replica's reports have caught up."""
        if ticket in self.inflight:
            self._finished[ticket] = self._num_reports

    def on_report(self) -> None:
        self._num_reports += 1
        for ticket, at in list(self._finished.items()):
            if self._num_reports >= at + REPORTS_AFTER_FINISH:
                self.drop(ticket)

    def match(self, ask: PrefixAsk | None) -> tuple[PrefixMatch, int]:
        """The reported cached run of the request's prompt blocks here, and the run the prompts of the grants in
        flight here share with it (a routing preference, not KV the request may count on). Asks in another block
        unit or seed match nothing."""
        if ask is None:
            return NO_MATCH, 0
        reported = self.index.match(ask.hashes, ask.tokens_per_block, ask.seed)
        # a hash names its block unit and seed too: prompts hashed otherwise share none
        inflight = self._inflight_blocks
        run = len(list(takewhile(inflight.__contains__, ask.hashes))) if inflight else 0
        return reported, run
