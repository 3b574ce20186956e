"""The metrics, the Grafana dashboard and the alert rules against a real Prometheus on loopback.

One app per engine backend (native: TP=2 x DCP=2 on logical GPUs, 32 KV blocks of 32 tokens; vLLM, in `make
test-vllm`: TP=2, 256 blocks of 32 tokens), an admission queue of 1 and a 12 s queue timeout, deployed on the
session's Ray head (bench/harness/cluster.py) under an application name of its own, so that every query below can select
this app's series by their `application` label; Prometheus started the way `make observe` starts it
(dcpserve/local/observe.py), with the project's scrape config pointed at the head's service-discovery file. A bounded
load makes every metric move: a normal stream, a never-fits 400, and, while the test itself holds the whole KV (a
grant of its own, ServeCluster.held_kv), a queued request that times out (429), one refused by a full queue (429)
and one that waits and is admitted when the test lets go; then one prompt twice (a prefix cache hit, the second
sent once the admission queue knows the replica caches it) and one as large as the KV (evictions). Then: every
panel's every query parses and returns data, promtool accepts the config and the rules, every metric in
docs/metrics.md exists (with its documented type in what Ray exports), every metric the dashboard uses is documented
or Ray's own, and the KV and prefix cache numbers Prometheus reports equal the engine's stats() (the prefix routing
counts, the admission queue's) at a quiet moment.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.harness.cluster import CAPACITY_BLOCKS, RayHead, ServeCluster, deploy_app, tiny_app_args
from dcpserve.deployments.messages import AdmissionStats, ReplicaStats
from dcpserve.local import observe
from dcpserve.local import serve as local_serve

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "grafana" / "dashboards" / "dcpserve.json"
METRICS_DOC = REPO / "docs" / "metrics.md"

if shutil.which("prometheus") is None and not os.environ.get("CI"):
    pytest.skip("the prometheus binary is not installed (apt-get install prometheus; .ci/run installs it)",
                allow_module_level=True)

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(400)]

MODEL = "tiny-observe"
APP = "dcpserve-observe"  # the `application` label of this app's series: earlier apps on the head have their own


@dataclass(frozen=True)
class Backend:
    """One engine backend's variant of the scenario."""

    name: str
    app_args: dict
    capacity_blocks: int
    never_fits_prompt: int  # prompt tokens of the request that can never run
    outcomes: tuple[str, ...]  # admission outcomes the scenario produces


_COMMON = dict(
    admission="full",  # the requests of the scenario hold their whole KV while they run
    max_queued_requests=1,
    queue_timeout_s=12,
    retry_after_s=1,
    grant_leak_grace_s=600,  # the test's own grant is never reported by the replica: it must outlast the module
    # A latency target: the service-level policy runs in Serve's controller and exports its metrics (one replica).
    autoscaling={"min_replicas": 1, "max_replicas": 1, "ttft_target_s": 30.0},
    # A tenant limit (the app has no keys: every request is the tenant `anonymous`) that one request of 5 prompts
    # passes: its fifth choice is refused while the other four hold their grants (admitted all or none).
    tenants={"anonymous": {"max_concurrent_requests": 4}},
)
NATIVE = Backend("native", tiny_app_args(MODEL, **_COMMON), CAPACITY_BLOCKS, never_fits_prompt=1500,
                 outcomes=("admitted", "queued", "rejected_queue_full", "rejected_timeout", "rejected_never_fits",
                           "rejected_limit"))
# vLLM: tp=2 dcp=1 (its CPU attention cannot shard KV), pages of 32 tokens, and a pool that holds one max_model_len
# request (vLLM's minimum), so the request that never fits is one past max_model_len (the ingress' 400, before
# admission).
VLLM = Backend(
    "vllm",
    tiny_app_args(MODEL, backend="vllm", decode_context_parallel_size=1, block_size=32, max_model_len=8192,
                  kv_cache_memory_bytes=257 * 16384, **_COMMON),
    capacity_blocks=256, never_fits_prompt=8200,
    outcomes=("admitted", "queued", "rejected_queue_full", "rejected_timeout", "rejected_limit"),
)


