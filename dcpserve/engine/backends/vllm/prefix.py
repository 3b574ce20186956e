"""The vLLM backend's prefix cache as the app sees it: vLLM's KV cache events, received from its engine core, turned
into this project's block names (dcpserve.engine.core.prefix_cache) for the PrefixReports the admission queue routes by
and for the ledger, which charges a cached block shared by several requests to one of them only.

vllm is imported here (its event types) only when events are received; dcpserve/engine/backends/vllm/engine.py wires
this in.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from dcpserve.engine.backends.vllm.args import KV_EVENTS_HOST
from dcpserve.engine.core.prefix_cache import (
    CACHED,
    EVICTED,
    HOSTED,
    PINNED,
    PrefixReport,
    PrefixReporter,
    block_hash,
    chain_hashes,
    max_hit_blocks,
    prompt_hashes,
)

logger = logging.getLogger(__name__)

@dataclass
class HeldRequest:
    """One request this replica holds: what the ledger needs to count it, and (prefix caching) its tokens so far
    with the hashes of their full blocks."""

    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list, repr=False)  # prompt, then the outputs received
    block_hashes: list[int] = field(default_factory=list, repr=False)  # of the full blocks of token_ids
    num_cached_tokens: int | None = None  # prompt tokens vLLM served from its cache (known from the first output)


# The KV pool vLLM reports its cached blocks for (BlockPool's medium; offloading tiers report others).
_POOL_MEDIUMS = (None, "GPU")
# The host tier: vLLM's CPU offloading (its OffloadingConnector, kv_offloading_size) stores and removes copies of the
# pool's blocks under this medium (vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py).
HOST_MEDIUM = "CPU"


class VllmPrefixCache:
    """vLLM's prefix cache as this replica reports it: which of our block hashes vLLM's pool holds (learned from its
    KV cache events), which of those the requests held here reference (PINNED) or none does (CACHED), and how many
    of a request's blocks are shared with another held request. Thread-safe: events arrive on the subscriber's
    thread, the rest is asked on the event loop.

    vLLM names a block by its own hash, chained like ours; a BlockStored event carries the token ids of the blocks
    it stores and the vLLM hash of the parent of the first, so our hash of each follows from the parent's, which an
    earlier event named (a request's blocks are stored in order, each while the request holds its parent). vLLM does
    not de-duplicate: two requests computing the same block at once each store a copy under one hash, and each copy
    is removed on its own, so a hash stays cached while any copy does.

    With vLLM's CPU offloading on, the same events come with medium CPU for the copies its host tier stores and
    removes: a block whose last pool copy is gone while the host tier still has one is HOSTED (a hit copies it back),
    and EVICTED only once both are gone. The offloading connector names a block by the pool's vLLM hash and may send
    no token ids for it (a placeholder), so a host copy is named through the pool's mapping when the event has no
    parent and tokens of its own.
    """

    def __init__(self, tokens_per_block: int, seed: bytes) -> None:
        self.tokens_per_block = tokens_per_block
        self.seed = seed
        self.reporter = PrefixReporter(tokens_per_block, seed)
        self._lock = threading.Lock()
        self._vllm_blocks: dict[Hashable, list] = {}  # vLLM block hash -> [our hash, its copies in the pool]
        self._copies: dict[int, int] = {}  # our hash -> copies in vLLM's pool
        self._host_blocks: dict[Hashable, list] = {}  # vLLM block hash -> [our hash, its copies in the host tier]
        self._host_copies: dict[int, int] = {}  # our hash -> copies in vLLM's host tier
        self._holders: dict[int, dict[str, None]] = {}  # our hash -> held requests whose blocks include it; the
        #                                                 first one is charged for it
        self.num_evictions = 0  # copies removed from vLLM's cache
        self.num_host_evictions = 0  # copies removed from vLLM's host tier
        self.num_unmapped_blocks = 0  # stored blocks whose parent no event named (events lost): not reported
        self.num_lost_batches = 0  # event batches that never arrived (the state was dropped then)
        self._warned: set[str] = set()

    # ---- vLLM's events (the subscriber's thread) ------------------------------------------------------------

    def stored(self, vllm_hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int],
               block_size: int, medium: str | None = None) -> None:
        """BlockStored: vLLM cached len(vllm_hashes) full blocks, holding token_ids in order, after `parent`."""
        if medium == HOST_MEDIUM:
            self._host_stored(vllm_hashes, parent, token_ids, block_size)
            return
        if medium not in _POOL_MEDIUMS:
            return
        if block_size != self.tokens_per_block or len(token_ids) != len(vllm_hashes) * block_size:
            self._warn_once("block_size", "vLLM stored blocks of %d tokens (%d token ids for %d blocks); this "
                            "replica names blocks of %d: not reported", block_size, len(token_ids), len(vllm_hashes),
                            self.tokens_per_block)
            return
        with self._lock:
            ours: int | None = None
            if parent is not None:
                entry = self._vllm_blocks.get(parent)
                if entry is None:
                    self.num_unmapped_blocks += len(vllm_hashes)
                    return
                ours = entry[0]
            for index, vllm_hash in enumerate(vllm_hashes):
                ours = block_hash(ours, token_ids[index * block_size:(index + 1) * block_size], self.seed)
                entry = self._vllm_blocks.setdefault(vllm_hash, [ours, 0])
                entry[1] += 1
                copies = self._copies.get(ours, 0)
                self._copies[ours] = copies + 1
                if copies == 0:
                    self.reporter.set(ours, PINNED if ours in self._holders else CACHED)

    def _host_stored(self, vllm_hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int],
                     block_size: int) -> None:
        """A BlockStored of the host tier: named by its own chain when it carries one, else by the pool's names."""
        chained = block_size == self.tokens_per_block and len(token_ids) == len(vllm_hashes) * block_size
        with self._lock:
            ours: int | None = None
            if chained and parent is not None:
                known = self._vllm_blocks.get(parent) or self._host_blocks.get(parent)
                chained = known is not None
                ours = known[0] if known is not None else None
            for index, vllm_hash in enumerate(vllm_hashes):
                if chained:
                    ours = block_hash(ours, token_ids[index * block_size:(index + 1) * block_size], self.seed)
                else:
                    known = self._vllm_blocks.get(vllm_hash) or self._host_blocks.get(vllm_hash)
                    if known is None:
                        self.num_unmapped_blocks += 1
                        continue
                    ours = known[0]
                entry = self._host_blocks.setdefault(vllm_hash, [ours, 0])
                entry[1] += 1
                self._host_copies[ours] = self._host_copies.get(ours, 0) + 1
                if ours not in self._copies:
                    self.reporter.set(ours, HOSTED)

    def removed(self, vllm_hashes: Iterable[Hashable], medium: str | None = None) -> None:
        """BlockRemoved: one copy of each block left vLLM's cache (evicted to make room, or reset)."""
        if medium == HOST_MEDIUM:
            self._host_removed(vllm_hashes)
            return
        if medium not in _POOL_MEDIUMS:
            return
        with self._lock:
            for vllm_hash in vllm_hashes:
                entry = self._vllm_blocks.get(vllm_hash)
                if entry is None:
                    continue
                self.num_evictions += 1
                ours = entry[0]
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._vllm_blocks[vllm_hash]
                self._drop_copy(ours)

    def _host_removed(self, vllm_hashes: Iterable[Hashable]) -> None:
        with self._lock:
            for vllm_hash in vllm_hashes:
                entry = self._host_blocks.get(vllm_hash)
                if entry is None:
                    continue
                self.num_host_evictions += 1
                ours = entry[0]
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._host_blocks[vllm_hash]
                copies = self._host_copies.get(ours, 0) - 1
                if copies > 0:
                    self._host_copies[ours] = copies
                    continue
                self._host_copies.pop(ours, None)
                if ours not in self._copies:
                    self.reporter.set(ours, EVICTED)

    def cleared(self) -> None:
        """AllBlocksCleared: vLLM reset its prefix cache (only ever with no block in use); its host tier too."""
        with self._lock:
            self.num_evictions += sum(self._copies.values())
            self.num_host_evictions += sum(self._host_copies.values())
            self._forget_all()

    def lost(self, num_batches: int) -> None:
        """Event batches went missing (the publisher's high-water mark, or a late connection): what this replica
        believes vLLM caches may be stale, so it forgets it all (reported EVICTED) rather than claim blocks vLLM may
        have evicted; blocks stored from now on are learned again (their descendants from the next time their
        chain is stored from the start)."""
        with self._lock:
            self.num_lost_batches += num_batches
            self._forget_all()
        logger.warning("lost %d KV event batch(es) from vLLM: prefix cache state dropped and relearned", num_batches)

    def _drop_copy(self, ours: int) -> None:
        copies = self._copies.get(ours, 0) - 1
        if copies > 0:
            self._copies[ours] = copies
        else:
            self._copies.pop(ours, None)
            self.reporter.set(ours, HOSTED if ours in self._host_copies else EVICTED)

    def _forget_all(self) -> None:
        for ours in {**self._copies, **self._host_copies}:
            self.reporter.set(ours, EVICTED)
        self._copies.clear()
        self._vllm_blocks.clear()
        self._host_copies.clear()
        self._host_blocks.clear()

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    # ---- the requests held here (the event loop) ------------------------------------------------------------

    def hold(self, request_id: str, held: HeldRequest) -> None:
        """A held request's full blocks so far: the new ones join their holders (a cached one becomes PINNED)."""
        known = len(held.block_hashes)
        if len(held.token_ids) < (known + 1) * self.tokens_per_block:
            return  # no new full block
        held.block_hashes = chain_hashes(held.token_ids, self.tokens_per_block, self.seed, held.block_hashes)
        if len(held.block_hashes) == known:
            return
        with self._lock:
            for ours in held.block_hashes[known:]:
                holders = self._holders.setdefault(ours, {})
                holders[request_id] = None
                if len(holders) == 1 and ours in self._copies:
                    self.reporter.set(ours, PINNED)

    def release(self, request_id: str, held: HeldRequest) -> None:
        """The request is no longer held: its cached blocks nobody else holds become CACHED (evictable)."""
        with self._lock:
            for ours in held.block_hashes:
                holders = self._holders.get(ours)
                if holders is None or request_id not in holders:
                    continue
                del holders[request_id]
                if not holders:
                    del self._holders[ours]
                    if ours in self._copies:
                        self.reporter.set(ours, CACHED)

    def _cached_run(self, hashes: Sequence[int]) -> int:
        count = 0
        for ours in hashes:
            if ours not in self._copies:
                break
            count += 1
        return count

    def pinned_hits(self, prompt_token_ids: Sequence[int]) -> int:
        """Of the longest cached run of a new request's blocks (before its last token), those a held request
        references: taking them adds no KV."""
        hashes = prompt_hashes(prompt_token_ids, self.tokens_per_block, self.seed)
        with self._lock:
            run = hashes[:self._cached_run(hashes)]
            return sum(1 for ours in run if ours in self._holders)

    def shared_blocks(self, held: dict[str, HeldRequest]) -> dict[str, int]:
        """Per held request, the cached blocks it shares that are charged to another held request: those vLLM
        served it from its cache (known from its first output; before that, the cached run of its prompt blocks it
        will take), each charged to its first holder only."""
        shared: dict[str, int] = {}
        with self._lock:
            for request_id, request in held.items():
                if request.num_cached_tokens is not None:
                    hits = request.block_hashes[:request.num_cached_tokens // self.tokens_per_block]
                else:
                    limit = max_hit_blocks(request.num_prompt_tokens, self.tokens_per_block)
                    hits = request.block_hashes[:self._cached_run(request.block_hashes[:limit])]
                shared[request_id] = sum(1 for ours in hits
                                         if ours in self._copies and self._charged(ours) != request_id)
        return shared

    def _charged(self, ours: int) -> str | None:
        holders = self._holders.get(ours)
        return next(iter(holders)) if holders else None

    # ---- what the replica reports ---------------------------------------------------------------------------

    def report(self, reader_epoch: str | None, reader_version: int) -> PrefixReport:
        with self._lock:
            return self.reporter.report(reader_epoch, reader_version)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks of vLLM's pool holding a cached prefix block now (copies included), held or evictable."""
        with self._lock:
            return sum(self._copies.values())

    @property
    def num_host_blocks(self) -> int:
        """Copies of cached prefix blocks in vLLM's host tier now."""
        with self._lock:
            return sum(self._host_copies.values())

    def cached_hashes(self) -> dict[int, int]:
        """Our hash -> PINNED | CACHED of every block vLLM caches now in its pool, HOSTED of those only its host tier
        holds."""
        with self._lock:
            hosted = {ours: HOSTED for ours in self._host_copies if ours not in self._copies}
            return {**hosted, **{ours: PINNED if ours in self._holders else CACHED for ours in self._copies}}


class KvEventSubscriber:
    """Receives vLLM's KV cache events on a thread of its own and applies them to a VllmPrefixCache.

    vLLM's engine core runs in another process (AsyncLLM's engine-core client), so its scheduler's events reach
    this one only through vLLM's publisher: ZeroMQ PUB, here connecting to our SUB socket, which binds a loopback
    port the kernel picks before vLLM starts (no fixed port, nothing beyond 127.0.0.1; a random topic, so only the
    engine core we configured is heard). Batches carry sequence numbers from 0: a gap is lost events."""

    def __init__(self) -> None:
        import zmq

        self.topic = f"dcpserve-kv-{secrets.token_hex(16)}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)  # no limit here: the publisher's own high-water mark bounds it
        self._socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._socket.bind(f"tcp://{KV_EVENTS_HOST}:0")
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_batches = 0

    def start(self, cache: VllmPrefixCache) -> None:
        self._thread = threading.Thread(target=self._run, args=(cache,), name="vllm-kv-events", daemon=True)
        self._thread.start()

    def _run(self, cache: VllmPrefixCache) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        expected = 0
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                _, seq_bytes, payload = self._socket.recv_multipart(zmq.NOBLOCK)
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    continue  # a replay's end marker
                if seq > expected:
                    cache.lost(seq - expected)
                expected = seq + 1
                self.num_batches += 1
                for event in decoder.decode(payload).events:
                    if isinstance(event, BlockStored):
                        cache.stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                                     event.medium)
                    elif isinstance(event, BlockRemoved):
                        cache.removed(event.block_hashes, event.medium)
                    elif isinstance(event, AllBlocksCleared):
                        cache.cleared()
            except zmq.ZMQError as err:
                if self._stop.is_set():
                    return
                logger.warning("KV event subscriber: %r", err)
                time.sleep(0.1)
            except Exception as err:  # noqa: BLE001 - one bad batch must not stop the events that follow
                logger.warning("KV event subscriber: a batch could not be applied: %r", err)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()
