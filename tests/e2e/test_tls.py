"""Ray's mutual TLS on the session's head, from the side of a node that wants in: a worker node started without the
TLS variables, or with a certificate of another CA, is refused by the head (its handshakes fail, it never registers),
while one with a certificate of the head's CA joins. The listeners of a running app and the absence of key material
from logs are checked beside that app (tests/e2e/test_serve_deploy.py); certificates that cannot work are refused
before any node starts (tests/cluster/test_tls.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.harness.cluster import RayHead, present
from dcpserve.cluster.tls import ClusterTls
from dcpserve.local.tls import without_tls

pytestmark = [pytest.mark.timeout(400)]
REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 180.0  # bounds, not expectations: each wait ends on a line of the node's output


@contextmanager
def worker_node(head: RayHead, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[str]]:
    """tests/e2e/join_node.py against the head, with env (token auth and loopback as the head's; TLS as given); its
    output in log. Ends it: a node that joined stops its own processes when its stdin closes; then, and at once for
    one that never joined, its process group goes."""
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "tests.e2e.join_node", head.address, str(head.temp_dir)],
                                   env=env, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                                   cwd=REPO_ROOT, start_new_session=True)
    try:
        yield process
    finally:
        assert process.stdin is not None
        process.stdin.close()
        if "JOINED" in log.read_text(errors="replace"):  # it stops its own processes; a refused one has none
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def wait_for_line(log: Path, process: subprocess.Popen[str], *needles: str) -> str:
    """The first of needles that the node's output shows (or AssertionError with that output)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        for needle in needles:
            if needle in text:
                return needle
        if process.poll() is not None:
            break
        time.sleep(0.25)
    raise AssertionError(f"none of {needles} from the node (exit {process.poll()}): {log.read_text()[-3000:]}")


def alive_node_ids() -> set[str]:
    import ray

    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


@pytest.mark.parametrize("who", ["no TLS variables", "another CA's certificate"])
def test_a_node_without_the_clusters_certificate_is_refused(ray_head: RayHead, tmp_path: Path, who: str) -> None:
    """Its connections to the GCS fail at the handshake (Ray says so, and keeps trying), and the head never lists
    it; the stranger's certificate is a valid one, of a CA of its own."""
    present(ray_head.tls, "TLS: the suite runs with it")
    before = alive_node_ids()
    env = without_tls(ray_head.env)
    if who == "another CA's certificate":
        env.update(ClusterTls.fresh(tmp_path / "another-ca").identity("stranger").env())
    else:
        env["RAY_USE_TLS"] = "0"
    log = tmp_path / "node.log"
    with worker_node(ray_head, env, log) as node:
        seen = wait_for_line(log, node, "Failed to connect to GCS", "JOINED")
        assert seen == "Failed to connect to GCS", log.read_text()[-3000:]
        assert alive_node_ids() == before
    assert "JOINED" not in log.read_text()


def test_a_node_with_a_certificate_of_the_clusters_ca_joins(ray_head: RayHead, tmp_path: Path) -> None:
    """The control of the test above: the same node, with an identity issued from the head's CA, registers (and
    leaves when it stops)."""
    tls = present(ray_head.tls, "TLS: the suite runs with it")
    before = alive_node_ids()
    env = {**without_tls(ray_head.env), **tls.identity("joining-node").env()}
    log = tmp_path / "node.log"
    with worker_node(ray_head, env, log) as node:
        assert wait_for_line(log, node, "JOINED", "Failed to connect to GCS") == "JOINED", log.read_text()[-3000:]
        node_id = log.read_text().split("JOINED ", 1)[1].split()[0]
        assert node_id in alive_node_ids() - before
    deadline = time.monotonic() + WAIT_S
    while node_id in alive_node_ids():
        assert time.monotonic() < deadline, "the node that stopped is still listed alive"
        time.sleep(0.5)
