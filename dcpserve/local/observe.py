"""`make observe`: Prometheus on loopback, scraping the `make serve` cluster through Ray's service discovery.

1. installs Debian's prometheus package when the binary is missing (as root; the package's service is not started:
   apt runs with a policy-rc.d that refuses service starts, put in place only for the install);
2. writes dashboards/prometheus/prometheus.yml (+ alerts.yml) into the state dir with the cluster's Ray temp dir
   filled in, checks both with promtool, and runs `prometheus` itself on 127.0.0.1 with storage under the state dir;
3. prints where to point Grafana (the provisioning files in dashboards/grafana), runs until Ctrl-C, then stops the
   Prometheus it started and nothing else.

Environment knobs: DCPSERVE_RAY_PORT (the `make serve` cluster, 6390), DCPSERVE_STATE_DIR (.dcpserve),
DCPSERVE_PROMETHEUS_PORT (9090), DCPSERVE_RAY_TEMP_DIR (default: the one `make serve` uses for that port).
tests/dashboards uses the same functions against a cluster of its own.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dcpserve.local.debian import ensure_debian_package
from dcpserve.local.serve import stop_on_signals

REPO = Path(__file__).resolve().parents[2]  # the repository: make serve and make observe run from a checkout
DASHBOARDS = REPO / "dashboards"
SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # ray._private.ray_constants


def say(line: str) -> None:
    print(f"[make observe] {line}", flush=True)


def write_config(ray_temp_dir: Path, out_dir: Path) -> Path:
    """The project's scrape config and alert rules, with the Ray temp dir filled in, under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = (DASHBOARDS / "prometheus" / "prometheus.yml").read_text().replace("RAY_TEMP_DIR", str(ray_temp_dir))
    shutil.copyfile(DASHBOARDS / "prometheus" / "alerts.yml", out_dir / "alerts.yml")
    path = out_dir / "prometheus.yml"
    path.write_text(config)
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool") or "promtool"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def start_prometheus(binary: str, config: Path, port: int, storage: Path, log: Path) -> subprocess.Popen[bytes]:
    """Prometheus on 127.0.0.1:port in a session of its own (so stopping it signals nothing else)."""
    storage.mkdir(parents=True, exist_ok=True)
    command = [
        binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={storage}", "--storage.tsdb.retention.time=2d", "--web.enable-lifecycle",
    ]
    out = open(log, "wb")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(port: int, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise RuntimeError(f"prometheus was not ready on 127.0.0.1:{port} within {timeout_s:.0f}s")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group this module started, SIGKILL after 10 s."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)
    except ProcessLookupError:
        pass


def main() -> None:
    stop_on_signals()
    env = os.environ
    ray_port = int(env.get("DCPSERVE_RAY_PORT", "6390"))
    state_dir = Path(env.get("DCPSERVE_STATE_DIR", REPO / ".dcpserve")).resolve()
    port = int(env.get("DCPSERVE_PROMETHEUS_PORT", "9090"))
    ray_temp_dir = Path(env.get("DCPSERVE_RAY_TEMP_DIR", f"/tmp/dcpserve-{os.getuid()}-{ray_port}"))
    discovery = ray_temp_dir / SERVICE_DISCOVERY_FILE
    if not discovery.exists():
        say(f"warning: {discovery} does not exist yet: start `make serve` (same DCPSERVE_RAY_PORT); Prometheus "
            f"picks the targets up when Ray writes it")
    binary = ensure_debian_package("prometheus", "prometheus", say)
    out_dir = state_dir / "prometheus"
    config = write_config(ray_temp_dir, out_dir)
    for check in (("check", "config", str(config)), ("check", "rules", str(out_dir / "alerts.yml"))):
        result = promtool(*check)
        if result.returncode != 0:
            raise SystemExit(f"promtool {' '.join(check)} failed:\n{result.stdout}{result.stderr}")
    process = start_prometheus(binary, config, port, out_dir / "data", out_dir / "prometheus.log")
    try:
        wait_ready(port, process)
        url = f"http://127.0.0.1:{port}"
        provisioning = DASHBOARDS / "grafana" / "provisioning"
        dashboards = DASHBOARDS / "grafana" / "dashboards"
        print(f"""
Prometheus is scraping the Ray cluster of {ray_temp_dir} (service discovery: {discovery})

  prometheus  {url}          (alerts: {url}/alerts; log: {out_dir / 'prometheus.log'})

Grafana: point a Prometheus data source at {url}, or start Grafana with this repository's provisioning:

  docker run --rm --network host -e PROMETHEUS_URL={url} -e GF_SERVER_HTTP_ADDR=127.0.0.1 \\
    -v {provisioning}:/etc/grafana/provisioning \\
    -v {dashboards}:/var/lib/grafana/dashboards/dcpserve grafana/grafana
  # then http://127.0.0.1:3000 (admin / admin), dashboard "dcpserve: KV cache, admission and latency"

Ctrl-C stops this Prometheus (and nothing else).
""", flush=True)
        while process.poll() is None:
            time.sleep(1)
        say(f"prometheus exited ({process.returncode}); see {out_dir / 'prometheus.log'}")
        sys.exit(1)
    except KeyboardInterrupt:
        print()
    finally:
        stop(process)
        say("stopped")


if __name__ == "__main__":
    main()
