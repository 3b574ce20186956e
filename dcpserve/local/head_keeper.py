"""The head of `make cluster` as one supervised session, with GCS fault tolerance (dcpserve/local/nodes.py starts
it in a session of its own, as `python -m dcpserve.local.head_keeper [options] -- ray start --head ...`):

1. Redis on 127.0.0.1 (Debian's redis-server, installed when missing as `make observe` installs Prometheus), without
   persistence: the GCS keeps its tables there (RAY_REDIS_ADDRESS), so a GCS started again finds the cluster as it
   was: its nodes, actors (the Serve controller, proxies, replicas), placement groups and jobs;
2. `ray start --head` without --block: with --block, Ray's CLI kills every process of the head when any of them
   exits unexpectedly, the GCS included (its block loop, ray/scripts/scripts.py), which is the opposite of fault
   tolerance;
3. supervision, twice a second: a GCS that exits is started again after `--gcs-restart-delay-s`, with the command
   line and environment it had (for a cluster on Kubernetes, KubeRay restarts the head; here only the GCS restarts:
   the head's raylet, dashboard, Serve controller and proxy stay up and keep serving; the dashboard is paused
   meanwhile, as its modules poll a missing GCS without backoff: _pause_dashboard). Raylets, workers and drivers
   reconnect on their own if it is back within RAY_gcs_rpc_server_reconnect_timeout_s (60 s by default); a GCS that
   exits again within a minute of each of GCS_MAX_QUICK_RESTARTS restarts is given up on. The head's raylet exiting
   stops everything, as --block does;
4. on SIGTERM or SIGINT (`make cluster-down`, Ctrl-C): stops every process of its session, worker nodes included:
   everything but the GCS and Redis first (their raylets shut down cleanly while the GCS answers), then the GCS, then
   Redis, SIGKILL for whatever is left; exits 0.

It is the subreaper of the processes `ray start` leaves behind, so it learns their exit codes and leaves no zombie.
`--redis-port 0` takes a free port that is none of the head's (those its command line and environment name): Redis
binds it before `ray start` runs, so nothing of the head can take it after. Without `--redis-port` it runs the same
way with the GCS' in-memory storage, and does not restart it (a GCS started again without its tables would not know
the cluster: its raylets would exit).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from dcpserve.local.debian import ensure_debian_package
from dcpserve.local.serve import free_port, port_in_use

GCS_MAX_QUICK_RESTARTS = 3  # restarts each followed by an exit within QUICK_EXIT_S: the GCS cannot start here
QUICK_EXIT_S = 60.0
POLL_S = 0.5
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def say(line: str) -> None:
    print(f"[head keeper] {line}", flush=True)


# The head's ports that `ray start` takes from the environment, not its command line (dcpserve/local/serve.py).
PORT_VARIABLES = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")


def head_ports(ray_start: list[str], env: dict[str, str]) -> set[int]:
    """Every port the head's `ray start` command names (the value of each --...port option) or its environment."""
    ports = {int(value) for option, value in zip(ray_start, ray_start[1:], strict=False)
             if option.startswith("--") and option.endswith("port") and value.isdigit()}
    return ports | {int(env[name]) for name in PORT_VARIABLES if env.get(name, "").isdigit()}


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(port: int, state_dir: Path, timeout_s: float = 30) -> subprocess.Popen[bytes]:
    """redis-server on 127.0.0.1:port, no persistence (RDB and AOF off), its log in state_dir; waits for PING."""
    binary = ensure_debian_package("redis-server", "redis-server", say)
    log = state_dir / "redis.log"
    command = [binary, "--bind", "127.0.0.1", "--port", str(port), "--protected-mode", "yes", "--save", "",
               "--appendonly", "no", "--dir", str(state_dir), "--logfile", str(log), "--daemonize", "no"]
    say(f"starting Redis for GCS fault tolerance on 127.0.0.1:{port}; log: {log}")
    redis = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while not redis_ping(port):
        if redis.poll() is not None or time.monotonic() > deadline:
            redis.kill()
            tail = log.read_text()[-2000:] if log.is_file() else ""
            raise SystemExit(f"redis-server did not come up on 127.0.0.1:{port}: {tail}")
        time.sleep(0.1)
    return redis


def gcs_process(port: int) -> psutil.Process | None:
    """The running GCS of the head whose GCS port is port (a killed one not yet reaped, a zombie, is not running)."""
    for process in psutil.process_iter(["name", "cmdline", "status"]):
        if (process.info["name"] == "gcs_server" and process.info["status"] != psutil.STATUS_ZOMBIE
                and f"--gcs_server_port={port}" in (process.info["cmdline"] or [])):
            return process
    return None


