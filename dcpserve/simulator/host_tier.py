"""The host-memory KV tier of a simulated replica: the engine's real block manager with a host pool under it.

What the tier does, as issue 51's engine tier does it:
- A cached prefix block the device pool evicts (to hand its page to another request) goes to the replica's host pool
  instead of being dropped: every rank of the replica copies its own page of the block (a DCP rank its shard of the
  block's tokens, never gathered) to its host memory. The replica reports it HOSTED (dcpserve/engine/core/
  prefix_cache.py). The host pool is an LRU of `HostTierShape.num_blocks` logical blocks; a block it drops is gone,
  reported EVICTED. The pool keeps a copy of a block it reloaded (inclusive), so that block's next eviction from the
  device copies nothing.
- A request whose cached run on the device continues in the host pool takes those blocks back: device blocks for them
  as for a miss (the admission need is a miss's, as the contract says), one copy per block per rank host -> device,
  and its computed tokens start after them: the reloaded prefill is not computed again.
- Copies overlap compute, batched per step: the loads and offloads a step's schedule started run on the copy engine
  while the step computes (layer by layer, as vLLM's and LMCache's layer-wise loading do), so the step lasts the
  longer of its compute and its copies; loads and offloads go opposite ways over the full-duplex link and run at
  once. Each rank copies its own pages over its own GPU's host link (dcpserve/simulator/gpus.py), all ranks at once:
  a copy of n blocks takes n * block_size * kv_bytes_per_token_per_rank / (host link * HOST_LINK_EFFICIENCY).
What it leaves out: host memory bandwidth shared by the GPUs of a node (two sockets of DDR5 give several hundred GB/s,
more than 8 PCIe Gen5 links take), PCIe switches shared with NICs, and a per-copy latency (blocks are batched).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from dcpserve.engine.args import parse_bytes
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.prefix_cache import EVICTED, HOSTED, PrefixReporter, max_hit_blocks
from dcpserve.engine.core.request import Request

# What a copy reaches of the link's per-direction rate: PCIe packet headers and flow control. A guess to calibrate,
# as RooflineModel's link_efficiency is.
HOST_LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class HostTierShape:
    """One replica's host KV tier: how many logical blocks it holds and how fast a rank copies its page of one."""

    num_blocks: int  # logical blocks (block_size * dcp tokens); every rank holds its page of each
    bytes_per_block_per_rank: int  # one page: block_size * kv_bytes_per_token_per_rank
    load_bytes_per_s: float  # host -> device, per GPU, what a copy reaches
    offload_bytes_per_s: float  # device -> host, per GPU

    def __post_init__(self) -> None:
        if self.num_blocks < 0:
            raise ValueError(f"the host tier's num_blocks is {self.num_blocks}; give 0 (no tier) or more")
        if self.bytes_per_block_per_rank < 1:
            raise ValueError(f"bytes_per_block_per_rank is {self.bytes_per_block_per_rank}; a page has bytes")
        for name, value in (("load_bytes_per_s", self.load_bytes_per_s),
                            ("offload_bytes_per_s", self.offload_bytes_per_s)):
            if not value > 0:
                raise ValueError(f"the host tier's {name} is {value}; give the host link's bytes per second")

    def load_seconds(self, blocks: int) -> float:
        """Seconds to copy `blocks` blocks host -> device (each rank its pages, all ranks at once)."""
        return blocks * self.bytes_per_block_per_rank / self.load_bytes_per_s

    def offload_seconds(self, blocks: int) -> float:
        return blocks * self.bytes_per_block_per_rank / self.offload_bytes_per_s

    def copy_seconds(self, loaded: int, offloaded: int) -> float:
        """How long a step's copies take: loads and offloads at once, each its own direction of the link."""
        return max(self.load_seconds(loaded), self.offload_seconds(offloaded))


