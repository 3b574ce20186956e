"""`make serve`: the whole system on one CPU machine, with the embedded tiny model.

1. writes the tiny model once under .dcpserve/ (git-ignored): the tiny Llama, or with DCPSERVE_MODEL=tiny-mla
   (`make serve MODEL=tiny-mla`) the tiny DeepSeek-V2 (MLA + MoE), served from serve_config.local.mla.yaml at
   TP=4 x DCP=4;
2. starts a Ray head of its own on loopback with logical GPUs (`ray start --head --block`, own ports, own short
   temp dir, token auth with a token file of its own), in a new session so Ctrl-C reaches only this script. Every
   Ray gRPC port of it requires a certificate of a CA made for it (Ray's mutual TLS, unless DCPSERVE_TLS=0);
3. `serve deploy`s serve_config.local.yaml (model path and HTTP port filled in) and waits for RUNNING, printing
   progress; then prints the endpoint, a curl and an openai-client example and the dashboard address;
4. on Ctrl-C (or any failure) stops the Ray processes it started (its own process group) and nothing else.

Environment knobs (all optional): DCPSERVE_PORT (HTTP, 8000), DCPSERVE_RAY_PORT (GCS, 6390),
DCPSERVE_DASHBOARD_PORT (8265), DCPSERVE_NUM_GPUS (logical GPUs, 4), DCPSERVE_STATE_DIR (.dcpserve),
DCPSERVE_MODEL (tiny, or tiny-mla), DCPSERVE_CONFIG (serve_config.local.yaml; serve_config.local.mla.yaml for
tiny-mla), DCPSERVE_DEPLOY_TIMEOUT_S (600), DCPSERVE_API_KEY (unset: the API is open; set: clients must send
`Authorization: Bearer $DCPSERVE_API_KEY`), DCPSERVE_TLS (1, the default: Ray's mutual TLS with a CA made for this
cluster at this start, in the state dir's tls/, removed at stop; 0: off, with a warning of what is then exposed;
dcpserve/local/tls.py).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dcpserve.cluster.tls import ClusterTls
from dcpserve.local.tls import cluster_tls, export_line, node_env, tls_setting, without_tls

REPO = Path(__file__).resolve().parents[2]  # the repository: make serve and make observe run from a checkout
# DCPSERVE_MODEL -> (directory under the state dir, the serve config it runs with unless DCPSERVE_CONFIG says)
TINY_MODELS = {
    "tiny": ("tiny-model", "serve_config.local.yaml"),
    "tiny-mla": ("tiny-mla-model", "serve_config.local.mla.yaml"),
}


@dataclass(frozen=True)
class LocalSettings:
    """Everything `make serve` reads from the environment, once."""

    http_port: int
    ray_port: int
    dashboard_port: int
    num_gpus: int
    state_dir: Path
    config: Path
    deploy_timeout_s: float
    api_key_env: str | None = None  # "DCPSERVE_API_KEY" when it is set: the app then requires that key
    model: str = "tiny"  # a key of TINY_MODELS
    tls: bool = True  # Ray's mutual TLS, with a CA of this cluster's own (DCPSERVE_TLS)

    @classmethod
    def from_env(cls) -> LocalSettings:
        env = os.environ
        model = env.get("DCPSERVE_MODEL", "tiny")
        if model not in TINY_MODELS:
            raise SystemExit(
                f"DCPSERVE_MODEL (make serve MODEL=...) must be one of {sorted(TINY_MODELS)}, got {model!r}")
        return cls(
            http_port=int(env.get("DCPSERVE_PORT", "8000")),
            ray_port=int(env.get("DCPSERVE_RAY_PORT", "6390")),
            dashboard_port=int(env.get("DCPSERVE_DASHBOARD_PORT", "8265")),
            num_gpus=int(env.get("DCPSERVE_NUM_GPUS", "4")),
            state_dir=Path(env.get("DCPSERVE_STATE_DIR", REPO / ".dcpserve")).resolve(),
            config=Path(env.get("DCPSERVE_CONFIG") or REPO / TINY_MODELS[model][1]).resolve(),
            deploy_timeout_s=float(env.get("DCPSERVE_DEPLOY_TIMEOUT_S", "600")),
            # The Ray head (and so every replica) inherits this environment: the app reads the key there, so the
            # secret never enters the generated config file.
            api_key_env="DCPSERVE_API_KEY" if env.get("DCPSERVE_API_KEY") else None,
            model=model,
            tls=tls_setting(),
        )


LOG_PREFIX = "make serve"  # `make cluster` (dcpserve/local/nodes.py) says its own name


def say(line: str) -> None:
    print(f"[{LOG_PREFIX}] {line}", flush=True)


def free_ports(count: int, exclude: Iterable[int] = ()) -> list[int]:
    """count distinct ports free on 127.0.0.1 now, none of them in exclude. Every socket stays bound until all are
    chosen: ports taken one at a time can repeat (the kernel may hand a just-released port out again; two of a
    head's component ports once came out equal and `ray start` refused them)."""
    excluded = set(exclude)
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            if port not in excluded:
                ports.append(port)
        return ports


def free_port(exclude: Iterable[int] = ()) -> int:
    return free_ports(1, exclude)[0]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def ensure_tiny_model(state_dir: Path, model: str = "tiny") -> Path:
    """The tiny model `model` (a key of TINY_MODELS) under state_dir, written the first time."""
    from dcpserve.cluster.tiny_model import is_tiny_model_dir, write_tiny_mla_model, write_tiny_model

    model_dir = state_dir / TINY_MODELS[model][0]
    if is_tiny_model_dir(model_dir) and (model_dir / "model.safetensors").is_file():
        say(f"{model} model: {model_dir} (already there)")
        return model_dir
    say(f"writing the {model} model to {model_dir} (once)")
    write = write_tiny_mla_model if model == "tiny-mla" else write_tiny_model
    return write(model_dir, log=lambda line: say(f"  {line}"))


# Ray on one machine binds to loopback only when this is 0: otherwise `ray start --node-ip-address 127.0.0.1` (and
# ray.init) resolve 127.0.0.1 to the machine's routable address, and the GCS, the raylet, the client server and the
# dashboard and runtime-env agents listen there or on every interface (Ray's services.resolve_ip_for_localhost; the
# variable is the one macOS and Windows use for single-machine Ray). It must be set before ray is imported.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def bind_ray_to_loopback() -> None:
    """Makes the Ray that this process starts or joins listen on 127.0.0.1 only (LOOPBACK_ENV). Call it before
    importing ray: Ray reads the variable once, at import."""
    os.environ.update(LOOPBACK_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError("ray was imported before bind_ray_to_loopback(): call it first, or set "
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment")


def ray_env(state_dir: Path, tls: ClusterTls | None) -> dict[str, str]:
    """The environment of this cluster's head and CLI calls: token auth with this cluster's own token file (never
    the user's ~/.ray/auth_token), loopback only (LOOPBACK_ENV), and mutual TLS as the identity `head` of tls
    (dcpserve/local/tls.py; None: RAY_USE_TLS=0), never what this process itself uses."""
    token_path = state_dir / "ray_auth_token"
    if not token_path.is_file():
        token_path.write_text(secrets.token_hex(32))
        token_path.chmod(0o600)
    env = without_tls(dict(os.environ))
    env.update(node_env(tls, "head"))
    env.pop("RAY_AUTH_TOKEN", None)
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path), "RAY_ADDRESS": ""})
    env.update(LOOPBACK_ENV)
    return env


