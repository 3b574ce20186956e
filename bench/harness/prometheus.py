"""The metric lines a Ray cluster's nodes export: what the benchmarks that read the app's own counters share.

Ray writes the Prometheus targets of its nodes' metrics agents to <temp dir>/prom_metrics_service_discovery.json;
each target's /metrics is plain Prometheus text. Ray exports custom metrics every metrics_report_interval_ms (10 s
by default), so a benchmark waits that long after its load before it reads them.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def metric_lines(ray_temp: Path) -> Iterator[str]:
    """Every line of every node's /metrics, through the newest service-discovery file under ray_temp (none if
    there is no such file); a target that does not answer is skipped."""
    files = sorted(ray_temp.glob("**/prom_metrics_service_discovery.json"))
    for entry in json.loads(files[-1].read_text()) if files else []:
        for target in entry.get("targets", []):
            try:
                body = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read().decode()
            except OSError:
                continue
            yield from body.splitlines()
