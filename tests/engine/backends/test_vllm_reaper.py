"""dcpserve/engine/backends/vllm/reaper.py: the processes a replica started (vLLM's engine core and its workers) end
when the replica is SIGKILLed, SIGTERM first and SIGKILL for those that ignore it; a graceful close leaves nothing to
do; a pid whose start time differs (reused) is never signalled. Plain processes stand in for vLLM's: the watcher knows
only pids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcpserve.engine.backends.vllm.reaper import GRACE_S, EngineCoreReaper, _reap, descendants, start_time

REPO_ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads /proc (Linux)")

# A stand-in replica: starts an "engine core" that ignores SIGTERM and has a "worker" of its own, hands them to the
# reaper, prints the pids, then waits to be killed.
REPLICA = """
import os, subprocess, sys, time
from dcpserve.engine.backends.vllm.reaper import EngineCoreReaper, descendants
core = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)")
subprocess.Popen([sys.executable, "-c", core])
deadline = time.monotonic() + 30
while len(descendants(os.getpid())) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
reaper = EngineCoreReaper()
started = descendants(os.getpid())
reaper.watch(started)
print(" ".join(map(str, started)), reaper.watcher_pid, flush=True)
time.sleep(600)
"""


def _gone_within(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(start_time(pid) is None for pid in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_killed_replica_takes_its_engine_processes_with_it() -> None:
    replica = subprocess.Popen([sys.executable, "-c", REPLICA], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    started: list[int] = []
    try:
        assert replica.stdout is not None
        *started, watcher = (int(p) for p in replica.stdout.readline().split())
        assert len(started) == 2 and all(start_time(pid) is not None for pid in started)
        replica.kill()  # SIGKILL: no finally, no atexit in the replica
        replica.wait()
        # The core ignores SIGTERM: it goes at the SIGKILL after the grace period; its worker at the first signal.
        assert _gone_within(started, GRACE_S + 10), [start_time(pid) for pid in started]
        assert _gone_within([watcher], 5)
    finally:  # what this test started, whatever the reaper did
        replica.kill()
        for pid in [*descendants(replica.pid), *started]:
            if start_time(pid) is not None:
                os.kill(pid, signal.SIGKILL)


def test_graceful_close_and_a_reused_pid() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        ticks = start_time(sleeper.pid)
        assert ticks is not None and sleeper.pid in descendants(os.getpid())
        _reap([(sleeper.pid, ticks + 1)])  # another process's start time: the pid was reused, leave it alone
        assert sleeper.poll() is None
        reaper = EngineCoreReaper()
        reaper.watch([sleeper.pid])
        sleeper.terminate()  # vLLM's own shutdown ended it
        sleeper.wait()
        start = time.monotonic()
        reaper.close()  # the watcher finds nothing left and exits
        assert time.monotonic() - start < 5 and reaper.watcher_pid is None
    finally:
        sleeper.kill()


# A replica's engine, vLLM's own: started inside an event loop as the replica starts it, then left to be killed.
VLLM_REPLICA = """
import asyncio, os, sys, time
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.backends import start_engine
from dcpserve.engine.backends.vllm.reaper import descendants

async def start():
    return start_engine(EngineArgs(sys.argv[1], backend="vllm", dtype="float32", device="cpu", block_size=32,
                                   kv_cache_memory_bytes=1 << 20, max_model_len=1024, enable_prefix_caching=False))

