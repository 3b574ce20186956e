"""Fault injection and load for the e2e fault tests, tests/local and the soak and burst benchmarks, on a cluster the
caller started itself.

Processes are found by what the cluster's own APIs say about them (Serve's replica details, Ray's state API: the
pid of a replica or of a rank actor), never by process name, and killed with SIGKILL by that pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from bench.harness.cluster import APP_NAME, ServeCluster


class Served(Protocol):
    """An app answering at url (the session head's ServeCluster, or tests/local' local multi-node cluster)."""

    @property
    def url(self) -> str: ...


def _dashboard_get(cluster: ServeCluster, path: str) -> Any:
    token = Path(cluster.env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    reply = httpx.get(f"http://127.0.0.1:{cluster.settings.dashboard_port}{path}",
                      headers={"Authorization": f"Bearer {token}"}, timeout=30)
    reply.raise_for_status()
    return reply.json()


def serve_replicas(cluster: ServeCluster, deployment: str) -> list[dict[str, Any]]:
    """RUNNING replicas of a deployment of the app, with their pid (Serve's REST API)."""
    app = cluster.serve_details().get("applications", {}).get(APP_NAME, {})
    replicas = app.get("deployments", {}).get(deployment, {}).get("replicas", [])
    return [r for r in replicas if r.get("state") == "RUNNING"]


def alive_actor_pids(cluster: ServeCluster, class_name: str) -> list[int]:
    """Pids of the ALIVE actors of a class (Ray's state API), e.g. the TP ranks (RankWorker)."""
    reply = _dashboard_get(cluster, "/api/v0/actors?limit=10000&detail=true")
    data = reply.get("data", {}).get("result", {})
    rows = data.get("result", data) if isinstance(data, dict) else data
    return sorted(int(a["pid"]) for a in rows
                  if a.get("class_name") == class_name and a.get("state") == "ALIVE" and a.get("pid"))


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a local process (Linux /proc), in seconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def health(cluster: Served, headers: dict[str, str] | None = None) -> dict[str, Any]:
    reply = httpx.get(f"{cluster.url}/health", headers=headers, timeout=30)
    return {"http_status": reply.status_code, **reply.json()}


def wait_until_serving(cluster: Served, model: str, timeout_s: float, headers: dict[str, str] | None = None
                       ) -> float:
    """Seconds until a small completion succeeds (polled every 0.5 s); AssertionError past timeout_s."""
    start = time.monotonic()
    last = ""
    while time.monotonic() - start < timeout_s:
        try:
            reply = httpx.post(f"{cluster.url}/v1/completions", headers=headers, timeout=30,
                               json={"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
            if reply.status_code == 200:
                return time.monotonic() - start
            last = f"{reply.status_code} {reply.text[:200]}"
        except httpx.HTTPError as err:
            last = repr(err)
        time.sleep(0.5)
    raise AssertionError(f"no successful completion within {timeout_s:.0f}s; last: {last}")


def wait_until_nothing_held(cluster: Served, timeout_s: float) -> float:
    """Seconds until /health shows no KV granted or held by any replica; AssertionError past timeout_s."""
    start = time.monotonic()
    counts: dict[str, Any] = {}
    while time.monotonic() - start < timeout_s:
        try:
            counts = health(cluster)
            if counts["http_status"] == 200 and counts["kv_granted_blocks"] + counts["kv_external_blocks"] == 0:
                return time.monotonic() - start
        except (httpx.HTTPError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"KV still held {timeout_s:.0f}s after the load stopped: {counts}")


def _error_message(body: bytes) -> str:
    """An OpenAI error body's message; anything else (e.g. Serve's proxy answering for a dead ingress) verbatim."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {body[:200]!r}"


@dataclass
class Outcome:
    """One request of the load: how it ended."""

    kind: str  # "stream" | "json" | "chat" | "burst"
    started: float
    ended: float | None = None
    status: int | None = None  # HTTP status; for a stream that broke after 200: still 200, with error set
    error: str | None = None  # an error event in the stream, a broken connection, or the client's timeout
    tokens: int = 0

    @property
    def hung(self) -> bool:
        return self.error is not None and self.error.startswith("client timeout")


@dataclass
class Load:
    """Streaming and non-streaming clients in loops, in a thread of their own, until stop(); every request's end is
    recorded, so the caller can prove none was lost or left hanging."""

    url: str
    model: str
    streams: int = 2
    plain: int = 2
    chats: int = 0
    max_tokens: int = 120
    client_timeout_s: float = 120.0
    headers: dict[str, str] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self, timeout_s: float) -> None:
        """Stops issuing requests and waits (at most timeout_s) for those in flight to end."""
        self._stop.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the load's requests did not end in time"

    def in_flight(self) -> int:
        return sum(o.ended is None for o in list(self.outcomes))

    def summary(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for o in list(self.outcomes):
            counts["in flight" if o.ended is None else "hung" if o.hung else
                   f"{o.status} error" if o.error else str(o.status)] += 1
        return counts

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.streams + self.plain + self.chats + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.client_timeout_s, limits=limits,
                                     headers=self.headers) as http:
            clients = [self._loop(http, "stream", i) for i in range(self.streams)]
            clients += [self._loop(http, "json", 100 + i) for i in range(self.plain)]
            clients += [self._loop(http, "chat", 200 + i) for i in range(self.chats)]
            await asyncio.gather(*clients)

    async def _loop(self, http: httpx.AsyncClient, kind: str, index: int) -> None:
        seed = index * 1000
        while not self._stop.is_set():
            seed += 1
            outcome = Outcome(kind, time.monotonic())
            self.outcomes.append(outcome)
            body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 1.0,
                                    "seed": seed, "stream": kind == "stream"}
            if kind == "chat":
                body["messages"] = [{"role": "user", "content": f"question {seed}: tell me about load {index}"}]
            else:
                body["prompt"] = [(index * 7 + j) % 200 + 3 for j in range(40)]
            try:
                await asyncio.wait_for(self._one(http, body, outcome), timeout=self.client_timeout_s)
            except TimeoutError:
                outcome.error = f"client timeout after {self.client_timeout_s:.0f}s"
            except httpx.HTTPError as err:
                outcome.error = f"connection: {err!r}"
            except Exception as err:  # noqa: BLE001 - whatever the server sent, this request ended: record how
                outcome.error = f"unexpected: {err!r}"
            outcome.ended = time.monotonic()
            if outcome.status is not None and outcome.status != 200:
                await asyncio.sleep(0.5)  # a refused client backs off, as Retry-After asks

    @staticmethod
    async def _one(http: httpx.AsyncClient, body: dict[str, Any], outcome: Outcome) -> None:
        if not body["stream"]:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            reply = await http.post(path, json=body)
            outcome.status = reply.status_code
            if reply.status_code == 200:
                outcome.tokens = reply.json()["usage"]["completion_tokens"]
            else:
                outcome.error = _error_message(reply.content)
            return
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            outcome.status = reply.status_code
            if reply.status_code != 200:
                outcome.error = _error_message(await reply.aread())
                return
            done = False
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    outcome.error = chunk["error"]["message"]
                elif chunk.get("choices"):
                    outcome.tokens += 1
            if not done and outcome.error is None:
                outcome.error = "stream ended without [DONE]"
