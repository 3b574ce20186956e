"""Faults under load on the session's Ray head (bench/harness/cluster.py, bench/harness/faults.py; these run last): a TP
rank, a whole engine replica, the admission queue and the ingress are each SIGKILLed (by the pid the cluster's own APIs
report) while streaming and non-streaming clients run. Every request ends (an answer or a clear error, never a hang),
the app heals by itself (Serve replaces what died), new requests succeed, and no KV stays held afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from bench.harness import faults
from bench.harness.cluster import RayHead, ServeCluster, deploy_app, tiny_app_args

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

MODEL = "tiny-faults"
APP_ARGS = tiny_app_args(MODEL, kv_cache_memory_bytes=1024 * 1024, health_check_period_s=2, queue_timeout_s=30,
                         retry_after_s=1)
RECOVERY_TIMEOUT_S = 150.0  # a replacement engine replica starts its Ray worker group on this 2-core machine
END_TIMEOUT_S = 90.0  # every request in flight at the fault has ended by then


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    with deploy_app(ray_head, APP_ARGS) as running:
        yield running


def _under_load(cluster: ServeCluster, kill_pid: int, what: str, drain_timeout_s: float = 20.0) -> None:
    load = faults.Load(cluster.url, MODEL).start()
    deadline = time.monotonic() + 60
    while sum(o.tokens > 0 and o.ended is None for o in list(load.outcomes)) < 2:  # requests mid-decode
        assert time.monotonic() < deadline, f"the load never got going: {load.summary()}"
        time.sleep(0.2)
    in_flight = [o for o in list(load.outcomes) if o.ended is None]
    killed_at = time.monotonic()
    faults.kill(kill_pid)
    recovery_s = faults.wait_until_serving(cluster, MODEL, RECOVERY_TIMEOUT_S)
    healed_from = killed_at + recovery_s + 1
    # The load runs on the healed app for a while: at least 3 s, and until a request it started there has ended (on
    # a loaded machine its clients may all be inside requests begun before then for longer than 3 s).
    time.sleep(3)
    deadline = time.monotonic() + END_TIMEOUT_S
    while not [o for o in list(load.outcomes) if o.started > healed_from and o.ended is not None]:
        assert time.monotonic() < deadline, f"no request started after the recovery ended: {load.summary()}"
        time.sleep(0.2)
    load.stop(END_TIMEOUT_S)
    outcomes = load.outcomes
    print(f"{what}: killed pid {kill_pid} with {len(in_flight)} requests in flight; serving again after "
          f"{recovery_s:.1f}s; outcomes {dict(load.summary())}")
    assert not [o for o in outcomes if o.hung], load.summary()  # nothing left hanging
    for outcome in in_flight:
        assert outcome.ended is not None and outcome.ended - killed_at < END_TIMEOUT_S
    for outcome in outcomes:  # an answer or a clear error: nothing lost in silence
        assert (outcome.status == 200 and outcome.error is None) or outcome.error, outcome
    healed = [o for o in outcomes if o.started > healed_from]
    assert healed and all(o.status == 200 and o.error is None for o in healed), healed
    held_s = faults.wait_until_nothing_held(cluster, drain_timeout_s)
    print(f"{what}: KV free {held_s:.1f}s after the load stopped")


def test_sigkill_one_tp_rank_mid_decode(cluster: ServeCluster) -> None:
    ranks = faults.alive_actor_pids(cluster, "RankWorker")
    assert len(ranks) == 2, ranks  # one replica, tp = 2
    _under_load(cluster, ranks[1], "TP rank 1")


def test_sigkill_a_whole_engine_replica(cluster: ServeCluster) -> None:
    (replica,) = faults.serve_replicas(cluster, "EngineReplica")
    _under_load(cluster, int(replica["pid"]), "engine replica")


def test_sigkill_the_admission_queue(cluster: ServeCluster) -> None:
    (queue,) = faults.serve_replicas(cluster, "KvAdmission")
    _under_load(cluster, int(queue["pid"]), "admission queue")


def test_sigkill_the_ingress(cluster: ServeCluster) -> None:
    (ingress,) = faults.serve_replicas(cluster, "OpenAIIngress")
    # Requests the dead ingress had granted are released by the queue's leak reconciliation (leak_grace_s = 30 s)
    # once their replica no longer holds them: allow for it.
    _under_load(cluster, int(ingress["pid"]), "ingress", drain_timeout_s=60.0)
