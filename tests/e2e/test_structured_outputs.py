"""Structured outputs and tools through the deployed native app at tp=2 x dcp=2 (the bitmask applied on rank 0 after
the logits gather), driven by the openai client: tests/e2e/structured_checks.py. After it all, nothing is held."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from bench.harness.cluster import RayHead, ServeCluster, deploy_app, tiny_app_args
from tests.e2e.structured_checks import (
    check_bad_constraints_are_400s,
    check_constraints_and_tools,
    check_thirty_schemas,
)

pytestmark = [pytest.mark.timeout(600)]

MODEL = "tiny-structured"


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    with deploy_app(ray_head, tiny_app_args(MODEL)) as running:
        yield running


def client(cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_thirty_schemas_are_valid_at_tp2_dcp2(cluster: ServeCluster) -> None:
    check_thirty_schemas(f"{cluster.url}/v1", MODEL)


def test_constraints_and_tools_at_tp2_dcp2(cluster: ServeCluster) -> None:
    check_constraints_and_tools(client(cluster), MODEL)


def test_bad_constraints_are_400s_before_admission(cluster: ServeCluster) -> None:
    check_bad_constraints_are_400s(client(cluster), MODEL)
    deadline = time.monotonic() + 60
    while (stats := cluster.engine_stats()).engine.num_running or stats.ledger.per_request:
        assert time.monotonic() < deadline, f"the replica still holds requests after every reply: {stats}"
        time.sleep(0.2)
