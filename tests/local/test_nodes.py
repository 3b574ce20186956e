"""`make cluster` end to end: ray_cluster.yaml's node types on this machine with Ray's real autoscaler
(dcpserve/local/nodes.py, dcpserve/local/provider.py).

One cluster for the module, started and stopped exactly as a user does (`python -m dcpserve.local.nodes up`, then
`... down`), with worker nodes of 2 logical GPUs so that each holds one TP=2 x DCP=2 replica:
- `serve deploy` of the printed config brings up a worker node for the first replica; the replica and its ranks run
  there and never on the head; a completion comes back through the openai client; no process of the cluster listens
  on or connects to anything but loopback (except Serve's inter-deployment gRPC server, which Ray binds to [::]);
- load past one replica (clients in loops) makes Serve ask for a second, whose placement group makes the autoscaler
  add a node; the new replica runs there and is granted requests, and Prometheus' service discovery lists the new
  node, whose metrics carry it; idle, one replica goes away and so does the node it leaves empty;
- a worker node killed under load costs only its in-flight requests: the admission queue forgets its replica at
  once, the other replica serves new requests, Serve and the autoscaler replace replica and node, no KV stays held;
- a layout no node type can hold is refused at deploy, naming the node type, its GPUs and the layout;
- the GCS killed (Redis-backed fault tolerance; the head keeper starts it again): requests sent while it is down are
  all answered, open streams keep streaming through the outage, the replicas that ran before run after on the same
  nodes (their raylets reconnect), and a changed config deploys once it is back;
- `down` leaves no process of the cluster behind.

What is asserted holds whatever the timing: states are waited for (bounded), never assumed after a sleep. How long
each phase took is printed (`-s`), as the measurement docs/operations.md quotes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.harness.cluster import (
    driver_of,
    serve_inter_deployment_grpc_ports,
    tiny_app_args,
)
from bench.harness.listeners import (
    LOOPBACK,
    assert_only_the_clusters_certificate,
    key_leaks,
    process_sockets,
    session_processes,
)
from dcpserve.cluster.tls import ClusterCa, ClusterTls
from dcpserve.deployments.messages import QueueReplicaView
from dcpserve.local import serve as local_serve
from dcpserve.local.tls import join_cluster_tls
from tests.local.probes import (
    Stream,
    admission_stats,
    alive_nodes,
    gcs_down,
    gcs_pid,
    head_node_id,
    kill_node,
    num_grants,
    scrape,
)

pytestmark = [pytest.mark.timeout(900)]

MODEL = "tiny-nodes"
WORKER_GPUS = 2  # one TP=2 replica per worker node: a second replica needs a second node
IDLE_TIMEOUT_S = 15
GCS_RESTART_DELAY_S = 20  # the GCS outage the GCS test makes: long enough to be served through, well within the
# 60 s that raylets and drivers (this test process too) wait for a GCS to come back
WAIT_S = 240.0  # bound on any one phase (a node launch plus a replica start on a busy 2-core machine)
APP_ARGS = tiny_app_args(
    MODEL,
    kv_cache_memory_bytes=2 * 1024 * 1024,  # 8192 tokens per replica: three ~1k-token streams fit in one
    autoscaling={"min_replicas": 1, "max_replicas": 2, "target_sequences_per_replica": 1,
                 "upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_period_s": 2},
)


@dataclass
class LocalNodes:
    """The running `make cluster` of this module: its process, settings, log, and this process as its driver."""

    process: subprocess.Popen[bytes]
    env: dict[str, str]  # the environment `up` and `down` run with
    state_dir: Path
    log: Path
    ray_port: int
    dashboard_port: int
    http_port: int
    started: float  # time.monotonic() when `up` was started
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def api(self) -> local_serve.ServeApi:
        return local_serve.ServeApi(self.dashboard_port, self.state_dir / "ray_auth_token")

    def session_id(self) -> int:
        """The session of the head's keeper (dcpserve/local/head_keeper.py, begun by `up`), whose command line ends
        with the head's `ray start --head --port ...`: Redis, the head and every node the autoscaler starts are in
        it."""
        import psutil

        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info["cmdline"] or []
            if "--head" in cmdline and "--port" in cmdline and str(self.ray_port) in cmdline:
                return os.getsid(process.pid)
        raise AssertionError(f"no head keeper of `ray start --head --port {self.ray_port}` is running; see {self.log}")

    def engine_replicas(self) -> list[dict[str, Any]]:
        app = (self.api.details().get("applications") or {}).get("dcpserve", {})
        replicas: list[dict[str, Any]] = app.get("deployments", {}).get("EngineReplica", {}).get("replicas", [])
        return replicas


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S, period_s: float = 1.0) -> Any:
    """check() until it returns something truthy; AssertionError with the last value after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(period_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s; last seen: {last!r}")


@pytest.fixture(scope="module")
def local_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNodes]:
    state = tmp_path_factory.mktemp("local-nodes")
    template = state / "serve_config.template.yaml"
    template.write_text(yaml.safe_dump({
        "proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 0},
        "applications": [{"name": "dcpserve", "route_prefix": "/", "import_path": "dcpserve.deployments.app:build_app",
                          "args": {"model": "filled in by local_nodes", **APP_ARGS}}]}))
    ports = dict(zip(("http", "ray", "dashboard"), local_serve.free_ports(3), strict=True))
    env = {**os.environ, "DCPSERVE_STATE_DIR": str(state), "DCPSERVE_PORT": str(ports["http"]),
           "DCPSERVE_RAY_PORT": str(ports["ray"]), "DCPSERVE_DASHBOARD_PORT": str(ports["dashboard"]),
           "DCPSERVE_CONFIG": str(template), "DCPSERVE_WORKER_GPUS": str(WORKER_GPUS),
           "DCPSERVE_IDLE_TIMEOUT_S": str(IDLE_TIMEOUT_S), "DCPSERVE_GCS_RESTART_DELAY_S": str(GCS_RESTART_DELAY_S)}
    log = state / "make_cluster.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "dcpserve.local.nodes", "up"], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    nodes = LocalNodes(process, env, state, log, ports["ray"], ports["dashboard"], ports["http"], started)
    session = None
    try:
        wait_for("make cluster says the cluster is up",
                 lambda: process.poll() is not None or "the local cluster is up" in log.read_text())
        assert process.poll() is None, log.read_text()
        nodes.timings["cluster up"] = time.monotonic() - started
        session = nodes.session_id()
        # This process joins as an identity of the cluster's CA, which `make cluster` made in its state dir.
        join_cluster_tls(ClusterTls(ClusterCa.load(state / "tls")))
        with driver_of(f"127.0.0.1:{ports['ray']}", state / "ray_auth_token"):
            yield nodes
    finally:
        down = subprocess.run([sys.executable, "-m", "dcpserve.local.nodes", "down"], env=env,
                              capture_output=True, text=True, timeout=180)
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:  # never leave it behind, whatever failed
                os.killpg(process.pid, 9)
        print(f"\nlocal cluster phases (s): {nodes.timings}")
        assert down.returncode == 0, down.stdout + down.stderr
        assert process.returncode == 0, log.read_text()[-3000:]
        if session is not None:
            left = session_processes(session)
            assert left == [], f"processes of the cluster left after `down`: {left}"