def ray_bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def start_head(settings: LocalSettings, env: dict[str, str], temp_dir: Path,
               autoscaling_config: Path | None = None, keeper: list[str] | None = None) -> subprocess.Popen[bytes]:
    """`ray start --head --block` on loopback with this cluster's ports and temp dir, in a session of its own.

    With autoscaling_config (`make cluster`, dcpserve/local/nodes.py) the head runs Ray's autoscaler with that
    config, whose provider starts the worker nodes on this machine (dcpserve/local/provider.py; Ray's fake provider
    requires RAY_FAKE_CLUSTER=1), and the head's object store is the size its node type declares. With keeper (a
    command: dcpserve/local/head_keeper.py's) that command runs instead, given `ray start --head` without --block to
    run and supervise."""
    for port, what in ((settings.ray_port, "DCPSERVE_RAY_PORT"), (settings.dashboard_port, "DCPSERVE_DASHBOARD_PORT"),
                       (settings.http_port, "DCPSERVE_PORT")):
        if port_in_use(port):
            raise SystemExit(f"port {port} is in use on 127.0.0.1: set {what} to a free port")
    # The head's other ports, distinct from each other and from the cluster's own.
    ports = free_ports(7, exclude=(settings.ray_port, settings.dashboard_port, settings.http_port))
    command = [
        ray_bin("ray"), "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1", "--port", str(settings.ray_port),
        "--num-gpus", str(settings.num_gpus), "--num-cpus", str(max(8, os.cpu_count() or 1)),
        "--temp-dir", str(temp_dir), "--include-dashboard", "true",
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(settings.dashboard_port),
        "--ray-client-server-port", str(ports.pop()),
        "--dashboard-agent-listen-port", str(ports.pop()),
        "--dashboard-agent-grpc-port", str(ports.pop()),
        "--runtime-env-agent-port", str(ports.pop()),
        "--metrics-export-port", str(ports.pop()),
        "--disable-usage-stats",
    ]
    if keeper is not None:
        command = [*keeper, "--", *[part for part in command if part != "--block"]]
    if autoscaling_config is not None:
        cluster = yaml.safe_load(autoscaling_config.read_text())
        head_type = cluster["available_node_types"][cluster["head_node_type"]]
        object_store = head_type.get("resources", {}).get("object_store_memory")
        command += ["--autoscaling-config", str(autoscaling_config)]
        command += ["--object-store-memory", str(object_store)] if object_store else []
        # The autoscaler's loop period (5 s by default): how soon a pending placement group becomes a node launch.
        env = {**env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "2"}
    # The metrics ports of the autoscaler monitor and the dashboard are fixed by default (44217, 44227): two heads on
    # one machine would collide. Ray reads them from these variables only.
    env = {**env, "AUTOSCALER_METRIC_PORT": str(ports.pop()), "DASHBOARD_METRIC_PORT": str(ports.pop())}
    log = open(settings.state_dir / "ray_head.log", "wb")  # noqa: SIM115 - lives as long as the head
    say(f"starting a Ray head on 127.0.0.1:{settings.ray_port} ({settings.num_gpus} logical GPUs, "
        f"temp dir {temp_dir}); log: {log.name}")
    # A session of its own: Ctrl-C goes to this script only, and stopping means signalling exactly this group.
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_dashboard(settings: LocalSettings, head: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise SystemExit(f"ray start exited with {head.returncode}; see {settings.state_dir / 'ray_head.log'}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{settings.dashboard_port}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers (401 without the token): it is up
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the Ray dashboard did not come up within {timeout_s:.0f}s")


def write_config(settings: LocalSettings, model_dir: Path) -> Path:
    config = yaml.safe_load(settings.config.read_text())
    config.setdefault("http_options", {}).update({"host": "127.0.0.1", "port": settings.http_port})
    for app in config["applications"]:
        app.setdefault("args", {})["model"] = str(model_dir)
        if settings.api_key_env is not None:
            app["args"]["api_keys_env"] = settings.api_key_env
    out = settings.state_dir / "serve_config.generated.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


@dataclass(frozen=True)
class ServeApi:
    """Serve's REST API on the head's dashboard (what `serve deploy` and `serve status` call), with the cluster's
    token: the applications' states in-process, without a CLI subprocess per poll."""

    dashboard_port: int
    token_path: Path

    def _request(self, method: str, body: dict[str, Any] | None = None, timeout_s: float = 30) -> dict[str, Any]:
        import json
        import urllib.request

        request = urllib.request.Request(
            f"http://127.0.0.1:{self.dashboard_port}/api/serve/applications/", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token_path.read_text().strip()}",
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            text = reply.read().decode()
        reply_body: dict[str, Any] = json.loads(text) if text.strip() else {}
        return reply_body

    def details(self) -> dict[str, Any]:
        """GET /api/serve/applications/: Serve's ServeInstanceDetails ({} of applications before Serve starts)."""
        return self._request("GET")

    def deploy(self, config: dict[str, Any]) -> None:
        """PUT /api/serve/applications/: the declarative config (exactly what `serve deploy` sends). Applications
        it does not name are deleted."""
        self._request("PUT", config, timeout_s=120)

    def application(self, name: str) -> dict[str, Any]:
        applications: dict[str, dict[str, Any]] = self.details().get("applications") or {}
        return applications.get(name, {})


def app_progress(app: dict[str, Any]) -> str:
    """One line of an application's state: its status and each deployment's replica states."""
    parts = []
    for name, deployment in (app.get("deployments") or {}).items():
        states: dict[str, int] = {}
        for replica in deployment.get("replicas", []):
            states[replica["state"]] = states.get(replica["state"], 0) + 1
        parts.append(f"{name}: {deployment.get('status')} {states}")
    return f"{app.get('status', 'NOT_STARTED')} " + "; ".join(parts)


def wait_until_running(api: ServeApi, app_name: str, timeout_s: float, head: subprocess.Popen[bytes] | None = None,
                       log: Path | None = None, progress: Callable[[str], None] = say) -> None:
    """Polls Serve's API until the application is RUNNING, saying each change of its state; SystemExit when it
    fails to deploy (with Serve's message), when the head exits, or after timeout_s (with the last state)."""
    start = time.monotonic()
    last = ""
    while True:
        if head is not None and head.poll() is not None:
            raise SystemExit(f"the Ray head exited ({head.returncode}); see {log}")
        try:
            app = api.application(app_name)
        except OSError as err:  # the dashboard restarting, or busy: ask again
            app = {"status": f"NOT_STARTED (Serve's API: {err})"}
        line = app_progress(app)
        if line != last:
            progress(f"{line} ({time.monotonic() - start:.0f}s)")
            last = line
        if app.get("status") == "RUNNING":
            return
        if app.get("status") == "DEPLOY_FAILED":
            raise SystemExit(f"deploy failed: {app.get('message', '')}")
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"the app was not RUNNING within {timeout_s:.0f}s; last state: {line}")
        time.sleep(0.5)


def deploy_and_wait(settings: LocalSettings, env: dict[str, str], config_path: Path,
                    head: subprocess.Popen[bytes]) -> None:
    """`serve deploy` (the CLI users run), then Serve's API until every application in the config is RUNNING."""
    address = f"http://127.0.0.1:{settings.dashboard_port}"
    say(f"serve deploy {config_path}")
    subprocess.run([ray_bin("serve"), "deploy", str(config_path), "--address", address], env=env, check=True)
    api = ServeApi(settings.dashboard_port, Path(env["RAY_AUTH_TOKEN_PATH"]))
    deadline = time.monotonic() + settings.deploy_timeout_s
    for app in yaml.safe_load(config_path.read_text())["applications"]:
        wait_until_running(api, app["name"], max(deadline - time.monotonic(), 0), head,
                           settings.state_dir / "ray_head.log")


def cli_exports(env: dict[str, str], tls: ClusterTls | None) -> str:
    """What a user's shell exports for Ray's CLI (`ray status`, `serve deploy`) against this cluster: token auth,
    loopback, and with TLS the client identity's paths (the files, never their contents)."""
    loopback = " ".join(f"{key}={value}" for key, value in LOOPBACK_ENV.items())
    line = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={env['RAY_AUTH_TOKEN_PATH']} {loopback}"
    return line + (f" {export_line(node_env(tls, 'client'))}" if tls is not None else "")


def tls_status(tls: ClusterTls | None) -> str:
    """The banner's line on mutual TLS."""
    if tls is None:
        return "off (DCPSERVE_TLS=0): every Serve replica's gRPC port takes plain connections on every interface"
    return (f"on: every Ray gRPC port requires a certificate of this cluster's CA ({tls.directory}, made at this "
            "start)")


def print_banner(settings: LocalSettings, model_name: str, env: dict[str, str], tls: ClusterTls | None) -> None:
    base = f"http://127.0.0.1:{settings.http_port}/v1"
    # The key itself is never printed: the examples read it from the environment.
    auth = " -H \"Authorization: Bearer $DCPSERVE_API_KEY\"" if settings.api_key_env else ""
    key = "os.environ['DCPSERVE_API_KEY']" if settings.api_key_env else "'none'"
    access = ("API keys: required (DCPSERVE_API_KEY)" if settings.api_key_env
              else "API keys: none (set DCPSERVE_API_KEY)")
    print(f"""
dcpserve is serving {model_name!r} (tiny random-weight model: the text is gibberish, the system is real)

  endpoint   {base}   ({access})
  dashboard  http://127.0.0.1:{settings.dashboard_port}
  Ray TLS    {tls_status(tls)}
  Ray's CLI  export {cli_exports(env, tls)}

  curl {base}/completions -H 'Content-Type: application/json'{auth} \\
       -d '{{"model": "{model_name}", "prompt": "def hello", "max_tokens": 16}}'

  python -c "import os, openai; c = openai.OpenAI(base_url='{base}', api_key={key}); \\
print(c.chat.completions.create(model='{model_name}', messages=[{{'role': 'user', 'content': 'hi'}}], \\
max_tokens=16).choices[0].message.content)"

Ctrl-C stops this Ray head and everything it started (and nothing else).
""", flush=True)


def stop_head(head: subprocess.Popen[bytes]) -> None:
    """Stops the Ray processes of our own session (the process group `ray start` leads), and nothing else.

    SIGTERM to `ray start --block` first: it stops its node's processes in order, an idle head in about 4 s. SIGTERM
    to the whole group at once is slower: the GCS, raylet and autoscaler each begin their own shutdown, were still
    running 10 s later, and the stop ended in SIGKILL after 17 s. Whatever is left in the group after `ray start`
    (a process it does not track) gets SIGTERM, then SIGKILL."""
    if head.poll() is None or _group_alive(head.pid):
        say("stopping the Ray head this command started...")
        steps: tuple[tuple[Callable[[int], None], signal.Signals, float], ...] = (
                 (lambda sig: os.kill(head.pid, sig), signal.SIGTERM, 20.0),
                 (lambda sig: os.killpg(head.pid, sig), signal.SIGTERM, 5.0),
                 (lambda sig: os.killpg(head.pid, sig), signal.SIGKILL, 5.0))
        for send, sig, wait_s in steps[0 if head.poll() is None else 1:]:
            try:
                send(sig)
            except ProcessLookupError:  # `ray start` ended just now, or the whole group did
                if _group_alive(head.pid):
                    continue
                break
            deadline = time.monotonic() + wait_s
            # poll() reaps `ray start` itself: an unreaped zombie would keep the group "alive" until the deadline.
            while time.monotonic() < deadline and (head.poll() is None or _group_alive(head.pid)):
                time.sleep(0.2)
            if head.poll() is not None and not _group_alive(head.pid):
                break
    try:
        head.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    say("stopped")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """Makes Ctrl-C and `kill` raise KeyboardInterrupt, so the caller's cleanup stops what it started. Installed
    explicitly: a shell without job control starts background commands with SIGINT ignored, and Python would then
    never raise KeyboardInterrupt."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def main() -> None:
    stop_on_signals()
    settings = LocalSettings.from_env()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_tiny_model(settings.state_dir, settings.model)
    tls = cluster_tls(settings.state_dir, settings.tls, say)
    env = ray_env(settings.state_dir, tls)
    temp_dir = Path(f"/tmp/dcpserve-{os.getuid()}-{settings.ray_port}")
    config_path = write_config(settings, model_dir)
    model_name = yaml.safe_load(config_path.read_text())["applications"][0]["args"].get("served_model_name") or \
        model_dir.name
    head = start_head(settings, env, temp_dir)
    try:
        wait_for_dashboard(settings, head)
        deploy_and_wait(settings, env, config_path, head)
        print_banner(settings, model_name, env, tls)
        while head.poll() is None:
            time.sleep(1)
        say(f"the Ray head exited ({head.returncode}); see {settings.state_dir / 'ray_head.log'}")
    except KeyboardInterrupt:
        print()
    finally:
        stop_head(head)
        if tls is not None:  # the cluster's keys die with it
            shutil.rmtree(tls.directory, ignore_errors=True)


if __name__ == "__main__":
    main()
