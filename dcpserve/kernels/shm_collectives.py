"""Collectives between the CPU ranks of one node over a shared-memory segment (dcpserve/kernels/collectives.py).

gloo sends every collective over TCP loopback: a decode step's ten collectives cost more than the step's compute on
a small model (docs/benchmarks.md, bench/engine.py). Ranks on one node can instead read each other's memory. Each
group maps one segment:

    header:  ready[r], done[r], pid[r] of every group rank r, one 64-byte line each
    data:    2 buffers x size slots of slot_bytes: slot (b, r) is where rank r writes its part of a round on buffer b

A collective is one or more rounds (a message larger than a slot is cut into slot-sized chunks). Round s uses buffer
s % 2; rank r:
  1. waits until every rank's done >= s - 2 (all have read the last round on this buffer),
  2. writes its part into slot (s % 2, r), then sets ready[r] = s,
  3. waits until every rank's ready >= s (all parts are there), reads what it needs from the slots,
  4. sets done[r] = s.
Two buffers let a rank write round s + 1 while a slower peer still reads round s. A gather's non-receiving ranks
skip step 3. Sums add the parts in group-rank order on every rank, so every rank gets the same bits (the ranks of a
TP group must stay identical); half-precision parts of more than two ranks are summed in fp32.

Waiting spins briefly, then yields the core, then sleeps in short naps, so ranks that share cores with other work
give way to it. Every wait has a deadline (`timeout_s`) and checks every `LIVENESS_PERIOD_S` that the ranks it
waits for are alive (their pids are in the header): a peer that died mid-collective fails the waiting rank at once,
and a stuck one after timeout_s, with an error that names the collective, the group and the missing ranks.

Ordering: a flag is written after its data by the same thread, and read before the data; a lock acquire and release
around them is a full memory barrier (as vLLM's shared-memory broadcast does), so this holds beyond x86's ordering.

The segment is a file in /dev/shm created 0600 by the group's first rank, sized with posix_fallocate (a full
/dev/shm fails here, not with a SIGBUS at the first write), and unlinked as soon as every rank has mapped it: a
crashed replica leaves nothing behind.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

LINE = 64  # bytes per header entry: one cache line, so ranks' flags never share one
DEFAULT_SLOT_BYTES = 1 << 20  # per rank per buffer; larger messages go in several rounds
SHM_DIR = "/dev/shm"
SPINS = 200  # flag checks before yielding the core (a peer usually arrives within microseconds)
YIELDS = 2000  # sched_yield()s before sleeping
NAP_S = 50e-6  # then sleeps of this much (the kernel rounds up to its timer slack)
LIVENESS_PERIOD_S = 0.25  # how often a long wait checks that the awaited ranks' processes are alive

_fence_lock = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier: a lock's acquire and release."""
    _fence_lock.acquire()
    _fence_lock.release()


