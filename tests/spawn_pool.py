"""mp.spawn without a fresh interpreter per rank per case: spawned processes kept for a pytest process's session.

Each multi-rank case of the model and exchange tests (tests/engine/models, tests/kernels/test_exchange.py) used to
mp.spawn its ranks: about 1.9 CPU-s of interpreter, torch and dcpserve imports per rank, some 76 ranks in the fast tier,
a fifth of its CPU time on a 2-core machine. `SpawnPool.spawn(fn, args, nprocs)` runs `fn(rank, *args)` on ranks
0..nprocs-1 as mp.spawn does, in processes that stay up between cases (grown to the largest nprocs asked for), so
each case pays only its own work. A case still gets a fresh gloo group of its own (its own port), and its function
runs at module level in a process that already imported it, as under mp.spawn.

What a rank may leave behind is checked after every case: a default process group still initialized fails the case
(the next one would not start clean). A rank that raises, or dies, fails the case with its traceback, and the whole
pool is torn down (its peers may be blocked in a collective), as mp.spawn terminates the other ranks; so does a case
interrupted on the pytest side (a timeout). The next case starts fresh processes.
"""

from __future__ import annotations

import gc
import queue
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

_CONTEXT = mp.get_context("spawn")
POLL_S = 0.5


def _serve(index: int, tasks: Any, results: Any) -> None:
    """Body of one pool process: runs `fn(index, *args)` for each task until told to stop (None). After a failure
    it reports the traceback and exits: a rank that raised may have left threads or process groups half torn down."""
    import torch.distributed as dist

    threads = torch.get_num_threads()
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args = task
        try:
            fn(index, *args)
            if dist.is_available() and dist.is_initialized():
                raise RuntimeError(f"{fn.__qualname__} left its default process group initialized")
        except BaseException:  # noqa: BLE001 - reported to the test, whose assertion this is; the process ends
            results.put((index, traceback.format_exc()))
            return
        torch.set_num_threads(threads)  # what the function set (run_rank sets one thread) ends with it
        gc.collect()
        results.put((index, None))


class _Rank:
    """One pool process and the queue of tasks only it reads."""

    def __init__(self, index: int, results: Any) -> None:
        self.tasks = _CONTEXT.SimpleQueue()
        self.process: BaseProcess = _CONTEXT.Process(target=_serve, args=(index, self.tasks, results), daemon=True)
        self.process.start()


class SpawnPool:
    """Processes that run `fn(rank, *args)` for one case after another (module docstring)."""

    def __init__(self) -> None:
        self._results: Any = _CONTEXT.Queue()
        self._ranks: list[_Rank] = []

    def spawn(self, fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
        """mp.spawn(fn, args, nprocs, join=True): returns once every rank returned; raises with a failed rank's
        traceback (and tears the pool down) if any raised or died."""
        while len(self._ranks) < nprocs:
            self._ranks.append(_Rank(len(self._ranks), self._results))
        done = False
        try:
            for rank in self._ranks[:nprocs]:
                rank.tasks.put((fn, args))
            pending = set(range(nprocs))
            while pending:
                try:
                    index, error = self._results.get(timeout=POLL_S)
                except queue.Empty:
                    dead = [i for i in pending if not self._ranks[i].process.is_alive()]
                    if dead:
                        code = self._ranks[dead[0]].process.exitcode
                        raise RuntimeError(f"rank {dead[0]} of {fn.__qualname__} died (exit code {code})") from None
                    continue
                if error is not None:
                    raise RuntimeError(f"rank {index} of {fn.__qualname__} raised:\n{error}")
                pending.discard(index)
            done = True
        finally:
            if not done:
                self.close(kill=True)

    def close(self, kill: bool = False) -> None:
        """Stops every process: asked to (idle ones return at once), or killed (after a failed or interrupted case,
        when some may be blocked in a collective)."""
        for rank in self._ranks:
            if kill:
                rank.process.kill()
            elif rank.process.is_alive():
                rank.tasks.put(None)
        for rank in self._ranks:
            rank.process.join(timeout=10)
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join()
        self._ranks = []
        self._results.close()
        self._results = _CONTEXT.Queue()
