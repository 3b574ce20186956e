"""The host-memory KV tier's index: which prefix blocks the ranks' host pools hold, in which slot, and the copies a
step must make.

The tier sits under the prefix cache (dcpserve/engine/core/block_manager.py). When the block manager hands out a
cached, unreferenced device block, the block's KV is first copied to a host slot (a swap-out) instead of being
dropped; a new request whose cached run goes on past its device hits into the tier gets device blocks for those and
copies them back (swap-ins) instead of recomputing their tokens. One index serves every rank: a host slot is the same
slot in each rank's pool (dcpserve/engine/worker/kv_copies.py), which holds that rank's own page of the block (its
TP heads, its DCP shard of the tokens), never gathered, exactly as the device pool does. The scheduler decides once
and every rank makes the same copies.

A step's copies are made on every rank before its forward: swap-outs first (their device blocks may be handed out,
and written, by this very step; a block evicted to the host and hit again in the same step is written to its slot
before being read back), then swap-ins. So the index keeps two invariants within a step: a slot a swap-in reads is
locked (never given to a later swap-out of the step), and a slot is the destination of at most one swap-out.

Keys: a block's chained hash (prefix_cache.block_hash), whose seed covers the model's config, weight files and dtype,
and whose chain covers tokens_per_block = block_size * dcp. The hash does not cover the rest of the layout (tp, pcp,
or block_size against dcp), and needs not: the index and the pools belong to one engine instance, whose layout is
fixed, and die with it (a restarted replica starts with an empty tier); nothing is persisted or shared between
instances. `TierLayout` names what the pools' bytes depend on; the engine builds the index and the ranks their pools
from the one EngineConfig.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

from dcpserve.engine.config import EngineConfig

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class TierLayout:
    """What one host block's bytes depend on besides its tokens: the model (hash seed: config, weights, dtype), the
    layout of the ranks, the page size and the KV dtype, and the bytes of one rank's page."""

    seed: bytes
    tp: int
    dcp: int
    pcp: int
    block_size: int
    kv_dtype: str
    bytes_per_block: int  # one rank's page of one logical block, all layers

    @property
    def fingerprint(self) -> str:
        """A short digest of the whole layout (logged at start; two layouts never share one)."""
        return hashlib.blake2b(repr(self).encode(), digest_size=8).hexdigest()


def available_host_bytes(meminfo: Path = MEMINFO) -> int:
    """MemAvailable of /proc/meminfo in bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemAvailable line: cannot size kv_host_tier against the host's memory")


def host_tier_blocks(tier_bytes: int | None, tier_share: float | None, bytes_per_block: int, ranks_on_node: int,
                     available_bytes: int) -> int:
    """Host slots per rank for a tier of tier_bytes per rank, or of tier_share of the node's available memory split
    over its ranks. Raises ValueError naming both numbers when the node's ranks together would take more than
    available_bytes, or when one block does not fit."""
    gib = 1 << 30
    per_rank = tier_bytes if tier_bytes is not None else int((tier_share or 0.0) * available_bytes / ranks_on_node)
    total = per_rank * ranks_on_node
    if total > available_bytes:
        raise ValueError(
            f"kv_host_tier asks {per_rank / gib:.2f} GiB per rank, {total / gib:.2f} GiB for the {ranks_on_node} "
            f"rank(s) on this node, but the host has {available_bytes / gib:.2f} GiB available (MemAvailable); "
            f"lower kv_host_tier or give it as a share of host memory (e.g. 0.25)"
        )
    slots = per_rank // bytes_per_block
    if slots < 1:
        raise ValueError(
            f"kv_host_tier of {per_rank} bytes per rank holds no block of {bytes_per_block} bytes (one rank's page of "
            f"a logical block, all layers); raise kv_host_tier"
        )
    return slots


def tier_layout(config: EngineConfig) -> TierLayout:
    """The layout of this engine's host pools: one rank's page of a logical block, all layers."""
    parallel, cache = config.parallel, config.cache
    per_token = config.model_config.kv_bytes_per_token_per_rank(parallel.tp, config.torch_dtype)
    return TierLayout(cache.prefix_hash_seed, parallel.tp, parallel.dcp, parallel.pcp, cache.block_size, config.dtype,
                      cache.block_size * per_token)


def with_host_tier(config: EngineConfig, meminfo: Path = MEMINFO) -> EngineConfig:
    """The config with kv_host_tier resolved to host slots per rank (CacheConfig.host_tier_blocks), checked against
    the host's available memory for every rank of the replica (they share one node); unchanged when the tier is off.
    The engine calls it at start, before its ranks allocate anything."""
    cache = config.cache
    if cache.host_tier_bytes is None and cache.host_tier_share is None:
        return config
    if not cache.enable_prefix_caching:
        raise ValueError("kv_host_tier holds the prefix cache's evicted blocks, but enable_prefix_caching is off: turn "
                         "it on, or leave kv_host_tier unset")
    slots = host_tier_blocks(cache.host_tier_bytes, cache.host_tier_share, tier_layout(config).bytes_per_block,
                             config.parallel.world_size, available_host_bytes(meminfo))
    return dataclasses.replace(config, cache=dataclasses.replace(cache, host_tier_blocks=slots))


@dataclass(frozen=True)
class StepCopies:
    """A step's copies between the device pools and the host pools, the same on every rank."""

    swap_out: list[tuple[int, int]]  # (device block, host slot): device -> host, made first
    swap_in: list[tuple[int, int]]  # (host slot, device block): host -> device, made after the swap-outs


