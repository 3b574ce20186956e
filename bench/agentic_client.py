"""The agentic benchmark's client side (bench/agentic.py): the sessions of a trace played through the served app with
the official `openai` client, and the app's prefix-cache counters read from its Prometheus endpoints.

Prompts are token ids (the replies come back as ids, `return_tokens_as_token_ids`, so every turn re-sends exactly the
tokens the server produced). They ride in `extra_body`: the SDK walks a `prompt=` list in Python to build the request
(88-113 ms for 8,000 ids on this machine, more than the prefill it would be measured with), and sends what
`extra_body` holds as it is (1.4-3 ms); the server sees the same JSON body either way.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.agentic_report import ConfigResult, TierCopies, TurnRecord
from bench.agentic_trace import FIRST_TOKEN_ID, Trace
from bench.harness import compare
from bench.harness.prometheus import metric_lines

REQUEST_TIMEOUT_S = 300.0  # one turn's bound: a turn that takes longer is recorded as failed with the timeout
TOKEN_ID = re.compile(r"^token_id:(\d+)$")


def client(base_url: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)


async def completion(api: Any, prompt: list[int], max_tokens: int, seed: int, key: str | None,
                     record: TurnRecord, start: float) -> list[int] | None:
    """One streamed turn at temperature 1 with its seed (EOS may end it); fills `record` (times from `start`) and
    returns the reply's token ids, or None with record.error set."""
    import openai

    body: dict[str, Any] = {"prompt": prompt, "return_tokens_as_token_ids": True}
    if key is not None:
        body["prompt_cache_key"] = key
    tokens: list[int] = []
    usage_tokens: int | None = None
    record.prompt_tokens = len(prompt)
    record.sent = time.perf_counter() - start
    try:
        stream = await api.completions.create(
            model=compare.MODEL_NAME, prompt=[], max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=0,
            stream=True, stream_options={"include_usage": True}, extra_body=body)
        async with stream:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    new = (choice.logprobs.tokens if choice.logprobs is not None else None) or []
                    if new and record.first_token is None:
                        record.first_token = time.perf_counter() - start
                    for text in new:
                        match = TOKEN_ID.match(text)
                        if match is None:
                            raise ValueError(f"a streamed token is not 'token_id:<id>': {text!r}")
                        tokens.append(int(match.group(1)))
                    record.finish_reason = choice.finish_reason or record.finish_reason
    except openai.APIStatusError as err:
        record.error = f"HTTP {err.status_code}: {str(err.message)[:300]}"
        return None
    except Exception as err:  # noqa: BLE001 - every failure is recorded with what it was
        record.error = f"{type(err).__name__}: {str(err)[:300]}"
        return None
    record.finished = time.perf_counter() - start
    if usage_tokens is None or usage_tokens != len(tokens):
        record.error = f"the stream carried {len(tokens)} token ids, its usage says {usage_tokens}"
        record.finished = None
        return None
    record.completion_tokens = len(tokens)
    return tokens


async def probe_session_keys(base_url: str, vocab_size: int, say: Callable[[str], None]) -> bool:
    """Warms the replica up (a few short requests of their own) and asks whether the API takes prompt_cache_key:
    False (said) if it answers 400 naming it; any other failure ends the benchmark."""
    import openai

    api = client(base_url)
    rng = random.Random(12345)
    try:
        keys = True
        for index in range(3):
            prompt = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(64)]
            record = TurnRecord(-1, index)
            reply = await completion(api, prompt, 4, index, "warm-up" if keys else None, record, time.perf_counter())
            if reply is None and keys and record.error and "400" in record.error and \
                    "prompt_cache_key" in record.error:
                say(f"the API refused prompt_cache_key ({record.error}): sending no session key")
                keys = False
                continue
            if reply is None:
                raise SystemExit(f"a warm-up request failed: {record.error}")
        return keys
    except openai.APIConnectionError as err:
        raise SystemExit(f"the app at {base_url} did not answer: {err}") from err
    finally:
        await api.close()