def test_deploy_lands_on_worker_nodes_and_answers(local_nodes: LocalNodes) -> None:
    import openai
    from ray.util.state import list_actors

    banner = local_nodes.log.read_text()
    # Exactly what the banner says to run.
    command = re.search(r"^\s+(\S+/serve deploy \S+ --address \S+)$", banner, re.MULTILINE)
    export = re.search(r"^\s+export (.+)$", banner, re.MULTILINE)
    assert command and export, banner
    env = {**local_nodes.env, **dict(item.split("=", 1) for item in export.group(1).split())}
    assert len(alive_nodes()) == 1, "the head alone until a replica needs a GPU"
    start = time.monotonic()
    subprocess.run(command.group(1).split(), env=env, check=True, timeout=120)
    local_serve.wait_until_running(local_nodes.api, "dcpserve", WAIT_S, local_nodes.process, local_nodes.log,
                                     progress=print)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{local_nodes.http_port}/v1", api_key="none")
    reply = client.completions.create(model=MODEL, prompt="def hello", max_tokens=8, temperature=0)
    local_nodes.timings["deploy to first completion"] = time.monotonic() - start
    local_nodes.timings["make cluster to first completion"] = time.monotonic() - local_nodes.started
    assert reply.choices[0].finish_reason == "length" and reply.usage and reply.usage.completion_tokens == 8

    head = head_node_id()
    nodes = alive_nodes()
    assert nodes[head]["Resources"].get("GPU", 0) == 0
    (replica,) = local_nodes.engine_replicas()
    assert replica["node_id"] != head, "an engine replica ran on the CPU head"
    assert nodes[replica["node_id"]]["Resources"].get("GPU") == WORKER_GPUS
    ranks = list_actors(filters=[("class_name", "=", "RankWorker"), ("state", "=", "ALIVE")])
    assert len(ranks) == 2 and {rank.node_id for rank in ranks} == {replica["node_id"]}, ranks  # STRICT_PACK

    # Every process of every node of the cluster: connected to loopback only, listening on loopback or behind the
    # cluster's mutual TLS (each worker node runs as an identity of its own: the replica's node among them).
    sockets = process_sockets(session_processes(local_nodes.session_id()))
    assert [s for s in sockets if s.remote_ip is not None and s.remote_ip not in LOOPBACK] == []
    tls = ClusterTls(ClusterCa.load(local_nodes.state_dir / "tls"))
    grpc = serve_inter_deployment_grpc_ports(local_nodes.api)
    assert len(grpc) == 3, grpc
    assert_only_the_clusters_certificate(sockets, tls, grpc, local_nodes.state_dir)
    identities = {p.name for p in tls.directory.iterdir() if p.is_dir()}
    assert {"head", "client", "gpu_worker-1"} <= identities, identities  # the worker node's own
    # No line of any key of the cluster in the banner and log of `make cluster`, nor in any log of any node.
    logs = [local_nodes.log, *(p for p in Path(f"/tmp/dcpserve-{os.getuid()}-{local_nodes.ray_port}").rglob("*")
                                 if p.is_file() and "logs" in p.parts)]
    assert len(logs) > 20, logs
    assert key_leaks(tls.directory, {str(path): path.read_text(errors="replace") for path in logs}) == []