class CollectiveTimeout(TimeoutError):
    """A rank of the group did not reach a collective within the timeout, or died in it."""


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets in a group's segment."""

    size: int  # ranks in the group
    slot_bytes: int

    @property
    def header_bytes(self) -> int:
        return -(-3 * self.size * LINE // mmap.PAGESIZE) * mmap.PAGESIZE

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + 2 * self.size * self.slot_bytes

    def slot_offset(self, buffer: int, rank: int) -> int:
        return self.header_bytes + (buffer * self.size + rank) * self.slot_bytes


def create_segment(layout: SegmentLayout) -> str:
    """Creates a zeroed segment file of layout.total_bytes (0600) and returns its path. OSError (naming the path and
    the size) when /dev/shm cannot hold it."""
    path = os.path.join(SHM_DIR, f"dcpserve-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, layout.total_bytes)
    except OSError as err:
        os.close(fd)
        os.unlink(path)
        raise OSError(err.errno, f"{SHM_DIR} cannot hold a {layout.total_bytes}-byte collectives segment "
                                 f"({path}): {err.strerror}") from err
    os.close(fd)
    return path


def unlink_segment(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                 torch.int32: np.int32, torch.int64: np.int64}


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array sharing its memory."""
    return t.reshape(-1).view(torch.uint8).numpy()


class _What:
    """Which collective a wait belongs to, formatted only for an error (the hot path never builds the string)."""

    __slots__ = ("op", "number", "tensor")

    def __init__(self, op: str, number: int, tensor: torch.Tensor) -> None:
        self.op, self.number, self.tensor = op, number, tensor

    def __str__(self) -> str:
        return f"{self.op} #{self.number} ({tuple(self.tensor.shape)} {self.tensor.dtype})"


class ShmCollectives:
    """One group's collectives over a shared-memory segment every rank of the group has mapped (module docstring).

    `path` is the segment create_segment made (on the group's first rank); every rank of the group constructs one
    with the same path, size and slot_bytes, and its own rank."""

    transport = "shm"

    def __init__(self, path: str, name: str, size: int, rank: int, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 timeout_s: float = 300.0) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        if slot_bytes % LINE:
            raise ValueError(f"slot_bytes must be a multiple of {LINE}, got {slot_bytes}")
        self.name, self.size, self.rank, self.timeout_s = name, size, rank, timeout_s
        self.layout = SegmentLayout(size, slot_bytes)
        self.slot_bytes = slot_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != self.layout.total_bytes:
                raise ValueError(f"the segment {path} has {os.fstat(fd).st_size} bytes, not the "
                                 f"{self.layout.total_bytes} of {size} ranks x {slot_bytes}-byte slots")
            self._map: mmap.mmap | None = mmap.mmap(fd, self.layout.total_bytes)
        finally:
            os.close(fd)
        self._flags = memoryview(self._map).cast("q")  # int64 view: entry e of line i is [i * 8 + e]
        # numpy views of the slots: slicing and copying small parts costs a fraction of torch's per-call overhead,
        # which a decode step pays ten times per layer pair.
        segment = np.frombuffer(self._map, dtype=np.uint8)
        self._slots = [[segment[self.layout.slot_offset(b, r):][:slot_bytes] for r in range(size)] for b in range(2)]
        self._lines = {field: [self._line(field, r) for r in range(size)] for field in ("ready", "done")}
        self._round = 0
        self._ops = 0
        self._pids: list[int] | None = None
        self._flags[self._line("pid", rank)] = os.getpid()

    # ---- the round protocol ----------------------------------------------------------------------------------

    def _line(self, field: str, rank: int) -> int:
        return ({"ready": 0, "done": 1, "pid": 2}[field] * self.size + rank) * (LINE // 8)

    def _begin(self, what: _What) -> int:
        """Steps 1: the next round's buffer, once every rank has read this buffer's previous round."""
        self._round += 1
        if self._round > 2:
            self._wait("done", self._round - 2, what)
        return self._round % 2

    def _publish(self) -> None:
        """Step 2's flag: this rank's part of the round is in its slot."""
        memory_fence()
        self._flags[self._line("ready", self.rank)] = self._round

    def _await_parts(self, what: _What) -> None:
        """Step 3: every rank's part of the round is in its slot."""
        self._wait("ready", self._round, what)
        memory_fence()

    def _end(self) -> None:
        """Step 4: this rank is done reading the round."""
        memory_fence()
        self._flags[self._line("done", self.rank)] = self._round

    def _wait(self, field: str, target: int, what: _What) -> None:
        flags = self._flags
        lines = self._lines[field]
        if all(flags[i] >= target for i in lines):
            return
        spins = 0
        started = 0.0
        next_check = 0.0
        while True:
            spins += 1
            if spins < SPINS:
                pass
            elif spins < SPINS + YIELDS:
                os.sched_yield()
            else:
                now = time.monotonic()
                if not started:
                    started, next_check = now, now + LIVENESS_PERIOD_S
                elif now >= next_check:
                    next_check = now + LIVENESS_PERIOD_S
                    missing = [r for r in range(self.size) if flags[lines[r]] < target]
                    self._check_alive(missing, what)
                    if now - started > self.timeout_s:
                        raise CollectiveTimeout(
                            f"{what}: ranks {missing} of the {self.name} group ({self.size} ranks, shared memory) "
                            f"did not reach it within {self.timeout_s:.0f}s (collective timeout)")
                time.sleep(NAP_S)
            if all(flags[i] >= target for i in lines):
                return

    def _check_alive(self, ranks: list[int], what: _What) -> None:
        if self._pids is None:
            self._pids = [self._flags[self._line("pid", r)] for r in range(self.size)]
        for r in ranks:
            pid = self._pids[r] or self._flags[self._line("pid", r)]
            if not pid:
                continue  # not attached yet: the deadline covers it
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise CollectiveTimeout(
                    f"{what}: rank {r} of the {self.name} group (pid {pid}) exited in the middle of it") from None
            except PermissionError:
                pass  # alive, another user's

    def _describe(self, op: str, x: torch.Tensor) -> _What:
        self._ops += 1
        return _What(op, self._ops, x)

    def _chunks(self, nbytes: int, per_round: int) -> list[tuple[int, int]]:
        return [(start, min(per_round, nbytes - start)) for start in range(0, nbytes, per_round)] or [(0, 0)]

    # ---- collectives -----------------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if not x.is_contiguous():
            x.copy_(self.all_reduce(x.contiguous()))
            return x
        what = self._describe("all_reduce", x)
        data = _np_bytes(x)  # x's own memory: the sums land in x
        np_dtype = _NUMPY_DTYPES.get(x.dtype)
        widen = x.dtype in (torch.float16, torch.bfloat16) and self.size > 2
        for start, length in self._chunks(data.size, self.slot_bytes):
            buffer = self._begin(what)
            slots = self._slots[buffer]
            slots[self.rank][:length] = data[start:start + length]
            self._publish()
            self._await_parts(what)
            if length == 0:
                pass  # an empty tensor: the round only keeps the ranks in step
            elif np_dtype is not None and not widen:
                out = data[start:start + length].view(np_dtype)
                np.add(slots[0][:length].view(np_dtype), slots[1][:length].view(np_dtype), out=out)
                for r in range(2, self.size):
                    np.add(out, slots[r][:length].view(np_dtype), out=out)
            else:  # bfloat16 (no numpy dtype), or half precision summed in fp32
                parts = [torch.from_numpy(slots[r][:length]).view(x.dtype) for r in range(self.size)]
                target = torch.from_numpy(data[start:start + length]).view(x.dtype)
                if widen:
                    total = parts[0].float()
                    for part in parts[1:]:
                        total += part
                    target.copy_(total)
                else:
                    torch.add(parts[0], parts[1], out=target)
                    for part in parts[2:]:
                        target += part
            self._end()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        gathered = x.new_empty((self.size, *x.shape))
        self._gather_into(x, gathered, "all_gather")
        return gathered

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        gathered = x.new_empty((self.size, *x.shape)) if self.rank == 0 else None
        self._gather_into(x, gathered, "gather")
        return gathered

    def _gather_into(self, x: torch.Tensor, gathered: torch.Tensor | None, op: str) -> None:
        if self.size == 1:
            if gathered is not None:
                gathered[0].copy_(x)
            return
        what = self._describe(op, x)
        data = _np_bytes(x)
        out = _np_bytes(gathered).reshape(self.size, -1) if gathered is not None else None
        for start, length in self._chunks(data.size, self.slot_bytes):
            buffer = self._begin(what)
            slots = self._slots[buffer]
            slots[self.rank][:length] = data[start:start + length]
            self._publish()
            if out is not None:
                self._await_parts(what)
                for r in range(self.size):
                    out[r, start:start + length] = slots[r][:length]
            self._end()

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.size:
            raise ValueError(f"all_to_all takes [group size {self.size}, ...], got shape {tuple(x.shape)}")
        received = torch.empty_like(x, memory_format=torch.contiguous_format)
        if self.size == 1:
            received.copy_(x)
            return received
        what = self._describe("all_to_all", x)
        send = _np_bytes(x).reshape(self.size, -1)
        out = _np_bytes(received).reshape(self.size, -1)
        part = send.shape[1]
        me = self.rank
        if part * self.size <= self.slot_bytes:  # one round: the parts side by side, written in one copy
            buffer = self._begin(what)
            slots = self._slots[buffer]
            slots[me][:part * self.size] = send.reshape(-1)
            self._publish()
            self._await_parts(what)
            for r in range(self.size):
                out[r] = slots[r][me * part:(me + 1) * part]
            self._end()
            return received
        stride = self.slot_bytes // self.size // LINE * LINE
        for start, length in self._chunks(part, stride):
            buffer = self._begin(what)
            slots = self._slots[buffer]
            for j in range(self.size):
                slots[me][j * stride:j * stride + length] = send[j, start:start + length]
            self._publish()
            self._await_parts(what)
            for r in range(self.size):
                out[r, start:start + length] = slots[r][me * stride:me * stride + length]
            self._end()
        return received

    def close(self) -> None:
        """Unmaps the segment (the file was unlinked once every rank had mapped it)."""
        if self._map is None:
            return
        self._slots = []
        self._flags.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a tensor still views the segment: the mapping goes with the process
        self._map = None

