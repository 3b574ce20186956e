"""Which transport carries each of a replica's rank groups (TP, DCP, PCP), chosen per device and placement.

    CUDA ranks                      -> NCCL (torch.distributed), which CUDA graphs capture
    CPU ranks all on one node       -> shared memory (dcpserve/kernels/shm_collectives.py)
    CPU ranks on several nodes      -> gloo over TCP

`rank_transport` (an engine argument) is "auto" (the table), "shm" (shared memory, refused where it cannot run:
CUDA ranks, a group spread over nodes, a /dev/shm that cannot hold the segment) or "gloo" (torch.distributed
everywhere: NCCL on CUDA, gloo on CPU). Under "auto" a shared-memory setup that fails falls back to gloo with one
warning (on the group's first rank) that names the cause.

Every rank of a group must make the same choice, so the choice reads only what every rank sees alike: the
configuration, each rank's node (published in the group's store) and the outcome of the segment's creation and of
every rank's attach (published in the store too).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

import torch.distributed as dist

from dcpserve.kernels.collectives import Collectives, TorchCollectives
from dcpserve.kernels.shm_collectives import (
    DEFAULT_SLOT_BYTES,
    SegmentLayout,
    ShmCollectives,
    create_segment,
    unlink_segment,
)

logger = logging.getLogger(__name__)

RankTransport = Literal["auto", "shm", "gloo"]
RANK_TRANSPORTS: tuple[str, ...] = ("auto", "shm", "gloo")
FAILED = "!"  # a store value starting with this is an error message, not a path


class TransportError(RuntimeError):
    """The transport the configuration forced cannot run for this group."""


def node_identity() -> str:
    """What makes two ranks co-located: the kernel's boot id (one per machine, and per container boot) and the
    host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def publish_node(store: dist.Store, world_rank: int) -> None:
    store.set(f"dcpserve/node/{world_rank}", node_identity())


def _read(store: dist.Store, key: str, timeout_s: float) -> str:
    store.wait([key], timedelta(seconds=timeout_s))
    return store.get(key).decode()


def group_collectives(
    store: dist.Store,
    name: str,
    ranks: Sequence[int],
    world_rank: int,
    torch_group: dist.ProcessGroup | None,
    device_type: str,
    requested: str = "auto",
    timeout_s: float = 300.0,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
) -> Collectives:
    """This rank's Collectives for the group of world ranks `ranks` (sorted; `torch_group` is its torch.distributed
    group, None for the default group). Every rank of the group calls it with the same arguments but world_rank,
    after publish_node() on every rank of the group."""
    if requested not in RANK_TRANSPORTS:
        raise ValueError(f"rank_transport must be one of {', '.join(RANK_TRANSPORTS)}, got {requested!r}")
    forced = requested == "shm"
    if requested == "gloo" or len(ranks) == 1:
        return TorchCollectives(torch_group, name)
    if device_type == "cuda":
        if forced:
            raise TransportError(f"rank_transport=shm cannot carry the {name} group: its ranks are CUDA devices "
                                 f"(NCCL carries them; set rank_transport=auto)")
        return TorchCollectives(torch_group, name)
    nodes = {_read(store, f"dcpserve/node/{r}", timeout_s) for r in ranks}
    if len(nodes) > 1:
        if forced:
            raise TransportError(f"rank_transport=shm cannot carry the {name} group: its ranks {list(ranks)} are on "
                                 f"{len(nodes)} nodes (shared memory needs one; set rank_transport=auto)")
        return TorchCollectives(torch_group, name)
    try:
        return _shm_collectives(store, name, ranks, world_rank, timeout_s, slot_bytes)
    except _SetupFailed as failure:
        if forced:
            raise TransportError(f"rank_transport=shm: the {name} group's shared memory cannot be set up: "
                                 f"{failure} (set rank_transport=auto to fall back to gloo)") from None
        if world_rank == ranks[0]:
            logger.warning("the %s group's ranks use gloo over TCP instead of shared memory, which is slower: %s",
                           name, failure)
        return TorchCollectives(torch_group, name)


class _SetupFailed(Exception):
    """The segment could not be created or attached on some rank (the message says where and why)."""


def _shm_collectives(store: dist.Store, name: str, ranks: Sequence[int], world_rank: int, timeout_s: float,
                     slot_bytes: int) -> ShmCollectives:
    prefix = f"dcpserve/shm/{name}/{'-'.join(map(str, ranks))}"
    layout = SegmentLayout(len(ranks), slot_bytes)
    first = world_rank == ranks[0]
    path: str | None = None
    if first:
        try:
            path = create_segment(layout)
            store.set(f"{prefix}/path", path)
        except OSError as err:
            store.set(f"{prefix}/path", FAILED + str(err))
    published = _read(store, f"{prefix}/path", timeout_s)
    if published.startswith(FAILED):
        raise _SetupFailed(f"rank {ranks[0]} could not create the segment: {published[1:]}")
    collectives: ShmCollectives | None = None
    try:
        collectives = ShmCollectives(published, name, len(ranks), ranks.index(world_rank), slot_bytes, timeout_s)
        store.set(f"{prefix}/attached/{world_rank}", "ok")
    except (OSError, ValueError) as err:
        store.set(f"{prefix}/attached/{world_rank}", FAILED + f"rank {world_rank} could not map {published}: {err}")
    outcomes = [_read(store, f"{prefix}/attached/{r}", timeout_s) for r in ranks]
    if first:
        unlink_segment(published)  # every rank has mapped it (or failed to): nothing is left in /dev/shm
    failures = [outcome[1:] for outcome in outcomes if outcome.startswith(FAILED)]
    if failures:
        if collectives is not None:
            collectives.close()
        raise _SetupFailed("; ".join(failures))
    assert collectives is not None  # this rank's own outcome is among them
    return collectives
