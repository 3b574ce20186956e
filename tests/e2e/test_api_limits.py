"""The API surface operators put behind a load balancer (bench/harness/cluster.py): API keys, request limits, the
per-request deadline, tenants' service levels and limits, /health for probes, and the served OpenAPI document fuzzed
with schemathesis.

The app reads its keys from an environment variable of the Ray processes (api_keys_env), as `make serve` does with
DCPSERVE_API_KEY, so no key is written into the deploy config, and named keys (tenants) from a keys file.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from bench.harness.cluster import RayHead, ServeCluster, deploy_app, present, tiny_app_args

pytestmark = [pytest.mark.timeout(400)]

MODEL = "tiny-limits"
KEYS = ("first-key-0123456789", "second-key-abcdefghij")
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
BODY_LIMIT = 64 * 1024
# The app's deadline is long enough for any request the fuzzer sends (up to the whole context); the "hasty" tenant's
# own is far shorter than the fastest this model could generate its context in, so its request runs past it.
REQUEST_TIMEOUT_S = 120.0
HASTY_TIMEOUT_S = 0.5
# The leak grace outlasts the deadline test's wait: only the ingress' own release can free the KV there.
APP_ARGS = tiny_app_args(MODEL, api_keys_env="DCPSERVE_TEST_API_KEYS", max_request_body_bytes=BODY_LIMIT,
                         request_timeout_s=REQUEST_TIMEOUT_S, grant_leak_grace_s=600)


# Named keys (api_keys_file) and their tenants' settings.
TENANT_KEYS = {"metered": "metered-key-0123456789", "serial": "serial-key-0123456789",
               "restricted": "restricted-key-0123456789", "hasty": "hasty-key-0123456789"}
TOKENS_PER_MINUTE = 300
TENANTS = {"metered": {"tokens_per_minute": TOKENS_PER_MINUTE}, "serial": {"max_concurrent_requests": 1},
           "restricted": {"priority": 5, "min_priority": 2},
           "hasty": {"request_timeout_s": HASTY_TIMEOUT_S}}


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeCluster]:
    # The keys reach the ingress replicas through the app's runtime_env, as an operator would set them.
    runtime_env = {"env_vars": {"DCPSERVE_TEST_API_KEYS": ",".join(KEYS)}}
    keys_file = tmp_path_factory.mktemp("keys") / "api_keys"
    keys_file.write_text("".join(f"{name} {key}\n" for name, key in TENANT_KEYS.items()))
    args = {**APP_ARGS, "api_keys_file": str(keys_file), "tenants": TENANTS}
    with deploy_app(ray_head, args, runtime_env=runtime_env) as running:
        yield running


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}


def assert_openai_error(reply: httpx.Response, status: int, fragment: str) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"], error
    return error


def test_api_keys_guard_every_v1_route_and_health_stays_open(cluster: ServeCluster) -> None:
    import openai

    completion = {"model": MODEL, "prompt": "def hello", "max_tokens": 3}
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEYS[0]},  # no Bearer scheme
                        {"Authorization": f"Bearer {KEYS[0]}x"}):
            for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", completion),
                                       ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []})):
                reply = http.request(method, path, json=body, headers=headers)
                error = assert_openai_error(reply, 401, "invalid or missing API key")
                assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
                assert not any(key in reply.text for key in KEYS)  # no hint of a valid key
        health = http.get("/health")  # load balancers probe it without a key
        assert health.status_code == 200
        assert set(health.json()) == {"status", "replicas", "healthy_replicas", "queued", "kv_capacity_blocks",
                                      "kv_granted_blocks", "kv_external_blocks", "kv_free_blocks", "num_grants"}
        assert http.get("/openapi.json").status_code == 200
        assert_openai_error(http.get("/v1/nothing-here", headers=AUTH), 404, "/v1/nothing-here")
    # Both keys work, through the official client.
    for key in KEYS:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [MODEL]
        answer = client.completions.create(model=MODEL, prompt="def hello", max_tokens=3)
        assert present(answer.usage).completion_tokens == 3
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_body_size_and_stop_limits_are_named_400s_and_413s(cluster: ServeCluster) -> None:
    with httpx.Client(base_url=cluster.url, timeout=60, headers=AUTH) as http:
        big = json.dumps({"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1})
        reply = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert_openai_error(reply, 413, f"max_request_body_bytes={BODY_LIMIT}")

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
            yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
            for _ in range(BODY_LIMIT // 1024 + 2):
                yield b"y" * 1024
            yield b'"}'

        reply = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert_openai_error(reply, 413, f"max_request_body_bytes={BODY_LIMIT}")
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]})
        assert_openai_error(reply, 400, "at most 4 stop sequences, got 5")
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop": "s" * 300})
        assert_openai_error(reply, 400, "at most 256 characters, got one of 300")
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200, ok.text  # nothing a client sent broke the server for others


def test_service_level_fields_and_tenant_limits_answer_named_errors(cluster: ServeCluster) -> None:
    """priority and deadline are checked (400 naming the field); a key's min_priority holds; a tenant's
    tokens_per_minute and max_concurrent_requests answer 429 with Retry-After naming the limit, or 400 when a
    request alone is past it, and other tenants are not affected. Nothing here depends on timing: every limit is
    hit by requests made one after another (the window is a minute), or while one request is still streaming."""
    request = {"model": MODEL, "prompt": "def hello", "max_tokens": 2}
    with httpx.Client(base_url=cluster.url, timeout=60, headers=AUTH) as http:
        bad: list[tuple[dict[str, object], str, str]] = [
            ({"priority": "high"}, "priority", "Input should be a valid integer"),
            ({"priority": 1.5}, "priority", "Input should be a valid integer"),
            ({"deadline": "soon"}, "deadline", "neither Unix seconds nor an ISO 8601 time"),
            ({"deadline": time.time() - 5}, "deadline", "passed"),
        ]
        for fields, param, fragment in bad:
            error = assert_openai_error(http.post("/v1/completions", json={**request, **fields}), 400, fragment)
            assert error["param"] == param, error
        in_a_minute = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))
        accepted: list[dict[str, object]] = [{"priority": -3}, {"priority": 7, "deadline": in_a_minute},
                                             {"deadline": time.time() + 60}]
        for level in accepted:
            reply = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **level})
            assert reply.status_code == 200, reply.text
        restricted = http.post("/v1/completions", json={**request, "priority": 1}, headers=bearer("restricted"))
        assert_openai_error(restricted, 400, "priority=1 is more urgent than this API key allows (min_priority=2)")
        assert http.post("/v1/completions", json=request, headers=bearer("restricted")).status_code == 200

        # 198 prompt tokens + 2 count 200 against the 300 a minute, and generate in well under request_timeout_s.
        metered = {"model": MODEL, "prompt": [7] * 198, "max_tokens": 2}
        assert http.post("/v1/completions", json=metered, headers=bearer("metered")).status_code == 200
        reply = http.post("/v1/completions", json=metered, headers=bearer("metered"))
        error = assert_openai_error(reply, 429, f"past its tokens_per_minute={TOKENS_PER_MINUTE}")
        assert error["code"] == "limit_exceeded" and 1 <= int(reply.headers["Retry-After"]) <= 60, reply.headers
        alone = http.post("/v1/completions", json={**request, "max_tokens": 400}, headers=bearer("metered"))
        assert_openai_error(alone, 400, f"(tokens_per_minute={TOKENS_PER_MINUTE}); lower max_tokens")
        assert http.post("/v1/completions", json=metered).status_code == 200  # the default tenant: no limit

        running = {**request, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=running, headers=bearer("serial")) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: a dropped generator would close the stream (a disconnect)
            next(line for line in lines if line.startswith("data: "))  # admitted and streaming
            reply = http.post("/v1/completions", json=request, headers=bearer("serial"))
            error = assert_openai_error(reply, 429, "tenant 'serial' has 1 requests waiting or running, its "
                                                    "max_concurrent_requests=1")
            assert reply.headers["Retry-After"] == "1"
            assert http.post("/v1/completions", json=request).status_code == 200  # others are served meanwhile
        deadline = time.monotonic() + 60
        while True:  # the stream's close aborts the request; its grant is released in the background
            reply = http.post("/v1/completions", json=request, headers=bearer("serial"))
            if reply.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert reply.status_code == 200, reply.text


def test_a_request_past_its_deadline_ends_with_an_error_and_frees_its_kv(cluster: ServeCluster) -> None:
    # No max_tokens: the rest of the context (about 2,040 tokens), which would need under 0.25 ms a step to end
    # within the tenant's 0.5 s (a decode step of this model takes about 2 ms here at tp=2 dcp=2, 1 ms at tp=1).
    long_request = {"model": MODEL, "prompt": "def hello", "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=cluster.url, timeout=60, headers=bearer("hasty")) as http:
        start = time.monotonic()
        reply = http.post("/v1/completions", json=long_request)
        took = time.monotonic() - start
        # The tenant's own deadline, the shorter one, applies.
        error = assert_openai_error(reply, 504, f"request_timeout_s={HASTY_TIMEOUT_S:g}")
        assert error["code"] == "request_timeout" and HASTY_TIMEOUT_S <= took < HASTY_TIMEOUT_S + 60, took
        with http.stream("POST", "/v1/completions", json={**long_request, "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert last["error"]["code"] == "request_timeout", last
        deadline = time.monotonic() + 60
        while (health := http.get("/health").json())["kv_granted_blocks"] + health["kv_external_blocks"]:
            assert time.monotonic() < deadline, health  # the KV is freed by the ingress, not by leak reconciliation
            time.sleep(0.25)
    assert cluster.admission_stats().num_leaked == 0


@pytest.fixture(scope="module")
def api_schema(cluster: ServeCluster) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{cluster.url}/openapi.json")


fuzzed = schemathesis.pytest.from_fixture("api_schema")


@fuzzed.parametrize()
@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_get_openai_shaped_4xx_never_5xx(case: schemathesis.Case, cluster: ServeCluster) -> None:
    response = case.call(base_url=cluster.url, headers=AUTH, timeout=60)
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                             response_schema_conformance])


def test_the_server_answers_a_valid_request_after_the_fuzzing(cluster: ServeCluster) -> None:
    async def run() -> int:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60, headers=AUTH) as http:
            reply = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            return reply.status_code

    assert asyncio.run(run()) == 200
