"""The metrics, the Grafana dashboard and the alert rules against a real Prometheus on loopback.

One app per engine backend (native: TP=2 x DCP=2 on logical GPUs, 32 KV blocks of 32 tokens; vLLM, in `make
test-vllm`: TP=2, 256 blocks of 32 tokens), an admission queue of 1 and a 12 s queue timeout, on a Ray head this
module starts (deployments/local_cluster.py, as `make serve` and tests/e2e do), and Prometheus started the way
`make observe` starts it (deployments/observe.py), with the project's scrape config pointed at this cluster's
service-discovery file. A bounded load makes every metric move: a normal stream, a never-fits 400, a long
request that fills the KV, a queued request that times out (429), one refused by a full queue (429), one that
waits and is admitted when the long request's client goes away, then one prompt twice (a prefix cache hit) and one
as large as the KV (evictions). Then: every panel's every query parses and returns data, promtool accepts the config
and the rules, every metric in docs/metrics.md exists (with its documented type in what Ray exports), every metric the
dashboard uses is documented or Ray's own, and the KV and prefix cache numbers Prometheus reports equal the engine's
stats() (the prefix routing counts, the admission queue's) at a quiet moment.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from deployments import local_cluster, observe
from engine.tiny_model import write_tiny_model
from tests.e2e.cluster import CAPACITY_BLOCKS, handle_calls, replica_stats, tiny_app_args

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "grafana" / "dashboards" / "dcpserve.json"
METRICS_DOC = REPO / "docs" / "metrics.md"

if shutil.which("prometheus") is None and not os.environ.get("CI"):
    pytest.skip("the prometheus binary is not installed (apt-get install prometheus; .ci/run installs it)",
                allow_module_level=True)

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(400)]

MODEL = "tiny-observe"
APP = "dcpserve"


@dataclass(frozen=True)
class Backend:
    """One engine backend's variant of the scenario."""

    name: str
    app_args: dict
    capacity_blocks: int
    never_fits_prompt: int  # prompt tokens of the request that can never run
    long_max_tokens: int  # the request that holds (nearly) all the KV long enough for the queue to time out
    outcomes: tuple[str, ...]  # admission outcomes the scenario produces


_COMMON = dict(
    admission="full",  # the scenario's requests hold their whole KV, so the queue waits and times out on cue
    max_queued_requests=1,
    queue_timeout_s=12,  # the long request outlives it; a loaded machine still frees its KV in time
    retry_after_s=1,
)
NATIVE = Backend("native", tiny_app_args(MODEL, **_COMMON), CAPACITY_BLOCKS, never_fits_prompt=1500,
                 long_max_tokens=1000,
                 outcomes=("admitted", "queued", "rejected_queue_full", "rejected_timeout", "rejected_never_fits"))
# vLLM: tp=2 dcp=1 (its CPU attention cannot shard KV), pages of 32 tokens, and a pool that holds one max_model_len
# request (vLLM's minimum), so the request that never fits is one past max_model_len (the ingress' 400, before
# admission). vLLM decodes the tiny model much faster: its long request is 8,000 tokens to outlive the queue timeout.
VLLM = Backend(
    "vllm",
    tiny_app_args(MODEL, backend="vllm", decode_context_parallel_size=1, block_size=32, max_model_len=8192,
                  kv_cache_memory_bytes=257 * 16384, **_COMMON),
    capacity_blocks=256, never_fits_prompt=8200, long_max_tokens=8000,
    outcomes=("admitted", "queued", "rejected_queue_full", "rejected_timeout"),
)