@dataclass
class Stack:
    """The app on the session's head, and the Prometheus scraping it."""

    backend: Backend
    cluster: ServeCluster
    prometheus: str
    prometheus_config: Path

    @property
    def http(self) -> str:
        return self.cluster.url


def prompt_tokens(count: int) -> list[int]:
    return [(7 * i) % 250 + 5 for i in range(count)]


# The prompt sent twice for the prefix cache: its own tokens (no block in common with prompt_tokens), 11 full blocks of
# 32 tokens before its last token, so the second request is served 352 of its 360 prompt tokens from the cache.
REPEATED_PROMPT = [(11 * i) % 240 + 7 for i in range(360)]


def evicting_prompt(backend: Backend) -> list[int]:
    """A prompt of its own that with 4 tokens to generate needs all but one of the KV's blocks: the replica evicts
    cached blocks to hold it, however few tokens the long request got to cache on a slow machine (the repeated prompt
    alone leaves 11 cached, the queued-then-admitted request 12 more)."""
    return [(13 * i) % 230 + 9 for i in range((backend.capacity_blocks - 1) * 32 - 4)]


@pytest.fixture(scope="module", params=[pytest.param(NATIVE, id="native"),
                                        pytest.param(VLLM, id="vllm", marks=pytest.mark.vllm)])
def stack(request: pytest.FixtureRequest, ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    backend: Backend = request.param
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("CI is set but prometheus is not installed: .ci/run installs it before `make test`")
    state = tmp_path_factory.mktemp("observe")
    with deploy_app(ray_head, backend.app_args, app_name=APP) as cluster:
        prometheus_config = observe.write_config(ray_head.temp_dir, state / "prometheus")
        port = local_serve.free_port()
        prometheus = observe.start_prometheus(binary, prometheus_config, port, state / "prometheus" / "data",
                                              state / "prometheus" / "prometheus.log")
        try:
            observe.wait_ready(port, prometheus)
            yield Stack(backend, cluster, f"http://127.0.0.1:{port}", prometheus_config)
        finally:
            observe.stop(prometheus)


def of_app(name: str, **labels: str) -> str:
    """A selector of this app's series of `name` (by its `application` label), with these labels too."""
    matchers = ", ".join(f'{key}="{value}"' for key, value in {"application": APP, **labels}.items())
    return f"{name}{{{matchers}}}"


def query(stack: Stack, expr: str) -> dict:
    reply = httpx.get(f"{stack.prometheus}/api/v1/query", params={"query": expr}, timeout=30)
    body = reply.json()
    assert reply.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]


def documented_metrics() -> dict[str, str]:
    """name -> type, from the tables of docs/metrics.md."""
    rows = re.findall(r"^\| `(ray_[a-z0-9_]+)` \| (gauge|counter|histogram) \|", METRICS_DOC.read_text(), re.M)
    return dict(rows)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target, template variables substituted as Grafana would."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$application", APP).replace("$replica", ".*").replace("$pool", ".*")
                    .replace("$__rate_interval", "2m"))
            out.append((panel["title"], expr))
    return out


