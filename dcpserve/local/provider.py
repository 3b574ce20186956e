"""The node provider `make cluster` gives Ray's autoscaler: Ray's fake multi-node provider, which starts each "node"
as a raylet of its own on this machine with the resources its node type declares, with two changes:

- the head is tagged with the config's own head node type (ray_cluster.yaml's `head`), not the fake provider's fixed
  `ray.head.default`, so one set of node types serves both configs;
- each worker node carries its node type as the label `ray.io/node-group` (NODE_TYPE_LABEL, as KubeRay labels its
  node groups), so `ray list nodes` and the replicas' node metric say which type it is;
- every node it starts binds 127.0.0.1: the monitor that runs this provider inherits LOOPBACK_ENV from the head
  (dcpserve/local/serve.py), under which Ray resolves a node's own address to loopback, and the provider config
  names the head's GCS address on loopback (`gcs_address`; the stock default is the machine's routable address and
  port 6379).

Ray loads it by `provider: {type: external, module: dcpserve.local.provider.LocalNodeProvider}` in the monitor process
of the head (dcpserve/cluster/node_types.py writes that config), so the project must be importable there: it is, the
head runs from this checkout's venv.
"""

from __future__ import annotations

from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

from dcpserve.cluster.node_types import NODE_TYPE_LABEL


class LocalNodeProvider(FakeMultiNodeProvider):
    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        if not provider_config.get("gcs_address"):
            raise ValueError("LocalNodeProvider needs provider.gcs_address (the head's 127.0.0.1:<port>): without it "
                             "Ray's fake provider points new nodes at the machine's routable address, port 6379")
        super().__init__(provider_config, cluster_name)
        head_type = provider_config.get("head_node_type")
        if head_type:
            self._nodes[self._head_node_id]["tags"][TAG_RAY_USER_NODE_TYPE] = head_type

    def _create_node_with_resources_and_labels(self, node_config: dict[str, Any], tags: dict[str, str], count: int,
                                               resources: dict[str, float], labels: dict[str, str]) -> None:
        labels = {**(labels or {}), NODE_TYPE_LABEL: tags[TAG_RAY_USER_NODE_TYPE]}
        super()._create_node_with_resources_and_labels(  # type: ignore[no-untyped-call]  # Ray's provider is untyped
            node_config, tags, count, resources, labels)
