"""Ends vLLM's engine core processes when the replica that started them dies, however it dies.

vLLM's AsyncLLM runs its engine core in a child process, and its TP workers are that process's children (they exit
with it: vLLM gives them a death pipe). The engine core has no such pipe to its own parent. A replica that is
SIGKILLed (Serve replacing an unhealthy replica, a node's Ray stopping) left the engine core and its workers running,
holding their memory (on a GPU, the KV cache) with nobody to serve: one `make test-vllm` left two engine cores and
their four workers behind, each at about 10% of a core.

`EngineCoreReaper.watch()` starts a small watcher process (this file run as a script: only the standard library)
that holds the read end of a pipe whose write end only the replica holds. When the replica exits, the kernel closes
it; the watcher reads EOF and ends the processes it was given: SIGTERM, then SIGKILL after a grace period. A process
is named by its pid and its start time (/proc/PID/stat), so a pid the kernel has reused is never signalled. A
graceful shutdown closes the pipe after vLLM's own shutdown: the watcher finds nothing left and exits. Linux only
(/proc); elsewhere the watcher is not started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 5.0  # between SIGTERM and SIGKILL


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (field 22 of /proc/PID/stat), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: the fields after it follow the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie has ended; only its parent's wait is missing
        return None
    return int(fields[19])


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children, their children, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    if not Path("/proc/self/stat").exists():
        return []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        parents.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found.extend(children)
        frontier.extend(children)
    return found


class EngineCoreReaper:
    """The watcher of one replica's vLLM processes (see the module docstring)."""

    def __init__(self) -> None:
        self._watcher: subprocess.Popen[bytes] | None = None

    def watch(self, pids: list[int]) -> None:
        """Starts the watcher for `pids` (the processes vLLM started for this replica)."""
        if not Path("/proc/self/stat").exists():
            return
        named = [f"{pid}:{ticks}" for pid in pids if (ticks := start_time(pid)) is not None]
        if not named:
            return
        self._watcher = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *named],
                                         stdin=subprocess.PIPE, close_fds=True, start_new_session=True)

    @property
    def watcher_pid(self) -> int | None:
        return self._watcher.pid if self._watcher is not None else None

    def close(self, timeout_s: float = GRACE_S + 5) -> None:
        """After vLLM's own shutdown: closes the pipe, so the watcher ends what is left (nothing, normally)."""
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        if watcher.stdin is not None:
            watcher.stdin.close()
        try:
            watcher.wait(timeout_s)
        except subprocess.TimeoutExpired:
            watcher.kill()


def _reap(named: list[tuple[int, int]]) -> None:
    alive = _signal([(pid, ticks) for pid, ticks in named if start_time(pid) == ticks], signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [(pid, ticks) for pid, ticks in alive if start_time(pid) == ticks]
    _signal(alive, signal.SIGKILL)


def _signal(processes: list[tuple[int, int]], signum: int) -> list[tuple[int, int]]:
    for pid, _ in processes:
        try:
            os.kill(pid, signum)
        except OSError:  # ended meanwhile
            pass
    return processes


def main(argv: list[str]) -> None:
    named = [(int(pid), int(ticks)) for pid, ticks in (arg.split(":") for arg in argv)]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the replica's process group is the replica's to handle
    sys.stdin.buffer.read()  # until EOF: the replica closed the pipe, or exited
    _reap(named)


if __name__ == "__main__":
    main(sys.argv[1:])
