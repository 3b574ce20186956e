"""What a cluster's processes listen on, and whether a listener lets in a peer without the cluster's keys: the
listener tests (tests/e2e/test_serve_deploy.py for the session head, tests/local for `make cluster`) and the same
check by hand (`python -m bench.harness.listeners PID...`).

Every probe connects over loopback only, never to the machine's outward address: a socket bound to every interface
(0.0.0.0, ::) is reached at 127.0.0.1 as well as anywhere else, and what it refuses there it refuses everywhere (a
TLS server checks certificates, not addresses).
"""

from __future__ import annotations

import os
import queue
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcpserve.cluster.tls import ClusterTls, Identity

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
WILDCARD = {"0.0.0.0", "::", "*"}


@dataclass(frozen=True)
class Socket:
    pid: int
    name: str  # the process's command line, cut
    local_ip: str
    port: int
    remote_ip: str | None  # None: listening


def session_processes(session_id: int) -> list[int]:
    """Pids of every process of a session (`ray start` begins one for its head, and every node the local
    autoscaler starts is in it too)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session_id:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def process_sockets(pids: list[int]) -> list[Socket]:
    """Every TCP socket of these processes that listens or is connected."""
    import psutil

    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            name = " ".join(process.cmdline())[:100] or process.name()
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN:
                    found.append(Socket(pid, name, connection.laddr.ip, connection.laddr.port, None))
                elif connection.raddr:
                    found.append(Socket(pid, name, connection.laddr.ip, connection.laddr.port, connection.raddr.ip))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def tls_accepts(port: int, ca_cert: Path, client: Identity | None, timeout_s: float = 30) -> bool:
    """Whether the server on 127.0.0.1:port completes a TLS session with this client certificate (None: none) and
    then speaks: a gRPC server sends its HTTP/2 settings first. The server's own certificate must be one of ca_cert's
    (a listener that speaks no TLS, or another CA's, fails here). With TLS 1.3 a server that refuses the client's
    certificate does so after the client's half of the handshake: its alert (or a closed connection) arrives in
    place of the settings."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=str(ca_cert))
    context.set_alpn_protocols(["h2"])
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return len(tls.recv(9)) > 0  # an HTTP/2 frame header
    except (ssl.SSLError, ConnectionError):
        return False


def grpc_channel_state(port: int, client: Identity | None, timeout_s: float = 60) -> str:
    """'READY' or 'TRANSIENT_FAILURE': where a gRPC channel to 127.0.0.1:port first settles, with this client
    identity (its certificate, key and the CA it trusts) or plain (None). Waits for the state, not for a time."""
    import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints

    if client is None:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=client.ca_cert.read_bytes(),
                                                   private_key=client.key.read_bytes(),
                                                   certificate_chain=client.cert.read_bytes())
        channel = grpc.secure_channel(f"127.0.0.1:{port}", credentials)
    states: queue.Queue[Any] = queue.Queue()
    channel.subscribe(states.put, try_to_connect=True)
    try:
        while True:
            state = states.get(timeout=timeout_s)
            if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
                return str(state.name)
    finally:
        channel.close()


@dataclass(frozen=True)
class Verdict:
    """How one listener answered the probes."""

    socket: Socket
    problem: str | None  # None: on loopback, or it lets in the cluster's certificate only


def judge_listeners(sockets: list[Socket], cluster: Identity, stranger: Identity) -> list[Verdict]:
    """Each listening socket: fine on loopback; on every interface, fine only when a TLS session with the cluster's
    certificate is accepted and one without a certificate, or with `stranger` (another CA's), is refused; bound to
    one routable address: a problem (nothing of a local cluster should be, and loopback cannot reach it)."""
    verdicts = []
    for listener in sockets:
        if listener.remote_ip is not None or listener.local_ip in LOOPBACK:
            verdicts.append(Verdict(listener, None))
            continue
        if listener.local_ip not in WILDCARD:
            verdicts.append(Verdict(listener, f"bound to the routable address {listener.local_ip}"))
            continue
        problems = []
        if not tls_accepts(listener.port, cluster.ca_cert, cluster):
            problems.append("no TLS session with the cluster's own certificate")
        if tls_accepts(listener.port, cluster.ca_cert, None):
            problems.append("a TLS session without a client certificate")
        if tls_accepts(listener.port, cluster.ca_cert, stranger):
            problems.append("a TLS session with another CA's certificate")
        verdicts.append(Verdict(listener, "; ".join(problems) or None))
    return verdicts


def assert_only_the_clusters_certificate(sockets: list[Socket], tls: ClusterTls, grpc_ports: dict[int, int],
                                         scratch: Path) -> list[Verdict]:
    """The listener check both cluster tests make: every listening socket on loopback or letting in the cluster's
    certificate only (judge_listeners, a stranger from a CA made under scratch), the replicas' gRPC ports among
    those probed, and a gRPC channel to each settling TRANSIENT_FAILURE plain and with the stranger's certificate,
    READY with the cluster's. Returns the verdicts."""
    ours = tls.identity("listener-probe")
    stranger = ClusterTls.fresh(scratch / "another-ca").identity("stranger")
    verdicts = judge_listeners([s for s in sockets if s.remote_ip is None], ours, stranger)
    assert [v for v in verdicts if v.problem] == [], verdicts
    probed = {(v.socket.pid, v.socket.port) for v in verdicts if v.socket.local_ip not in LOOPBACK}
    assert set(grpc_ports.items()) <= probed, (grpc_ports, verdicts)
    stranger_trusting_ours = Identity(stranger.cert, stranger.key, ours.ca_cert)  # its own key, our CA's server
    for port in grpc_ports.values():
        assert grpc_channel_state(port, None) == "TRANSIENT_FAILURE", port  # plain gRPC
        assert grpc_channel_state(port, stranger_trusting_ours) == "TRANSIENT_FAILURE", port
        assert grpc_channel_state(port, ours) == "READY", port
    return verdicts


def key_leaks(tls_directory: Path, texts: dict[str, str]) -> list[tuple[str, str]]:
    """(text's name, the line's first characters) of every line of every private key under tls_directory that
    appears in one of texts (logs, banners, metrics, replies)."""
    secrets = {line for key in tls_directory.rglob("*.key") for line in key.read_text().splitlines()
               if line and not line.startswith("-----")}
    assert secrets and all(len(line) >= 16 for line in secrets), "no key, or a key line too short to search for"
    return sorted((name, line[:12]) for name, text in texts.items() for line in secrets if line in text)