def test_load_adds_a_node_for_a_second_replica_and_idle_removes_it(local_nodes: LocalNodes) -> None:
    """Load past one replica until a second one runs on a node the autoscaler added and has been granted a request,
    then idle. The load is clients in loops (bench.harness.faults.Load), not a fixed set of streams: a fixed set may end
    before the new node is up on a fast machine, and then Serve rightly scales back and nothing needs a second
    replica. The request that proves the new replica is routed to is a probe with a prompt of its own: while the
    first replica holds any of the load's streams, the new one has more KV free and no prefix anywhere decides."""
    import openai

    from bench.harness import faults

    (first,) = local_nodes.engine_replicas()

    def second_replica_running() -> dict[str, Any] | None:
        replicas = [r for r in local_nodes.engine_replicas() if r["replica_id"] != first["replica_id"]]
        return next((r for r in replicas if r["state"] == "RUNNING"), None)

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{local_nodes.http_port}/v1", api_key="none",
                           max_retries=0, timeout=300)
    probes = iter(range(100, 10_000))

    def new_replica_granted(second: dict[str, Any]) -> QueueReplicaView | None:
        reply = client.completions.create(model=MODEL, prompt=f"def probe_{next(probes)}():", max_tokens=4,
                                          temperature=0)
        assert reply.choices and reply.choices[0].finish_reason in ("length", "stop"), reply
        granted = admission_stats().replicas.get(second["replica_id"])
        return granted if granted is not None and granted.num_granted > 0 else None

    # 3 sequences at a target of 1 per replica: Serve wants a second replica (max_replicas 2) for as long as it runs.
    load = faults.Load(local_nodes.url, MODEL, streams=3, plain=0, max_tokens=1500, client_timeout_s=300).start()
    try:
        start = time.monotonic()
        second = wait_for("a second engine replica RUNNING", second_replica_running)
        local_nodes.timings["load to second replica running"] = time.monotonic() - start
        granted = wait_for("the new replica granted a request", lambda: new_replica_granted(second), period_s=0.5)
    finally:
        load.stop(WAIT_S)
        client.close()
    assert load.outcomes and all(o.status == 200 and o.error is None for o in load.outcomes), load.summary()
    assert granted.num_granted > 0, f"the new replica was granted nothing: {granted}"
    nodes = alive_nodes()
    assert second["node_id"] not in (first["node_id"], head_node_id()), "the second replica needed a new node"
    assert nodes[second["node_id"]]["Resources"].get("GPU") == WORKER_GPUS
    assert len(nodes) == 3

    # Prometheus finds the node the autoscaler added: Ray's service-discovery file (what dashboards/prometheus reads)
    # lists the node's metrics agent, which serves the new replica's series labelled with that node and its type.
    target = f"127.0.0.1:{nodes[second['node_id']]['MetricsExportPort']}"
    discovery = Path(f"/tmp/dcpserve-{os.getuid()}-{local_nodes.ray_port}/prom_metrics_service_discovery.json")
    wait_for(f"{target} in {discovery}", lambda: discovery.is_file() and target in discovery.read_text())
    expected = (f'node_id="{second["node_id"]}"', 'node_type="gpu_worker"')
    wait_for(f"the new node's replica_node_info on {target}",
             lambda: [line for line in scrape(target).splitlines()
                      if line.startswith("ray_dcpserve_replica_node_info{") and all(e in line for e in expected)])

    # Idle: Serve stops one of the two replicas (either: Serve chooses), then the autoscaler removes the node it
    # leaves empty; the other replica's node stays (min_replicas 1).
    start = time.monotonic()
    (kept,) = wait_for("back to one engine replica", lambda: [
        r for r in local_nodes.engine_replicas() if r["state"] == "RUNNING"]
        if [r["state"] for r in local_nodes.engine_replicas()] == ["RUNNING"] else None)
    local_nodes.timings["idle to one replica"] = time.monotonic() - start
    emptied = ({first["node_id"], second["node_id"]} - {kept["node_id"]}).pop()
    wait_for("the emptied worker node removed", lambda: emptied not in alive_nodes() and len(alive_nodes()) == 2)
    local_nodes.timings["idle to node removed"] = time.monotonic() - start
    assert kept["node_id"] in alive_nodes()
    stats = admission_stats()
    assert all(r.num_grants == 0 for r in stats.replicas.values()), stats  # no KV held after the drain