class HostKvTier:
    """The host pool: block hashes in least-recently-used order, at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._held: set[int] = set()  # being copied to the device now: never dropped meanwhile

    def __len__(self) -> int:
        return len(self._lru) + len(self._held)

    def __contains__(self, block: int) -> bool:
        return block in self._lru or block in self._held

    def put(self, block: int) -> tuple[bool, list[int]]:
        """Takes a block the device evicted: (whether its pages must be copied (False: the pool had it, or has no
        room but blocks being copied back, so it does not take it), the blocks the pool dropped for room, least
        recently used first)."""
        if block in self._lru:
            self._lru.move_to_end(block)
            return False, []
        if block in self._held or len(self._held) >= self.capacity:
            return False, []  # held: being copied back, so the pool has it; or no room but held blocks
        self._lru[block] = None
        return True, self._trim()

    def hold(self, block: int) -> None:
        """Keeps a block out of the LRU while its copy to the device runs."""
        del self._lru[block]
        self._held.add(block)

    def release(self, block: int) -> list[int]:
        """A held block's copy is done: it stays, most recently used. Returns the blocks dropped for room."""
        self._held.discard(block)
        self._lru[block] = None
        return self._trim()

    def _trim(self) -> list[int]:
        dropped = []
        while self._lru and len(self) > self.capacity:
            block, _ = self._lru.popitem(last=False)
            dropped.append(block)
        return dropped


class _TierReporter(PrefixReporter):
    """The block manager's reporter, with a device eviction turned into the tier's answer (HOSTED or EVICTED)."""

    def __init__(self, tokens_per_block: int, seed: bytes, on_device_evicted: Callable[[int], int]) -> None:
        super().__init__(tokens_per_block, seed)
        self._on_device_evicted = on_device_evicted

    def set(self, block: int, state: int) -> None:
        if state == EVICTED:
            state = self._on_device_evicted(block)
        super().set(block, state)


class TieredBlockManager(BlockManager):
    """The engine's BlockManager (prefix caching on) with a host tier under its device pool (module doc)."""

    def __init__(self, num_blocks: int, block_size: int, dcp_size: int, tier: HostTierShape,
                 hash_seed: bytes = b"") -> None:
        super().__init__(num_blocks, block_size, dcp_size, enable_prefix_caching=True, hash_seed=hash_seed)
        self.tier_shape = tier
        self.tier = HostKvTier(tier.num_blocks)
        self._tier_reporter = _TierReporter(self.tokens_per_block, hash_seed, self._device_evicted)
        self.reporter = self._tier_reporter
        self.num_host_hit_tokens = 0  # prompt tokens of new requests reloaded from the tier (not computed)
        self.num_loaded_blocks = 0  # host -> device copies, in logical blocks (every rank its page)
        self.num_offloaded_blocks = 0  # device -> host copies
        self.num_host_evictions = 0  # blocks the tier dropped that the device did not hold: reported EVICTED
        self._pending_loads = 0  # copies started since the last take_copies()
        self._pending_offloads = 0

    @property
    def prefix_reporter(self) -> PrefixReporter:
        """The reporter (BlockManager.reporter, never None here): device states, HOSTED, EVICTED."""
        return self._tier_reporter

    def _device_evicted(self, block: int) -> int:
        """A cached block left the device pool: into the tier (HOSTED), or gone (EVICTED) without room for it."""
        if self.tier.capacity == 0:
            return EVICTED
        copied, dropped = self.tier.put(block)
        if copied:
            self._pending_offloads += 1
            self.num_offloaded_blocks += 1
        self._drop(dropped)
        return HOSTED if block in self.tier else EVICTED

    def _drop(self, dropped: list[int]) -> None:
        """Blocks the tier let go: gone from the replica unless the device holds them (then it reports their state)."""
        reporter = self._tier_reporter
        for block in dropped:
            self._forget_readers(block)  # a waiting request's run through it ends before it now
            if reporter.state.get(block) == HOSTED:
                self.num_host_evictions += 1
                PrefixReporter.set(reporter, block, EVICTED)

    def hosted_run(self, request: Request, device_hits: int) -> int:
        """The blocks continuing the request's cached run in this tier, as admit would reload them (and the engine's
        tier counts its own): the ledger's prefill estimate of a waiting request leaves them out."""
        if not len(self.tier) or not self._can_look_up(request):
            return 0
        return len(self._tier_run(request, device_hits))

    def _tier_run(self, request: Request, device_hits: int) -> list[int]:
        """The hashes of the blocks after the request's first device_hits that the tier holds, up to the first it
        does not (before the prompt's last token)."""
        run: list[int] = []
        limit = max_hit_blocks(request.num_tokens, self.tokens_per_block)
        for block in self.block_hashes(request, limit)[device_hits:]:
            if block not in self.tier:
                break
            run.append(block)
        return run

    def admit(self, request: Request, reserve_tokens: int, keep_free: int = 0) -> bool:
        """BlockManager.admit, then the blocks that continue the request's cached run in the host tier: allocated
        on the device as a miss's would be, copied back, and counted computed."""
        fresh = (not request.block_ids and request.num_computed_tokens == 0
                 and request.sampling_params.prompt_logprobs is None)
        if not super().admit(request, reserve_tokens, keep_free):
            return False
        if not fresh or not len(self.tier):
            return True
        tokens_per_block = self.tokens_per_block
        device_hits = request.num_cached_blocks
        run = self._tier_run(request, device_hits)  # after its device hits were taken: not hosted_run's look-up
        if not run:
            return True
        for block in run:
            self.tier.hold(block)
        allocated = self.allocate(request, (device_hits + len(run)) * tokens_per_block)
        dropped: list[int] = []
        for block in run:
            dropped += self.tier.release(block)
        self._drop(dropped)
        if not allocated:  # cannot happen: admit reserved the whole prompt; computed instead
            return True
        request.num_computed_tokens = (device_hits + len(run)) * tokens_per_block
        self.cache_computed(request)  # on the device again: reported PINNED
        self._pending_loads += len(run)
        self.num_loaded_blocks += len(run)
        if not request.num_preemptions:
            self.num_host_hit_tokens += len(run) * tokens_per_block
        return True

    def take_copies(self) -> tuple[int, int]:
        """The blocks loaded and offloaded since the last call (a step's copies), and starts counting anew."""
        copies = self._pending_loads, self._pending_offloads
        self._pending_loads = self._pending_offloads = 0
        return copies


