"""Content addresses of KV blocks, and what a replica tells the rest of the app about the prefixes it caches.

A full logical block (block_size * dcp tokens, the unit of the whole system: one page on every rank of a DCP group)
is named by a hash chained over its parent block's hash and its own token ids, seeded with what else changes the KV
(the model: its config and weight files, the dtype). So a block's hash names exactly its token run from the start of
the sequence, and one replica, the admission queue and the ingress all compute the same names for the same prompt
with `chain_hashes`. A request only ever hits whole blocks of the tokens before its last one
(`max_hit_blocks`): the last prompt token is always computed, for its logits.

Replicas report their cache as `PrefixReport`s: each cached block hash with its state (PINNED: held by a request
now, so a request that hits it adds no KV; CACHED: unreferenced, evictable, counted as free KV; HOSTED: not on the
device any more but in the replica's host-memory KV tier, so a hit reloads it instead of recomputing it and needs
device blocks as a miss does; EVICTED: gone from both).
Reports are changes since the last report, or the whole state when the reader's (epoch, version) is not the one the
changes start from (a new reader, a lost report, a restarted engine). `PrefixIndex` is the reader's side.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import uuid
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import takewhile
from operator import is_not
from pathlib import Path

PINNED = 1  # cached and referenced by at least one request of the replica
CACHED = 0  # cached, referenced by none: evictable, counted as free KV
HOSTED = 2  # only in the host-memory KV tier: a hit copies it back to the device instead of recomputing it
EVICTED = -1  # no longer cached on device or host (a change only; never part of a full state)

_DIGEST_BYTES = 16


def prefix_hash_seed(model: str | Path, dtype: str) -> bytes:
    """The seed of every block hash of a model: its config.json, the names and sizes of its weight files, and the
    dtype, so two deployments of different weights or precisions never share a block name. The ingress and the
    replicas compute it from the same engine arguments."""
    root = Path(model)
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    config = root / "config.json"
    digest.update(config.read_bytes() if config.is_file() else str(root).encode())
    if root.is_dir():
        weights = sorted((p.name, p.stat().st_size) for p in root.iterdir()
                         if p.suffix in (".safetensors", ".bin", ".pt") or p.name.endswith(".index.json"))
        digest.update(json.dumps(weights).encode())
    digest.update(str(dtype).encode())
    return digest.digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def block_hash(parent: int | None, token_ids: Sequence[int], seed: bytes) -> int:
    """The hash of one full block: its parent's hash (None for the first block: the seed) and its token ids."""
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    digest.update(seed if parent is None else parent.to_bytes(_DIGEST_BYTES, "little"))
    digest.update(_token_bytes(token_ids))
    return int.from_bytes(digest.digest(), "little")


def chain_hashes(token_ids: Sequence[int], tokens_per_block: int, seed: bytes, known: Sequence[int] = (),
                 max_blocks: int | None = None) -> list[int]:
    """The hashes of the full blocks of token_ids (at most max_blocks), extending `known` (the hashes of its first
    blocks, already computed)."""
    count = len(token_ids) // tokens_per_block
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes = list(known[:count])
    parent = hashes[-1] if hashes else None
    for index in range(len(hashes), count):
        parent = block_hash(parent, token_ids[index * tokens_per_block:(index + 1) * tokens_per_block], seed)
        hashes.append(parent)
    return hashes


def max_hit_blocks(num_tokens: int, tokens_per_block: int) -> int:
    """The most blocks a request of num_tokens tokens may take from the cache: whole blocks before its last token,
    which is always computed (its logits sample the next token), so a hit never makes a request write a shared block."""
    return max(0, num_tokens - 1) // tokens_per_block


def prompt_hashes(prompt_token_ids: Sequence[int], tokens_per_block: int, seed: bytes) -> list[int]:
    """The hashes of the blocks a new request could find cached (what the ingress sends the admission queue)."""
    return chain_hashes(prompt_token_ids, tokens_per_block, seed,
                        max_blocks=max_hit_blocks(len(prompt_token_ids), tokens_per_block))


