"""The soak of `python -m bench soak` (bench/soak.py), short: a minute of mixed traffic (streams, chat, completions,
disconnecting clients, bad inputs, a burst of long sampled requests past the KV while autoscaling adds a replica) from
two tenants at urgent, normal and sheddable priorities, with one SIGKILL of each kind (TP rank, engine replica,
admission queue, ingress). Nothing is lost or hangs, every 429 is a refusal the app owes (shed, limit_exceeded,
queue_full, queue_timeout, deadline_exceeded), no KV stays held, no over-commit is seen, every bad input gets an
OpenAI-shaped 4xx and no app process is busy afterwards.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest

from bench import soak, soak_report, soak_traffic
from bench.harness.cluster import RayHead, ServeCluster, deploy_app

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeCluster]:
    # `default`'s key reaches the ingress through the app's runtime_env; `batch`'s is in a keys file on this machine.
    runtime_env = {"env_vars": {"DCPSERVE_SOAK_API_KEYS": soak_traffic.KEY}}
    keys_file = soak_traffic.write_keys_file(tmp_path_factory.mktemp("soak-keys"))
    with deploy_app(ray_head, soak_traffic.app_args(keys_file), runtime_env=runtime_env) as running:
        yield running


def test_a_short_soak_with_every_fault_loses_nothing(cluster: ServeCluster) -> None:
    report = soak.run(cluster, minutes=1.0, burst_size=12, burst_period_s=30.0)
    print("\n".join(soak_report.table(report, 1.0)))
    # Every kind of traffic ran (how much of each depends on the machine's pace: printed above), every request of
    # every burst was recorded, and soak_report.healthy: nothing lost or hung, no 429 but the refusals owed, no KV
    # held after the drain, no over-commit, every bad input answered as it should be, idle processes idle, every fault
    # injected and recovered from.
    kinds = collections.Counter(outcome.kind for outcome in report.outcomes)
    assert kinds["burst"] == 12 * len(report.burst_checks) >= 12, kinds
    assert kinds["stream"] and kinds["json"] and kinds["chat"], kinds
    assert report.disconnects and sum(report.bad_inputs.values()) >= len(soak_traffic.BAD_INPUTS), report
    assert [fault for fault, _, _ in report.recoveries] == list(soak_traffic.FAULTS)
    assert soak_report.healthy(report) == []
    # Both tenants were served, at more than one priority (which ones, and the shares, depend on the interleaving).
    levels = soak_report.outcomes_by_level(report)
    served = [level for level, counts in levels.items() if counts["200"]]
    assert {tenant for tenant, _ in served} == set(soak_traffic.TENANT_KEYS), levels
    assert len({priority for _, priority in served}) >= 2, levels
