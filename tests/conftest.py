"""Test-wide setup: Triton runs natively on CUDA, and under its CPU interpreter everywhere else.

TRITON_INTERPRET must be set before triton.jit decorates the kernels, so before `kernels` is imported.

DCPSERVE_VERIFY_PREFIX_HITS=1 (dcpserve.engine.core.engine.VERIFY_PREFIX_HITS_ENV) makes every engine of the suite keep
each cached block's token ids and compare them on every prefix cache hit, so a hash collision or a block named for the
wrong tokens fails the test (PrefixCacheCorruption) instead of serving another prefix's KV. Set here, at import,
so engines in processes the tests start (a `ray start` cluster's replicas) inherit it too; a value set outside wins.

Ray: one head for the whole session (`ray_head`, bench/harness/cluster.py), on loopback only; the engine's Ray tests
(`ray_cluster`) and every e2e and dashboard module use it, each module deploying its app and deleting it after.
Tiers (markers, set here from what a test uses, so none is forgotten): `e2e` (an app on the head), `ray` (the head
alone: the engine's multi-rank tests), `faults` (kills processes of the head: run after every other test on it),
`nodes` (a multi-node cluster of its own with Ray's autoscaler, `make cluster`'s: tests/local; a pytest process can
drive one Ray cluster only, so it runs in a process of its own), the rest needing no cluster (`make test-fast`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DCPSERVE_VERIFY_PREFIX_HITS", "1")  # engine.core.engine.VERIFY_PREFIX_HITS_ENV; see above

from dcpserve.local.serve import bind_ray_to_loopback
from dcpserve.local.tls import prepare_driver_tls

bind_ray_to_loopback()  # before anything imports ray: every Ray this session starts or joins listens on 127.0.0.1
# Also before ray's import, which fixes Ray's TLS setting for the process: this process joins the clusters it starts
# with mutual TLS, as an identity of each one's CA (dcpserve/local/tls.py; DCPSERVE_TLS=0 turns it off).
prepare_driver_tls()

# schemathesis' pytest plugin imports its report writers lazily, in its pytest_sessionfinish hook, and pytest parses
# them then to rewrite their asserts. By then the session's Ray head has stopped and the garbage of the Serve handles
# the tests made is being finalized: a finalizer that runs in the middle of CPython 3.11's ast.parse throws its
# recursion count off ("SystemError: AST constructor recursion depth mismatch", a CPython 3.11 bug), which crashed the
# cluster tier after all of its tests had passed. Imported now, before any test, they are parsed in a quiet process.
for _lazy in ("schemathesis.reporting.html.writer", "schemathesis.reporting.html.build",
              "schemathesis.reporting.junitxml", "schemathesis.reporting._command"):
    try:
        importlib.import_module(_lazy)
    except ImportError:  # another schemathesis: what it does not have, its hook does not import
        pass
# Ray reads its auth mode once, at import: the session's head (bench/harness/cluster.py) uses token auth.
os.environ["RAY_AUTH_MODE"] = "token"
# Nothing in a test process may start a Ray of its own by calling into Ray unconnected (Ray's auto-init, also read
# at import): after the session head's ray.shutdown(), a Serve handle's metrics thread still calls ray.wait, and
# auto-init then started a fresh local Ray under /tmp/ray whose GCS never came up, 30 s per try, several tries per
# pytest process. Code that needs Ray connects to a head explicitly (ray_head, dcpserve.engine.worker.ray_executor).
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

import pytest  # noqa: E402

from tests.spawn_pool import SpawnPool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The modules of the tier's longest tests (10-60 s each on 2 cores; the rest take a second or less), run first: xdist's
# worksteal hands the short tests left at the end to whichever worker is free, instead of one worker running a long
# test alone while the other idles.
LONGEST_FIRST = ("tests/engine/models/test_long_context.py", "tests/engine/models/test_mla_vs_hf.py",
                 "tests/engine/models/test_model_vs_hf.py")


def _longest_first_rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::")[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test by the cluster it uses (module docstring), runs the `faults` tests after every other test
    that uses the head and the LONGEST_FIRST modules before the rest, and skips `vllm` tests where vLLM is not
    installed (`make test-vllm` runs them)."""
    import importlib.util

    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "local_nodes" in fixtures:
            item.add_marker(pytest.mark.nodes)
        if "ray_head" in fixtures or "ray_cluster" in fixtures:
            item.add_marker(pytest.mark.xdist_group("ray"))  # one xdist worker holds the head
            item.add_marker(pytest.mark.ray if "ray_cluster" in fixtures else pytest.mark.e2e)
    # Stable: otherwise in collection order, but the `faults` tests last and the LONGEST_FIRST modules first.
    items.sort(key=lambda item: (item.get_closest_marker("faults") is not None, _longest_first_rank(item)))
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
def spawn_pool() -> Iterator[SpawnPool]:
    """mp.spawn for the multi-rank model and exchange tests, in processes kept for the session (tests/spawn_pool.py)."""
    pool = SpawnPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory):
    """The session's Ray head (4 logical GPUs on CPU machines, the real count where there are GPUs), with this
    process joined as its driver; stopped at the end of the session."""
    from bench.harness.cluster import ray_head as start_ray_head

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 4
    with start_ray_head(tmp_path_factory.mktemp("ray-head"), num_gpus=gpus) as head:
        yield head


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    """Ray, joined to the session's head: the engine's multi-rank tests create their worker groups on it."""
    import ray

    return ray
