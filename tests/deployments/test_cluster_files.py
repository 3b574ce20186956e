"""ray_cluster.yaml passes Ray's own validation; serve_config*.yaml validate as Serve configs and as app args."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def test_ray_cluster_yaml_is_valid_for_ray_up() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    prepared = prepare_config(config)
    validate_config(prepared)
    workers = prepared["available_node_types"]["gpu_worker"]
    assert workers["resources"]["GPU"] == 8 and workers["max_workers"] >= 1
    assert prepared["available_node_types"]["head"]["resources"].get("GPU", 0) == 0
    assert "/home/ubuntu/dcpserve" in prepared["file_mounts"]
    assert any("pip install" in c and "dcpserve" in c for c in prepared["setup_commands"])
    head_start = " ".join(prepared["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start  # never open to the internet
    # The API keys file serve_config.yaml reads is copied to every node.
    serve_args = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"][0]["args"]
    assert serve_args["api_keys_file"] in prepared["file_mounts"]


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.local.yaml", "serve_config.vllm.yaml",
                                  "serve_config.local.vllm.yaml", "serve_config.local.mla.yaml"])
def test_serve_configs_validate(name: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    from dcpserve.deployments.config import parse_args

    raw = yaml.safe_load((REPO / name).read_text())
    schema = ServeDeploySchema.model_validate(raw)
    app = schema.applications[0]
    assert app.import_path == "dcpserve.deployments.app:build_app" and app.runtime_env in (None, {})
    args = parse_args(app.args)  # every key known, every value valid
    # Every example shards KV with DCP, except vLLM on CPU, whose attention cannot (the engine refuses dcp > 1 there).
    assert args.decode_context_parallel_size > 1 or name == "serve_config.local.vllm.yaml"