@dataclass(frozen=True)
class HostKvOption:
    """`--host-kv-per-node`: host memory for the KV tier per node, in bytes or as a multiple of the device KV."""

    bytes_per_node: int | None = None
    multiple: float | None = None  # of the node's device KV pool

    def __str__(self) -> str:
        return f"{self.multiple:g}x" if self.multiple is not None else f"{self.bytes_per_node} bytes"


def parse_host_kv(text: str) -> HostKvOption:
    """"4x" (four times the device KV), or a size: "2TiB", "1.5TB", a number of bytes."""
    value = text.strip()
    if value.lower().endswith("x"):
        try:
            multiple = float(value[:-1])
        except ValueError:
            multiple = -1.0
        if not 0 < multiple < float("inf"):
            raise ValueError(f"host KV {text!r}: a multiple of the device KV is a positive number and x, e.g. 4x")
        return HostKvOption(multiple=multiple)
    try:
        return HostKvOption(bytes_per_node=parse_bytes(value))
    except ValueError as err:
        raise ValueError(f"host KV {text!r}: {err}; or a multiple of the device KV such as 4x") from None


def host_tier_shape(option: HostKvOption, device_blocks: int, bytes_per_block_per_rank: int, gpus_per_node: int,
                    link_bytes_per_s: float) -> HostTierShape:
    """One replica's tier: a multiple of its device pool, or its GPUs' share of the node's host memory (each GPU's
    share holds that GPU's pages), copies at HOST_LINK_EFFICIENCY of the GPU's host link per direction."""
    if not link_bytes_per_s > 0:
        raise ValueError(f"the host link is {link_bytes_per_s} bytes/s; give the GPU's host link (--host-link-gbps)")
    if option.multiple is not None:
        blocks = round(option.multiple * device_blocks)
    else:
        blocks = (option.bytes_per_node or 0) // gpus_per_node // bytes_per_block_per_rank
    rate = link_bytes_per_s * HOST_LINK_EFFICIENCY
    return HostTierShape(blocks, bytes_per_block_per_rank, rate, rate)