@dataclass
class Gcs:
    """The head's GCS process, and what starts it again."""

    pid: int
    cmdline: list[str]
    env: dict[str, str]
    cwd: str
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart

    @classmethod
    def find(cls, port: int) -> Gcs:
        process = gcs_process(port)
        if process is None:
            raise SystemExit(f"no GCS serving port {port} after `ray start --head`")
        return cls(process.pid, process.cmdline(), process.environ(), process.cwd())

    def restart(self) -> None:
        process = subprocess.Popen(self.cmdline, env=self.env, cwd=self.cwd, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        self.pid = process.pid
        self.restarts.append(time.monotonic())

    def restarting_too_often(self, now: float) -> bool:
        """The last GCS_MAX_QUICK_RESTARTS restarts each exited within QUICK_EXIT_S (the latest one at now, a
        time.monotonic())."""
        recent = self.restarts[-GCS_MAX_QUICK_RESTARTS:]
        ends = [*recent[1:], now]  # each restart's run ended by the next restart, the last one now
        return len(recent) == GCS_MAX_QUICK_RESTARTS and all(
            end - begin < QUICK_EXIT_S for begin, end in zip(recent, ends, strict=True))


class Keeper:
    def __init__(self, gcs_port: int, redis_port: int | None, restart_delay_s: float, state_dir: Path) -> None:
        self.gcs_port = gcs_port
        self.redis_port = redis_port
        self.restart_delay_s = restart_delay_s
        self.state_dir = state_dir
        self.exited: dict[int, int] = {}  # pid -> exit status of the processes reaped here
        self.stopping = False
        self.redis: subprocess.Popen[bytes] | None = None

    def run(self, ray_start: list[str]) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        env = dict(os.environ)
        if self.redis_port == 0:
            self.redis_port = free_port(exclude=head_ports(ray_start, env))
        if self.redis_port is not None:
            self.redis = start_redis(self.redis_port, self.state_dir)
            env["RAY_REDIS_ADDRESS"] = f"127.0.0.1:{self.redis_port}"
            env["RAY_external_storage_namespace"] = f"dcpserve-{self.gcs_port}"
        try:
            code = subprocess.run(ray_start, env=env).returncode
            if code != 0 or self.stopping:
                say(f"`ray start` exited with {code}" if code else "stopping before the head was up")
                return code or 0
            gcs = Gcs.find(self.gcs_port)
            raylet = self._head_raylet()
            say(f"the head is up: GCS pid {gcs.pid}, raylet pid {raylet}; "
                + ("GCS fault tolerance on (Redis), a GCS that exits is started again"
                   if self.redis_port is not None else "GCS fault tolerance off (no Redis)"))
            return self._supervise(gcs, raylet)
        finally:
            self._stop_session()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _head_raylet(self) -> int:
        for process in psutil.process_iter(["name", "cmdline"]):
            cmdline = " ".join(process.info["cmdline"] or [])
            if (process.info["name"] == "raylet" and _session_of(process.pid) == os.getsid(0)
                    and f"127.0.0.1:{self.gcs_port}" in cmdline):
                return process.pid
        raise SystemExit(f"no raylet of the head (GCS 127.0.0.1:{self.gcs_port}) after `ray start --head`")

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exited[pid] = os.waitstatus_to_exitcode(status)

    def _gone(self, pid: int) -> bool:
        return pid in self.exited or not psutil.pid_exists(pid)

    def _supervise(self, gcs: Gcs, raylet: int) -> int:
        while not self.stopping:
            time.sleep(POLL_S)
            self._reap()
            if self._gone(raylet):
                say(f"the head's raylet exited ({self.exited.get(raylet, 'unknown status')}): stopping the cluster")
                return 1
            if self.redis is not None and self._gone(self.redis.pid):
                say(f"Redis exited ({self.exited.get(self.redis.pid, 'unknown status')}): stopping the cluster")
                return 1
            if not self._gone(gcs.pid):
                continue
            status = self.exited.get(gcs.pid, "unknown status")
            if self.redis_port is None:
                say(f"the GCS exited ({status}) and has no Redis to recover from: stopping the cluster")
                return 1
            if gcs.restarting_too_often(time.monotonic()):
                say(f"the GCS exited ({status}) within {QUICK_EXIT_S:.0f}s of each of its last "
                    f"{GCS_MAX_QUICK_RESTARTS} restarts: stopping the cluster")
                return 1
            say(f"the GCS (pid {gcs.pid}) exited ({status}); starting it again in {self.restart_delay_s:g}s")
            paused = self._pause_dashboard()
            try:
                deadline = time.monotonic() + self.restart_delay_s
                while time.monotonic() < deadline and not self.stopping:
                    time.sleep(min(POLL_S, self.restart_delay_s))
                if self.stopping:
                    break
                gcs.restart()
                say(f"the GCS started again (pid {gcs.pid}, restart {len(gcs.restarts)})")
                self._wait_for_gcs(gcs)
            finally:
                _signal_all(paused, signal.SIGCONT)
        return 0

    def _pause_dashboard(self) -> list[psutil.Process]:
        """SIGSTOPs the head's dashboard and its module processes until the GCS is back. While the GCS is away,
        Ray's dashboard modules (NodeHead, ServeHead in Ray 2.60) poll its pubsub in a loop with no backoff: a poll
        answered UNAVAILABLE returns at once, empty, and is sent again. Two of them took both cores of a 2-core
        machine, and requests that took 0.1 s took 1-3 s meanwhile (the proxy and replicas run at Ray's worker
        niceness). Nothing of the dashboard works without the GCS anyway; a `serve deploy` sent meanwhile waits."""
        session = os.getsid(0)
        paused: list[psutil.Process] = []
        for process in psutil.process_iter(["cmdline"]):
            if _session_of(process.pid) == session and any(
                    part.endswith("ray/dashboard/dashboard.py") for part in process.info["cmdline"] or []):
                try:
                    paused += [process, *process.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
        _signal_all(paused, signal.SIGSTOP)
        if paused:
            say(f"paused the dashboard ({len(paused)} processes) until the GCS is back: its modules poll a missing "
                "GCS without backoff, taking the CPU that serving needs")
        return paused

    def _wait_for_gcs(self, gcs: Gcs, timeout_s: float = 30.0) -> None:
        """Until the GCS started just now accepts connections (or exits, or timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stopping:
            self._reap()
            if self._gone(gcs.pid) or port_in_use(self.gcs_port):
                return
            time.sleep(0.1)

    def _stop_session(self) -> None:
        """Every process of this session but this one: the GCS and Redis last, SIGKILL for what outlives SIGTERM."""
        me = os.getpid()
        session = os.getsid(0)

        def members() -> list[psutil.Process]:
            self._reap()
            found = []
            for process in psutil.process_iter(["name", "status"]):
                if (process.pid != me and _session_of(process.pid) == session
                        and process.info["status"] != psutil.STATUS_ZOMBIE):
                    found.append(process)
            return found

        def last(process: psutil.Process) -> int:
            name = process.info["name"] or ""
            return 2 if name.startswith("redis") else 1 if name == "gcs_server" else 0

        _signal_all(members(), signal.SIGCONT)  # a process paused (_pause_dashboard) would not act on SIGTERM
        for rank, wait_s in ((0, 10.0), (1, 3.0), (2, 2.0)):
            group = [p for p in members() if last(p) <= rank]
            _signal_all(group, signal.SIGTERM)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and [p for p in members() if last(p) <= rank]:
                time.sleep(0.2)
        left = members()
        if left:
            say(f"{len(left)} processes outlived SIGTERM: killing them")
            _signal_all(left, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and members():
                time.sleep(0.2)


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _signal_all(processes: list[psutil.Process], sig: signal.Signals) -> None:
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m dcpserve.local.head_keeper", description=__doc__.split("\n")[0])
    parser.add_argument("--gcs-port", type=int, required=True, help="the head's GCS port (`ray start --port`)")
    parser.add_argument("--redis-port", type=int,
                        help="start Redis on this port for GCS fault tolerance (0: a free one, none of the head's)")
    parser.add_argument("--gcs-restart-delay-s", type=float, default=2.0,
                        help="seconds between a GCS exiting and its restart")
    parser.add_argument("--state-dir", type=Path, required=True, help="Redis' log and working directory")
    parser.add_argument("ray_start", nargs=argparse.REMAINDER, help="-- then the `ray start --head` command")
    args = parser.parse_args()
    command = args.ray_start[1:] if args.ray_start[:1] == ["--"] else args.ray_start
    if not command or "--block" in command:
        parser.error("give the `ray start --head` command after --, without --block")
    sys.exit(Keeper(args.gcs_port, args.redis_port, args.gcs_restart_delay_s, args.state_dir).run(command))


if __name__ == "__main__":
    main()
