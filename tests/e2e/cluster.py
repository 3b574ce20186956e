"""A Ray head of the test's own (`ray start`, loopback, logical GPUs, token auth) with the app `serve deploy`ed on it.

The e2e modules share this instead of each building a cluster: `serve_cluster(state_dir, app_args)` yields a
`ServeCluster` (HTTP base URL, the dashboard's Serve REST API for replica states) and stops exactly the Ray
processes it started, whatever happens. Built on deployments/local_cluster.py, the same code `make serve` runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from deployments import local_cluster
from engine.tiny_model import write_tiny_model

APP_NAME = "dcpserve"

# The tiny model at TP=2 x DCP=2 with 256 KiB of KV per rank: 512 B per token -> 512 tokens per rank, x dcp 2 =
# 1024 tokens = 32 logical blocks of 32 tokens.
CAPACITY_BLOCKS = 32


def tiny_app_args(served_model_name: str, **overrides: Any) -> dict[str, Any]:
    """App args the e2e, autoscaling and dashboard tests share; each overrides what its scenario needs."""
    args: dict[str, Any] = {
        "served_model_name": served_model_name,
        "tensor_parallel_size": 2,
        "decode_context_parallel_size": 2,
        "kv_cache_memory_bytes": 262144,
        "max_model_len": 2048,
        "max_num_seqs": 8,
        "routing_stats_period_s": 0.5,
        "kv_report_period_s": 0.25,
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
    }
    args.update(overrides)
    return args


@dataclass(frozen=True)
class ServeCluster:
    """One running head with the app deployed: where to send requests and how to ask Serve about replicas."""

    url: str  # http://127.0.0.1:<port>, the app's route prefix is /
    settings: local_cluster.LocalSettings
    env: dict[str, str]  # RAY_AUTH_MODE=token with this cluster's own token file
    model_dir: Path
    temp_dir: Path  # Ray's temp dir (session logs under session_latest/logs)

    def engine_stats(self) -> dict[str, Any]:
        """EngineReplica.stats() through a Serve handle, from a separate driver (the test process stays off it)."""
        return replica_stats(f"127.0.0.1:{self.settings.ray_port}", self.env)

    def serve_details(self) -> dict[str, Any]:
        """GET /api/serve/applications/ on the dashboard (ServeInstanceDetails), with this cluster's token."""
        token = Path(self.env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        reply = httpx.get(f"http://127.0.0.1:{self.settings.dashboard_port}/api/serve/applications/",
                          headers={"Authorization": f"Bearer {token}"}, timeout=30)
        reply.raise_for_status()
        return reply.json()

    def replica_states(self, deployment: str = "EngineReplica") -> dict[str, int]:
        """How many replicas of `deployment` are in each state (RUNNING, STARTING, STOPPING, ...)."""
        app = self.serve_details().get("applications", {}).get(APP_NAME, {})
        counts: dict[str, int] = {}
        for replica in app.get("deployments", {}).get(deployment, {}).get("replicas", []):
            counts[replica["state"]] = counts.get(replica["state"], 0) + 1
        return counts


def handle_calls(ray_address: str, env: dict[str, str], deployment: str, method: str, calls: int = 1,
                 app: str = APP_NAME) -> list[Any]:
    """`calls` answers of deployment.method() through a Serve handle, from a separate driver process (Serve picks the
    replica of each call: to reach every engine replica, every_replica_stats)."""
    script = (
        "import json, ray; from ray import serve; "
        f"ray.init(address={ray_address!r}, log_to_driver=False); "
        f"h = serve.get_deployment_handle({deployment!r}, app_name={app!r}); "
        f"print('STATS' + json.dumps([getattr(h, {method!r}).remote().result(timeout_s=60) for _ in range({calls})]))"
    )
    return _driver_json(script, env)


def _driver_json(script: str, env: dict[str, str]) -> Any:
    """Runs a driver script (in the repository root) and returns the JSON it prints after "STATS"."""
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180,
                            cwd=Path(__file__).resolve().parents[2])
    line = next((x for x in result.stdout.splitlines() if x.startswith("STATS")), None)
    assert line is not None, result.stderr[-2000:]
    return json.loads(line[len("STATS"):])


def every_replica_stats(ray_address: str, env: dict[str, str], app: str = APP_NAME) -> list[dict[str, Any]]:
    """EngineReplica.stats() of each replica the admission queue knows, each call addressed to its replica
    (ReplicaQuery), from a separate driver process."""
    script = (
        "import json, ray; from ray import serve; from deployments.replica import ReplicaQuery; "
        f"ray.init(address={ray_address!r}, log_to_driver=False); "
        f"ids = serve.get_deployment_handle('KvAdmission', app_name={app!r}).stats.remote().result(timeout_s=60)"
        "['replicas']; "
        f"h = serve.get_deployment_handle('EngineReplica', app_name={app!r}); "
        "print('STATS' + json.dumps([h.stats.remote(ReplicaQuery(i)).result(timeout_s=60) for i in ids]))"
    )
    return _driver_json(script, env)


def replica_stats(ray_address: str, env: dict[str, str], app: str = APP_NAME) -> dict[str, Any]:
    """EngineReplica.stats() through a Serve handle, from a separate driver process."""
    return handle_calls(ray_address, env, "EngineReplica", "stats", 1, app)[0]


def serve_config(app_args: dict[str, Any]) -> dict[str, Any]:
    """A serve deploy config of the app with these args (write_config fills in the model path and HTTP port)."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "deployments.app:build_app",
                          "args": dict(app_args)}],
    }


@contextmanager
def serve_cluster(
    state: Path,
    app_args: dict[str, Any],
    num_gpus: int = 4,
    extra_env: dict[str, str] | None = None,
    deploy_timeout_s: float = 240,
) -> Iterator[ServeCluster]:
    """Writes the tiny model, starts a head on free ports, deploys the app and waits for RUNNING; stops the head
    (its own process group only) on exit. `extra_env` reaches every Ray process (e.g. Serve's push intervals)."""
    model_dir = write_tiny_model(state / "model")
    (state / "serve_config.yaml").write_text(yaml.safe_dump(serve_config(app_args)))
    settings = local_cluster.LocalSettings(
        http_port=local_cluster.free_port(), ray_port=local_cluster.free_port(),
        dashboard_port=local_cluster.free_port(), num_gpus=num_gpus, state_dir=state,
        config=state / "serve_config.yaml", deploy_timeout_s=deploy_timeout_s,
    )
    env = local_cluster.ray_env(state)
    env.update(extra_env or {})
    # Ray's socket paths must stay short: a temp dir directly under /tmp, not pytest's deep tmp_path.
    temp_dir = Path(tempfile.mkdtemp(prefix="dcpe2e-", dir="/tmp"))
    head = local_cluster.start_head(settings, env, temp_dir)
    try:
        local_cluster.wait_for_dashboard(settings, head)
        local_cluster.deploy_and_wait(settings, env, local_cluster.write_config(settings, model_dir), head)
        yield ServeCluster(f"http://127.0.0.1:{settings.http_port}", settings, env, model_dir, temp_dir)
    finally:
        local_cluster.stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
