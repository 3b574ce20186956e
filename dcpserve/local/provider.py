"""The node provider `make cluster` gives Ray's autoscaler: Ray's fake multi-node provider, which starts each "node"
as a raylet of its own on this machine with the resources its node type declares, with these changes:

- the head is tagged with the config's own head node type (ray_cluster.yaml's `head`), not the fake provider's fixed
  `ray.head.default`, so one set of node types serves both configs;
- each worker node carries its node type as the label `ray.io/node-group` (NODE_TYPE_LABEL, as KubeRay labels its
  node groups), so `ray list nodes` and the replicas' node metric say which type it is;
- every node it starts binds 127.0.0.1: the monitor that runs this provider inherits LOOPBACK_ENV from the head
  (dcpserve/local/serve.py), under which Ray resolves a node's own address to loopback, and the provider config
  names the head's GCS address on loopback (`gcs_address`; the stock default is the machine's routable address and
  port 6379);
- with mutual TLS (the head's environment names the cluster's TLS directory, dcpserve/local/tls.py TLS_DIR_ENV),
  each worker node runs as an identity of its own, issued from the cluster's CA when the node is created and
  checked before its raylet starts (a bad file stops the launch with its name, in the autoscaler's log).

Ray loads it by `provider: {type: external, module: dcpserve.local.provider.LocalNodeProvider}` in the monitor process
of the head (dcpserve/cluster/node_types.py writes that config), so the project must be importable there: it is, the
head runs from this checkout's venv.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

from dcpserve.cluster.node_types import NODE_TYPE_LABEL
from dcpserve.cluster.tls import ClusterCa, ClusterTls, check_identity
from dcpserve.local.tls import TLS_DIR_ENV

# Ray's fake provider starts a node's raylet with this process's environment (plus variables of its own it builds
# inside the call): a node's identity is set in os.environ for exactly that call, one node at a time.
_ENV_LOCK = threading.Lock()


@contextmanager
def _environment(updates: dict[str, str]) -> Iterator[None]:
    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in updates}
        os.environ.update(updates)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class LocalNodeProvider(FakeMultiNodeProvider):
    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        if not provider_config.get("gcs_address"):
            raise ValueError("LocalNodeProvider needs provider.gcs_address (the head's 127.0.0.1:<port>): without it "
                             "Ray's fake provider points new nodes at the machine's routable address, port 6379")
        super().__init__(provider_config, cluster_name)
        head_type = provider_config.get("head_node_type")
        if head_type:
            self._nodes[self._head_node_id]["tags"][TAG_RAY_USER_NODE_TYPE] = head_type
        tls_dir = os.environ.get(TLS_DIR_ENV)
        self._tls = ClusterTls(ClusterCa.load(Path(tls_dir))) if tls_dir else None
        self._launched = 0

    def _create_node_with_resources_and_labels(self, node_config: dict[str, Any], tags: dict[str, str], count: int,
                                               resources: dict[str, float], labels: dict[str, str]) -> None:
        labels = {**(labels or {}), NODE_TYPE_LABEL: tags[TAG_RAY_USER_NODE_TYPE]}
        self._launched += 1
        env: dict[str, str] = {}
        if self._tls is not None:
            identity = self._tls.identity(f"{tags[TAG_RAY_USER_NODE_TYPE]}-{self._launched}")
            check_identity(identity)
            env = identity.env()
        with _environment(env):
            super()._create_node_with_resources_and_labels(  # type: ignore[no-untyped-call]  # Ray's is untyped
                node_config, tags, count, resources, labels)
