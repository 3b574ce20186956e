"""What tests/local/test_nodes.py asks of its multi-node cluster from the driver: the alive nodes, a node killed as a
machine losing power, the GCS process, a metrics scrape, the admission queue's stats, a stream held open."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dcpserve.deployments.messages import AdmissionStats
from dcpserve.local import head_keeper
from dcpserve.local import serve as local_serve


def alive_nodes() -> dict[str, dict[str, Any]]:
    """node id -> ray.nodes() entry of every alive node."""
    import ray

    return {node["NodeID"]: node for node in ray.nodes() if node.get("Alive")}


def head_node_id() -> str:
    return next(node_id for node_id, node in alive_nodes().items()
                if "node:__internal_head__" in node.get("Resources", {}))


def kill_node(node_id: str) -> list[int]:
    """SIGKILLs a worker node: its raylet and every process under it (the node's workers and agents), as a machine
    that loses power. Returns their pids."""
    import psutil

    socket = alive_nodes()[node_id]["RayletSocketName"]
    (raylet,) = [p for p in psutil.process_iter(["cmdline"])
                 if f"--raylet_socket_name={socket}" in (p.info["cmdline"] or [])]
    victims = [raylet, *raylet.children(recursive=True)]
    for process in victims:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return [process.pid for process in victims]


def gcs_pid(ray_port: int) -> int | None:
    process = head_keeper.gcs_process(ray_port)
    return None if process is None else process.pid


def gcs_down(ray_port: int) -> bool:
    """No GCS process (a killed one not yet reaped is a zombie: gone) and nothing listening on its port."""
    return gcs_pid(ray_port) is None and not local_serve.port_in_use(ray_port)


def scrape(target: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as reply:
            return str(reply.read().decode())
    except OSError as err:
        return f"(scrape failed: {err})"


def admission_stats() -> AdmissionStats:
    """KvAdmission.stats() of the cluster's app."""
    from ray import serve

    handle = serve.get_deployment_handle("KvAdmission", app_name="dcpserve")
    stats: AdmissionStats = handle.stats.remote().result(timeout_s=60)
    return stats


def num_grants(replica_id: str) -> int:
    """The grants the admission queue holds on a replica now (0 for one it does not know)."""
    view = admission_stats().replicas.get(replica_id)
    return 0 if view is None else view.num_grants


@dataclass
class Stream:
    """A streaming completion read in a thread of its own until stop is set (then the client disconnects): the
    time.monotonic() of every chunk, and the error that ended it if one did."""

    client: Any
    model: str
    prompt: str
    chunks: list[float] = field(default_factory=list)
    error: BaseException | None = None
    finish_reason: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        try:
            with self.client.completions.create(model=self.model, prompt=self.prompt, max_tokens=2000, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}) as reply:
                for chunk in reply:
                    self.chunks.append(time.monotonic())
                    if chunk.choices and chunk.choices[0].finish_reason:
                        self.finish_reason = chunk.choices[0].finish_reason
                    if self.stop.is_set():
                        return
        except BaseException as err:  # noqa: BLE001 - recorded: the test asserts there is none
            self.error = err

    @property
    def ended(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def between(self, begin: float, end: float) -> int:
        return sum(1 for t in list(self.chunks) if begin <= t <= end)