def drive_load(stack: Stack) -> dict[str, int | str]:
    """Every outcome at least once; returns the HTTP status of each scenario. The KV pressure is the test's own grant
    of the whole KV: what waits, times out or is refused follows from it, not from how fast anything decodes."""
    statuses: dict[str, int | str] = {}  # statuses, and the body of an unexpected one
    with httpx.Client(base_url=stack.http, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "def hello", "max_tokens": 8, "stream": True}) as reply:
            statuses["stream"] = reply.status_code
            assert [line for line in reply.iter_lines() if line.startswith("data:")][-1] == "data: [DONE]"
        statuses["chat"] = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).status_code
        statuses["never_fits"] = http.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt_tokens(stack.backend.never_fits_prompt), "max_tokens": 16}).status_code
        statuses["tenant_limit"] = http.post("/v1/completions", json={
            "model": MODEL, "prompt": [[5, 6, 7]] * 5, "max_tokens": 2}).status_code

    async def contention() -> None:
        need_13 = {"model": MODEL, "prompt": prompt_tokens(380), "max_tokens": 20, "ignore_eos": True}  # (380+20)/32
        async with httpx.AsyncClient(base_url=stack.http, timeout=120) as http:
            async def queued(n: int) -> None:
                await wait_until(lambda: http.get("/health"), lambda health: health["queued"] == n,
                                 f"{n} request(s) wait in the admission queue")

            # The test holds the whole KV (its handle calls block: off the event loop).
            held = stack.cluster.held_kv(stack.backend.capacity_blocks)
            await asyncio.to_thread(held.__enter__)
            try:
                times_out = asyncio.create_task(http.post("/v1/completions", json=need_13))
                await queued(1)  # it waits in the queue of one: the next is refused at once
                statuses["queue_full"] = (await http.post("/v1/completions", json=need_13)).status_code
                statuses["timeout"] = (await times_out).status_code  # queue_timeout_s: nothing was released
                waits = asyncio.create_task(http.post("/v1/completions", json=need_13))
                await queued(1)
            finally:
                await asyncio.to_thread(held.__exit__, None, None, None)
            # The test let go of the KV: the waiting request is admitted.
            admitted = await waits
            statuses["queued_then_admitted"] = admitted.status_code
            if admitted.status_code != 200:
                statuses["queued_then_admitted_body"] = admitted.text

    asyncio.run(contention())

    # Prefix caching: the same prompt twice, the second once the replica's KV report (every kv_report_period_s) has
    # told the admission queue that it caches the first's blocks.
    with httpx.Client(base_url=stack.http, timeout=120) as http:
        repeated = {"model": MODEL, "prompt": REPEATED_PROMPT, "max_tokens": 4}
        statuses["prefix_first"] = http.post("/v1/completions", json=repeated).status_code
        if prefix_caching(stack):
            asyncio.run(wait_until(
                lambda: asyncio.to_thread(admission_stats, stack),
                lambda queue: all(r.cached_prefix_blocks >= 11 for r in queue.replicas.values()),
                "the admission queue knows the repeated prompt's 11 blocks are cached"))
        statuses["prefix_repeated"] = http.post("/v1/completions", json=repeated).status_code
        if prefix_caching(stack):
            statuses["prefix_evicting"] = http.post("/v1/completions", json={
                "model": MODEL, "prompt": evicting_prompt(stack.backend), "max_tokens": 4}).status_code
    return statuses


async def wait_until(read: Callable[[], Awaitable[Any]], done: Callable[[Any], bool], what: str,
                     timeout_s: float = 60.0) -> Any:
    """Awaits read() until done(its result); AssertionError with the last result after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = await read()
        if isinstance(seen, httpx.Response):
            seen = seen.json()
        if done(seen):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting until {what}; last seen: {seen}")
        await asyncio.sleep(0.1)


def engine_stats(stack: Stack) -> ReplicaStats:
    return stack.cluster.engine_stats()


def admission_stats(stack: Stack) -> AdmissionStats:
    """KvAdmission.stats(): the queue's own counts."""
    return stack.cluster.admission_stats()


def prefix_caching(stack: Stack) -> bool:
    """Whether the replica's engine caches prefixes (EngineStats.prefix_caching); its prefix counters stay at 0 if
    not."""
    return engine_stats(stack).engine.prefix_caching


