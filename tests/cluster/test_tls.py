"""The cluster's PKI (dcpserve/cluster/tls.py), the `dcpserve tls` commands and the local clusters' TLS settings
(dcpserve/local/tls.py): keys private from the moment they exist, a CA never reused, every certificate that cannot
work refused before a node starts, with the file's name and never its contents."""

from __future__ import annotations

import datetime
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dcpserve.cli import main as dcpserve_main
from dcpserve.cluster.tls import (
    ClusterCa,
    ClusterTls,
    Identity,
    TlsConfigError,
    check_env,
    check_identity,
    tls_enabled,
)
from dcpserve.local import tls as local_tls

NOW = datetime.datetime.now(datetime.UTC)


def key_lines(*paths: Path) -> set[str]:
    return {line for path in paths for line in path.read_text().splitlines() if line and not line.startswith("-")}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def cluster(tmp_path: Path) -> ClusterTls:
    return ClusterTls.fresh(tmp_path / "tls")


def test_a_cluster_ca_and_identities_are_private_and_valid(cluster: ClusterTls) -> None:
    node = cluster.identity("head", addresses=["10.0.0.7", "node-7.internal"])
    assert mode(cluster.directory) == 0o700 and mode(cluster.ca.key) == 0o600
    assert mode(node.key.parent) == 0o700 and mode(node.key) == 0o600
    check_identity(node)
    assert cluster.identity("head") == node  # issued once, asked for again
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(node.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", "::1", "10.0.0.7"}
    assert "node-7.internal" in names.get_values_for_type(x509.DNSName)
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
    assert node.env() == {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(node.cert),
                          "RAY_TLS_SERVER_KEY": str(node.key), "RAY_TLS_CA_CERT": str(cluster.ca.cert)}


def test_a_ca_is_never_reused(cluster: ClusterTls, tmp_path: Path) -> None:
    with pytest.raises(TlsConfigError, match="already holds a CA"):
        ClusterCa.create(cluster.directory)
    old = cluster.ca.cert.read_bytes()
    fresh = ClusterTls.fresh(cluster.directory)  # a new cluster in the same place: new keys, nothing of the old
    assert fresh.ca.cert.read_bytes() != old and not (cluster.directory / "head").exists()


def bad(identity: Identity, match: str, *names: Path) -> None:
    """check_identity refuses identity with a message matching `match` that names each of names and contains no
    line of any key."""
    with pytest.raises(TlsConfigError, match=match) as caught:
        check_identity(identity)
    message = str(caught.value)
    for name in names:
        assert str(name) in message, message
    for line in key_lines(identity.key) if identity.key.is_file() else ():
        assert line not in message


def test_every_certificate_that_cannot_work_is_refused_with_its_files_name(cluster: ClusterTls,
                                                                          tmp_path: Path) -> None:
    good = cluster.identity("node")
    bad(Identity(tmp_path / "missing.crt", good.key, good.ca_cert), "does not exist", tmp_path / "missing.crt")
    unreadable = tmp_path / "a-directory.key"
    unreadable.mkdir()  # unreadable as a file even to root (the tests may run as root: chmod 000 would not do)
    bad(Identity(good.cert, unreadable, good.ca_cert), "cannot be read", unreadable)
    not_pem = tmp_path / "not-pem.crt"
    not_pem.write_text("hello")
    bad(Identity(not_pem, good.key, good.ca_cert), "not a PEM certificate", not_pem)
    expired = cluster.ca.issue(tmp_path / "expired", "old", valid_days=1,
                               not_before=NOW - datetime.timedelta(days=3))
    bad(expired, "expired on", expired.cert)
    future = cluster.ca.issue(tmp_path / "future", "early", not_before=NOW + datetime.timedelta(days=2))
    bad(future, "not valid before", future.cert)
    stranger = ClusterTls.fresh(tmp_path / "another-ca").identity("stranger")
    bad(Identity(stranger.cert, stranger.key, good.ca_cert), "not signed by the CA", stranger.cert, good.ca_cert)
    bad(Identity(good.cert, stranger.key, good.ca_cert), "not the key of the certificate", stranger.key, good.cert)


def test_check_env_names_what_is_missing(cluster: ClusterTls) -> None:
    assert check_env({}) is None and check_env({"RAY_USE_TLS": "0"}) is None
    with pytest.raises(TlsConfigError, match="RAY_TLS_SERVER_KEY, RAY_TLS_CA_CERT are not set"):
        check_env({"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": "x.crt"})
    node = cluster.identity("node")
    assert check_env(node.env()) == node


def test_the_tls_switch_is_on_unless_exactly_0() -> None:
    assert tls_enabled({}) and tls_enabled({"DCPSERVE_TLS": "1"}) and not tls_enabled({"DCPSERVE_TLS": "0"})
    with pytest.raises(TlsConfigError, match="DCPSERVE_TLS must be 1 .* or 0 .*, got 'off'"):
        tls_enabled({"DCPSERVE_TLS": "off"})  # a typo never turns it off


def test_a_cluster_of_tls_off_warns_what_is_exposed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    assert local_tls.cluster_tls(tmp_path, False, warnings.append) is None
    assert "inter-deployment server listens on every interface" in warnings[0] and "unpickles" in warnings[0]
    made = local_tls.cluster_tls(tmp_path, True, warnings.append)
    assert made is not None and len(warnings) == 1 and made.directory == tmp_path / "tls"
    assert local_tls.node_env(None, "head") == {"RAY_USE_TLS": "0"}
    env = local_tls.node_env(made, "head")
    assert env["RAY_TLS_SERVER_CERT"] == str(made.directory / "head" / "node.crt")
    assert local_tls.without_tls({**env, "PATH": "/bin"}) == {"PATH": "/bin"}


def test_a_driver_slot_takes_each_clusters_identity_in_turn(tmp_path: Path) -> None:
    """The slot's paths stay (Ray read them at import); the files become an identity of each cluster joined."""
    slot = local_tls.DriverTls(tmp_path / "slot")
    slot.directory.mkdir(mode=0o700)
    first, second = ClusterTls.fresh(tmp_path / "one"), ClusterTls.fresh(tmp_path / "two")
    slot.fill(first)
    check_identity(slot.identity)
    assert slot.identity.ca_cert.read_bytes() == first.ca.cert.read_bytes() and mode(slot.identity.key) == 0o600
    slot.fill(second)
    check_identity(slot.identity)
    assert slot.identity.ca_cert.read_bytes() == second.ca.cert.read_bytes()


def test_dcpserve_tls_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """ca, then node, then check with what node printed; check refuses another CA's certificate and, with
    --require, a node without the variables; nothing printed holds a line of a key."""
    ca_dir, out = tmp_path / "ca", tmp_path / "node"
    assert dcpserve_main(["tls", "ca", str(ca_dir)]) == 0
    assert dcpserve_main(["tls", "ca", str(ca_dir)]) == 2  # never overwritten
    assert dcpserve_main(["tls", "node", "--ca", str(ca_dir), "--out", str(out), "--address", "10.1.2.3"]) == 0
    printed = capsys.readouterr()
    export = next(line for line in printed.out.splitlines() if line.startswith("export "))
    for item in export.removeprefix("export ").split():
        monkeypatch.setenv(*item.split("=", 1))
    assert dcpserve_main(["tls", "check", "--require"]) == 0
    stranger = ClusterTls.fresh(tmp_path / "stranger").identity("x")
    monkeypatch.setenv("RAY_TLS_SERVER_CERT", str(stranger.cert))
    monkeypatch.setenv("RAY_TLS_SERVER_KEY", str(stranger.key))
    assert dcpserve_main(["tls", "check"]) == 2
    refused = capsys.readouterr()
    assert f"{stranger.cert} (RAY_TLS_SERVER_CERT) is not signed by the CA" in refused.err
    for name in ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
        monkeypatch.delenv(name)
    assert dcpserve_main(["tls", "check"]) == 0
    assert dcpserve_main(["tls", "check", "--require"]) == 2
    everything = printed.out + printed.err + refused.out + refused.err + "".join(capsys.readouterr())
    for line in key_lines(ca_dir / "ca.key", out / "node.key", stranger.key):
        assert line not in everything


def test_a_process_imports_ray_after_its_slot_is_ready() -> None:
    """prepare_driver_tls() in a fresh process: the slot's variables set before ray's import, a parent's slot
    replaced by the child's own (or dropped with DCPSERVE_TLS=0), and a refusal once ray is imported first."""
    script = ("import os; os.environ['DCPSERVE_DRIVER_TLS_SLOT'] = '/parent'; os.environ['RAY_USE_TLS'] = '1'; "
              "from dcpserve.local.tls import prepare_driver_tls; slot = prepare_driver_tls(); "
              "assert slot is not None and os.environ['RAY_TLS_CA_CERT'] == str(slot.identity.ca_cert); "
              "assert os.environ['DCPSERVE_DRIVER_TLS_SLOT'] == str(slot.directory); print('ok')")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_TLS", "DCPSERVE_DRIVER"))}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    off = ("import os; os.environ.update(DCPSERVE_DRIVER_TLS_SLOT='/parent', RAY_USE_TLS='1', DCPSERVE_TLS='0'); "
           "from dcpserve.local.tls import prepare_driver_tls; assert prepare_driver_tls() is None; "
           "assert 'RAY_USE_TLS' not in os.environ and 'DCPSERVE_DRIVER_TLS_SLOT' not in os.environ; print('ok')")
    done = subprocess.run([sys.executable, "-c", off], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr  # a parent's slot, TLS off: dropped
    late = ("import ray, dcpserve.local.tls as t\ntry:\n    t.prepare_driver_tls()\nexcept RuntimeError as e:\n"
            "    print('refused', 'ray was imported before prepare_driver_tls' in str(e))")
    env.pop("RAY_USE_TLS", None)
    done = subprocess.run([sys.executable, "-c", late], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "refused True", done.stdout + done.stderr


def test_ray_cluster_yaml_issues_each_nodes_certificate_and_checks_it_before_ray_start(tmp_path: Path) -> None:
    """ray_cluster.yaml's own TLS commands, run by bash as a node runs them (its home moved under tmp_path): the
    operator's CA in file_mounts, the node's certificate issued at setup and loaded by every start command, whose
    check passes; the same start command with another CA's certificate in tls.env stops before `ray start`."""
    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "ray_cluster.yaml").read_text())
    home = "/home/ubuntu"
    assert config["file_mounts"][f"{home}/.dcpserve/tls-ca"] == "~/.dcpserve/tls-ca"
    tls_setup = [command for command in config["setup_commands"] if "tls" in command and "bashrc" not in command]
    starts = [command for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for command in config[key] if "ray start" in command]
    assert len(tls_setup) == 2 and len(starts) == 2
    check = f". {home}/.dcpserve/tls.env && python3 -m dcpserve tls check --require && "
    assert all(command.startswith(check) for command in starts), starts

    def bash(command: str) -> subprocess.CompletedProcess[str]:
        command = command.replace(home, str(tmp_path)).replace("python3 -m", f"{sys.executable} -m")
        env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_TLS", "RAY_USE_TLS"))}
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, env=env)

    assert dcpserve_main(["tls", "ca", str(tmp_path / ".dcpserve" / "tls-ca")]) == 0  # the operator, before `ray up`
    for command in tls_setup:
        done = bash(command)
        assert done.returncode == 0, done.stderr
    assert mode(tmp_path / ".dcpserve" / "tls-node" / "node.key") == 0o600
    checked = bash(check.removesuffix(" && ") + " && echo started")
    assert checked.returncode == 0 and "started" in checked.stdout, checked.stderr
    stranger = ClusterTls.fresh(tmp_path / "stranger").identity("x")
    env_file = tmp_path / ".dcpserve" / "tls.env"
    node_dir = tmp_path / ".dcpserve" / "tls-node"
    env_file.write_text(env_file.read_text().replace(str(node_dir / "node.crt"), str(stranger.cert))
                        .replace(str(node_dir / "node.key"), str(stranger.key)))
    refused = bash(check.removesuffix(" && ") + " && echo started")
    assert refused.returncode != 0 and "started" not in refused.stdout
    assert f"{stranger.cert} (RAY_TLS_SERVER_CERT) is not signed by the CA" in refused.stderr
