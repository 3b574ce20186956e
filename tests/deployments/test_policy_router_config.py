"""Autoscaling arithmetic, router ranking by reported KV, and build_app's argument validation (no Ray cluster)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dcpserve.deployments.autoscaling import desired_replicas
from dcpserve.deployments.config import parse_args
from dcpserve.deployments.dispatch.router import rank_by_free_kv

TARGETS = {"target_sequences_per_replica": 8, "kv_usage_scale_up": 0.85}


def test_desired_replicas_by_sequences_and_kv() -> None:
    assert desired_replicas([3, 4], [0.1, 0.2], 0, 2, **TARGETS) == 1
    assert desired_replicas([8, 8], [0.1, 0.2], 9, 2, **TARGETS) == 4  # 25 sequences / 8
    assert desired_replicas([1], [0.9], 0, 1, **TARGETS) == 2  # KV nearly full: one more
    assert desired_replicas([0, 0], [0.0, 0.0], 0, 2, **TARGETS) == 0  # idle: Serve clamps to min_replicas


@dataclass
class FakeReplicaId:
    unique_id: str

    def __hash__(self) -> int:
        return hash(self.unique_id)


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict = field(default_factory=dict)

    @property
    def replica_id(self) -> FakeReplicaId:
        return FakeReplicaId(self.name)


def test_rank_by_free_kv_filters_and_orders() -> None:
    a = FakeReplica("a", {"kv_free_blocks": 10, "healthy": True})
    b = FakeReplica("b", {"kv_free_blocks": 30, "healthy": True})
    c = FakeReplica("c", {"kv_free_blocks": 50, "healthy": False})
    d = FakeReplica("d", {})  # no report yet
    ranked = rank_by_free_kv([a, b, c, d], need=8, sent_since_report={FakeReplicaId("b"): 25})
    assert [[r.name for r in rank] for rank in ranked] == [["a"]]  # b: 30 - 25 sent = 5 < 8
    ranked = rank_by_free_kv([a, b], need=8, sent_since_report={})
    assert [[r.name for r in rank] for rank in ranked] == [["b"], ["a"]]


def test_args_name_unknown_and_invalid_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_queue_size: Extra inputs are not permitted"):
        parse_args({"model": str(tmp_path), "max_queue_size": 3})
    with pytest.raises(ValueError, match="autoscaling.max_replicas"):
        parse_args({"model": str(tmp_path), "autoscaling": {"min_replicas": 3, "max_replicas": 2}})
    with pytest.raises(ValueError, match="queue_timeout_s"):
        parse_args({"model": str(tmp_path), "queue_timeout_s": -1})
    # The engine fields' ranges are EngineArgs' own checks (dcpserve/engine/args.py), named the same way.
    with pytest.raises(ValueError, match=r"kv_headroom must be a fraction of the KV cache in \[0, 1\), got 1.0"):
        parse_args({"model": str(tmp_path), "kv_headroom": 1.0})
    with pytest.raises(ValueError, match=r"kv_headroom must be a fraction of the KV cache in \[0, 1\), got -0.1"):
        parse_args({"model": str(tmp_path), "kv_headroom": -0.1})
    with pytest.raises(ValueError, match=r"invalid dcpserve app args: tensor_parallel_size must be >= 1, got 0"):
        parse_args({"model": str(tmp_path), "tensor_parallel_size": 0})
    with pytest.raises(ValueError, match=r"admission: Input should be 'full' or 'usage'"):
        parse_args({"model": str(tmp_path), "admission": "prompt"})
    args = parse_args({"model": str(tmp_path)})
    assert args.max_queued_requests == 64 and args.autoscaling.target_sequences_per_replica == 8.0
    assert args.admission == "usage" and args.kv_headroom == 0.05


def test_build_app_rejects_a_bad_layout(tiny_model_dir: Path) -> None:
    from dcpserve.deployments.app import build_app

    with pytest.raises(ValueError, match="dcp|DCP|decode_context"):
        build_app({"model": str(tiny_model_dir), "tensor_parallel_size": 2, "decode_context_parallel_size": 4})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_app({"model": "/nonexistent/model"})
    app = build_app({"model": str(tiny_model_dir), "tensor_parallel_size": 2, "decode_context_parallel_size": 2})
    assert app is not None


def test_a_pcp_replica_reserves_tp_times_pcp_gpus_and_a_bad_pcp_layout_is_refused(tiny_model_dir: Path) -> None:
    from dcpserve.deployments.app import build_app, engine_deployment
    from dcpserve.deployments.config import parse_args

    args = {"model": str(tiny_model_dir), "tensor_parallel_size": 2, "prefill_context_parallel_size": 2,
            "decode_context_parallel_size": 4}
    deployment = engine_deployment(parse_args(args))
    # Serve's deployment options as built (no public accessor): the replica's CPU bundle, then one GPU per rank.
    assert deployment._replica_config.placement_group_bundles == [{"CPU": 1.0}] + [{"GPU": 1.0}] * 4
    assert build_app(args) is not None
    with pytest.raises(ValueError, match=r"dcp=3 with pcp=2 must be 1 or a multiple of pcp.*Valid here: dcp in "
                                         r"\[1, 2, 4\]"):
        build_app({**args, "decode_context_parallel_size": 3})


def test_build_app_refuses_pools_none_of_which_holds_a_whole_request(tiny_model_dir: Path) -> None:
    from dcpserve.deployments.app import build_app

    # 256 KiB per rank at tp=2: 512 tokens at dcp=1, 1,024 at dcp=2.
    pools = [{"name": "short", "tensor_parallel_size": 2},
             {"name": "long", "tensor_parallel_size": 2, "decode_context_parallel_size": 2}]
    args = {"model": str(tiny_model_dir), "kv_cache_memory_bytes": 262144, "device": "cpu", "pools": pools}
    with pytest.raises(ValueError, match=r"no pool can hold one request of max_model_len=2048 tokens \(short holds 512 "
                                         r"tokens; long holds 1024 tokens\)"):
        build_app({**args, "max_model_len": 2048})
    assert build_app({**args, "max_model_len": 1024}) is not None  # the long pool holds it; short serves the rest


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dcpserve.cluster.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


def test_api_keys_come_from_the_list_an_environment_variable_and_a_file(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# operators' keys\nfile-key-1\n\nfile-key-2\n")
    monkeypatch.setenv("TEST_DCPSERVE_KEYS", " env-key-1 , env-key-2,")
    args = parse_args({"model": str(tmp_path), "api_keys": ["inline"], "api_keys_env": "TEST_DCPSERVE_KEYS",
                       "api_keys_file": str(keys_file)})
    assert args.resolved_api_keys() == ["inline", "env-key-1", "env-key-2", "file-key-1", "file-key-2"]
    assert "inline" not in repr(args) and "inline" not in str(args.model_dump())  # secrets stay out of logs
    assert parse_args({"model": str(tmp_path)}).resolved_api_keys() == []  # no keys: an open API
    monkeypatch.delenv("TEST_DCPSERVE_KEYS")
    with pytest.raises(ValueError, match="api_keys_env='TEST_DCPSERVE_KEYS': that environment variable is unset"):
        args.resolved_api_keys()
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        parse_args({"model": str(tmp_path), "api_keys_file": str(empty)}).resolved_api_keys()
    with pytest.raises(ValueError, match="does not exist on this node"):
        parse_args({"model": str(tmp_path), "api_keys_file": str(tmp_path / "missing")}).resolved_api_keys()


def test_a_keys_file_names_its_keys_and_the_names_are_the_tenants(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# name key\nteam-a  sk-aaa\nbatch sk-bbb\nsk-unnamed\n")
    args = parse_args({"model": str(tmp_path), "api_keys_file": str(keys_file),
                       "tenants": {"batch": {"priority": 20, "max_concurrent_requests": 4, "weight": 0.5},
                                   "team-a": {"tokens_per_minute": 100_000, "min_priority": 0}}})
    assert args.resolved_tenant_keys() == [("team-a", "sk-aaa"), ("batch", "sk-bbb"), ("default", "sk-unnamed")]
    assert args.tenant("batch").priority == 20 and args.tenant("nobody").max_concurrent_requests is None
    for text, fragment in [
        ("a sk-1\na sk-2\n", "line 2: the name 'a' is used on line 1 too; give each key its own name"),
        ("a sk-1\nb sk-1\n", "line 2: this key is given on an earlier line too"),
        ("a b c\n", "line 1: expected `<name> <key>` or `<key>`, got 3 fields"),
        ("bad/name sk-1\n", "the name 'bad/name' must be letters"),
    ]:
        keys_file.write_text(text)
        with pytest.raises(ValueError, match=re.escape(fragment)):
            args.resolved_tenant_keys()
        assert "sk-" not in fragment  # the message never shows a key
    keys_file.write_text("team-a sk-aaa\n")
    with pytest.raises(ValueError, match="tenants: batch name no API key"):
        args.resolved_tenant_keys()
    open_args = parse_args({"model": str(tmp_path), "tenants": {"anonymous": {"priority": 3}}})
    assert open_args.resolved_tenant_keys() == [] and open_args.tenant("anonymous").priority == 3


def test_a_tenant_request_timeout_only_shortens_the_apps(tmp_path: Path) -> None:
    args = parse_args({"model": str(tmp_path), "request_timeout_s": 30,
                       "tenants": {"chat": {"request_timeout_s": 5}, "batch": {"request_timeout_s": 900}}})
    assert args.request_timeout_for("chat") == 5  # its own, the shorter
    assert args.request_timeout_for("batch") == 30  # the app's bounds every tenant
    assert args.request_timeout_for("nobody") == 30


@pytest.mark.parametrize("tenants,fragment", [
    ({"a": {"max_concurrent_requests": 0}}, "tenants.a.max_concurrent_requests: Input should be greater than or "
                                            "equal to 1"),
    ({"a": {"tokens_per_minute": 0}}, "tenants.a.tokens_per_minute: Input should be greater than or equal to 1"),
    ({"a": {"weight": 0}}, "tenants.a.weight: Input should be greater than 0"),
    ({"a": {"request_timeout_s": 0}}, "tenants.a.request_timeout_s: Input should be greater than 0"),
    ({"a": {"priority": "high"}}, "tenants.a.priority: Input should be a valid integer"),
    ({"a": {"priority": -5, "min_priority": 0}}, "priority (-5) is more urgent than min_priority (0)"),
    ({"a": {"burst": 3}}, "tenants.a.burst: Extra inputs are not permitted"),
    ({"a b": {}}, "tenants: the names 'a b' must be letters"),
])
def test_tenant_settings_are_checked_naming_the_field(tmp_path: Path, tenants: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        parse_args({"model": str(tmp_path), "tenants": tenants})
