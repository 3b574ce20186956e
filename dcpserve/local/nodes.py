"""`make cluster`: ray_cluster.yaml's cluster on this machine, with Ray's real autoscaler adding and removing nodes.

1. writes the tiny model once (as `make serve`), the autoscaling config (dcpserve/cluster/node_types.py:
   ray_cluster.yaml's node types with ray_cluster.local.yaml merged over them) and a serve config for this cluster,
   under the state dir;
2. starts a Ray head on loopback with ray_cluster.yaml's head resources (no GPUs) and Ray's autoscaler, under
   dcpserve/local/head_keeper.py: Redis for GCS fault tolerance, and a GCS that exits started again; the autoscaler
   starts GPU worker nodes (each a raylet of its own with logical GPUs, dcpserve/local/provider.py) when Serve's
   placement groups need them, and removes them after idle_timeout_minutes idle;
3. checks that the serve config's replica layout fits a node type (dcpserve/cluster/node_types.check_replica_fits),
   prints how to deploy it (`serve deploy` with this cluster's address and token) and how to stop, then reports every
   node that joins or leaves, and the GCS going down and coming back;
4. on Ctrl-C, on `make cluster-down` (which signals this process through the pid file in the state dir) or on any
   failure, stops every process of the cluster, worker nodes included, and nothing else.

`python -m dcpserve.local.nodes` runs 1-4; `python -m dcpserve.local.nodes down` is `make cluster-down`.
Environment knobs: those of `make serve` (dcpserve/local/serve.py: DCPSERVE_PORT, DCPSERVE_RAY_PORT,
DCPSERVE_DASHBOARD_PORT, DCPSERVE_STATE_DIR, DCPSERVE_CONFIG, DCPSERVE_API_KEY, DCPSERVE_TLS; not
DCPSERVE_NUM_GPUS: the head has none), and DCPSERVE_WORKER_GPUS (logical GPUs per GPU worker node; ray_cluster.yaml's
by default),
DCPSERVE_IDLE_TIMEOUT_S (seconds before an idle worker node is removed; ray_cluster.local.yaml's by default),
DCPSERVE_GCS_FT (1: Redis-backed GCS fault tolerance, the default; 0: none, a GCS exit stops the cluster) and
DCPSERVE_GCS_RESTART_DELAY_S (seconds between a GCS exit and its restart, 2 by default; at most 30, well within the
60 s raylets wait for a GCS to come back).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from dcpserve.cluster.node_types import (
    CLUSTER_CONFIG_ENV,
    NODE_TYPE_LABEL,
    NodeType,
    ReplicaDoesNotFit,
    check_replica_fits,
    local_cluster_config,
    node_types,
)
from dcpserve.cluster.tls import ClusterTls
from dcpserve.deployments.config import parse_args
from dcpserve.local import serve as local_serve
from dcpserve.local.tls import cluster_tls

REPO = local_serve.REPO
PID_FILE = "cluster.pid"


say = local_serve.say


@dataclass(frozen=True)
class ClusterSettings:
    base: local_serve.LocalSettings  # ports, state dir, serve config (num_gpus is the head's: 0)
    worker_gpus: int | None
    idle_timeout_s: float | None
    gcs_fault_tolerance: bool = True
    gcs_restart_delay_s: float = 2.0

    @classmethod
    def from_env(cls) -> ClusterSettings:
        env = os.environ
        base = replace(local_serve.LocalSettings.from_env(), num_gpus=0)
        try:
            worker_gpus = int(env["DCPSERVE_WORKER_GPUS"]) if env.get("DCPSERVE_WORKER_GPUS") else None
            idle_s = float(env["DCPSERVE_IDLE_TIMEOUT_S"]) if env.get("DCPSERVE_IDLE_TIMEOUT_S") else None
            restart_delay_s = float(env.get("DCPSERVE_GCS_RESTART_DELAY_S") or 2.0)
        except ValueError as err:
            raise SystemExit(f"DCPSERVE_WORKER_GPUS must be an integer, DCPSERVE_IDLE_TIMEOUT_S and "
                             f"DCPSERVE_GCS_RESTART_DELAY_S numbers: {err}") from err
        if worker_gpus is not None and worker_gpus < 1:
            raise SystemExit(f"DCPSERVE_WORKER_GPUS must be at least 1, got {worker_gpus}")
        if not 0 <= restart_delay_s <= 30:
            raise SystemExit(f"DCPSERVE_GCS_RESTART_DELAY_S must be within 0-30 (raylets wait 60 s for a GCS to come "
                             f"back), got {restart_delay_s:g}")
        fault_tolerance = env.get("DCPSERVE_GCS_FT", "1")
        if fault_tolerance not in ("0", "1"):
            raise SystemExit(f"DCPSERVE_GCS_FT must be 1 (Redis-backed GCS fault tolerance) or 0, got "
                             f"{fault_tolerance!r}")
        return cls(base=base, worker_gpus=worker_gpus, idle_timeout_s=idle_s,
                   gcs_fault_tolerance=fault_tolerance == "1", gcs_restart_delay_s=restart_delay_s)

    def keeper(self) -> list[str]:
        """The command of the head's keeper (dcpserve/local/head_keeper.py) for these settings."""
        command = [sys.executable, "-m", "dcpserve.local.head_keeper", "--gcs-port", str(self.base.ray_port),
                   "--gcs-restart-delay-s", str(self.gcs_restart_delay_s), "--state-dir", str(self.base.state_dir)]
        if self.gcs_fault_tolerance:
            command += ["--redis-port", "0"]  # the keeper takes one the head's ports leave free
        return command