async def run_trace(base_url: str, trace: Trace, result: ConfigResult, session_keys: bool, deadline_s: float,
                    progress_every: int, say: Callable[[str], None]) -> None:
    """Every session at its start, turn after turn with its think time; fills result.records (session-major, one
    per planned turn), makespan_s and kv_tokens_seen. A failed turn ends its session: its later turns are recorded
    not sent, naming it; turns that would start after `deadline_s` are recorded not sent, naming the bound."""
    api = client(base_url)
    start = time.perf_counter()
    records = [[TurnRecord(i, t) for t in range(len(s.turns))] for i, s in enumerate(trace.sessions)]
    result.records = [r for session in records for r in session]
    completed = 0
    own_kv = 0

    async def play(index: int) -> None:
        nonlocal completed, own_kv
        plan = trace.sessions[index]
        history = list(trace.system)
        await asyncio.sleep(max(0.0, plan.start_s - (time.perf_counter() - start)))
        for turn, (step, record) in enumerate(zip(plan.turns, records[index], strict=True)):
            await asyncio.sleep(step.think_s)
            if time.perf_counter() - start > deadline_s:
                for later in records[index][turn:]:
                    later.not_sent = f"past the run's time bound of {deadline_s:.0f}s"
                break
            prompt = history + list(step.chunk)
            reply = await completion(api, prompt, step.max_tokens, step.seed, plan.key if session_keys else None,
                                     record, start)
            if reply is None:
                for later in records[index][turn + 1:]:
                    later.not_sent = f"turn {turn} of the session failed"
                break
            history = prompt + reply
            completed += 1
            if completed % progress_every == 0:
                say(f"{result.label}: {completed}/{trace.num_requests} turns answered, "
                    f"{time.perf_counter() - start:.0f}s")
        own_kv += len(history) - len(trace.system)

    try:
        await asyncio.gather(*(play(i) for i in range(len(trace.sessions))))
    finally:
        await api.close()
    result.makespan_s = time.perf_counter() - start
    result.kv_tokens_seen = own_kv + len(trace.system)
    result.session_keys = session_keys


# ---- Prometheus ----------------------------------------------------------------------------------------------------

SERIES = re.compile(r"^(?:ray_)?(dcpserve_\w+?)(?:_total)?(\{[^}]*\})?\s+(\S+)$")
PREFIX_QUERIES, PREFIX_HITS = "dcpserve_prefix_cache_query_tokens", "dcpserve_prefix_cache_hit_tokens"
# The host tier's series (dcpserve/deployments/metrics.py): prefix hits by the tier that held them, and the copies.
TIER_HITS = "dcpserve_prefix_cache_tier_hit_tokens"  # {tier="device" | "host"}
COPIED_BLOCKS = "dcpserve_kv_host_tier_copied_blocks"  # {direction="to_host" | "to_device"}
COPY_SECONDS = "dcpserve_kv_host_tier_copy_seconds"  # {direction=...}
TIER_EVICTIONS = "dcpserve_kv_host_tier_evictions"  # {eviction="to_host" | "dropped"}


def scrape(ray_temp: Path) -> dict[tuple[str, str], float]:
    """Every dcpserve series the cluster exports, (name, labels) -> value (bench/harness/prometheus.py)."""
    series: dict[tuple[str, str], float] = {}
    for line in metric_lines(ray_temp):
        match = SERIES.match(line)
        if match:
            key = (match.group(1), match.group(2) or "")
            series[key] = series.get(key, 0.0) + float(match.group(3))
    return series


def difference(after: dict[tuple[str, str], float], before: dict[tuple[str, str], float]
               ) -> dict[tuple[str, str], float]:
    """Per series, after - before (a series new since `before` counts from 0): what one run added."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def label_value(labels: str, name: str) -> str | None:
    match = re.search(rf'\b{name}="([^"]*)"', labels)
    return match.group(1) if match else None


def by_label(delta: dict[tuple[str, str], float], name: str, label: str) -> dict[str, float] | None:
    """Series `name` summed by the value of `label` (over replicas and other labels); None if no series of that name
    carries the label."""
    sums: dict[str, float] = {}
    for (series, labels), value in delta.items():
        if series == name and (key := label_value(labels, label)) is not None:
            sums[key] = sums.get(key, 0.0) + value
    return sums or None


def host_metric_names(series: dict[tuple[str, str], float]) -> list[str]:
    """The names of the series that speak of a host tier (for the report: which the app exports)."""
    return sorted({name for name, _ in series if "host" in name or "tier" in name})


def tier_split(delta: dict[tuple[str, str], float]) -> tuple[int, int] | None:
    """(device, host) prefix-hit tokens from the app's hit counter by tier; None if the app exports none."""
    tiers = by_label(delta, TIER_HITS, "tier")
    if tiers is None:
        return None
    return round(tiers.get("device", 0.0)), round(tiers.get("host", 0.0))


def tier_copies(delta: dict[tuple[str, str], float]) -> TierCopies | None:
    """The host tier's copies and drops during a run; None if the app exports no copy counters."""
    blocks = by_label(delta, COPIED_BLOCKS, "direction")
    if blocks is None:
        return None
    seconds = by_label(delta, COPY_SECONDS, "direction") or {}
    evictions = by_label(delta, TIER_EVICTIONS, "eviction") or {}
    return TierCopies(round(blocks.get("to_host", 0.0)), round(blocks.get("to_device", 0.0)),
                      seconds.get("to_host", 0.0), seconds.get("to_device", 0.0), round(evictions.get("dropped", 0.0)))


def totals(delta: dict[tuple[str, str], float], name: str) -> int:
    return round(sum(value for (series, _), value in delta.items() if series == name))