@dataclass
class Stack:
    """The app's URL, Prometheus' URL, and what it takes to reach the cluster."""

    backend: Backend
    http: str
    prometheus: str
    prometheus_config: Path
    ray_env: dict[str, str]
    ray_address: str


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
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    backend: Backend = request.param
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("CI is set but prometheus is not installed: .ci/run installs it before `make test`")
    state = tmp_path_factory.mktemp("observe")
    model_dir = write_tiny_model(state / "model")
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [{"name": APP, "route_prefix": "/", "import_path": "deployments.app:build_app",
                          "args": dict(backend.app_args)}],
    }
    (state / "serve_config.yaml").write_text(yaml.safe_dump(config))
    settings = local_cluster.LocalSettings(
        http_port=local_cluster.free_port(), ray_port=local_cluster.free_port(),
        dashboard_port=local_cluster.free_port(), num_gpus=4, state_dir=state,
        config=state / "serve_config.yaml", deploy_timeout_s=240,
    )
    env = local_cluster.ray_env(state)
    env["RAY_metrics_report_interval_ms"] = "1000"  # Ray exports every 10 s by default: too slow for a test
    temp_dir = Path(tempfile.mkdtemp(prefix="dcpobs-", dir="/tmp"))  # Ray's socket paths must stay short
    head = local_cluster.start_head(settings, env, temp_dir)
    prometheus = None
    try:
        local_cluster.wait_for_dashboard(settings, head)
        local_cluster.deploy_and_wait(settings, env, local_cluster.write_config(settings, model_dir), head)
        prometheus_config = observe.write_config(temp_dir, state / "prometheus")
        port = local_cluster.free_port()
        prometheus = observe.start_prometheus(binary, prometheus_config, port, state / "prometheus" / "data",
                                              state / "prometheus" / "prometheus.log")
        observe.wait_ready(port, prometheus)
        yield Stack(backend, f"http://127.0.0.1:{settings.http_port}", f"http://127.0.0.1:{port}", prometheus_config,
                    env, f"127.0.0.1:{settings.ray_port}")
    finally:
        if prometheus is not None:
            observe.stop(prometheus)
        local_cluster.stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


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
            expr = (target["expr"].replace("$application", APP).replace("$replica", ".*")
                    .replace("$__rate_interval", "2m"))
            out.append((panel["title"], expr))
    return out


def drive_load(stack: Stack) -> dict[str, int]:
    """Every outcome at least once; returns the HTTP status of each scenario."""
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=stack.http, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "def hello", "max_tokens": 8, "stream": True}) as reply:
            statuses["stream"] = reply.status_code
            assert [line for line in reply.iter_lines() if line.startswith("data:")][-1] == "data: [DONE]"
        statuses["chat"] = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).status_code
        statuses["never_fits"] = http.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt_tokens(stack.backend.never_fits_prompt), "max_tokens": 16}).status_code

    async def contention() -> None:
        # The long request holds all 32 blocks natively ((3 + 1000) / 32, about 17 s of decode even on a quiet
        # machine), 251 of 256 with vLLM ((3 + 8000) / 32); each later one needs 13 ((380 + 20) / 32).
        need_13 = {"model": MODEL, "prompt": prompt_tokens(380), "max_tokens": 20, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=stack.http, timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "def hello", "max_tokens": stack.backend.long_max_tokens,
                    "ignore_eos": True,
                    "stream": True}) as long:
                statuses["long"] = long.status_code
                lines = long.aiter_lines()
                while not (await lines.__anext__()).startswith("data:"):
                    pass
                times_out = asyncio.create_task(http.post("/v1/completions", json=need_13))
                await asyncio.sleep(1.0)  # it waits in the queue of one: the next is refused at once
                statuses["queue_full"] = (await http.post("/v1/completions", json=need_13)).status_code
                statuses["timeout"] = (await times_out).status_code  # 12 s queue_timeout_s
                waits = asyncio.create_task(http.post("/v1/completions", json=need_13))
                await asyncio.sleep(0.5)
            # The long request's client went away: its KV is freed and the waiting request is admitted.
            admitted = await waits
            statuses["queued_then_admitted"] = admitted.status_code
            if admitted.status_code != 200:
                statuses["queued_then_admitted_body"] = admitted.text

    asyncio.run(contention())
    if statuses.get("queued_then_admitted") != 200:
        # What held the KV when the waiting request gave up: the queue's view (grants, external, free per replica)
        # and the replica's own ledger, so a failure here says which side did not let go of the long request.
        statuses["admission_then"] = json.dumps(admission_stats(stack)["replicas"])
        engine = engine_stats(stack)
        statuses["replica_then"] = json.dumps({k: engine.get(k) for k in (
            "kv_held_blocks", "kv_free_blocks", "num_held", "num_running", "num_waiting", "num_pending")})

    # Prefix caching: the same prompt twice, one after the other. The pause lets the replica's KV reports (every
    # kv_report_period_s, 0.25 s) tell the admission queue what it caches before the second request is routed.
    with httpx.Client(base_url=stack.http, timeout=120) as http:
        repeated = {"model": MODEL, "prompt": REPEATED_PROMPT, "max_tokens": 4}
        statuses["prefix_first"] = http.post("/v1/completions", json=repeated).status_code
        time.sleep(2.0)
        statuses["prefix_repeated"] = http.post("/v1/completions", json=repeated).status_code
        if prefix_caching(stack):
            statuses["prefix_evicting"] = http.post("/v1/completions", json={
                "model": MODEL, "prompt": evicting_prompt(stack.backend), "max_tokens": 4}).status_code
    return statuses