def wait_for(stack: Stack, exprs: list[str], timeout_s: float) -> list[str]:
    """Polls until every expression has data; returns those that still have none."""
    deadline = time.monotonic() + timeout_s
    missing = list(exprs)
    while missing and time.monotonic() < deadline:
        missing = [e for e in missing if not query(stack, e)["result"]]
        if missing:
            time.sleep(2)
    return missing


@pytest.fixture(scope="module")
def loaded(stack: Stack) -> Stack:
    statuses = drive_load(stack)
    caching = prefix_caching(stack)
    assert statuses == {"stream": 200, "chat": 200, "never_fits": 400, "tenant_limit": 429, "queue_full": 429,
                        "timeout": 429, "queued_then_admitted": 200, "prefix_first": 200, "prefix_repeated": 200,
                        **({"prefix_evicting": 200} if caching else {})}, statuses
    # Samples of everything, and the counters' latest values (Ray exports every second, Prometheus scrapes every 5).
    expected = [f'{of_app("ray_dcpserve_admission_requests_total", outcome=o)} > 0' for o in stack.backend.outcomes]
    expected += [f'{of_app(name + "_count")} > 0' if kind == "histogram" else of_app(name)
                 for name, kind in documented_metrics().items()]
    expected += [f'{of_app("ray_dcpserve_http_responses_total", status_code="429")} >= 2']
    if caching:
        # The repeated prompt's 11 blocks: served from the replica's cache, and routed to the replica caching them;
        # the evicting prompt's evictions.
        expected += [f'{of_app("ray_dcpserve_prefix_cache_hit_tokens_total")} >= 352',
                     f'{of_app("ray_dcpserve_prefix_cache_evictions_total")} > 0',
                     f'{of_app("ray_dcpserve_admission_prefix_hit_blocks_total")} >= 11',
                     f'{of_app("ray_dcpserve_admission_prefix_routed_requests_total", prefix_hit="true")} >= 1',
                     f'{of_app("ray_dcpserve_admission_prefix_routed_requests_total", prefix_hit="false")} >= 1']
    missing = wait_for(stack, expected, timeout_s=60)
    assert not missing, f"no data in Prometheus for: {missing}"
    return stack