class HostTier:
    """The host slots' index: block hash -> slot in LRU order (least recently used first), free slots, and the copies
    the current step has asked for (module docstring: the invariants within a step)."""

    def __init__(self, num_slots: int, layout: TierLayout | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.layout = layout
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free: deque[int] = deque(range(num_slots))
        self._tokens: dict[int, tuple[int, ...]] = {}  # verify_hits: hash -> the block's token ids
        self._locked: set[int] = set()  # slots this step's swap-ins read
        self._swap_out: dict[int, int] = {}  # host slot -> device block, this step
        self._swap_in: list[tuple[int, int]] = []  # (host slot, device block), this step
        self.num_stored = 0  # blocks the device pool evicted into the tier (copied, or already there)
        self.num_dropped = 0  # blocks the tier's LRU dropped (gone from device and host)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def slot(self, block_hash: int) -> int | None:
        """The slot holding the block, or None. No change to the LRU order."""
        return self._slot_of.get(block_hash)

    def tokens(self, block_hash: int) -> tuple[int, ...] | None:
        return self._tokens.get(block_hash)

    def store(self, block_hash: int, device_block: int, tokens: tuple[int, ...] | None = None
              ) -> tuple[bool, int | None]:
        """The device pool evicts device_block holding block_hash: keeps it (most recently used), asking for a
        swap-out unless the tier already holds the hash (it was reloaded from here and never changes). Returns
        (kept, the hash the LRU dropped for it or None); not kept when every slot is read by this step's swap-ins."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            self.num_stored += 1
            return True, None
        dropped = None
        if self._free:
            slot = self._free.popleft()
        else:
            victim = next((h for h, s in self._slot_of.items() if s not in self._locked), None)
            if victim is None:
                return False, None
            slot = self._slot_of.pop(victim)
            self._tokens.pop(victim, None)
            self.num_dropped += 1
            dropped = victim
        self._slot_of[block_hash] = slot
        if tokens is not None:
            self._tokens[block_hash] = tokens
        self._swap_out[slot] = device_block  # a slot reused within the step: only its last content is copied
        self.num_stored += 1
        return True, dropped

    def lock(self, block_hash: int) -> None:
        """Keeps the block's slot from every swap-out of this step (a swap-in will read it)."""
        self._locked.add(self._slot_of[block_hash])

    def load(self, block_hash: int, device_block: int) -> None:
        """Asks for a swap-in of the block into device_block; the slot is locked for the rest of the step and the
        block stays in the tier (most recently used), so evicting it again needs no copy."""
        slot = self._slot_of[block_hash]
        self._slot_of.move_to_end(block_hash)
        self._locked.add(slot)
        self._swap_in.append((slot, device_block))

    def cancel_load(self, device_block: int) -> bool:
        """Drops this step's swap-in into device_block (its request gave its blocks back before the step ran)."""
        kept = [(slot, block) for slot, block in self._swap_in if block != device_block]
        cancelled = len(kept) != len(self._swap_in)
        self._swap_in = kept
        return cancelled

    @property
    def loading(self) -> set[int]:
        """Device blocks this step's swap-ins fill."""
        return {block for _, block in self._swap_in}

    def drain(self) -> StepCopies:
        """This step's copies, handed to the step message; the next step starts with none and no slot locked."""
        copies = StepCopies(sorted((block, slot) for slot, block in self._swap_out.items()), self._swap_in)
        self._swap_out, self._swap_in, self._locked = {}, [], set()
        return copies