def write_autoscaling_config(settings: ClusterSettings) -> Path:
    cloud = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    local = yaml.safe_load((REPO / "ray_cluster.local.yaml").read_text())
    config = local_cluster_config(cloud, local, gcs_address=f"127.0.0.1:{settings.base.ray_port}",
                                  worker_gpus=settings.worker_gpus, idle_timeout_s=settings.idle_timeout_s)
    path = settings.base.state_dir / "ray_cluster.local.generated.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def check_serve_config(serve_config: Path, cluster_config: Path) -> list[NodeType]:
    """Every application's replica layout against the cluster's node types: SystemExit naming the node types and
    the layout when one cannot fit (dcpserve/deployments/app.py refuses the same at deploy time)."""
    types = node_types(yaml.safe_load(cluster_config.read_text()))
    for app in yaml.safe_load(serve_config.read_text())["applications"]:
        args = parse_args(app.get("args") or {})
        try:
            check_replica_fits(types, args.tensor_parallel_size, args.decode_context_parallel_size,
                               "ray_cluster.yaml (as `make cluster` runs it)", args.prefill_context_parallel_size)
        except ReplicaDoesNotFit as err:
            raise SystemExit(f"application {app['name']!r} of {serve_config}: {err}") from err
    return types


def alive_nodes(settings: local_serve.LocalSettings, token_path: Path) -> dict[str, str]:
    """node id -> node type (the local provider's NODE_TYPE_LABEL, or "head") of every alive node, from the
    dashboard's state API."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{settings.dashboard_port}/api/v0/nodes?limit=1000&detail=true",
        headers={"Authorization": f"Bearer {token_path.read_text().strip()}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        result = json.loads(reply.read().decode())["data"]["result"]["result"]
    nodes = {}
    for node in result:
        if node.get("state") == "ALIVE":
            labels = node.get("labels") or {}
            kind = "head" if node.get("is_head_node") else labels.get(NODE_TYPE_LABEL, "worker")
            nodes[node["node_id"]] = kind
    return nodes


def print_banner(settings: ClusterSettings, config_path: Path, env: dict[str, str], types: list[NodeType],
                 tls: ClusterTls | None) -> None:
    base = settings.base
    workers = ", ".join(f"{t.name} ({t.gpus} logical GPUs, up to {t.max_workers})" for t in types if not t.head)
    serve = local_serve.ray_bin("serve")
    gcs = (f"on (Redis on loopback; a GCS that exits is started again after {settings.gcs_restart_delay_s:g}s, "
           "and the app keeps serving meanwhile)" if settings.gcs_fault_tolerance else
           "off (DCPSERVE_GCS_FT=0: a GCS that exits stops the cluster)")
    print(f"""
the local cluster is up: a head on 127.0.0.1:{base.ray_port} with no GPUs; Ray's autoscaler adds worker nodes of
{workers} when a replica needs them and removes them idle.

  deploy the app (its replicas land on worker nodes the autoscaler starts for them):
    export {local_serve.cli_exports(env, tls)}
    {serve} deploy {config_path} --address http://127.0.0.1:{base.dashboard_port}
  then the OpenAI API is at http://127.0.0.1:{base.http_port}/v1 (`make serve` prints client examples)
  the nodes:  {local_serve.ray_bin('ray')} status --address 127.0.0.1:{base.ray_port}   (with the export above)
  dashboard:  http://127.0.0.1:{base.dashboard_port}
  GCS fault tolerance: {gcs}
  Ray TLS:    {local_serve.tls_status(tls)}{"; each worker node gets a certificate of its own" if tls else ""}