def test_every_documented_metric_moves_and_has_its_type(loaded: Stack) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    documented = documented_metrics()
    assert len(documented) >= 25
    # What Ray's metrics agents export, read with prometheus_client's parser: the documented types.
    # Ray lists its autoscaler's and dashboard's metrics ports too (fixed defaults, shared by every cluster on a
    # host); the node's metrics agent, which serves the replicas' metrics, must be up.
    targets = [t for t in query(loaded, 'up{job="ray"}')["result"] if t["value"][1] == "1"]
    assert targets, "no Ray metrics target is up"
    exported: dict[str, str] = {}
    for target in targets:
        text = httpx.get(f"http://{target['metric']['instance']}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            if family.name.startswith("ray_dcpserve_"):
                # prometheus_client names a counter family without its _total suffix.
                exported[family.name + ("_total" if family.type == "counter" else "")] = family.type
    assert exported == documented
    # Every counter and histogram moved, except those that exist at 0: preemptions and recomputed tokens (this app
    # reserves KV in full), returned grants (only when a grant races a replica's report), and the prefix cache's and
    # prefix routing's where the engine does not cache prefixes.
    at_zero = {"ray_dcpserve_preemptions_total", "ray_dcpserve_recomputed_tokens_total",
               "ray_dcpserve_admission_replica_refusals_total"}
    # The host KV tier's: this app runs without one (kv_host_tier unset), so its series exist at 0
    # (tests/deployments/test_tier_metrics.py moves them with a real engine's tier).
    at_zero |= {name for name in documented if name.startswith(("ray_dcpserve_kv_host_tier_",
                                                                 "ray_dcpserve_prefix_cache_tier_"))}
    if not prefix_caching(loaded):
        at_zero |= {"ray_dcpserve_prefix_cache_query_tokens_total", "ray_dcpserve_prefix_cache_hit_tokens_total",
                    "ray_dcpserve_prefix_cache_evictions_total", "ray_dcpserve_admission_prefix_query_blocks_total",
                    "ray_dcpserve_admission_prefix_hit_blocks_total",
                    "ray_dcpserve_admission_prefix_routed_requests_total"}
    for name, kind in documented.items():
        if kind != "gauge" and name not in at_zero:
            series = f"{name}_count" if kind == "histogram" else name
            value = sum(float(s["value"][1]) for s in query(loaded, of_app(series))["result"])
            assert value > 0, (name, value)
    assert query(loaded, f'{of_app("ray_dcpserve_admission_queue_wait_seconds_sum")} > 11')["result"]  # 12 s waited
    dcp = loaded.backend.app_args.get("decode_context_parallel_size", 1)
    if dcp > 1:
        assert query(loaded, f'{of_app("ray_dcpserve_engine_dcp_exchange_seconds_sum")} > 0')["result"]  # exchanges
    layout = query(loaded, of_app("ray_dcpserve_layout_info"))["result"][0]["metric"]
    assert (layout["tp"], layout["dcp"], layout["kv_heads"], layout["duplication_removed"]) == (
        "2", str(dcp), "1", str(dcp))
    # The app has no pools: its replicas' series and the ingress' latencies carry its one pool, "default".
    for name in ("ray_dcpserve_kv_capacity_tokens", "ray_dcpserve_engine_step_seconds_count",
                 "ray_dcpserve_inter_token_latency_seconds_count"):
        assert {s["metric"].get("pool") for s in query(loaded, of_app(name))["result"]} == {"default"}, name
    # The session head is the only node: every engine replica reports it, by its Ray node id.
    import ray

    head_id = next(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    nodes = {(s["metric"]["node_id"], s["metric"]["node_type"])
             for s in query(loaded, of_app("ray_dcpserve_replica_node_info"))["result"]}
    assert nodes == {(head_id, "head")}, nodes


def test_every_dashboard_query_returns_data(loaded: Stack) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and {"application", "replica", "pool"} <= set(variables)
    for name in ("application", "replica", "pool"):
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variables[name]["query"]["query"])
        assert match, variables[name]
        series = query(loaded, match.group(1).replace("$application", APP))["result"]
        assert {s["metric"][match.group(2)] for s in series}, f"variable {name} has no values"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    queries = dashboard_queries()
    assert len(queries) >= 25
    # rate() needs two samples of a series: give the last-born series a few scrapes.
    empty = wait_for(loaded, [expr for _, expr in queries], timeout_s=60)
    assert not empty, f"panels without data: {[(t, e) for t, e in queries if e in empty]}"
    documented = documented_metrics()
    bases = set(documented) | {n.removesuffix("_total") for n in documented}
    for title, expr in queries:
        for name in re.findall(r"\bray_[a-zA-Z0-9_:]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert base in bases or name in documented or not name.startswith("ray_dcpserve_"), (title, name)


def test_promtool_accepts_config_and_rules_and_every_alert_parses(loaded: Stack) -> None:
    config = observe.promtool("check", "config", str(loaded.prometheus_config))
    assert config.returncode == 0, config.stdout + config.stderr
    rules_path = loaded.prometheus_config.parent / "alerts.yml"
    rules = observe.promtool("check", "rules", str(rules_path))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    loaded_rules = httpx.get(f"{loaded.prometheus}/api/v1/rules", timeout=30).json()["data"]["groups"]
    names = {r["name"] for g in loaded_rules for r in g["rules"]}
    assert names == {"DcpserveKvCacheNearlyFull", "DcpserveAdmissionQueueGrowing", "DcpserveHigh429Rate",
                     "DcpservePreemptions", "DcpserveReplicaUnhealthy", "DcpserveSloScaleUpBlocked",
                     "DcpserveHostKvTierThrashing", "DcpserveHostKvTierCopiesSlowSteps"}
    assert all(r["health"] != "err" for g in loaded_rules for r in g["rules"]), loaded_rules
    documented = documented_metrics()
    for group in yaml.safe_load(rules_path.read_text())["groups"]:
        for rule in group["rules"]:
            query(loaded, rule["expr"])  # parses and evaluates
            for name in re.findall(r"\bray_[a-zA-Z0-9_:]+", rule["expr"]):  # a histogram's by its documented name
                assert re.sub(r"_(bucket|sum|count)$", "", name) in documented or name in documented or (
                    not name.startswith("ray_dcpserve_")), (rule["alert"], name)


def test_kv_in_prometheus_matches_engine_stats_when_quiet(loaded: Stack) -> None:
    async def health() -> dict:  # quiet: nothing held or queued
        async with httpx.AsyncClient(base_url=loaded.http, timeout=30) as http:
            return (await http.get("/health")).json()

    asyncio.run(wait_until(health, lambda h: h["queued"] == 0 and h["kv_free_blocks"] == loaded.backend.capacity_blocks,
                           "the app is quiet"))
    stats = engine_stats(loaded)
    assert stats.engine.num_running == 0 and stats.engine.kv_capacity_tokens == loaded.backend.capacity_blocks * 32
    assert stats.engine.backend == loaded.backend.name
    replica = stats.replica_id
    expected = {
        "ray_dcpserve_kv_capacity_tokens": stats.engine.kv_capacity_tokens,
        "ray_dcpserve_kv_used_tokens": stats.engine.kv_used_tokens,
        "ray_dcpserve_kv_reserved_tokens": stats.engine.kv_reserved_tokens,
        "ray_dcpserve_kv_usage_ratio": stats.engine.kv_usage,
        "ray_dcpserve_kv_block_size_tokens": stats.engine.kv_block_size_tokens,
        "ray_dcpserve_sequences_running": stats.engine.num_running,
        # The prefix cache: the gauge, and the counters the replica fed from the engine's counts since it started.
        "ray_dcpserve_kv_cached_blocks": stats.engine.kv_blocks_cached,
        "ray_dcpserve_prefix_cache_query_tokens_total": stats.engine.prefix_cache_queries,
        "ray_dcpserve_prefix_cache_hit_tokens_total": stats.engine.prefix_cache_hits,
        "ray_dcpserve_prefix_cache_evictions_total": stats.engine.prefix_cache_evictions,
    }
    # A gauge reaches Prometheus within a gauge period + Ray's export + a scrape: poll until they agree.
    deadline = time.monotonic() + 60
    seen: dict[str, float | None] = {}
    while time.monotonic() < deadline:
        seen = {}
        for name in expected:
            result = query(loaded, f'{name}{{replica="{replica}"}}')["result"]
            seen[name] = float(result[0]["value"][1]) if len(result) == 1 else None
        if seen == {k: float(v) for k, v in expected.items()}:
            break
        time.sleep(2)
    assert seen == {k: float(v) for k, v in expected.items()}
    # Prefix routing: the admission queue's counters equal its own counts.
    queue = admission_stats(loaded)
    routing = {"ray_dcpserve_admission_prefix_query_blocks_total": float(queue.prefix_query_blocks),
               "ray_dcpserve_admission_prefix_hit_blocks_total": float(queue.prefix_hit_blocks)}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen = {name: sum(float(r["value"][1]) for r in query(loaded, of_app(name))["result"]) for name in routing}
        if seen == routing:
            break
        time.sleep(2)
    assert seen == routing
    ranks = query(loaded, f'ray_dcpserve_kv_rank_capacity_tokens{{replica="{replica}"}}')["result"]
    assert sorted((r["metric"]["rank"], float(r["value"][1])) for r in ranks) == sorted(
        (str(r.rank), float(r.tokens_capacity)) for r in stats.engine.per_rank)
