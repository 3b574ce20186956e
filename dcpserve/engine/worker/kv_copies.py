"""One rank's host KV pool and the step's copies between it and the rank's device KV cache.

The pool holds num_slots pages with the device cache's layout (every layer's K and V, or the key-only cache of MLA;
this rank's heads and this rank's DCP shard of a logical block's tokens: what the rank's own page holds, never
gathered), pinned on CUDA. The scheduler's host tier (dcpserve/engine/core/host_tier.py) decides the slots, the same
on every rank; a step's copies arrive with it (SchedulerOutput.swap_out / swap_in) and `apply` makes them before the
step touches its pages: swap-outs first (their device pages may be written, or on CPU zeroed as fresh, by this step),
then swap-ins (which may read a slot a swap-out of this step just wrote).

On CPU both directions are one index_select / index_copy_ per cache tensor (no loop over blocks). On CUDA the
swap-outs gather the pages on the device, copy them to pinned staging and scatter them into the pool once the copy
has landed (the host waits: the next swap-in may read them); the swap-ins gather the slots into pinned staging and
copy them to the device on a side stream, scattered into the cache there, and the forward's stream waits on that
stream's event (`wait`), so the host-to-device copy overlaps the step's input preparation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class CopyCounters:
    """What one rank's copies cost since start (both directions), and what the last step's took."""

    blocks_out: int = 0
    blocks_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    seconds_out: float = 0.0
    seconds_in: float = 0.0
    last_seconds_out: float = 0.0
    last_seconds_in: float = 0.0


class HostKvPool:
    """One rank's host pages (module docstring) and the copies to and from its device KV cache."""

    def __init__(self, num_slots: int, device_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if num_slots < 1:
            raise ValueError(f"a host KV pool needs at least one slot, got {num_slots}")
        self.device = device_caches[0][0].device
        pin = self.device.type == "cuda"
        self.num_slots = num_slots
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device tensor, host tensor), each cache once
        for keys, values in device_caches:
            for tensor in (keys,) if values is keys else (keys, values):
                host = torch.zeros((num_slots, *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=pin)
                self._pairs.append((tensor, host))
        self.bytes_per_slot = sum(host[0].numel() * host.element_size() for _, host in self._pairs)
        self.counters = CopyCounters()
        self._stream = torch.cuda.Stream(self.device) if pin else None
        self._event: torch.cuda.Event | None = None
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # the last swap-in's (start, end)

    def apply(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Makes a step's copies: swap_out (device page, host slot) first, then swap_in (host slot, device page)."""
        counters = self.counters
        counters.last_seconds_out = counters.last_seconds_in = 0.0
        self._timing = None
        if swap_out:
            start = time.perf_counter()
            self._swap_out(swap_out)
            counters.last_seconds_out = time.perf_counter() - start
            counters.seconds_out += counters.last_seconds_out
            counters.blocks_out += len(swap_out)
            counters.bytes_out += len(swap_out) * self.bytes_per_slot
        if swap_in:
            start = time.perf_counter()
            self._swap_in(swap_in)
            if self._stream is None:
                counters.last_seconds_in = time.perf_counter() - start
                counters.seconds_in += counters.last_seconds_in
            counters.blocks_in += len(swap_in)
            counters.bytes_in += len(swap_in) * self.bytes_per_slot

    def _swap_out(self, swap_out: list[tuple[int, int]]) -> None:
        pages = torch.tensor([page for page, _ in swap_out], dtype=torch.int64)
        slots = torch.tensor([slot for _, slot in swap_out], dtype=torch.int64)
        if self._stream is None:
            for device_tensor, host in self._pairs:
                host.index_copy_(0, slots, device_tensor.index_select(0, pages))
            return
        staged = []
        device_pages = pages.to(self.device, non_blocking=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the pages' last writes (and device_pages)
        with torch.cuda.stream(self._stream):
            for device_tensor, host in self._pairs:
                buffer = torch.empty((len(swap_out), *host.shape[1:]), dtype=host.dtype, pin_memory=True)
                buffer.copy_(device_tensor.index_select(0, device_pages), non_blocking=True)
                staged.append(buffer)
        self._stream.synchronize()  # the staging must land before the host reads it (and this step overwrites pages)
        for (_, host), buffer in zip(self._pairs, staged, strict=True):
            host.index_copy_(0, slots, buffer)

    def _swap_in(self, swap_in: list[tuple[int, int]]) -> None:
        slots = torch.tensor([slot for slot, _ in swap_in], dtype=torch.int64)
        pages = torch.tensor([page for _, page in swap_in], dtype=torch.int64)
        if self._stream is None:
            for device_tensor, host in self._pairs:
                device_tensor.index_copy_(0, pages, host.index_select(0, slots))
            return
        staged = []
        for _, host in self._pairs:
            buffer = torch.empty((len(swap_in), *host.shape[1:]), dtype=host.dtype, pin_memory=True)
            torch.index_select(host, 0, slots, out=buffer)
            staged.append(buffer)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward stream's reads of the pages
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            device_pages = pages.to(self.device, non_blocking=True)
            for (device_tensor, _), buffer in zip(self._pairs, staged, strict=True):
                device_tensor.index_copy_(0, device_pages, buffer.to(self.device, non_blocking=True))
            end.record(self._stream)
        # The pinned staging outlives the copies: torch's host allocator reuses a pinned block only once the streams
        # that copied from it are past the copy.
        self._event, self._timing = end, (start, end)

    def wait(self) -> None:
        """Makes the forward's stream wait for this step's swap-ins (CUDA); a no-op on CPU, where they are done."""
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
            self._event = None

    def last_seconds(self) -> tuple[float, float]:
        """(swap-out, swap-in) seconds of the last step on this rank; on CUDA read after the step (it waits for the
        swap-ins' end event and adds them to the counters)."""
        counters = self.counters
        if self._timing is not None:
            start, end = self._timing
            end.synchronize()
            counters.last_seconds_in = start.elapsed_time(end) / 1000
            counters.seconds_in += counters.last_seconds_in
            self._timing = None
        return counters.last_seconds_out, counters.last_seconds_in
