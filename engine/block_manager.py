"""KV cache blocks, counted in logical blocks of block_size * dcp tokens.

A logical block is one physical page of block_size slots on every rank of the DCP group, so one block table
serves every rank. Everything above the kernels (scheduler, admission, metrics, planning) counts KV with
blocks_needed(); nothing else rounds tokens to blocks.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from engine.request import Request, RequestRejected


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


class BlockManager:
    """Hands out logical blocks; tracks what admission promised so that a promise can always be kept."""

    def __init__(self, num_blocks: int, block_size: int, dcp_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache has no room for a single block (num_blocks={num_blocks}): raise the KV memory budget "
                f"(kv_cache_memory_bytes, or gpu_memory_utilization on GPUs)"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.tokens_per_block = block_size * dcp_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._promised = 0  # sum over requests of reserved_blocks - allocated, where positive

    @property
    def capacity_tokens(self) -> int:
        """pages per rank * block_size * dcp."""
        return self.num_blocks * self.tokens_per_block

    @property
    def num_free_blocks(self) -> int:
        """Unallocated and unpromised."""
        return len(self._free_block_ids) - self._promised

    def usage(self) -> BlockUsage:
        used = self.num_blocks - len(self._free_block_ids)
        return BlockUsage(self.num_blocks, used, used + self._promised, self.tokens_per_block)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.tokens_per_block)

    @staticmethod
    def _outstanding(request: Request) -> int:
        return max(0, request.reserved_blocks - len(request.block_ids))

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
            request.block_ids.append(self._free_block_ids.popleft())
        self._promised -= from_promise
        return True

    def free(self, request: Request) -> None:
        """Returns every block the request holds or was promised."""
        self._promised -= self._outstanding(request)
        self._free_block_ids.extend(request.block_ids)
        request.block_ids = []
        request.reserved_blocks = 0
