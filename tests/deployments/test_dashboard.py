"""The Grafana dashboard and the alert rules against the metrics the recorders create, without Prometheus: every
query names only metrics that exist and only labels those series carry (in its selectors, its `by` / `on` /
`group_left` clauses and its panel's legend), every variable it uses is defined, and the panels do not overlap.

The labels each series carries come from dcpserve/deployments/metrics.py's recorders (their tag keys; a replica's
include its pool), plus the labels Ray Serve and Ray add to every series (docs/metrics.md). A small reader of the PromQL
the dashboard uses (promql_labels.py) works out the labels of each expression's result; it refuses syntax it does not
know, so a query it cannot check fails here instead of passing unread. tests/dashboards runs the same queries against
a real Prometheus.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from ray.util import metrics as ray_metrics

from dcpserve.deployments.metrics import (
    METRIC_NAMES,
    AdmissionMetrics,
    AutoscalingMetrics,
    IngressMetrics,
    ReplicaMetrics,
)
from tests.deployments.promql_labels import query_labels

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "grafana" / "dashboards" / "dcpserve.json"
ALERTS = REPO / "dashboards" / "prometheus" / "alerts.yml"

# What Ray Serve adds to a replica's metrics, and what Ray's metrics agent adds to every series (docs/metrics.md).
SERVE_LABELS = frozenset({"application", "deployment", "replica"})
RAY_LABELS = frozenset({"SessionName", "NodeAddress", "WorkerId", "Component", "Version"})
# Ray Serve's own metrics the dashboard and the alerts use (docs/metrics.md), by the controller: no replica label.
SERVE_OWN = {name: frozenset({"application", "deployment"}) | RAY_LABELS
             for name in ("ray_serve_autoscaling_target_replicas", "ray_serve_autoscaling_desired_replicas")}


def series_labels() -> dict[str, frozenset[str]]:
    """Every series name Prometheus shows for dcpserve's metrics (a histogram's _bucket, _sum and _count) -> the
    labels it carries."""
    # Each recorder with the labels added to its own tags: Serve's and Ray's in a replica; Ray's only in Serve's
    # controller, where the autoscaling policy tags its application and deployment itself.
    recorders = ((ReplicaMetrics(pool="default", tp=2, dcp=2, num_kv_heads=1, target_sequences_per_replica=4),
                  SERVE_LABELS | RAY_LABELS), (AdmissionMetrics(), SERVE_LABELS | RAY_LABELS),
                 (IngressMetrics(), SERVE_LABELS | RAY_LABELS), (AutoscalingMetrics(), RAY_LABELS))
    labels: dict[str, frozenset[str]] = {}
    shown: set[str] = set()  # the names of METRIC_NAMES
    for recorder, added in recorders:
        for metric in vars(recorder).values():
            if not isinstance(metric, ray_metrics.Metric):
                continue
            name = f"ray_{metric._name}"
            tags = frozenset(metric._tag_keys) | added
            if isinstance(metric, ray_metrics.Counter):
                name += "_total"
                labels[name] = tags
            elif isinstance(metric, ray_metrics.Histogram):
                labels[f"{name}_bucket"] = tags | {"le"}
                labels[f"{name}_sum"] = labels[f"{name}_count"] = tags
            else:
                labels[name] = tags
            shown.add(name)
    assert shown == set(METRIC_NAMES)
    return {**labels, **SERVE_OWN}


# ---- the dashboard ---------------------------------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def targets() -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every query of the dashboard."""
    return [(panel["title"], target["expr"], target.get("legendFormat", ""))
            for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def test_every_dashboard_query_names_only_metrics_and_labels_that_exist() -> None:
    labels = series_labels()
    queries = targets()
    assert len(queries) >= 60
    for title, expr, legend in queries:
        result = query_labels(expr, labels)
        assert result is not None, f"{title}: {expr} is a scalar"
        used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        assert used <= result, f"{title}: legend {legend!r} names {sorted(used - result)}, not on {sorted(result)}"


def test_every_variable_query_names_a_label_its_metric_carries() -> None:
    labels = series_labels()
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert {"datasource", "application", "replica", "pool"} <= set(variables)
    for name, variable in variables.items():
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
        assert match and match.group(0) == variable["definition"], variable
        carried = query_labels(match.group(1), labels)
        assert carried is not None and match.group(2) in carried, (name, match.group(2), carried)
    used = {v for _, expr, _ in targets() for v in re.findall(r"\$(\w+)", expr) if not v.startswith("__")}
    used |= {v for var in variables.values() if var["type"] == "query"
             for v in re.findall(r"\$(\w+)", var["query"]["query"])}
    assert used <= set(variables), sorted(used - set(variables))


def row_panels(title: str) -> list[dict]:
    """The panels of the dashboard's row of this title (up to the next row)."""
    panels = dashboard()["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title)
    following = panels[row + 1:]
    return following[:next((i for i, p in enumerate(following) if p["type"] == "row"), len(following))]


def test_the_layout_pools_row_shows_kv_sequences_itl_and_routing_share_by_pool() -> None:
    pool_panels = row_panels("Layout pools")
    metrics_by_pool = {re.sub(r"_(bucket|sum|count|total)$", "", name)
                       for p in pool_panels for t in p["targets"] if re.search(r"by \(pool\b", t["expr"])
                       for name in re.findall(r"\bray_dcpserve_\w+", t["expr"])}
    assert {"ray_dcpserve_kv_used_tokens", "ray_dcpserve_sequences_running",
            "ray_dcpserve_inter_token_latency_seconds", "ray_dcpserve_admission_pool_grants"} <= metrics_by_pool
    # Routing share: grants by pool (and by pool and reason) over all grants.
    shares = [t for p in pool_panels for t in p["targets"] if "pool_grants" in t["expr"]]
    assert {t["legendFormat"] for t in shares} == {"{{pool}}", "{{pool}} {{reason}}"}
    assert all("/ scalar(sum(rate(ray_dcpserve_admission_pool_grants_total" in t["expr"] for t in shares)


def test_the_service_levels_row_shows_latency_queue_and_refusals_by_tenant_and_priority() -> None:
    """Each service-level view groups its metric by the labels it is about (checked in the query's `by`, so a panel
    that lost its grouping fails here)."""
    labels = series_labels()
    grouped: set[tuple[str, frozenset[str]]] = set()
    for panel in row_panels("Service levels"):
        for target in panel["targets"]:
            for name in re.findall(r"\bray_dcpserve_\w+", target["expr"]):
                grouped.add((re.sub(r"_(bucket|sum|count|total)$", "", name),
                             query_labels(target["expr"], labels) or frozenset()))
    for metric, by in [
        ("ray_dcpserve_time_to_first_token_seconds", {"tenant"}),
        ("ray_dcpserve_time_to_first_token_seconds", {"priority"}),
        ("ray_dcpserve_inter_token_latency_seconds", {"tenant"}),
        ("ray_dcpserve_inter_token_latency_seconds", {"priority"}),
        ("ray_dcpserve_admission_queued_requests_by_level", {"tenant", "priority"}),
        ("ray_dcpserve_admission_queue_wait_seconds", {"priority"}),
        ("ray_dcpserve_admission_requests", {"tenant", "priority"}),
        ("ray_dcpserve_admission_requests", {"outcome", "tenant"}),
        ("ray_dcpserve_tenant_limited_requests", {"tenant", "limit"}),
    ]:
        assert (metric, frozenset(by)) in grouped, (metric, by)
    refusals = [t["expr"] for p in row_panels("Service levels") for t in p["targets"] if "outcome, tenant" in t["expr"]]
    assert refusals and all('outcome=~"rejected_.+"' in expr for expr in refusals)


def test_the_autoscaling_row_shows_every_input_replica_count_and_reason_of_the_slo_policy() -> None:
    exprs = [t["expr"] for p in row_panels("Service-level autoscaling") for t in p["targets"]]
    shown_inputs = {name for expr in exprs for group in re.findall(r'input=~"([^"]+)"', expr)
                    for name in group.split("|")}
    assert shown_inputs == {"ttft_s", "itl_s", "kv_load_blocks", "kv_remaining_blocks", "kv_capacity_blocks",
                            "kv_usage", "demand"}
    assert any("by (deployment, replicas) (ray_dcpserve_autoscaling_slo_replicas" in e for e in exprs)
    # Decisions: each reason's rate over all of the deployment's, so the shares add up to 1.
    assert any(re.search(r"sum by \(deployment, reason\) \(rate\(ray_dcpserve_autoscaling_slo_decisions_total.*"
                         r"/ on \(deployment\) group_left sum by \(deployment\)", e) for e in exprs)
    labels = series_labels()
    assert labels["ray_dcpserve_autoscaling_slo_input"] == {"application", "deployment", "input"} | RAY_LABELS
    assert "replica" not in labels["ray_dcpserve_autoscaling_slo_decisions_total"]  # the controller is no replica


def test_the_host_kv_tier_row_shows_occupancy_hits_copies_evictions_and_sessions() -> None:
    """Each view of the host KV tier groups its metric by what it is about (checked in the result's labels, so a
    panel that lost its grouping fails here): occupancy and the reload cost per replica, hit tokens by tier, bytes
    and seconds copied by direction, evictions by kind beside the reloads, and the admission queue's sessions."""
    labels = series_labels()
    panels = row_panels("Host KV tier")
    grouped: set[tuple[str, frozenset[str]]] = set()
    for panel in panels:
        for target in panel["targets"]:
            for name in re.findall(r"\bray_dcpserve_\w+", target["expr"]):
                grouped.add((re.sub(r"_(bucket|sum|count|total)$", "", name),
                             query_labels(target["expr"], labels) or frozenset()))
    for metric, by in [
        ("ray_dcpserve_kv_host_tier_used_blocks", {"replica"}),
        ("ray_dcpserve_kv_host_tier_capacity_blocks", {"replica"}),
        ("ray_dcpserve_kv_host_tier_reload_seconds_per_block", {"replica"}),
        ("ray_dcpserve_prefix_cache_tier_hit_tokens", {"tier"}),
        ("ray_dcpserve_kv_host_tier_copied_bytes", {"replica", "direction"}),
        ("ray_dcpserve_kv_host_tier_copy_seconds", {"replica", "direction"}),
        ("ray_dcpserve_kv_host_tier_evictions", {"replica", "eviction"}),
        ("ray_dcpserve_kv_host_tier_copied_blocks", {"replica"}),  # reloads, beside the evictions
        ("ray_dcpserve_admission_sessions", {"application"}),
    ]:
        assert (metric, frozenset(by)) in grouped, (metric, by)
    exprs = {panel["title"]: [t["expr"] for t in panel["targets"]] for panel in panels}
    units = {panel["title"]: panel["fieldConfig"]["defaults"].get("unit") for panel in panels}
    # Occupancy is used over capacity; counters are shown as rates; bandwidth in bytes/s, copy time as a share.
    assert re.fullmatch(r"sum by \(replica\) \(ray_dcpserve_kv_host_tier_used_blocks\{[^}]*\}\) / "
                        r"sum by \(replica\) \(ray_dcpserve_kv_host_tier_capacity_blocks\{[^}]*\}\)",
                        exprs["Host tier occupancy per replica"][0])
    assert all(re.search(r"rate\(ray_dcpserve_\w+_total", e) for es in exprs.values() for e in es if "_total" in e)
    assert units["Host tier copy bandwidth"] == "Bps" and units["Host tier copy seconds per second"] == "percentunit"
    assert any('direction="to_device"' in e for e in exprs["Host tier evictions and reloads /s"])


def test_the_host_kv_tier_alerts_say_what_to_do() -> None:
    """The tier's alerts (their firing is evaluated by promtool in tests/deployments/test_tier_metrics.py) last a
    while before they fire, tell what happens and what to do, and docs/metrics.md lists them."""
    rules = {rule["alert"]: rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}
    doc = (REPO / "docs" / "metrics.md").read_text()
    for name in ("DcpserveHostKvTierThrashing", "DcpserveHostKvTierCopiesSlowSteps"):
        rule = rules[name]
        assert rule["for"] in ("10m", "15m") and rule["labels"]["severity"] == "warning", name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        assert "kv_host_tier" in rule["annotations"]["description"] and "replicas" in rule["annotations"][
            "description"], name
        assert f"| `{name}` |" in doc, name
    thrash = rules["DcpserveHostKvTierThrashing"]["expr"]
    for series in ('eviction="dropped"', 'eviction="to_host"', 'direction="to_device"'):
        assert series in thrash, series


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    board = dashboard()
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            assert grid["w"] == 24 and grid["h"] == 1 and not panel.get("collapsed"), panel["title"]
        else:
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)) and all(
                t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
    # Grafana lays out panels in the order of the list: each row begins below everything before it.
    for index, panel in enumerate(panels):
        if panel["type"] == "row":
            above = [p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels[:index]]
            assert panel["gridPos"]["y"] >= max(above, default=0), panel["title"]


def test_every_alert_names_only_metrics_and_labels_that_exist() -> None:
    labels = series_labels()
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert rules
    for rule in rules:
        query_labels(rule["expr"], labels)


@pytest.mark.parametrize(("expr", "error"), [
    ("ray_dcpserve_kv_usage_ratio{pool_name=\"x\"}", "has no label 'pool_name'"),
    ("sum by (pool) (rate(ray_dcpserve_admission_requests_total[5m]))", "['pool'] not on"),
    ("sum by (pool) (rate(ray_dcpserve_http_responses_total[5m]))", "['pool'] not on"),
    ("ray_dcpserve_kv_usage_ratios", "no metric"),
    ("histogram_quantile(0.5, sum by (pool) (rate(ray_dcpserve_engine_step_seconds_bucket[5m])))", "without `le`"),
    ("sum by (pool) (ray_dcpserve_kv_used_tokens) / sum(ray_dcpserve_kv_capacity_tokens)", "matches no series"),
    ("ray_dcpserve_kv_used_tokens * on (replica) group_left (tp) ray_dcpserve_replica_node_info",
     "['tp'] not on the right side"),
    ("label_replace(ray_dcpserve_kv_used_tokens, \"a\", \"b\", \"c\", \"d\")", "extend the reader"),
])
def test_the_reader_refuses_what_does_not_exist(expr: str, error: str) -> None:
    """The checks above can fail: a query naming a label its series lack, or a metric that is not there, or
    syntax the reader does not know, is refused."""
    with pytest.raises(AssertionError, match=re.escape(error)):
        query_labels(expr, series_labels())


def test_the_reader_works_out_the_labels_of_the_result() -> None:
    labels = series_labels()
    assert query_labels("sum by (pool, reason) (rate(ray_dcpserve_admission_pool_grants_total[5m])) / "
                        "scalar(sum(rate(ray_dcpserve_admission_pool_grants_total[5m])))", labels) == {"pool", "reason"}
    assert query_labels("histogram_quantile(0.9, sum by (pool, le) "
                        "(rate(ray_dcpserve_inter_token_latency_seconds_bucket[5m])))", labels) == {"pool"}
    assert query_labels("sum by (node_id) (ray_dcpserve_kv_used_tokens * on (replica) group_left (node_id) "
                        "ray_dcpserve_replica_node_info)", labels) == {"node_id"}
    assert query_labels("max(ray_dcpserve_kv_usage_ratio) > 0.9", labels) == frozenset()
    assert query_labels("1 + 2", labels) is None
