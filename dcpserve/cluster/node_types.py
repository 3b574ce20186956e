"""The node types of a Ray cluster config (ray_cluster.yaml, or what `make cluster` starts), and whether a replica's
layout fits on one node of them.

A replica's ranks share one node: its placement group is STRICT_PACK (dcpserve/deployments/app.py), one bundle of {GPU:
1} per TP rank (DCP reuses the TP ranks). Spanning nodes would put the ranks' gloo / NCCL groups across the network for
every layer's all-reduce and every decode step's DCP all-to-all; nothing here supports it, so a layout that needs more
GPUs than any node type has is refused before deploy (`check_replica_fits`), with the node types and their GPUs named,
instead of a placement group that waits forever for a node that no type can be.

`local_cluster_config` merges ray_cluster.local.yaml over ray_cluster.yaml: the autoscaling config of `make cluster`
(dcpserve/local/nodes.py), so the local cluster has the cloud's node types, their GPUs and worker bounds.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The label a node's type is under: the local provider puts it on every worker node it starts (as KubeRay labels its
# node groups); replicas report it in their node metric (dcpserve/deployments/metrics.py).
NODE_TYPE_LABEL = "ray.io/node-group"

# Read by the app builder (dcpserve/deployments/app.py) on any node: the cluster config whose node types a deploy is
# checked against. `make cluster` sets it to the config it started the head with; ray_cluster.yaml sets it in its start
# commands to its own copy on every node.
CLUSTER_CONFIG_ENV = "DCPSERVE_CLUSTER_CONFIG"

# Keys of a cluster config the local provider cannot use: no SSH, no setup (every local node runs from this
# checkout's venv), no files to copy. They are emptied in the local config.
_CLOUD_ONLY_LISTS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                     "head_start_ray_commands", "worker_start_ray_commands", "cluster_synced_files", "rsync_exclude",
                     "rsync_filter")


@dataclass(frozen=True)
class NodeType:
    name: str
    gpus: int  # GPUs per node of this type (logical on the local cluster)
    max_workers: int  # how many nodes of this type the autoscaler may start (0 for the head)
    head: bool


class ReplicaDoesNotFit(ValueError):
    """No node type of the cluster can hold one replica's ranks on one node."""


def node_types(config: dict[str, Any]) -> list[NodeType]:
    """Every node type of a cluster config, head first."""
    head = config.get("head_node_type")
    types = []
    for name, spec in (config.get("available_node_types") or {}).items():
        resources = spec.get("resources") or {}
        max_workers = 0 if name == head else int(spec.get("max_workers", config.get("max_workers", 0)))
        types.append(NodeType(name=name, gpus=int(resources.get("GPU", 0)), max_workers=max_workers,
                              head=name == head))
    return sorted(types, key=lambda t: not t.head)


def check_replica_fits(types: list[NodeType], tp: int, dcp: int, source: str, pcp: int = 1) -> NodeType:
    """The node type with the most GPUs that can hold a replica of tp * pcp ranks on one node; ReplicaDoesNotFit
    naming every node type and its GPUs when none can (or none may be started)."""
    ranks = tp * pcp
    candidates = [t for t in types if t.gpus >= ranks and (t.head or t.max_workers > 0)]
    if candidates:
        return max(candidates, key=lambda t: t.gpus)
    listed = ", ".join(f"{t.name!r} has {t.gpus} GPU{'s' if t.gpus != 1 else ''}"
                       + ("" if t.head or t.max_workers > 0 else " but max_workers 0") for t in types)
    most = max((t.gpus for t in types if t.head or t.max_workers > 0), default=0)
    if pcp == 1:
        layout = f"tensor_parallel_size={tp} x decode_context_parallel_size={dcp}"
        fix = f"Lower tensor_parallel_size to at most {most} (DCP shards the KV within those ranks)"
    else:
        layout = (f"tensor_parallel_size={tp} x prefill_context_parallel_size={pcp} (decode_context_parallel_size="
                  f"{dcp})")
        fix = f"Lower tensor_parallel_size x prefill_context_parallel_size to at most {most}"
    raise ReplicaDoesNotFit(
        f"a replica at {layout} needs {ranks} GPUs on one node "
        f"(its ranks are placed STRICT_PACK), but no node type of {source} has that many: {listed or 'no node types'}. "
        f"{fix}, or add a node type with {ranks} GPUs or more")


def load_cluster_config(path: str | Path) -> dict[str, Any]:
    config = yaml.safe_load(Path(path).expanduser().read_text())
    if not isinstance(config, dict) or "available_node_types" not in config:
        raise ValueError(f"{path} is not a Ray cluster config: it has no available_node_types")
    return config


def cluster_config_from_env() -> tuple[dict[str, Any], str] | None:
    """(config, its path) of CLUSTER_CONFIG_ENV, or None when it is not set. A set path that cannot be read is an
    error, not a skipped check."""
    path = os.environ.get(CLUSTER_CONFIG_ENV)
    if not path:
        return None
    try:
        return load_cluster_config(path), path
    except OSError as err:
        raise ValueError(f"{CLUSTER_CONFIG_ENV}={path} cannot be read here ({err}): set it to the cluster config's "
                         "path on every node, or unset it") from err


def local_cluster_config(cloud: dict[str, Any], local: dict[str, Any], *, gcs_address: str,
                         worker_gpus: int | None = None, idle_timeout_s: float | None = None) -> dict[str, Any]:
    """The autoscaling config of the local cluster: `cloud` (ray_cluster.yaml) with `local` (ray_cluster.local.yaml)
    merged over it. Node types must be the cloud's (a local-only type is an error); their resources are updated key
    by key, so GPUs stay the cloud's unless worker_gpus says otherwise (every GPU worker type gets that many: the
    autoscaling test uses small nodes so that a second replica needs a second node)."""
    unknown = sorted(set(local.get("available_node_types") or {}) - set(cloud["available_node_types"]))
    if unknown:
        raise ValueError(f"ray_cluster.local.yaml names node types {unknown} that ray_cluster.yaml does not have "
                         f"({sorted(cloud['available_node_types'])}): the local cluster has the cloud's node types")
    config = copy.deepcopy(cloud)
    for key, value in local.items():
        if key not in ("available_node_types", "provider"):
            config[key] = copy.deepcopy(value)
    config["provider"] = {**copy.deepcopy(local["provider"]), "gcs_address": gcs_address,
                          "head_node_type": cloud["head_node_type"]}
    for name, spec in config["available_node_types"].items():
        spec["node_config"] = {}
        overlay = (local.get("available_node_types") or {}).get(name) or {}
        spec["resources"] = {**(spec.get("resources") or {}), **(overlay.get("resources") or {})}
        for key, value in overlay.items():
            if key != "resources":
                spec[key] = value
        if worker_gpus is not None and name != cloud["head_node_type"] and spec["resources"].get("GPU", 0) > 0:
            spec["resources"]["GPU"] = worker_gpus
    if idle_timeout_s is not None:
        config["idle_timeout_minutes"] = idle_timeout_s / 60
    for key in _CLOUD_ONLY_LISTS:
        config[key] = []
    config["file_mounts"] = {}
    config["file_mounts_sync_continuously"] = False
    config.setdefault("docker", {})
    return config
