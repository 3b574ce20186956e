"""A Ray head of this process's own and the apps deployed on it: the test session's head (tests/e2e, tests/dashboards,
tests/local and the engine's Ray tests) and the cluster the soak and fairness benchmarks start for themselves.

`ray_head(state_dir)` starts one head (`ray start`, loopback only, logical GPUs, token auth, ports of its own; the
same code as `make serve`, dcpserve/local/serve.py), joins this process to it as a Ray driver and, on exit,
stops exactly the processes it started. tests/conftest.py holds it as the session fixture `ray_head`: one head for
the whole session. `deploy_app(head, app_args)` deploys the app onto it through Serve's REST API (what `serve
deploy` calls; `via_cli=True` runs the CLI itself), waits until Serve's API says RUNNING, and on exit deletes the app
and waits until its replicas have given back every GPU, so the next module's app finds the head as the first did.

Handle calls (stats of a replica, the admission queue's view, grants the test itself holds) go straight from this
process, which is a driver of the head.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from bench.harness.listeners import Socket, process_sockets, session_processes
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.cluster.tls import ClusterTls
from dcpserve.local import serve as local_serve
from dcpserve.local.tls import cluster_tls, join_cluster_tls, prepare_driver_tls, tls_setting

if TYPE_CHECKING:
    from dcpserve.deployments.messages import AdmissionStats, ReplicaStats

APP_NAME = "dcpserve"

# The tiny model at TP=2 x DCP=2 with 256 KiB of KV per rank: 512 B per token -> 512 tokens per rank, x dcp 2 =
# 1024 tokens = 32 logical blocks of 32 tokens.
CAPACITY_BLOCKS = 32

# Every Ray process of a test session: Ray exports metrics every second (10 s by default: too slow for the dashboard
# test's Prometheus), Serve's handles push autoscaling metrics often.
SESSION_ENV = {"RAY_metrics_report_interval_ms": "1000"}
T = TypeVar("T")


def present(value: T | None, what: str = "a field the test needs") -> T:
    """value, asserted not None: the official clients type most fields of a reply as optional (usage, logprobs)."""
    assert value is not None, f"the reply has no {what}"
    return value


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


@dataclass
class RayHead:
    """One running head: its ports, environment and temp dir, the tiny model, and this process as its driver."""

    settings: local_serve.LocalSettings
    env: dict[str, str]  # RAY_AUTH_MODE=token with this head's own token file, loopback only
    temp_dir: Path  # Ray's temp dir (session logs under session_latest/logs)
    model_dir: Path  # the tiny Llama, written once for the session
    process: subprocess.Popen[bytes]
    num_gpus: int
    tls: ClusterTls | None  # this head's CA and identities (None: DCPSERVE_TLS=0)
    deployed: list[str] = field(default_factory=list)  # served model names, in the order they were deployed

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.settings.ray_port}"

    @property
    def api(self) -> local_serve.ServeApi:
        return local_serve.ServeApi(self.settings.dashboard_port, Path(self.env["RAY_AUTH_TOKEN_PATH"]))

    def alive(self) -> bool:
        return self.process.poll() is None

    def processes(self) -> list[int]:
        """Pids of every process of this head (its own session: `ray start` began one) and of this driver."""
        return [os.getpid(), *session_processes(self.process.pid)]

    def listening_sockets(self) -> list[Socket]:
        """Every TCP socket a process of this head (or this driver) listens on."""
        return [s for s in process_sockets(self.processes()) if s.remote_ip is None]


def serve_inter_deployment_grpc_ports(api: local_serve.ServeApi) -> dict[int, int]:
    """pid -> port of the inter-deployment gRPC server of every running Serve replica on the head. Ray 2.60 starts one
    in each replica, bound to "[::]:0" in its code (ray/serve/_private/replica.py, `_on_initialized`) with no setting
    to move it (ray-project/ray#64544): the one listener of the cluster that cannot be kept on loopback, and so the
    one that mutual TLS must guard. Read from each replica actor, so that a test knows it probes those servers."""
    import ray

    found: dict[int, int] = {}
    for app in (api.details().get("applications") or {}).values():
        for deployment in app["deployments"].values():
            for replica in deployment["replicas"]:
                if replica["state"] == "RUNNING":
                    actor: Any = ray.get_actor(replica["actor_name"], namespace="serve")  # methods by name
                    port = actor.__ray_call__.remote(lambda a: a._replica_impl._internal_grpc_port)
                    found[int(replica["pid"])] = int(ray.get(port, timeout=60))
    return found


@contextlib.contextmanager
def driver_of(address: str, token_path: Path) -> Iterator[None]:
    """This process as a driver of the head at address, authenticated with that head's token (named in this
    process's environment while it is joined); on exit it leaves the cluster and restores the environment."""
    import ray
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # Ray's _raylet stub lacks it

    saved = {key: os.environ.get(key) for key in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    try:
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token_path)
        os.environ.pop("RAY_ADDRESS", None)
        AuthenticationTokenLoader.instance().reset_cache()
        ray.init(address=address, log_to_driver=False, namespace="dcpserve-tests")
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        restore_env(saved)


def restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextlib.contextmanager
def ray_head(state: Path, num_gpus: int = 4, extra_env: dict[str, str] | None = None) -> Iterator[RayHead]:
    """Starts a head on free ports (state under `state`, Ray's temp dir short under /tmp), with Ray's mutual TLS
    and a CA of its own unless DCPSERVE_TLS=0, joins this process to it as a driver, and stops the head (its own
    process group only) and leaves it on exit.

    Ray reads RAY_AUTH_MODE and its TLS setting once, when it is imported: both are set here if ray is not imported
    yet (tests/conftest.py and `python -m bench` set them before); the token file is the head's own, set when the
    head is up, and this process's TLS slot gets an identity of the head's CA (dcpserve/local/tls.py)."""
    saved = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE")}
    os.environ["RAY_AUTH_MODE"] = "token"
    local_serve.bind_ray_to_loopback()  # this driver too listens on loopback only
    prepare_driver_tls()
    from ray._raylet import (  # type: ignore[attr-defined]  # Ray's stub of the Cython _raylet lacks them
        AuthenticationMode,
        get_authentication_mode,
    )

    if get_authentication_mode() != AuthenticationMode.TOKEN:
        raise RuntimeError("ray was imported before RAY_AUTH_MODE=token was set: this process cannot join a head "
                           "with token auth; set RAY_AUTH_MODE=token before importing ray")
    state.mkdir(parents=True, exist_ok=True)
    model_dir = write_tiny_model(state / "model")
    http_port, ray_port, dashboard_port = local_serve.free_ports(3)
    settings = local_serve.LocalSettings(
        http_port=http_port, ray_port=ray_port, dashboard_port=dashboard_port, num_gpus=num_gpus, state_dir=state,
        config=state / "serve_config.yaml", deploy_timeout_s=240, tls=tls_setting(),
    )
    tls = cluster_tls(state, settings.tls, local_serve.say)
    env = local_serve.ray_env(state, tls)
    env.update(SESSION_ENV)
    env.update(extra_env or {})
    # Ray's socket paths must stay short: a temp dir directly under /tmp, not pytest's deep tmp_path.
    temp_dir = Path(tempfile.mkdtemp(prefix="dcpray-", dir="/tmp"))
    process = local_serve.start_head(settings, env, temp_dir)
    head = RayHead(settings, env, temp_dir, model_dir, process, num_gpus, tls)
    try:
        local_serve.wait_for_dashboard(settings, process)
        join_cluster_tls(tls)
        with driver_of(head.address, Path(env["RAY_AUTH_TOKEN_PATH"])):
            yield head
    finally:
        restore_env(saved)
        local_serve.stop_head(process)
        shutil.rmtree(temp_dir, ignore_errors=True)
        if tls is not None:
            shutil.rmtree(tls.directory, ignore_errors=True)


def serve_config(head: RayHead, app_args: dict[str, Any], runtime_env: dict[str, Any] | None = None,
                 app_name: str = APP_NAME) -> dict[str, Any]:
    """A serve deploy config of the app with these args on this head (its HTTP port, the session's tiny model)."""
    app: dict[str, Any] = {"name": app_name, "route_prefix": "/", "import_path": "dcpserve.deployments.app:build_app",
                           "args": {"model": str(head.model_dir), **app_args}}
    if runtime_env:
        app["runtime_env"] = runtime_env
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": head.settings.http_port},
            "applications": [app]}