def engine_stats(stack: Stack) -> dict:
    return replica_stats(stack.ray_address, stack.ray_env, APP)


def admission_stats(stack: Stack) -> dict:
    """KvAdmission.stats() (the queue's own counts) through a Serve handle, from a separate driver process."""
    return handle_calls(stack.ray_address, stack.ray_env, "KvAdmission", "stats", 1, APP)[0]


def prefix_caching(stack: Stack) -> bool:
    """Whether the replica's engine caches prefixes (EngineStats.prefix_caching); its prefix counters stay at 0 if
    not."""
    return bool(engine_stats(stack)["prefix_caching"])


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
    assert statuses == {"stream": 200, "chat": 200, "never_fits": 400, "long": 200, "queue_full": 429,
                        "timeout": 429, "queued_then_admitted": 200, "prefix_first": 200, "prefix_repeated": 200,
                        **({"prefix_evicting": 200} if caching else {})}, statuses
    # Samples of everything, and the counters' latest values (Ray exports every second, Prometheus scrapes every 5).
    expected = [f'ray_dcpserve_admission_requests_total{{outcome="{o}"}} > 0'
                for o in stack.backend.outcomes]
    expected += [f"{name}_count > 0" if kind == "histogram" else name for name, kind in documented_metrics().items()]
    expected += ['ray_dcpserve_http_responses_total{status_code="429"} >= 2']
    if caching:
        # The repeated prompt's 11 blocks: served from the replica's cache, and routed to the replica caching them;
        # the evicting prompt's evictions.
        expected += ["ray_dcpserve_prefix_cache_hit_tokens_total >= 352",
                     "ray_dcpserve_prefix_cache_evictions_total > 0",
                     "ray_dcpserve_admission_prefix_hit_blocks_total >= 11",
                     'ray_dcpserve_admission_prefix_routed_requests_total{prefix_hit="true"} >= 1',
                     'ray_dcpserve_admission_prefix_routed_requests_total{prefix_hit="false"} >= 1']
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
    if not prefix_caching(loaded):
        at_zero |= {"ray_dcpserve_prefix_cache_query_tokens_total", "ray_dcpserve_prefix_cache_hit_tokens_total",
                    "ray_dcpserve_prefix_cache_evictions_total", "ray_dcpserve_admission_prefix_query_blocks_total",
                    "ray_dcpserve_admission_prefix_hit_blocks_total",
                    "ray_dcpserve_admission_prefix_routed_requests_total"}
    for name, kind in documented.items():
        if kind != "gauge" and name not in at_zero:
            series = f"{name}_count" if kind == "histogram" else name
            value = sum(float(s["value"][1]) for s in query(loaded, series)["result"])
            assert value > 0, (name, value)
    assert query(loaded, 'ray_dcpserve_admission_queue_wait_seconds_sum > 11')["result"]  # the 12 s timeout waited
    dcp = loaded.backend.app_args.get("decode_context_parallel_size", 1)
    if dcp > 1:
        assert query(loaded, 'ray_dcpserve_engine_dcp_exchange_seconds_sum > 0')["result"]  # the DCP exchanges
    layout = query(loaded, "ray_dcpserve_layout_info")["result"][0]["metric"]
    assert (layout["tp"], layout["dcp"], layout["kv_heads"], layout["duplication_removed"]) == (
        "2", str(dcp), "1", str(dcp))


