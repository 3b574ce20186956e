"""Mutual TLS for the Ray clusters dcpserve starts on this machine (`make serve`, `make cluster`, the tests' and
benches' heads): a fresh CA per cluster, and the Ray identity of the processes that join one as drivers.

A cluster: `cluster_tls(state_dir)` makes state_dir/tls (0700) anew at every start, with a new CA: nothing of an
earlier cluster is reused. The head runs as `head`, each worker node `make cluster`'s autoscaler adds as a node of its
own (dcpserve/local/provider.py), the user's CLI as `client` (the banner prints its variables, never a key).

A driver (a process that calls ray.init: the test session, a benchmark): Ray's C++ core reads RAY_USE_TLS and the
certificate paths once, when ray is imported, and reads the files themselves each time it opens a connection. So
`prepare_driver_tls()` (before ray is imported, as `bind_ray_to_loopback`) points those variables at a slot of this
process's own, a private temporary directory; `join_cluster_tls(tls)` puts an identity of the cluster it is about to
join there (issued from that cluster's CA), so one process can join the clusters it starts one after another.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from dcpserve.cluster.tls import (
    CA_CERT,
    SERVER_CERT,
    SERVER_KEY,
    TLS_OFF_WARNING,
    TLS_VARIABLES,
    USE_TLS,
    ClusterTls,
    Identity,
    TlsConfigError,
    tls_enabled,
)

# Set with a process's TLS slot (prepare_driver_tls): its children inherit the slot's variables, and a child that
# prepares a slot of its own replaces them instead of mistaking them for certificates the user set.
SLOT_ENV = "DCPSERVE_DRIVER_TLS_SLOT"
# The variable that names a cluster's TLS directory to the processes of its head that issue identities: the local
# node provider (one per worker node it starts).
TLS_DIR_ENV = "DCPSERVE_TLS_DIR"


def tls_setting() -> bool:
    """DCPSERVE_TLS, read once into a cluster's settings: SystemExit naming a value that is neither 0 nor 1."""
    try:
        return tls_enabled(os.environ)
    except TlsConfigError as err:
        raise SystemExit(str(err)) from None


def cluster_tls(state_dir: Path, enabled: bool, warn: Callable[[str], None]) -> ClusterTls | None:
    """The TLS of a cluster about to start: a fresh CA in state_dir/tls, or None (and TLS_OFF_WARNING through warn)
    when not enabled (DCPSERVE_TLS=0)."""
    if not enabled:
        warn(f"WARNING: {TLS_OFF_WARNING}")
        return None
    return ClusterTls.fresh(state_dir / "tls")


def node_env(tls: ClusterTls | None, name: str) -> dict[str, str]:
    """The environment of a Ray node (or CLI) of this cluster running as identity `name`: Ray's TLS variables, and
    TLS_DIR_ENV for the head's node provider. Without TLS: RAY_USE_TLS=0, so that nothing inherited turns it on."""
    if tls is None:
        return {USE_TLS: "0"}
    return {**tls.identity(name).env(), TLS_DIR_ENV: str(tls.directory)}


def without_tls(env: dict[str, str]) -> dict[str, str]:
    """env without any of Ray's TLS variables, TLS_DIR_ENV or SLOT_ENV (a cluster's processes never inherit a
    driver's)."""
    return {key: value for key, value in env.items() if key not in (*TLS_VARIABLES, TLS_DIR_ENV, SLOT_ENV)}


def export_line(identity_env: dict[str, str]) -> str:
    """`KEY=value ...` of the TLS variables in identity_env, for a banner's export line (paths only)."""
    return " ".join(f"{key}={identity_env[key]}" for key in TLS_VARIABLES if key in identity_env)


class DriverTls:
    """This process's Ray identity slot: the paths Ray reads certificates from, filled per cluster it joins."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.identity = Identity(directory / "node.crt", directory / "node.key", directory / "ca.crt")

    def fill(self, tls: ClusterTls) -> None:
        """An identity of tls's cluster in the slot (replacing the last cluster's), each file replaced at once."""
        issued = tls.identity(f"driver-{os.getpid()}")
        for source, target in ((issued.cert, self.identity.cert), (issued.key, self.identity.key),
                               (issued.ca_cert, self.identity.ca_cert)):
            staged = target.with_suffix(".new")
            staged.unlink(missing_ok=True)
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(source.read_bytes())
            os.replace(staged, target)


_slot: DriverTls | None = None


def prepare_driver_tls() -> DriverTls | None:
    """Call before ray is imported: this process's Ray uses mutual TLS with a slot of its own (DriverTls), unless
    DCPSERVE_TLS=0 or the environment already sets RAY_USE_TLS (a driver of a cluster the user runs, with the
    user's certificates; a parent's slot, inherited, does not count). Idempotent."""
    global _slot
    if _slot is not None:
        return _slot
    inherited_slot = SLOT_ENV in os.environ
    if USE_TLS in os.environ and not inherited_slot:
        return None
    if not tls_enabled(os.environ):
        if inherited_slot:  # a parent's slot, in a process told to run without TLS: none of it applies
            for key in (*TLS_VARIABLES, SLOT_ENV):
                os.environ.pop(key, None)
        return None
    if "ray" in sys.modules or "ray._raylet" in sys.modules:
        raise RuntimeError("ray was imported before prepare_driver_tls(): Ray reads RAY_USE_TLS once, at import; "
                           "call it first, or set RAY_USE_TLS (and its certificate variables) in the environment")
    directory = Path(tempfile.mkdtemp(prefix="dcpserve-driver-tls-"))  # 0700
    atexit.register(shutil.rmtree, directory, True)
    _slot = DriverTls(directory)
    os.environ.update({**_slot.identity.env(), SLOT_ENV: str(directory)})
    return _slot


def local_ray_tls(directory: Path, warn: Callable[[str], None]) -> None:
    """Before ray.init(address="local") (a benchmark's own Ray instance, started in this process): a fresh CA in
    directory/tls, and this process's slot as the instance's identity (its processes inherit the slot's variables);
    nothing with DCPSERVE_TLS=0."""
    join_cluster_tls(cluster_tls(directory, tls_setting(), warn))


def join_cluster_tls(tls: ClusterTls | None) -> None:
    """Before this process joins (or starts, with ray.init(address="local")) a cluster dcpserve made with tls: puts
    an identity of that cluster in this process's slot. Refuses what cannot work: Ray's TLS setting was fixed when
    ray was imported."""
    if tls is None:
        if os.environ.get(USE_TLS, "0").lower() in ("1", "true"):
            raise RuntimeError("this cluster runs without TLS (DCPSERVE_TLS=0), but this process imported ray with "
                               f"{USE_TLS}=1: set DCPSERVE_TLS=0 before the process starts")
        return
    if _slot is None:
        raise RuntimeError("this cluster runs with mutual TLS, but this process has no TLS slot: call "
                           "dcpserve.local.tls.prepare_driver_tls() before importing ray (or set DCPSERVE_TLS=0 for "
                           "every cluster and process)")
    if os.environ.get(SERVER_CERT) != str(_slot.identity.cert) or os.environ.get(SERVER_KEY) != str(
            _slot.identity.key) or os.environ.get(CA_CERT) != str(_slot.identity.ca_cert):
        raise RuntimeError(f"{SERVER_CERT}, {SERVER_KEY} or {CA_CERT} changed after prepare_driver_tls(): Ray read "
                           "them at import")
    _slot.fill(tls)
