"""KV cache blocks, counted in logical blocks of block_size * dcp tokens.

A logical block is one physical page of block_size slots on every rank of the DCP group, so one block table
serves every rank. Everything above the kernels (scheduler, admission, metrics, planning) counts KV with
blocks_needed(); nothing else rounds tokens to blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from dcpserve.engine.core.host_tier import HostTier, StepCopies
from dcpserve.engine.core.prefix_cache import (
    CACHED,
    EVICTED,
    HOSTED,
    PINNED,
    PrefixReporter,
    chain_hashes,
    max_hit_blocks,
)
from dcpserve.engine.core.request import Request, RequestRejected


def blocks_needed(num_tokens: int, tokens_per_block: int) -> int:
    """Logical blocks that hold num_tokens tokens (tokens_per_block = block_size * dcp)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // tokens_per_block)


def admission_blocks(admission: str, num_prompt_tokens: int, max_tokens: int, tokens_per_block: int) -> int:
    """The blocks a new request asks admission for, under the policy: "full" commits prompt + max_tokens, "usage"
    the prompt (decode grows into free blocks and the headroom). The ingress, the admission queue and the engine's
    accept check all count a request with this one function."""
    if admission == "full":
        return blocks_needed(num_prompt_tokens + max_tokens, tokens_per_block)
    if admission == "usage":
        return blocks_needed(num_prompt_tokens, tokens_per_block)
    raise ValueError(f"admission must be 'full' or 'usage', got {admission!r}")


def headroom_blocks(admission: str, kv_headroom: float, num_blocks: int, num_sequences: int) -> int:
    """Blocks "usage" admission leaves free as growth room for `num_sequences` sequences: kv_headroom of the pool
    and at least one per sequence; none for no sequence (so any prompt that fits the pool can start), none under
    "full". Both engine backends count their ledger's headroom with it."""
    if admission == "full" or num_sequences == 0:
        return 0
    return min(num_blocks, max(math.ceil(kv_headroom * num_blocks), num_sequences))


def check_fits(admission: str, num_prompt_tokens: int, max_tokens: int, max_model_len: int, num_blocks: int,
               tokens_per_block: int) -> None:
    """Raises RequestRejected when a request could never be served, naming the numbers: an empty prompt, prompt +
    max_tokens past max_model_len, or more KV than the pool holds (prompt + max_tokens under "full", the prompt
    under "usage", where a request that outgrows the pool finishes with "length")."""
    total = num_prompt_tokens + max_tokens
    if num_prompt_tokens < 1:
        raise RequestRejected("the prompt is empty: send at least one token")
    if total > max_model_len:
        raise RequestRejected(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"max_model_len={max_model_len}; shorten the prompt or lower max_tokens"
        )
    full = admission == "full"
    needed = blocks_needed(total if full else num_prompt_tokens, tokens_per_block)
    if needed > num_blocks:
        what = f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total}" if full else (
            f"the prompt ({num_prompt_tokens})")
        raise RequestRejected(
            f"{what} tokens needs {needed} KV blocks of {tokens_per_block} tokens but the replica holds "
            f"{num_blocks} ({num_blocks * tokens_per_block} tokens); shorten the request or give the KV cache more "
            f"memory (or raise dcp)"
        )


def num_blocks_for_budget(kv_bytes_per_rank: int, block_size: int, kv_bytes_per_token_per_rank: int) -> int:
    """Pages that fit a per-rank KV memory budget; one page per rank is one logical block of the group."""
    return kv_bytes_per_rank // (block_size * kv_bytes_per_token_per_rank)


@dataclass(frozen=True)
class BlockUsage:
    """A snapshot of the block pool (all in logical blocks)."""

    total: int
    used: int  # allocated to requests
    reserved: int  # committed at admission: allocated plus promised but not yet allocated
    tokens_per_block: int

    @property
    def free(self) -> int:
        """Blocks nobody holds or was promised: what admission may still hand out."""
        return self.total - self.reserved


class PrefixCacheCorruption(RuntimeError):
    """A cache hit whose stored token ids differ from the request's (a hash collision): never served."""