@dataclass(frozen=True)
class ServeCluster:
    """The app running on the session's head: where to send requests, and what to ask Serve and the app itself."""

    head: RayHead
    url: str  # http://127.0.0.1:<port>, the app's route prefix is /
    app_name: str = APP_NAME  # Serve's application name, also the `application` label of the app's metrics

    @property
    def settings(self) -> local_serve.LocalSettings:
        return self.head.settings

    @property
    def env(self) -> dict[str, str]:
        return self.head.env

    @property
    def model_dir(self) -> Path:
        return self.head.model_dir

    @property
    def temp_dir(self) -> Path:
        return self.head.temp_dir

    def serve_details(self) -> dict[str, Any]:
        """GET /api/serve/applications/ on the dashboard (ServeInstanceDetails), with this cluster's token."""
        return self.head.api.details()

    def replica_states(self, deployment: str = "EngineReplica") -> dict[str, int]:
        """How many replicas of `deployment` are in each state (RUNNING, STARTING, STOPPING, ...)."""
        app = self.serve_details().get("applications", {}).get(self.app_name, {})
        counts: dict[str, int] = {}
        for replica in app.get("deployments", {}).get(deployment, {}).get("replicas", []):
            counts[replica["state"]] = counts.get(replica["state"], 0) + 1
        return counts

    def call(self, deployment: str, method: str, *args: Any, timeout_s: float = 60) -> Any:
        """deployment.method(*args) through a Serve handle from this driver (blocking: not inside an event loop;
        use asyncio.to_thread there)."""
        from ray import serve

        handle = serve.get_deployment_handle(deployment, app_name=self.app_name)
        return getattr(handle, method).remote(*args).result(timeout_s=timeout_s)

    def engine_stats(self) -> ReplicaStats:
        """EngineReplica.stats() of the one engine replica (any replica, when there are several)."""
        return self.call("EngineReplica", "stats")

    def admission_stats(self) -> AdmissionStats:
        """KvAdmission.stats(): the queue's counters and its view of each replica's KV."""
        return self.call("KvAdmission", "stats")

    def every_replica_stats(self) -> list[ReplicaStats]:
        """EngineReplica.stats() of each replica the admission queue knows, each call addressed to its replica
        (ReplicaQuery): Serve's own choice among idle replicas may send every unaddressed call to one of them."""
        from dcpserve.deployments.messages import ReplicaQuery

        return [self.call("EngineReplica", "stats", ReplicaQuery(replica_id))
                for replica_id in self.admission_stats().replicas]

    @contextlib.contextmanager
    def held_kv(self, blocks: int, ticket: str = "test-held-kv") -> Iterator[str]:
        """Holds `blocks` KV blocks of the admission queue's grants with a ticket of the test's own, so that KV
        pressure is the test's doing, not a long request's that may end early; yields the replica it holds them on.
        The app must give such grants time: its grant_leak_grace_s must outlast the block (the replica never
        reports a ticket it never got)."""
        from dcpserve.deployments.messages import Acquire, Granted

        reply = self.call("KvAdmission", "acquire", Acquire(ticket, blocks, 30.0))
        assert isinstance(reply, Granted), reply
        try:
            yield reply.replica_id
        finally:
            self.call("KvAdmission", "release", ticket)