def test_a_worker_node_killed_under_load_costs_only_its_in_flight_requests(local_nodes: LocalNodes) -> None:
    """A worker node dies (SIGKILL of its raylet and everything under it) while requests stream on both replicas:
    the requests on it end with an error, the admission queue forgets its replica at once (an ingress' delta
    stream from it fails: replica_lost), new requests are served by the other replica, Serve replaces the replica
    and the autoscaler the node, and nothing is lost, hung or left holding KV."""
    from bench.harness import faults

    # Enough concurrent sequences for two replicas (target 1 per replica), hence two worker nodes.
    load = faults.Load(local_nodes.url, MODEL, streams=3, plain=1, max_tokens=300, client_timeout_s=300).start()
    try:
        def two_running() -> list[dict[str, Any]] | None:
            running = [r for r in local_nodes.engine_replicas() if r["state"] == "RUNNING"]
            return running if len(running) == 2 and running[0]["node_id"] != running[1]["node_id"] else None

        replicas = wait_for("two engine replicas on two nodes", two_running)
        granted = wait_for("a replica holding grants", lambda: [
            r for r in replicas if num_grants(r["replica_id"])])
        victim = granted[0]
        in_flight = [o for o in list(load.outcomes) if o.ended is None]
        killed_at = time.monotonic()
        killed = kill_node(victim["node_id"])
        forgotten = wait_for("the admission queue forgot the dead replica", lambda: victim["replica_id"] not in
                             admission_stats().replicas, period_s=0.2)
        local_nodes.timings["node kill to replica forgotten"] = time.monotonic() - killed_at
        assert forgotten
        local_nodes.timings["node kill to a new request served"] = (
            time.monotonic() - killed_at + faults.wait_until_serving(local_nodes, MODEL, WAIT_S))
        # Serve replaces the replica; its placement group needs a node: the autoscaler replaces the dead one.
        wait_for("two engine replicas running again", lambda: (running := two_running()) is not None
                 and victim["replica_id"] not in {r["replica_id"] for r in running})
        local_nodes.timings["node kill to two replicas again"] = time.monotonic() - killed_at
        healed_from = time.monotonic()
        wait_for("a request started after the recovery answered", lambda: [
            o for o in list(load.outcomes) if o.started > healed_from and o.ended is not None])
    finally:
        load.stop(WAIT_S)
    errors = sorted({(o.status, o.error[:160]) for o in load.outcomes if o.error})
    print(f"killed node {victim['node_id'][-8:]} ({len(killed)} processes) with {len(in_flight)} requests in flight; "
          f"outcomes {dict(load.summary())}; errors: {errors}")
    outcomes = load.outcomes
    assert not [o for o in outcomes if o.hung], load.summary()
    for outcome in in_flight:
        assert outcome.ended is not None, outcome
    for outcome in outcomes:  # an answer or a clear error: nothing lost in silence
        assert (outcome.status == 200 and outcome.error is None) or outcome.error, outcome
    healed = [o for o in outcomes if o.started > healed_from]
    assert healed and all(o.status == 200 and o.error is None for o in healed), healed
    faults.wait_until_nothing_held(local_nodes, WAIT_S)
    assert victim["node_id"] not in alive_nodes()


