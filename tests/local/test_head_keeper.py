"""The pieces of `make cluster`'s head supervision that need no cluster: when the keeper gives up on a GCS that keeps
exiting, the settings it runs with (bad values refused naming the variable), and the distinct ports the head takes.
tests/local kills the real GCS."""

from __future__ import annotations

import pytest

from dcpserve.local import head_keeper
from dcpserve.local import nodes as local_nodes
from dcpserve.local import serve as local_serve


def gcs_restarted_at(*times: float) -> head_keeper.Gcs:
    return head_keeper.Gcs(pid=1, cmdline=["gcs_server"], env={}, cwd="/", restarts=list(times))


def test_the_keeper_gives_up_only_on_quick_exits_after_each_of_the_last_restarts() -> None:
    quick = head_keeper.QUICK_EXIT_S
    now = 1000.0
    assert not gcs_restarted_at().restarting_too_often(now)  # never restarted: this is its first exit
    assert not gcs_restarted_at(now - 1, now - 0.5).restarting_too_often(now)  # fewer than GCS_MAX_QUICK_RESTARTS
    three_quick = [now - 3, now - 2, now - 1][-head_keeper.GCS_MAX_QUICK_RESTARTS:]
    assert gcs_restarted_at(*three_quick).restarting_too_often(now)
    # One run in between lasted long: the GCS can run here, so it is started again.
    assert not gcs_restarted_at(now - 3 * quick, now - 2, now - 1).restarting_too_often(now)
    # The latest restart ran long before this exit.
    assert not gcs_restarted_at(now - 3 * quick, now - 2 * quick - 1, now - quick - 1).restarting_too_often(now)


@pytest.mark.parametrize(("variable", "value", "named"), [
    ("DCPSERVE_GCS_RESTART_DELAY_S", "45", "DCPSERVE_GCS_RESTART_DELAY_S must be within 0-30"),
    ("DCPSERVE_GCS_RESTART_DELAY_S", "soon", "DCPSERVE_GCS_RESTART_DELAY_S"),
    ("DCPSERVE_GCS_FT", "yes", "DCPSERVE_GCS_FT must be 1"),
])
def test_bad_gcs_settings_are_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, variable: str,
                                                          value: str, named: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit, match=named):
        local_nodes.ClusterSettings.from_env()


def test_the_keeper_command_has_redis_only_with_fault_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCPSERVE_GCS_RESTART_DELAY_S", "7")
    settings = local_nodes.ClusterSettings.from_env()
    command = settings.keeper()
    assert command[command.index("--gcs-port") + 1] == str(settings.base.ray_port)
    assert command[command.index("--gcs-restart-delay-s") + 1] == "7.0"
    assert command[command.index("--redis-port") + 1] == "0"  # the keeper's choice, once the head's are known
    monkeypatch.setenv("DCPSERVE_GCS_FT", "0")
    assert "--redis-port" not in local_nodes.ClusterSettings.from_env().keeper()


def test_redis_takes_none_of_the_heads_ports() -> None:
    command = ["ray", "start", "--head", "--port", "6380", "--dashboard-port", "8266", "--metrics-export-port",
               "9100", "--num-gpus", "2", "--temp-dir", "/tmp/x"]
    env = {"AUTOSCALER_METRIC_PORT": "44300", "DASHBOARD_METRIC_PORT": "44301", "PATH": "/bin"}
    assert head_keeper.head_ports(command, env) == {6380, 8266, 9100, 44300, 44301}


def test_free_ports_are_distinct_and_skip_the_excluded() -> None:
    taken = local_serve.free_ports(3)
    ports = local_serve.free_ports(40, exclude=taken)
    assert len(set(ports)) == 40 and not set(ports) & set(taken)