@contextlib.contextmanager
def deploy_app(head: RayHead, app_args: dict[str, Any], runtime_env: dict[str, Any] | None = None,
               deploy_timeout_s: float = 240, via_cli: bool = False, app_name: str = APP_NAME
               ) -> Iterator[ServeCluster]:
    """Deploys the app on the head and waits until it is RUNNING (Serve's API); on exit deletes it and waits until
    Serve lists no application and the head's GPUs are all free again."""
    config = serve_config(head, app_args, runtime_env, app_name)
    head.deployed.append(str(app_args.get("served_model_name")))

    def progress(line: str) -> None:
        print(f"[deploy {app_args.get('served_model_name')}] {line}", flush=True)

    if via_cli:
        path = head.settings.state_dir / f"serve_config.{len(head.deployed)}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        subprocess.run([local_serve.ray_bin("serve"), "deploy", str(path), "--address",
                        f"http://127.0.0.1:{head.settings.dashboard_port}"], env=head.env, check=True)
    else:
        head.api.deploy(config)
    try:
        local_serve.wait_until_running(head.api, app_name, deploy_timeout_s, head.process,
                                         head.settings.state_dir / "ray_head.log", progress)
        yield ServeCluster(head, f"http://127.0.0.1:{head.settings.http_port}", app_name)
    finally:
        if head.alive():
            delete_apps(head)


def delete_apps(head: RayHead, timeout_s: float = 60) -> None:
    """Deletes every application (a config with none, as `serve deploy` of an empty list does) and waits until
    Serve lists none and every GPU of the head is free (the replicas' placement groups are gone). An idle app goes in
    seconds; the bound is well below the engine replicas' drain_timeout_s (120 s), so a replica that cannot stop
    until Serve kills it (as one did, waiting on the deleted admission queue) fails here."""
    import ray

    head.api.deploy({"proxy_location": "HeadOnly",
                     "http_options": {"host": "127.0.0.1", "port": head.settings.http_port}, "applications": []})
    deadline = time.monotonic() + timeout_s
    while True:
        apps = head.api.details().get("applications") or {}
        free_gpus = ray.available_resources().get("GPU", 0)
        if not apps and free_gpus >= head.num_gpus:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{timeout_s:.0f}s after the apps were deleted: Serve lists "
                                 f"{ {name: app.get('status') for name, app in apps.items()} }, {free_gpus} of "
                                 f"{head.num_gpus} GPUs free")
        time.sleep(0.5)


@contextlib.contextmanager
def serve_cluster(state: Path, app_args: dict[str, Any], num_gpus: int = 4, extra_env: dict[str, str] | None = None,
                  deploy_timeout_s: float = 240) -> Iterator[ServeCluster]:
    """A head of its own with the app deployed (the soak and fairness benchmarks run on one); `extra_env` reaches
    every Ray process."""
    with ray_head(state, num_gpus, extra_env) as head, deploy_app(head, app_args,
                                                                   deploy_timeout_s=deploy_timeout_s) as cluster:
        yield cluster