Ctrl-C here, or `make cluster-down`, stops the head, every worker node and everything on them (and nothing else).
""", flush=True)


def watch_nodes(settings: ClusterSettings, head: Any, token_path: Path) -> None:
    """Says every node that joins or leaves, and the GCS going down and coming back, until the head exits."""
    known: dict[str, str] = {}
    start = time.monotonic()
    gcs_up = True
    while head.poll() is None:
        if local_serve.port_in_use(settings.base.ray_port) != gcs_up:
            gcs_up = not gcs_up
            say(f"the GCS is back ({time.monotonic() - start:.0f}s): deploys and autoscaling resume" if gcs_up else
                f"the GCS is down ({time.monotonic() - start:.0f}s): the app keeps serving; deploys, autoscaling "
                f"and replica restarts wait for it" + (" (its keeper starts it again)"
                                                       if settings.gcs_fault_tolerance else ""))
        try:
            nodes = alive_nodes(settings.base, token_path)
        except (OSError, KeyError, ValueError):  # the dashboard busy or restarting: ask again
            nodes = known
        for node_id in sorted(nodes.keys() - known.keys()):
            say(f"node joined: {nodes[node_id]} {node_id[-8:]} ({time.monotonic() - start:.0f}s); "
                f"{len(nodes)} nodes")
        for node_id in sorted(known.keys() - nodes.keys()):
            say(f"node left: {known[node_id]} {node_id[-8:]} ({time.monotonic() - start:.0f}s); {len(nodes)} nodes")
        known = nodes
        time.sleep(2)
    say(f"the Ray head exited ({head.returncode}); see {settings.base.state_dir / 'ray_head.log'}")


def up() -> None:
    local_serve.LOG_PREFIX = "make cluster"
    local_serve.stop_on_signals()
    settings = ClusterSettings.from_env()
    base = settings.base
    base.state_dir.mkdir(parents=True, exist_ok=True)
    pid_file = base.state_dir / PID_FILE
    if pid_file.is_file() and _alive(int(pid_file.read_text())):
        raise SystemExit(f"a local cluster is already running (pid {pid_file.read_text().strip()}, {pid_file}): "
                         "`make cluster-down` stops it")
    model_dir = local_serve.ensure_tiny_model(base.state_dir, base.model)
    cluster_config = write_autoscaling_config(settings)
    serve_config = local_serve.write_config(base, model_dir)
    types = check_serve_config(serve_config, cluster_config)
    tls = cluster_tls(base.state_dir, base.tls, say)
    env = local_serve.ray_env(base.state_dir, tls)
    env[CLUSTER_CONFIG_ENV] = str(cluster_config)  # the app builder checks layouts against it (deployments/app.py)
    temp_dir = Path(f"/tmp/dcpserve-{os.getuid()}-{base.ray_port}")
    pid_file.write_text(str(os.getpid()))
    say(f"autoscaling config: {cluster_config}")
    head = local_serve.start_head(base, env, temp_dir, autoscaling_config=cluster_config,
                                    keeper=settings.keeper())
    try:
        local_serve.wait_for_dashboard(base, head)
        print_banner(settings, serve_config, env, types, tls)
        watch_nodes(settings, head, Path(env["RAY_AUTH_TOKEN_PATH"]))
    except KeyboardInterrupt:
        print()
    finally:
        local_serve.stop_head(head)
        pid_file.unlink(missing_ok=True)
        if tls is not None:  # the cluster's keys die with it
            shutil.rmtree(tls.directory, ignore_errors=True)


def down(timeout_s: float = 90) -> None:
    """Signals the running `make cluster` (its pid file) and waits until it has stopped everything it started."""
    state_dir = local_serve.LocalSettings.from_env().state_dir
    pid_file = state_dir / PID_FILE
    if not pid_file.is_file():
        print(f"[make cluster-down] no local cluster is running ({pid_file} does not exist)")
        return
    pid = int(pid_file.read_text())
    if not _alive(pid):
        print(f"[make cluster-down] the cluster's process {pid} is gone; removing its stale pid file")
        pid_file.unlink(missing_ok=True)
        return
    print(f"[make cluster-down] stopping the local cluster (pid {pid})...", flush=True)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            raise SystemExit(f"the local cluster (pid {pid}) did not stop within {timeout_s:.0f}s")
        time.sleep(0.5)
    print("[make cluster-down] stopped", flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    if sys.argv[1:] == ["down"]:
        down()
    elif sys.argv[1:] in ([], ["up"]):
        up()
    else:
        raise SystemExit("usage: python -m dcpserve.local.nodes [up|down]")