engine = asyncio.new_event_loop().run_until_complete(start())
print("PIDS", " ".join(map(str, descendants(os.getpid()))), flush=True)
time.sleep(600)
"""


@pytest.mark.vllm
def test_a_killed_vllm_replica_leaves_no_engine_core(tmp_path: Path) -> None:
    """The leak this module exists for: SIGKILL the process that owns an AsyncLLM, and vLLM's engine core (and its
    worker) go too, instead of running on with PPID 1."""
    from dcpserve.cluster.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", seed=0)
    replica = subprocess.Popen([sys.executable, "-c", VLLM_REPLICA, str(model)], cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    started: list[int] = []
    try:
        assert replica.stdout is not None
        line = ""
        while not line.startswith("PIDS"):  # vLLM logs to stdout too
            line = replica.stdout.readline()
            assert line, "the replica ended before its engine started"
        started = [int(p) for p in line.split()[1:]]
        names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in started if start_time(pid) is not None}
        assert "VLLM::EngineCor" in names, names  # /proc/PID/comm keeps 15 characters
        replica.kill()
        replica.wait()
        assert _gone_within(started, GRACE_S + 20), {pid: start_time(pid) for pid in started}
    finally:
        replica.kill()
        for pid in started:
            if start_time(pid) is not None:
                os.kill(pid, signal.SIGKILL)



# A replica's engine shut down while vLLM's force-kill path fails as its race does (kill_process_tree raising
# psutil.NoSuchProcess for a worker that exited after being listed, before it kills the engine core). The grace is
# forced to 0 and the engine core is stopped (SIGSTOP) first, so that it is still alive when vLLM checks after its
# SIGTERM, whatever the machine's load: with the grace alone a core that had already begun to exit (vLLM's client
# shutdown runs first) skipped the path now and then under load. A fresh process, so that vLLM's start is what starts
# multiprocessing's tracker.
VLLM_FAILING_SHUTDOWN = """
import asyncio, os, signal, sys
import psutil, vllm.v1.utils
from multiprocessing import resource_tracker
import dcpserve.engine.backends.vllm.engine as vllm_engine
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.backends import start_engine
from dcpserve.engine.backends.vllm.reaper import descendants, start_time

def racing_kill_process_tree(pid):
    print("FORCED", pid, flush=True)
    raise psutil.NoSuchProcess(pid + 1_000_000)

async def main():
    engine = start_engine(EngineArgs(sys.argv[1], backend="vllm", dtype="float32", device="cpu", block_size=32,
                                     kv_cache_memory_bytes=1 << 20, max_model_len=1024, enable_prefix_caching=False))
    tracker = resource_tracker._resource_tracker._pid
    print("PIDS", tracker, engine._reaper.watcher_pid, *descendants(os.getpid()), flush=True)
    vllm_engine.process_shutdown_grace_s = lambda: 0.0
    vllm.v1.utils.kill_process_tree = racing_kill_process_tree
    cores = [pid for pid in descendants(os.getpid())
             if open(f"/proc/{pid}/comm").read().strip() == "VLLM::EngineCor"]
    assert len(cores) == 1, cores
    os.kill(cores[0], signal.SIGSTOP)
    await engine.shutdown()
    print("SHUT DOWN", engine._reaper.watcher_pid, start_time(tracker) is not None, flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.vllm
def test_a_failing_vllm_shutdown_still_ends_its_processes_and_spares_the_resource_tracker(tmp_path: Path) -> None:
    """VllmEngine.shutdown() neither raises vLLM's force-kill failure nor leaves the engine core and its worker
    behind (the reaper ends them), and it leaves multiprocessing's resource tracker, which serves the whole process
    and cleans up after it, alone."""
    from dcpserve.cluster.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", seed=0)
    script = tmp_path / "replica.py"
    script.write_text(VLLM_FAILING_SHUTDOWN)
    replica = subprocess.Popen([sys.executable, str(script), str(model)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    started: list[int] = []
    try:
        assert replica.stdout is not None
        lines: dict[str, list[str]] = {}
        for line in replica.stdout:  # vLLM logs to stdout too
            word, _, rest = line.partition(" ")
            if word in ("PIDS", "FORCED", "SHUT"):
                lines[word] = rest.split()
        assert replica.wait(60) == 0
        tracker, watcher, *descendants_ = (int(p) for p in lines["PIDS"])
        started = [pid for pid in descendants_ if pid not in (tracker, watcher)]
        assert len(started) >= 2, lines["PIDS"]  # the engine core and its worker
        assert "FORCED" in lines, "vLLM's force-kill path did not run: the test no longer exercises it"
        assert lines["SHUT"] == ["DOWN", "None", "True"], lines["SHUT"]  # returned; watcher closed; tracker alive
        assert _gone_within(started, 10), {pid: start_time(pid) for pid in started}
    finally:
        replica.kill()
        for pid in started:
            if start_time(pid) is not None:
                os.kill(pid, signal.SIGKILL)