@dataclass
class PrefixReport:
    """A replica's cached blocks, as changes since (epoch, base_version) or, with full=True, the whole state."""

    epoch: str  # one engine instance; a new epoch means the reader starts over
    version: int  # the state after these changes
    base_version: int  # the state these changes apply to (ignored when full)
    full: bool
    changes: dict[int, int]  # block hash -> PINNED | CACHED | HOSTED | EVICTED
    tokens_per_block: int
    seed: bytes


class PrefixReporter:
    """The writer's side: collects block state changes and hands them out as reports. The engine's block manager
    (native) or the vLLM adapter calls `set` on every change; the replica calls `report` when it reports."""

    def __init__(self, tokens_per_block: int, seed: bytes) -> None:
        self.tokens_per_block = tokens_per_block
        self.seed = seed
        self.epoch = uuid.uuid4().hex
        self.version = 0
        self.state: dict[int, int] = {}  # hash -> PINNED | CACHED | HOSTED
        self._changes: dict[int, int] = {}
        self._lock = threading.Lock()  # the engine's step thread sets, the replica's event loop reports

    def set(self, block: int, state: int) -> None:
        with self._lock:
            if state == EVICTED:
                self.state.pop(block, None)
            else:
                self.state[block] = state
            self._changes[block] = state

    def report(self, reader_epoch: str | None, reader_version: int) -> PrefixReport:
        """The changes since the reader's (epoch, version) when that is where this reporter's last report left
        off, else the whole state. Either way the reader ends at the returned version."""
        with self._lock:
            changes, self._changes = self._changes, {}
            base = self.version
            if changes:
                self.version += 1
            if reader_epoch == self.epoch and reader_version == base:
                return PrefixReport(self.epoch, self.version, base, False, changes, self.tokens_per_block, self.seed)
            return PrefixReport(self.epoch, self.version, 0, True, dict(self.state), self.tokens_per_block, self.seed)


@dataclass(frozen=True)
class PrefixMatch:
    """What a replica's cache holds of a request's prompt: the longest run of its blocks from the start (on device
    or in the host tier), how many of those are pinned (held by a request now: taking them adds no KV), and how many
    are only in the host tier (a hit copies them back: it saves their prefill but needs their device blocks)."""

    hit_blocks: int = 0
    pinned_blocks: int = 0
    host_blocks: int = 0


# The match of a prompt a replica caches nothing of: what the admission queue finds on most replicas for most
# requests, at every grant (shared: a match is never changed).
NO_MATCH = PrefixMatch()
_IS_CACHED = partial(is_not, None)  # a block's state in an index: present


@dataclass
class PrefixIndex:
    """The reader's copy of one replica's cached blocks, kept by applying its reports."""

    epoch: str | None = None
    version: int = 0
    tokens_per_block: int = 0
    seed: bytes = b""
    blocks: dict[int, int] = field(default_factory=dict)

    def apply(self, report: PrefixReport) -> None:
        if report.full:
            self.blocks = {h: s for h, s in report.changes.items() if s != EVICTED}
        elif report.epoch != self.epoch or report.base_version != self.version:
            return  # not the state these changes start from: the next report is the whole state
        else:
            for block, state in report.changes.items():
                if state == EVICTED:
                    self.blocks.pop(block, None)
                else:
                    self.blocks[block] = state
        self.epoch, self.version = report.epoch, report.version
        self.tokens_per_block, self.seed = report.tokens_per_block, report.seed

    def match(self, hashes: Iterable[int], tokens_per_block: int, seed: bytes) -> PrefixMatch:
        """The longest cached run of `hashes` (computed with tokens_per_block and seed: a replica of another layout
        or model matches nothing)."""
        if tokens_per_block != self.tokens_per_block or seed != self.seed:
            return NO_MATCH
        # The run's states, walked in C: the admission queue matches every prompt on every replica at each grant, and
        # prompts of an agentic trace share runs of hundreds of blocks (a tool preamble) that every replica caches.
        states = list(takewhile(_IS_CACHED, map(self.blocks.get, hashes)))
        if not states:
            return NO_MATCH
        return PrefixMatch(len(states), states.count(PINNED), states.count(HOSTED))