class BlockManager:
    """Hands out logical blocks; tracks what admission promised so that a promise can always be kept.

    With prefix caching a full block whose KV is computed is named by its chained hash
    (dcpserve.engine.core.prefix_cache) and stays in the cache when its requests finish: reference count 0, evictable in
    LRU order, counted as free. A new request starts from the longest cached run of its blocks (`admit`); blocks are
    shared, never written twice (a request only hits blocks before its last token and computes from the first block it
    did not hit) and never handed out while referenced. Each referenced block is charged to one of its holders (the
    first; the next one when that one lets go), so the per-request charges add up to the blocks really held.

    With a host tier (dcpserve/engine/core/host_tier.py) an evicted cached block goes to a host slot (a swap-out) and
    is reported HOSTED; a request's cached run goes on past its device hits into the tier, and those blocks get device
    blocks and swap-ins (`admit`), named by their hash at once as computed blocks are. The step's copies leave with
    the step message (`drain_copies`)."""

    def __init__(self, num_blocks: int, block_size: int, dcp_size: int, enable_prefix_caching: bool = False,
                 hash_seed: bytes = b"", verify_hits: bool = False, host_tier: HostTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache has no room for a single block (num_blocks={num_blocks}): raise the KV memory budget "
                f"(kv_cache_memory_bytes, or gpu_memory_utilization on GPUs)"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.tokens_per_block = block_size * dcp_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.verify_hits = verify_hits  # keep each cached block's token ids and compare them on every hit
        self._free_block_ids: deque[int] = deque(range(num_blocks))  # free and holding no cached prefix
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently used first
        self._promised = 0  # sum over requests of reserved_blocks - allocated, where positive
        self._ref_count = [0] * num_blocks
        self._holders: list[dict[str, Request]] = [{} for _ in range(num_blocks)]  # the first one is charged
        self._block_hash: dict[int, int] = {}  # block id -> its hash, for cached blocks
        self._cached: dict[int, int] = {}  # hash -> block id
        self._block_tokens: dict[int, tuple[int, ...]] = {}  # verify_hits: block id -> its token ids
        self.reporter = PrefixReporter(self.tokens_per_block, hash_seed) if enable_prefix_caching else None
        self.num_queried_tokens = 0  # prompt tokens of new requests looked up in the cache
        self.num_hit_tokens = 0  # of those, tokens served from the cache
        self.num_evictions = 0
        if host_tier is not None and not enable_prefix_caching:
            raise ValueError("a host KV tier holds the prefix cache's evicted blocks: enable prefix caching to use one")
        self.host_tier = host_tier
        self.num_host_hit_tokens = 0  # of num_hit_tokens, tokens reloaded from the host tier
        # Waiting requests' cached runs, as the ledger last looked them up (cached_run): request id -> (its tokens,
        # hit blocks, pinned hits, the hashes it read: the run and the first miss), and hash -> the requests that read
        # it. A change of a block's state (`_report`: cached, pinned, unpinned, hosted, evicted) forgets the runs that
        # read it, so a run is looked up again only when something in it changed.
        self._runs: dict[str, tuple[int, int, int, list[int]]] = {}
        self._readers: dict[int, set[str]] = {}

    @property
    def capacity_tokens(self) -> int:
        """pages per rank * block_size * dcp."""
        return self.num_blocks * self.tokens_per_block

    @property
    def num_free_blocks(self) -> int:
        """Unallocated and unpromised (cached blocks nobody references count as free: evicted on demand)."""
        return len(self._free_block_ids) + len(self._evictable) - self._promised

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a cached prefix block, referenced or not."""
        return len(self._cached)

    def usage(self) -> BlockUsage:
        used = self.num_blocks - len(self._free_block_ids) - len(self._evictable)
        return BlockUsage(self.num_blocks, used, used + self._promised, self.tokens_per_block)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.tokens_per_block)

    @staticmethod
    def _outstanding(request: Request) -> int:
        return max(0, request.reserved_blocks - len(request.block_ids))

    @staticmethod
    def shared_blocks(request: Request) -> int:
        """Blocks the request holds that are charged to another holder."""
        return len(request.block_ids) - request.num_charged_blocks

    # ---- prefix cache ---------------------------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The request's first num_blocks block hashes (computed once, extended as its tokens grow)."""
        if len(request.block_hashes) < num_blocks:
            request.block_hashes = chain_hashes(request.all_token_ids, self.tokens_per_block, self.hash_seed,
                                                request.block_hashes, num_blocks)
        return request.block_hashes[:num_blocks]

    def _can_look_up(self, request: Request) -> bool:
        # Prompt logprobs need every prompt position's logits: such a request computes its whole prompt.
        return (self.enable_prefix_caching and not request.block_ids and request.num_computed_tokens == 0
                and request.sampling_params.prompt_logprobs is None)

    def find_cached(self, request: Request) -> list[int]:
        """The block ids of the longest cached run of the request's blocks (before its last token). No change."""
        if not self._can_look_up(request):
            return []
        hits: list[int] = []
        limit = max_hit_blocks(request.num_tokens, self.tokens_per_block)
        if limit == 0:
            return hits
        for index, block in enumerate(self.block_hashes(request, limit)):
            block_id = self._cached.get(block)
            if block_id is None:
                break
            if self.verify_hits:
                expected = self._block_tokens.get(block_id)
                start = index * self.tokens_per_block
                if expected != tuple(request.all_token_ids[start:start + self.tokens_per_block]):
                    if self._cached.get(block) != block_id or self._block_hash.get(block_id) != block:
                        break  # evicted while we looked (the ledger reads from another thread than the step's)
                    raise PrefixCacheCorruption(
                        f"prefix cache hit on block {block_id} (hash {block:#x}) for request {request.request_id} "
                        f"at block {index}, but the block holds other token ids: a hash collision; refusing to "
                        f"serve another prefix's KV")
            hits.append(block_id)
        return hits

    def find_hosted(self, request: Request, device_hits: int) -> list[int]:
        """The host slots of the request's cached run past its device_hits device blocks (before its last token):
        each next block the tier holds and the device pool does not. No change."""
        tier = self.host_tier
        if tier is None or not len(tier) or not self._can_look_up(request):
            return []
        limit = max_hit_blocks(request.num_tokens, self.tokens_per_block)
        slots: list[int] = []
        hashes = self.block_hashes(request, limit)
        for index in range(device_hits, limit):
            block = hashes[index]
            slot = tier.slot(block)
            if slot is None or block in self._cached:
                break
            if self.verify_hits:
                start = index * self.tokens_per_block
                if tier.tokens(block) != tuple(request.all_token_ids[start:start + self.tokens_per_block]):
                    raise PrefixCacheCorruption(
                        f"host tier hit on slot {slot} (hash {block:#x}) for request {request.request_id} at block "
                        f"{index}, but the slot holds other token ids: a hash collision; refusing to serve it")
            slots.append(slot)
        return slots

    def hosted_run(self, request: Request, device_hits: int) -> int:
        """How many blocks of the request's cached run continue in the host tier past its device_hits (what
        find_hosted finds; a block manager with a tier of its own counts its own)."""
        return len(self.find_hosted(request, device_hits))

    def hit_blocks(self, request: Request) -> int:
        """Blocks of the request's cached run, on device and in the host tier: what it will not compute."""
        device = len(self.find_cached(request))
        return device + self.hosted_run(request, device)

    def pinned_hits(self, request: Request) -> int:
        """Of the request's cached run, the blocks other requests reference now (taking them adds no KV)."""
        return sum(1 for block_id in self.find_cached(request) if self._ref_count[block_id] > 0)

    def cached_run(self, request: Request) -> tuple[int, int]:
        """(hit_blocks, pinned_hits) of a waiting request: what its ledger entry needs. The ledger is built after
        every step over every request the replica holds; a waiting request's run is walked again only when a block
        it read changed state since (`_runs`), not at every step."""
        request_id = request.request_id
        run = self._runs.get(request_id)
        if run is not None and run[0] == request.num_tokens:
            return run[1], run[2]
        if run is not None:
            self._forget_run(request_id)
        hits = self.find_cached(request)
        ref_count = self._ref_count
        pinned = sum(1 for block_id in hits if ref_count[block_id] > 0)
        hit_blocks = len(hits) + self.hosted_run(request, len(hits))
        if self.enable_prefix_caching:
            read = request.block_hashes[:hit_blocks + 1]
            self._runs[request_id] = (request.num_tokens, hit_blocks, pinned, read)
            readers = self._readers
            for block in read:
                holders = readers.get(block)
                if holders is None:
                    readers[block] = {request_id}
                else:
                    holders.add(request_id)
        return hit_blocks, pinned

    def _forget_run(self, request_id: str) -> None:
        run = self._runs.pop(request_id, None)
        if run is None:
            return
        readers = self._readers
        for block in run[3]:
            holders = readers.get(block)
            if holders is not None:
                holders.discard(request_id)
                if not holders:
                    del readers[block]

    def _report(self, block: int, state: int) -> None:
        """A cached block changed state: to the reporter, and the waiting runs that read it are looked up again."""
        self._forget_readers(block)
        if self.reporter is not None:
            self.reporter.set(block, state)

    def _forget_readers(self, block: int) -> None:
        """The block changed state: the remembered runs that read it (cached_run) are looked up again."""
        holders = self._readers.pop(block, None)
        if holders:
            for request_id in holders:
                self._forget_run(request_id)

    def _take(self, request: Request, block_id: int) -> None:
        if self._ref_count[block_id] == 0:
            self._evictable.pop(block_id, None)
            request.num_charged_blocks += 1
            if block_id in self._block_hash:
                self._report(self._block_hash[block_id], PINNED)
        self._ref_count[block_id] += 1
        self._holders[block_id][request.request_id] = request
        request.block_ids.append(block_id)

    def cache_computed(self, request: Request) -> None:
        """Names the request's blocks whose KV is now fully computed, so later requests can hit them. A block whose
        hash another block already holds (computed by two requests at once) stays private."""
        if not self.enable_prefix_caching:
            return
        full = min(request.num_computed_tokens // self.tokens_per_block, len(request.block_ids))
        if full <= request.num_cached_blocks:
            return
        hashes = self.block_hashes(request, full)
        for index in range(request.num_cached_blocks, full):
            block, block_id = hashes[index], request.block_ids[index]
            if block in self._cached or block_id in self._block_hash:
                continue
            self._cached[block] = block_id
            self._block_hash[block_id] = block
            if self.verify_hits:
                start = index * self.tokens_per_block
                self._block_tokens[block_id] = tuple(request.all_token_ids[start:start + self.tokens_per_block])
            self._report(block, PINNED)
        request.num_cached_blocks = full

    def _pop_free(self) -> int:
        """A block to hand out: a never-cached one first, else the least recently used cached one (evicted)."""
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        block = self._block_hash.pop(block_id)
        del self._cached[block]
        tokens = self._block_tokens.pop(block_id, None)
        self.num_evictions += 1
        state, dropped = EVICTED, None
        if self.host_tier is not None:
            kept, dropped = self.host_tier.store(block, block_id, tokens)
            state = HOSTED if kept else EVICTED
        self._report(block, state)
        if dropped is not None and dropped not in self._cached:  # a block reloaded earlier stays on device
            self._report(dropped, EVICTED)
        return block_id

    # ---- admission and allocation ---------------------------------------------------------------------------

    def can_reserve(self, request: Request, num_tokens: int, keep_free: int = 0) -> bool:
        """Whether reserving KV for num_tokens tokens of this request would fit now, leaving keep_free blocks."""
        target = self.blocks_for(num_tokens)
        held = max(request.reserved_blocks, len(request.block_ids))
        return target - held <= self.num_free_blocks - keep_free

    def reserve(self, request: Request, num_tokens: int, keep_free: int = 0) -> bool:
        """Promises the request blocks for num_tokens tokens (admission), leaving keep_free blocks unpromised.
        False, changing nothing, if they don't fit."""
        if not self.can_reserve(request, num_tokens, keep_free):
            return False
        target = self.blocks_for(num_tokens)
        if target > request.reserved_blocks:
            self._promised -= self._outstanding(request)
            request.reserved_blocks = target
            self._promised += self._outstanding(request)
        return True

    def admit(self, request: Request, reserve_tokens: int, keep_free: int = 0) -> bool:
        """Admission of a waiting request: takes the longest cached run of its blocks (its computed tokens start
        after them) and promises blocks for reserve_tokens tokens, leaving keep_free blocks unpromised. False,
        changing nothing, if that does not fit; cached blocks nobody references cost as much as free ones."""
        if self._runs:
            self._forget_run(request.request_id)
        looked_up = self._can_look_up(request)
        hits = self.find_cached(request)
        hosted = self.find_hosted(request, len(hits))
        unreferenced = sum(1 for block_id in hits if self._ref_count[block_id] == 0)
        held = max(request.reserved_blocks, len(request.block_ids))
        if self.blocks_for(reserve_tokens) - max(held, len(hits)) > self.num_free_blocks - unreferenced - keep_free:
            return False
        for block_id in hits:
            self._take(request, block_id)
        if not self.reserve(request, reserve_tokens, keep_free):  # cannot happen after the check above
            self.free(request)
            return False
        if hosted and not self._reload(request, len(hits), hosted):
            self.free(request)
            return False
        if looked_up and not request.num_preemptions:  # caching off or prompt logprobs: nothing was looked up
            self.num_queried_tokens += request.num_prompt_tokens
            self.num_hit_tokens += (len(hits) + len(hosted)) * self.tokens_per_block
            self.num_host_hit_tokens += len(hosted) * self.tokens_per_block
        request.num_cached_blocks = len(hits) + len(hosted)
        request.num_computed_tokens = request.num_cached_blocks * self.tokens_per_block
        return True

    def _reload(self, request: Request, device_hits: int, hosted: list[int]) -> bool:
        """Device blocks, from the request's promise, for its host-tier hits, each named by its hash at once and
        filled by a swap-in this step. The device blocks this takes may evict cached ones into the tier: the slots
        read here are locked first, so those swap-outs never overwrite them."""
        tier = self.host_tier
        if tier is None:
            return False
        hashes = self.block_hashes(request, device_hits + len(hosted))[device_hits:]
        for block in hashes:
            tier.lock(block)
        if not self.allocate(request, (device_hits + len(hosted)) * self.tokens_per_block):
            return False
        for offset, block in enumerate(hashes):
            index = device_hits + offset
            block_id = request.block_ids[index]
            tier.load(block, block_id)
            self._cached[block] = block_id
            self._block_hash[block_id] = block
            tokens = tier.tokens(block)
            if tokens is not None:
                self._block_tokens[block_id] = tokens
            self._report(block, PINNED)
        return True

    def drain_copies(self) -> StepCopies | None:
        """This step's swap-outs and swap-ins (None without a tier), handed to the step message."""
        return self.host_tier.drain() if self.host_tier is not None else None

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Makes the request hold blocks for its first num_tokens tokens, drawing on its promise first.
        False, changing nothing, when the pool cannot provide them."""
        needed = self.blocks_for(num_tokens) - len(request.block_ids)
        if needed <= 0:
            return True
        from_promise = min(needed, self._outstanding(request))
        if needed - from_promise > self.num_free_blocks:
            return False
        for _ in range(needed):
            block_id = self._pop_free()
            self._ref_count[block_id] = 1
            self._holders[block_id][request.request_id] = request
            request.block_ids.append(block_id)
        request.num_charged_blocks += needed
        self._promised -= from_promise
        return True

    def free(self, request: Request) -> None:
        """Returns every block the request holds or was promised. Cached blocks nobody else holds stay cached and
        evictable, the end of the request's run first in line for eviction (its start is the likelier hit)."""
        if self._runs:
            self._forget_run(request.request_id)
        self._promised -= self._outstanding(request)
        for block_id in reversed(request.block_ids):
            holders = self._holders[block_id]
            charged = next(iter(holders)) == request.request_id
            del holders[request.request_id]
            self._ref_count[block_id] -= 1
            if self._ref_count[block_id] > 0:
                if charged:
                    next(iter(holders.values())).num_charged_blocks += 1  # the next holder carries it
                continue
            block = self._block_hash.get(block_id)
            if block is not None and self.host_tier is not None and self.host_tier.cancel_load(block_id):
                # Given back before the step that would have filled it ran: not a cached block after all.
                del self._cached[block], self._block_hash[block_id]
                self._block_tokens.pop(block_id, None)
                self._report(block, HOSTED)
                block = None
            if block is None:
                self._free_block_ids.append(block_id)
            else:
                self._evictable[block_id] = None
                self._report(block, CACHED)
        request.block_ids = []
        request.num_charged_blocks = 0
        request.num_cached_blocks = 0
        request.reserved_blocks = 0
