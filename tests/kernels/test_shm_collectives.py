"""The shared-memory collectives (dcpserve/kernels/shm_collectives.py) across real processes, and the choice of
transport (dcpserve/engine/worker/rank_transport.py).

Each rank regenerates every rank's input from seeds, so it knows what every collective must return; slots of a few
hundred bytes force the multi-round path (a message larger than a slot) as well as the one-round path."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bench.harness.model_harness import free_port
from dcpserve.engine.worker.rank_transport import TransportError, group_collectives, publish_node
from dcpserve.kernels.shm_collectives import (
    CollectiveTimeout,
    SegmentLayout,
    ShmCollectives,
    create_segment,
    unlink_segment,
)
from tests.spawn_pool import SpawnPool

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
SHAPES = ((3, 5), (1, 128), (40, 33), (0, 4), ())  # one round, several rounds (at 256-byte slots), empty, scalar


def _data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=generator)
    return torch.randn(shape, generator=generator).to(dtype)


def _expected_sum(size: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    parts = [_data(r, shape, dtype, salt) for r in range(size)]
    if dtype in (torch.float16, torch.bfloat16) and size > 2:
        return sum((p.float() for p in parts[1:]), parts[0].float()).to(dtype)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def _every_op(rank: int, size: int, path: str, slot_bytes: int) -> None:
    torch.set_num_threads(1)
    comm = ShmCollectives(path, "tp", size, rank, slot_bytes, timeout_s=60)
    try:
        salt = 0
        for dtype in DTYPES:
            for shape in SHAPES:
                salt += 1
                x = _data(rank, shape, dtype, salt)
                assert torch.equal(comm.all_reduce(x.clone()), _expected_sum(size, shape, dtype, salt)), (dtype, shape)
                everyone = torch.stack([_data(r, shape, dtype, salt) for r in range(size)])
                assert torch.equal(comm.all_gather(x), everyone), (dtype, shape)
                gathered = comm.gather(x)
                assert (gathered is None) == (rank != 0)
                if gathered is not None:
                    assert torch.equal(gathered, everyone)
                sends = torch.stack([_data(r, (size, *shape), dtype, salt) for r in range(size)])  # [from, to, ...]
                assert torch.equal(comm.all_to_all(sends[rank]), sends[:, rank]), (dtype, shape)
        # In place on a view that is not contiguous (a column), and the same bits on every rank.
        matrix = _data(rank, (6, 4), torch.float32, 99)
        column = matrix[:, 1]
        result = comm.all_reduce(column)
        assert result is column and torch.equal(matrix[:, 1], _expected_sum(size, (6, 4), torch.float32, 99)[:, 1])
        sums = comm.all_gather(comm.all_reduce(_data(rank, (64,), torch.bfloat16, 7)))
        assert all(torch.equal(sums[0], sums[r]) for r in range(size))
    finally:
        comm.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,slot_bytes", [(2, 256), (2, 1 << 20), (3, 256), (4, 512)])
def test_every_collective_matches_its_definition(size: int, slot_bytes: int, spawn_pool: SpawnPool) -> None:
    path = create_segment(SegmentLayout(size, slot_bytes))
    try:
        spawn_pool.spawn(_every_op, (size, path, slot_bytes), size)
    finally:
        unlink_segment(path)


def _skips_a_collective(rank: int, path: str, errors: str) -> None:
    comm = ShmCollectives(path, "dcp", 2, rank, 4096, timeout_s=1.0)
    try:
        comm.all_reduce(torch.ones(4))
        if rank == 1:
            return  # leaves its peer alone in the next one
        started = time.monotonic()
        try:
            comm.all_gather(torch.ones(4))
        except CollectiveTimeout as err:
            with open(errors, "w") as f:
                f.write(f"{time.monotonic() - started:.2f}\n{err}")
    finally:
        comm.close()


def test_a_rank_that_skips_a_collective_times_out_its_peer_naming_it(spawn_pool: SpawnPool, tmp_path) -> None:
    path = create_segment(SegmentLayout(2, 4096))
    errors = tmp_path / "error.txt"
    try:
        spawn_pool.spawn(_skips_a_collective, (path, str(errors)), 2)
    finally:
        unlink_segment(path)
    seconds, message = errors.read_text().split("\n", 1)
    assert 1.0 <= float(seconds) < 10
    assert "all_gather #2 ((4,) torch.float32)" in message and "ranks [1] of the dcp group" in message
    assert "within 1s (collective timeout)" in message


def _dies(path: str) -> None:
    comm = ShmCollectives(path, "tp", 2, 1, 4096)
    comm.all_reduce(torch.ones(2))
    os._exit(3)  # gone before the next collective, as a killed rank is


def test_a_rank_that_dies_fails_its_peer_at_once() -> None:
    path = create_segment(SegmentLayout(2, 4096))
    try:
        comm = ShmCollectives(path, "tp", 2, 0, 4096, timeout_s=120)
        child = multiprocessing.get_context("spawn").Process(target=_dies, args=(path,))
        child.start()
        assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), 2.0))
        child.join(60)
        started = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=rf"rank 1 of the tp group \(pid {child.pid}\) exited"):
            comm.all_reduce(torch.ones(2))
        assert time.monotonic() - started < 5  # not the 120 s timeout
        comm.close()
    finally:
        unlink_segment(path)


def test_a_segment_dev_shm_cannot_hold_is_refused_naming_its_size() -> None:
    layout = SegmentLayout(2, 1 << 46)  # 128 TiB
    with pytest.raises(OSError, match=f"cannot hold a {layout.total_bytes}-byte collectives segment"):
        create_segment(layout)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("dcpserve-") and
                os.stat(f"/dev/shm/{name}").st_size == layout.total_bytes]


def _choose(rank: int, port: int, requested: str, slot_bytes: int, nodes: list[str] | None, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("dcpserve.engine.worker.rank_transport")
    logger.addHandler(handler)
    try:
        if nodes is None:
            publish_node(store, rank)
        else:  # two machines, as two nodes' ranks would publish them
            store.set(f"dcpserve/node/{rank}", nodes[rank])
        try:
            comm = group_collectives(store, "tp", [0, 1], rank, None, "cpu", requested, 30.0, slot_bytes)
            outcome = comm.transport
            assert torch.equal(comm.all_reduce(torch.ones(3)), torch.full((3,), 2.0))
            comm.close()
        except TransportError as err:
            outcome = f"refused: {err}"
        with open(f"{out}.{rank}", "w") as f:
            f.write("\n".join([outcome, *records]))
        dist.barrier()
    finally:
        logger.removeHandler(handler)
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("requested,slot_bytes,nodes,expected", [
    ("auto", 4096, None, "shm"),
    ("auto", 4096, ["a", "b"], "gloo"),  # ranks on two nodes
    ("shm", 4096, ["a", "b"], "refused: rank_transport=shm cannot carry the tp group: its ranks [0, 1] are on 2"),
    ("auto", 1 << 46, None, "gloo"),  # /dev/shm cannot hold the segment: one warning, then gloo
    ("shm", 1 << 46, None, "refused: rank_transport=shm: the tp group's shared memory cannot be set up: rank 0 "
                           "could not create the segment"),
    ("gloo", 4096, None, "gloo"),
])
def test_every_rank_makes_the_same_choice(requested: str, slot_bytes: int, nodes: list[str] | None, expected: str,
                                          spawn_pool: SpawnPool, tmp_path) -> None:
    out = str(tmp_path / "outcome")
    spawn_pool.spawn(_choose, (free_port(), requested, slot_bytes, nodes, out), 2)
    outcomes = [(tmp_path / f"outcome.{rank}").read_text().split("\n") for rank in range(2)]
    assert all(lines[0].startswith(expected) for lines in outcomes), outcomes
    warned = [[line for line in lines[1:] if "instead of shared memory" in line] for lines in outcomes]
    if requested == "auto" and slot_bytes > 1 << 40:
        assert len(warned[0]) == 1 and "cannot hold a" in warned[0][0] and not warned[1]
    else:
        assert warned == [[], []]