def test_a_layout_no_node_type_can_hold_is_refused_at_deploy(local_nodes: LocalNodes) -> None:
    config, deployed = deployed_configs(local_nodes)
    app = config["applications"][0]
    app["name"] = "too-wide"
    app["route_prefix"] = "/too-wide"
    app["args"].update(tensor_parallel_size=4, decode_context_parallel_size=4, served_model_name="too-wide")
    local_nodes.api.deploy({**config, "applications": [*[d | {"name": d["name"]} for d in deployed], app]})
    try:
        failed = wait_for("the too-wide app refused", lambda: local_nodes.api.application("too-wide")
                          if local_nodes.api.application("too-wide").get("status") == "DEPLOY_FAILED" else None)
        message = failed.get("message", "")
        for part in ("tensor_parallel_size=4", "'gpu_worker' has 2 GPUs", "4 GPUs on one node"):
            assert part in message, (part, message)
    finally:
        local_nodes.api.deploy({**config, "applications": deployed})


def running_replicas(local_nodes: LocalNodes) -> dict[str, str] | None:
    """replica id -> node id of the RUNNING engine replicas; None while the dashboard does not answer."""
    try:
        return {r["replica_id"]: r["node_id"] for r in local_nodes.engine_replicas() if r["state"] == "RUNNING"}
    except OSError:
        return None