def test_every_dashboard_query_returns_data(loaded: Stack) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and {"application", "replica"} <= set(variables)
    for name in ("application", "replica"):
        expr = re.fullmatch(r"label_values\((.*), (\w+)\)", variables[name]["query"]["query"])
        assert expr, variables[name]
        series = query(loaded, expr.group(1).replace("$application", APP))["result"]
        assert {s["metric"][expr.group(2)] for s in series}, f"variable {name} has no values"
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
                     "DcpservePreemptions", "DcpserveReplicaUnhealthy"}
    assert all(r["health"] != "err" for g in loaded_rules for r in g["rules"]), loaded_rules
    documented = documented_metrics()
    for group in yaml.safe_load(rules_path.read_text())["groups"]:
        for rule in group["rules"]:
            query(loaded, rule["expr"])  # parses and evaluates
            for name in re.findall(r"\bray_[a-zA-Z0-9_:]+", rule["expr"]):
                assert name in documented or not name.startswith("ray_dcpserve_"), (rule["alert"], name)


def test_kv_in_prometheus_matches_engine_stats_when_quiet(loaded: Stack) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # quiet: nothing held, queued or running
        health = httpx.get(f"{loaded.http}/health", timeout=30).json()
        if health["queued"] == 0 and health["kv_free_blocks"] == loaded.backend.capacity_blocks:
            break
        time.sleep(0.5)
    stats = engine_stats(loaded)
    assert stats["num_running"] == 0 and stats["kv_capacity_tokens"] == loaded.backend.capacity_blocks * 32
    assert stats["backend"] == loaded.backend.name
    replica = stats["replica_id"]
    expected = {
        "ray_dcpserve_kv_capacity_tokens": stats["kv_capacity_tokens"],
        "ray_dcpserve_kv_used_tokens": stats["kv_used_tokens"],
        "ray_dcpserve_kv_reserved_tokens": stats["kv_reserved_tokens"],
        "ray_dcpserve_kv_usage_ratio": stats["kv_usage"],
        "ray_dcpserve_kv_block_size_tokens": stats["kv_block_size_tokens"],
        "ray_dcpserve_sequences_running": stats["num_running"],
        # The prefix cache: the gauge, and the counters the replica fed from the engine's counts since it started.
        "ray_dcpserve_kv_cached_blocks": stats["kv_blocks_cached"],
        "ray_dcpserve_prefix_cache_query_tokens_total": stats["prefix_cache_queries"],
        "ray_dcpserve_prefix_cache_hit_tokens_total": stats["prefix_cache_hits"],
        "ray_dcpserve_prefix_cache_evictions_total": stats["prefix_cache_evictions"],
    }
    # A gauge reaches Prometheus within a gauge period + Ray's export + a scrape: poll until they agree.
    deadline = time.monotonic() + 30
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
    routing = {"ray_dcpserve_admission_prefix_query_blocks_total": float(queue["prefix_query_blocks"]),
               "ray_dcpserve_admission_prefix_hit_blocks_total": float(queue["prefix_hit_blocks"])}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        seen = {name: sum(float(r["value"][1]) for r in query(loaded, name)["result"]) for name in routing}
        if seen == routing:
            break
        time.sleep(2)
    assert seen == routing
    ranks = query(loaded, f'ray_dcpserve_kv_rank_capacity_tokens{{replica="{replica}"}}')["result"]
    assert sorted((r["metric"]["rank"], float(r["value"][1])) for r in ranks) == sorted(
        (str(r["rank"]), float(r["tokens_capacity"])) for r in stats["per_rank"])
