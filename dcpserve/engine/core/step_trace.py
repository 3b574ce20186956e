"""The engine's step trace: one JSON line per engine step, what it computed and how long it took.

`step_trace_path` (an engine argument) turns it on. Each line is a JSON object:
- `t`: the step's start, Unix time in seconds;
- `seconds`: the step's wall time (schedule -> execute -> update, as dcpserve_engine_step_seconds);
- `gap_s`: the host's time between the end of the previous step and this one's start while the engine had work
  all along (the engine core's inputs and outputs, the replica's other threads), or null after an idle wait;
- `rows`: the scheduled rows as [start_position, new_tokens] pairs (a decode row computes 1 token, a prefill
  chunk more), which is all a step-time model needs of the batch (dcpserve.simulator.step_time.StepWork.from_rows);
- `exchange_s`: of `seconds`, the time in the DCP exchange (0 without DCP);
- `pid`: the process, so that the replicas of one node may share a file.

`dcpserve.simulator.step_fit.read_step_trace` reads it back, and `python -m bench step_fit --from-steps FILE` fits the
simulator's step model to a served app's own steps. Each line is one append-mode write, so the lines of several
processes writing one local file do not interleave.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable


class StepTraceWriter:
    """Appends the step trace's lines to one file (the engine's thread only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ValueError(f"step_trace_path={path!r}: the directory {directory!r} does not exist; create it or "
                             f"name a file in an existing directory")
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pid = os.getpid()
        self._busy_end: float | None = None  # perf_counter at the end of the last step that left work behind

    def record(self, start: float, end: float, rows: Iterable[tuple[int, int]], exchange_s: float,
               busy_after: bool) -> None:
        """One step that ran from perf_counter() `start` to `end`; busy_after: the engine still had work after it. A
        step with no rows (it only told the workers of finished requests) has no line: its time is part of the next
        step's gap."""
        pairs = [list(row) for row in rows]
        if self._fd is None or not pairs:
            return
        gap = None if self._busy_end is None else max(0.0, start - self._busy_end)
        self._busy_end = end if busy_after else None
        line = {"t": round(time.time() - (end - start), 6), "seconds": round(end - start, 9),
                "gap_s": None if gap is None else round(gap, 9), "rows": pairs,
                "exchange_s": round(exchange_s, 9), "pid": self._pid}
        os.write(self._fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())

    def idle(self) -> None:
        """The engine waited with nothing to run: the next step's gap is not host overhead."""
        self._busy_end = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
