"""The spawn pool the multi-rank tests run in (tests/spawn_pool.py) fails a case as mp.spawn would: a rank that
raises or dies fails it with the cause, and so does one that leaves its process group behind; processes are reused
only after cases that succeeded."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.spawn_pool import SpawnPool


def _write_pid(rank: int, out_dir: str) -> None:
    (Path(out_dir) / f"rank{rank}").write_text(str(os.getpid()))


def _raise_on_rank_1(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 was told to fail")
    time.sleep(600)  # as a peer blocked in a collective would


def _exit_on_rank_0(rank: int) -> None:
    if rank == 0:
        os._exit(3)


def _leave_a_group(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1,
                            timeout=timedelta(seconds=30))


@pytest.fixture(scope="module")
def pool() -> Iterator[SpawnPool]:
    pool = SpawnPool()
    yield pool
    pool.close()


def _pids(pool: SpawnPool, tmp_path: Path, nprocs: int) -> list[str]:
    pool.spawn(_write_pid, (str(tmp_path),), nprocs)
    return [(tmp_path / f"rank{rank}").read_text() for rank in range(nprocs)]


def test_a_failed_rank_fails_the_case_and_fresh_processes_run_the_next(pool: SpawnPool, tmp_path: Path) -> None:
    """Its peer, blocked, is killed rather than waited for."""
    first = _pids(pool, tmp_path, 2)
    assert _pids(pool, tmp_path, 2) == first, "processes are reused after a case that succeeded"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of _raise_on_rank_1 raised:.*rank 1 was told to fail"):
        pool.spawn(_raise_on_rank_1, (), 2)
    assert time.monotonic() - start < 300
    assert set(_pids(pool, tmp_path, 2)).isdisjoint(first), "a failed case's processes are not reused"


def test_a_rank_that_dies_fails_the_case(pool: SpawnPool) -> None:
    with pytest.raises(RuntimeError, match=r"rank 0 of _exit_on_rank_0 died \(exit code 3\)"):
        pool.spawn(_exit_on_rank_0, (), 1)


def test_a_rank_that_leaves_its_process_group_fails_the_case(pool: SpawnPool) -> None:
    from bench.harness.model_harness import free_port

    with pytest.raises(RuntimeError, match="_leave_a_group left its default process group initialized"):
        pool.spawn(_leave_a_group, (free_port(),), 1)
