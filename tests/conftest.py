"""Test-wide setup: Triton runs natively on CUDA, and under its CPU interpreter everywhere else.

TRITON_INTERPRET must be set before triton.jit decorates the kernels, so before `kernels` is imported.

DCPSERVE_VERIFY_PREFIX_HITS=1 (engine.engine.VERIFY_PREFIX_HITS_ENV) makes every engine of the suite keep each
cached block's token ids and compare them on every prefix cache hit, so a hash collision or a block named for the
wrong tokens fails the test (PrefixCacheCorruption) instead of serving another prefix's KV. Set here, at import,
so engines in processes the tests start (a `ray start` cluster's replicas) inherit it too; a value set outside wins.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DCPSERVE_VERIFY_PREFIX_HITS", "1")  # engine.engine.VERIFY_PREFIX_HITS_ENV; see above

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `vllm` run the real vLLM backend: `make test-vllm` runs them in .venv-vllm; elsewhere they skip."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - yields the ray module
    """A Ray cluster of this test session's own (4 logical GPUs on CPU machines), stopped at the end.

    Tests that use it carry @pytest.mark.xdist_group("ray") so one xdist worker runs them all on one cluster.
    """
    import tempfile

    import ray

    # Ray's socket paths must stay short: a temp dir directly under /tmp, not pytest's deep tmp_path.
    temp_dir = tempfile.mkdtemp(prefix="dcpray-", dir="/tmp")
    # Logical GPUs on CPU machines; the real count where there are GPUs (tests needing more skip themselves).
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 4
    ray.init(
        address="local",
        num_cpus=8,
        num_gpus=gpus,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