def test_the_gcs_killed_the_app_serves_through_and_deploys_after(local_nodes: LocalNodes) -> None:
    """SIGKILL of the GCS with Redis-backed fault tolerance: until the head keeper starts it again
    (GCS_RESTART_DELAY_S later) the app answers every request and open streams keep streaming, since proxies,
    ingress, admission queue and replicas talk to each other directly; after, the same nodes are there (their raylets
    reconnected to the new GCS rather than being replaced) and a changed config deploys."""
    import openai

    from bench.harness import faults

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{local_nodes.http_port}/v1", api_key="none",
                           max_retries=0, timeout=120)
    streams = [Stream(client, MODEL, f"def stream_{i}(x):").start() for i in range(2)]
    try:
        wait_for("both streams streaming", lambda: all(s.chunks for s in streams) or any(s.error for s in streams))
        assert not [s.error for s in streams if s.error], [s.error for s in streams]
        running_before = running_replicas(local_nodes)
        assert running_before, "no engine replica running"
        victim = gcs_pid(local_nodes.ray_port)
        assert victim is not None
        os.kill(victim, 9)
        killed_at = time.monotonic()
        # SIGKILL is delivered, not done: the process ends (and its port closes) a moment later.
        wait_for("the GCS gone", lambda: gcs_down(local_nodes.ray_port), period_s=0.05)
        probes: list[tuple[float, float, bool]] = []  # (sent, answered, the GCS down over the whole request)
        while local_nodes.process.poll() is None and gcs_down(local_nodes.ray_port):
            sent = time.monotonic()
            reply = client.completions.create(model=MODEL, prompt=f"def during_{len(probes)}():", max_tokens=4,
                                              temperature=0)
            assert reply.choices and reply.choices[0].finish_reason in ("length", "stop"), reply
            probes.append((sent, time.monotonic(), gcs_down(local_nodes.ray_port)))
            assert time.monotonic() - killed_at < WAIT_S, "the GCS was not started again"
        back_at = time.monotonic()
        local_nodes.timings["GCS outage"] = back_at - killed_at
        assert local_nodes.process.poll() is None, local_nodes.log.read_text()[-3000:]
        served_down = [p for p in probes if p[2]]
        print(f"GCS down {back_at - killed_at:.1f}s: {len(probes)} requests sent, {len(served_down)} of them sent "
              f"and answered while it was down, answered in {[round(p[1] - p[0], 2) for p in probes]} s")
        assert served_down, f"no request was both sent and answered while the GCS was down: {probes}"
        wait_for("a new GCS", lambda: gcs_pid(local_nodes.ray_port) not in (None, victim))
        # The same cluster: replicas that ran before run now, on the same nodes, alive (their raylets reconnected
        # to the new GCS: nothing restarted or replaced). Not every one of them: Serve may rightly stop one that
        # its autoscaler no longer needs, and the autoscaler remove its node; the streams' replica stays.
        running = wait_for("Serve's REST API answering again", lambda: running_replicas(local_nodes))
        kept = {replica: node for replica, node in running_before.items() if running.get(replica) == node}
        assert kept, f"no replica from before the outage runs after it: {running_before} then {running}"
        assert set(kept.values()) <= set(alive_nodes()), kept
        # The streams were open across the outage and go on after it: chunks while down, and after (or their end:
        # 2,000 tokens each, ignoring EOS, may all be out on a fast machine).
        wait_for("both streams streaming after the GCS is back", lambda: all(
            s.between(back_at, float("inf")) or s.ended for s in streams) or any(s.error for s in streams))
        for stream in streams:
            assert stream.error is None, stream.error
            assert stream.between(killed_at, back_at) > 0, "a stream stalled while the GCS was down"
            assert not stream.ended or stream.finish_reason == "length", (stream.finish_reason, len(stream.chunks))
    finally:
        for stream in streams:
            stream.stop.set()
        for stream in streams:
            if stream.thread is not None:
                stream.thread.join(timeout=120)

    # Manageable again: a changed config deploys (Serve's controller, the dashboard and the GCS all involved).
    config, deployed = deployed_configs(local_nodes)
    (app,) = [a for a in deployed if a["name"] == "dcpserve"]
    target = app["args"]["autoscaling"]["target_sequences_per_replica"] + 1
    app["args"]["autoscaling"]["target_sequences_per_replica"] = target
    start = time.monotonic()
    local_nodes.api.deploy({**config, "applications": deployed})

    def deployed_with_new_target() -> bool:
        details = local_nodes.api.application("dcpserve")
        engine = details.get("deployments", {}).get("EngineReplica", {})
        policy = (engine.get("deployment_config", {}).get("autoscaling_config") or {}).get("policy", {})
        return (details.get("status") == "RUNNING" and engine.get("status") == "HEALTHY"
                and policy.get("policy_kwargs", {}).get("target_sequences_per_replica") == target)

    wait_for("the changed config deployed", deployed_with_new_target)
    local_nodes.timings["GCS back to a changed config running"] = time.monotonic() - start
    faults.wait_until_serving(local_nodes, MODEL, WAIT_S)
    faults.wait_until_nothing_held(local_nodes, WAIT_S)


def deployed_configs(local_nodes: LocalNodes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """This cluster's generated serve config, and the config of each application deployed now (as Serve's REST
    API takes them back)."""
    config = yaml.safe_load((local_nodes.state_dir / "serve_config.generated.yaml").read_text())
    current = local_nodes.api.details()
    deployed = [{"name": name, "route_prefix": a.get("route_prefix"), **a["deployed_app_config"]}
                for name, a in (current.get("applications") or {}).items()]
    return config, deployed
