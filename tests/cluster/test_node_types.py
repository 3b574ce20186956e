"""The local cluster's config agrees with ray_cluster.yaml, and a replica layout no node type can hold is refused
with the node types, their GPUs and the layout named (dcpserve/cluster/node_types.py, dcpserve/deployments/app.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dcpserve.cluster.node_types import (
    CLUSTER_CONFIG_ENV,
    NodeType,
    ReplicaDoesNotFit,
    check_replica_fits,
    cluster_config_from_env,
    local_cluster_config,
    node_types,
)

REPO = Path(__file__).resolve().parents[2]
CLOUD = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
LOCAL = yaml.safe_load((REPO / "ray_cluster.local.yaml").read_text())


def test_local_cluster_has_the_cloud_node_types_and_is_valid_for_ray() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = local_cluster_config(CLOUD, LOCAL, gcs_address="127.0.0.1:6390")
    validate_config(prepare_config(config))
    assert set(config["available_node_types"]) == set(CLOUD["available_node_types"])
    assert config["head_node_type"] == CLOUD["head_node_type"]
    for name, cloud_type in CLOUD["available_node_types"].items():
        local_type = config["available_node_types"][name]
        assert local_type["resources"].get("GPU", 0) == cloud_type["resources"].get("GPU", 0), name
        assert local_type.get("min_workers") == cloud_type.get("min_workers"), name
        assert local_type.get("max_workers") == cloud_type.get("max_workers"), name
        assert local_type["resources"].get("CPU", 0) > 0, f"{name}: a local node has only the CPUs it declares"
        assert local_type["node_config"] == {}
    assert config["max_workers"] == CLOUD["max_workers"]
    provider = config["provider"]
    assert provider["module"] == "dcpserve.local.provider.LocalNodeProvider"
    assert provider["gcs_address"] == "127.0.0.1:6390" and provider["head_node_type"] == CLOUD["head_node_type"]
    # Nothing of the cloud path runs locally: no SSH setup, no installs on nodes, no files copied.
    assert config["setup_commands"] == [] and config["worker_start_ray_commands"] == [] and config["file_mounts"] == {}


def test_local_overrides_worker_gpus_and_idle_timeout_only() -> None:
    config = local_cluster_config(CLOUD, LOCAL, gcs_address="127.0.0.1:1", worker_gpus=2, idle_timeout_s=30)
    assert config["available_node_types"]["gpu_worker"]["resources"]["GPU"] == 2
    assert config["available_node_types"]["head"]["resources"].get("GPU", 0) == 0  # the head keeps none
    assert config["idle_timeout_minutes"] == 0.5


def test_local_config_refuses_a_node_type_the_cloud_lacks() -> None:
    local = {**LOCAL, "available_node_types": {"tpu_worker": {"resources": {"CPU": 1}}}}
    with pytest.raises(ValueError, match=r"tpu_worker.*ray_cluster.yaml does not have"):
        local_cluster_config(CLOUD, local, gcs_address="127.0.0.1:1")


def test_node_types_of_ray_cluster_yaml() -> None:
    assert node_types(CLOUD) == [NodeType("head", 0, 0, True), NodeType("gpu_worker", 8, 2, False)]


def test_a_replica_fits_on_the_node_type_with_enough_gpus() -> None:
    assert check_replica_fits(node_types(CLOUD), tp=8, dcp=8, source="ray_cluster.yaml").name == "gpu_worker"


def test_a_replica_wider_than_every_node_is_refused_naming_node_types_gpus_and_layout() -> None:
    with pytest.raises(ReplicaDoesNotFit) as err:
        check_replica_fits(node_types(CLOUD), tp=16, dcp=4, source="ray_cluster.yaml")
    message = str(err.value)
    for part in ("tensor_parallel_size=16", "decode_context_parallel_size=4", "16 GPUs on one node",
                 "'gpu_worker' has 8 GPUs", "'head' has 0 GPUs", "at most 8", "ray_cluster.yaml"):
        assert part in message, (part, message)


def test_a_pcp_replica_needs_tp_times_pcp_gpus_on_one_node() -> None:
    assert check_replica_fits(node_types(CLOUD), tp=4, dcp=2, source="c.yaml", pcp=2).name == "gpu_worker"
    with pytest.raises(ReplicaDoesNotFit) as err:
        check_replica_fits(node_types(CLOUD), tp=8, dcp=2, source="ray_cluster.yaml", pcp=2)
    message = str(err.value)
    for part in ("tensor_parallel_size=8 x prefill_context_parallel_size=2", "16 GPUs on one node",
                 "'gpu_worker' has 8 GPUs", "tensor_parallel_size x prefill_context_parallel_size to at most 8"):
        assert part in message, (part, message)


def test_a_node_type_that_may_never_start_does_not_count() -> None:
    types = [NodeType("head", 0, 0, True), NodeType("big", 16, 0, False), NodeType("small", 4, 3, False)]
    with pytest.raises(ReplicaDoesNotFit, match=r"'big' has 16 GPUs but max_workers 0.*at most 4"):
        check_replica_fits(types, tp=8, dcp=1, source="c.yaml")


def test_cluster_config_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CLUSTER_CONFIG_ENV, raising=False)
    assert cluster_config_from_env() is None
    monkeypatch.setenv(CLUSTER_CONFIG_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=rf"{CLUSTER_CONFIG_ENV}=.*missing.yaml cannot be read here"):
        cluster_config_from_env()
    monkeypatch.setenv(CLUSTER_CONFIG_ENV, str(REPO / "ray_cluster.yaml"))
    found = cluster_config_from_env()
    assert found is not None and found[0]["head_node_type"] == "head"


def test_the_app_refuses_a_layout_the_cluster_config_cannot_hold(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    from dcpserve.deployments.app import check_cluster_fits
    from dcpserve.deployments.config import parse_args

    config = local_cluster_config(CLOUD, LOCAL, gcs_address="127.0.0.1:1", worker_gpus=2)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv(CLUSTER_CONFIG_ENV, str(path))
    args = {"model": str(tmp_path), "tensor_parallel_size": 4, "decode_context_parallel_size": 4}
    with pytest.raises(ReplicaDoesNotFit, match=r"tensor_parallel_size=4 .*'gpu_worker' has 2 GPUs"):
        check_cluster_fits(parse_args(args))
    check_cluster_fits(parse_args({**args, "tensor_parallel_size": 2, "decode_context_parallel_size": 2}))
