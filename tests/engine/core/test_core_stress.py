"""Stress of AsyncEngine's public API: the engine steps while the event loop queries it, under a load that preempts,
aborts, finishes on EOS and on max_tokens, and hits and evicts the prefix cache.

Only the public API is used (construct, submit / generate, abort, kv_ledger, admission_need, stats, prefix_report,
snapshot, shutdown). Before the engine core (dcpserve/engine/core/core.py), the event loop read the scheduler while a
worker thread stepped it: on that code this test failed every run, 41-78 `RuntimeError: dictionary changed size during
iteration` from kv_ledger() per 20 s, and once a false PrefixCacheCorruption (a block named in the cache before its
token ids were recorded, read from the other thread in between). With the core, the front reads only immutable
snapshots.

For STRESS_SECONDS the load keeps 16-32 requests in flight over a KV pool far too small for them (usage admission,
prefix caching on): random prompt lengths, most cut from a few shared bases (cache hits, and evictions as the pool
turns over), temperature 1.0 with seeds, random max_tokens, some requests biased towards EOS, and about a third
aborted at a random point (engine.abort, the consumer's task cancelled, or the stream closed by its reader). A query
task on the same event loop calls kv_ledger(), admission_need(), stats() and prefix_report(None, 0) as fast as it can,
in rounds of QUERY_BURST calls of each with a sleep(0) between rounds, under a short GIL switch interval so that the
engine's thread can take over in the middle of a query (see QUERY_BURST), and checks each answer against what the
engine's definitions promise:

- ledger: committed_blocks == sum(per_request), 0 <= used_blocks <= capacity_blocks, every per_request value >= 0,
  every id one this test submitted, headroom_blocks >= 0, capacity_blocks == stats().kv_blocks_total;
- admission_need(prompt): "usage" admission blocks (the prompt's) less cached prefix blocks, which are whole blocks
  before the last token, so 1 <= need <= ceil(len(prompt) / tokens_per_block);
- stats: 0 <= kv_blocks_used <= kv_blocks_reserved <= kv_blocks_total (block_manager.usage(): reserved is used plus
  the promised-not-allocated blocks; a promise is only made from free blocks), 0 <= kv_blocks_cached <= total,
  num_running, num_waiting >= 0, and the counters (steps, preemptions, tokens, prefix hits, evictions) never go back;
- prefix_report(None, 0): a full report, every state PINNED or CACHED, at most capacity blocks.
- snapshot() (the core's, when the engine has one): ledger requests == running + waiting, no request in two states
  (running, waiting, finished in that batch), stats' sequences and used blocks == the states' and the ledger's.

Every stream must end with a finished delta (reason "stop" on an EOS token or "length" at max_tokens, output counts
contiguous) or be one the test aborted; every wait is bounded (DELTA_TIMEOUT_S, DRAIN_TIMEOUT_S). After the drain the
ledger is empty (per_request == {}, committed 0, used 0) and the only KV left is what the prefix cache keeps: cached
blocks nobody references, which block_manager.usage() counts as free, so kv_blocks_used == kv_blocks_reserved == 0,
and prefix_report lists exactly kv_blocks_cached blocks, all CACHED (none PINNED). The run must also have preempted,
aborted, finished on EOS and on max_tokens, hit the cache and evicted from it. Every failure is recorded and all are
reported in one assertion (count and first example of each kind).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
import traceback
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.core.prefix_cache import CACHED, PINNED, PrefixReport
from dcpserve.engine.frontend.async_engine import AsyncEngine
from dcpserve.engine.protocol import RequestDelta
from dcpserve.engine.sampling_params import SamplingParams

# Before the engine core this test saw 41-78 failures per 20 s of this load: 8 s per seed still fails every run.
STRESS_SECONDS = 8.0
DELTA_TIMEOUT_S = 60.0  # longest wait for a stream's next delta (queued behind preemptions on a busy machine)
DRAIN_TIMEOUT_S = 90.0  # longest wait for the streams in flight once the load stops
SETTLE_TIMEOUT_S = 20.0  # longest wait for the engine to show the drained state once every stream ended

BLOCK_SIZE = 4  # tp = dcp = 1: a logical block is 4 tokens
NUM_BLOCKS = 40  # 160 tokens of KV for 16-32 requests of up to 48 + 48 tokens: admission waits, decode preempts
KV_BYTES_PER_TOKEN = 512  # the tiny model: 2 layers x (K + V) x 1 KV head x 32 x float32
MAX_PROMPT = 48
MAX_TOKENS = 48
MIN_IN_FLIGHT, MAX_IN_FLIGHT = 16, 32
VOCAB_LOW, VOCAB_HIGH = 5, 500  # prompt tokens clear of the special tokens
# A query round is QUERY_BURST query sets (stats, kv_ledger, admission_need, prefix_report), then a yield to the loop;
# the stress runs under sys.setswitchinterval(SWITCH_INTERVAL_S). With one set per round (about 0.3 ms) and the
# default 5 ms interval, the step thread only ever takes the GIL while the loop thread waits in select() between
# rounds, so a query is never interleaved with a step and a racy query cannot be caught; bursts longer than the
# switch interval make the interpreter hand the GIL over in the middle of the queries.
QUERY_BURST = 10
SWITCH_INTERVAL_S = 2e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


async def _submit(engine: AsyncEngine, **kw: Any) -> AsyncGenerator[RequestDelta]:
    return await engine.submit(**kw)


async def _prefix_report(engine: AsyncEngine, epoch: str | None, version: int) -> PrefixReport | None:
    return await engine.prefix_report(epoch, version)


async def _abort(engine: AsyncEngine, request_id: str) -> None:
    engine.abort(request_id)


class Failures:
    """Failures by kind: a count and the first example of each."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def add(self, kind: str, example: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.first.setdefault(kind, example)

    def exception(self, where: str, err: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        self.add(f"{where}: {type(err).__name__}", tb)

    def report(self) -> str:
        lines = [f"{sum(self.counts.values())} failures of {len(self.counts)} kinds:"]
        for kind, count in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            lines.append(f"--- {kind}: {count}x; first:\n{self.first[kind]}")
        return "\n".join(lines)


@dataclass
class Record:
    """One request as its consumer saw it."""

    request_id: str
    prompt_len: int
    max_tokens: int
    plan: str  # "read" | "abort" (engine.abort) | "close" (aclose the stream) | "cancel" (cancel the task)
    outcome: str = "pending"  # "finished" | "aborted" | "hung" | "error" | "ended" (stream ended unfinished)
    finish_reason: str | None = None
    tokens: list[int] = field(default_factory=list)


@dataclass
class Tally:
    rounds: int = 0  # query rounds (each `burst` query sets, then a yield to the loop)
    sets: int = 0  # query sets: stats, kv_ledger, admission_need, prefix_report
    ledgers: int = 0
    snapshots: int = 0
    max_committed: int = 0
    max_used: int = 0
    max_per_request: int = 0


def _prompt_maker(rng: random.Random) -> Callable[[], list[int]]:
    """Prompts of 1..MAX_PROMPT tokens, three in four cut from 4 shared bases (the first the most often)."""
    bases = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(MAX_PROMPT)] for _ in range(4)]

    def prompt() -> list[int]:
        length = rng.randint(1, MAX_PROMPT)
        if rng.random() < 0.75:  # a cut of a shared base, sometimes with a private tail: prefix hits
            cut = rng.randint(max(1, length - 8), length)
            base = bases[min(int(rng.expovariate(1.0)), len(bases) - 1)]  # skewed: base 0 stays hot
            return base[:cut] + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length - cut)]
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]

    return prompt


async def _stress(tiny: Path, seed: int, burst: int = QUERY_BURST) -> tuple[Failures, dict]:
    rng = random.Random(seed)
    failures = Failures()
    eos = set(json.loads((tiny / "config.json").read_text())["eos_token_id"])
    args = EngineArgs(model=str(tiny), block_size=BLOCK_SIZE, kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_SIZE *
                      KV_BYTES_PER_TOKEN, enable_prefix_caching=True, admission="usage", max_num_batched_tokens=32,
                      max_model_len=256, kv_headroom=0.05)
    engine = AsyncEngine(args.create_engine_config())
    make_prompt = _prompt_maker(rng)
    records: dict[str, Record] = {}
    tasks: set[asyncio.Task] = set()
    tally = Tally()
    stop_queries = asyncio.Event()
    loop = asyncio.get_running_loop()
    tpb = None  # tokens per block, from the first ledger
    capacity = None

    async def consume(record: Record, prompt: list[int], params: SamplingParams, abort_after: int,
                      use_generate: bool) -> None:
        rid = record.request_id
        stream = None
        last_outputs = 0
        try:
            if use_generate:
                stream = engine.generate(sampling_params=params, prompt_token_ids=prompt, request_id=rid)
            else:
                stream = await _submit(engine, sampling_params=params, prompt_token_ids=prompt, request_id=rid)
            if record.plan == "abort" and abort_after == 0:
                await _abort(engine, rid)
                record.outcome = "aborted"
                return
            while True:
                try:
                    delta = await asyncio.wait_for(stream.__anext__(), DELTA_TIMEOUT_S)
                except StopAsyncIteration:
                    record.outcome = "ended"
                    failures.add("stream ended without a finished delta",
                                 f"{rid} plan={record.plan} after {len(record.tokens)} tokens")
                    return
                except TimeoutError:
                    record.outcome = "hung"
                    failures.add("request hung (no delta within DELTA_TIMEOUT_S)",
                                 f"{rid} plan={record.plan} after {len(record.tokens)} tokens, "
                                 f"prompt {record.prompt_len}, max_tokens {record.max_tokens}")
                    return
                if delta.request_id != rid:
                    failures.add("delta of another request", f"{rid} got {delta.request_id}")
                if delta.num_output_tokens != last_outputs + len(delta.new_token_ids):
                    failures.add("output count not contiguous",
                                 f"{rid}: {last_outputs} then {delta.num_output_tokens} with "
                                 f"{len(delta.new_token_ids)} new")
                last_outputs = delta.num_output_tokens
                record.tokens += delta.new_token_ids
                if delta.finished:
                    record.outcome, record.finish_reason = "finished", delta.finish_reason
                    n = len(record.tokens)
                    if delta.finish_reason == "length":
                        if n != record.max_tokens:
                            failures.add("'length' before max_tokens", f"{rid}: {n} of {record.max_tokens}")
                    elif delta.finish_reason == "stop":
                        if not record.tokens or record.tokens[-1] not in eos:
                            failures.add("'stop' without EOS", f"{rid}: last tokens {record.tokens[-3:]}")
                    elif not (delta.finish_reason == "abort" and record.plan != "read"):
                        failures.add("unexpected finish reason", f"{rid}: {delta.finish_reason!r}")
                    if n > record.max_tokens:
                        failures.add("more tokens than max_tokens", f"{rid}: {n} > {record.max_tokens}")
                    return
                if record.plan in ("abort", "close") and len(record.tokens) >= abort_after:
                    if record.plan == "abort":
                        await _abort(engine, rid)
                    record.outcome = "aborted"
                    return  # the finally closes the stream
        except asyncio.CancelledError:
            if record.outcome == "pending":
                record.outcome = "aborted" if record.plan == "cancel" else "cancelled"
            raise
        except Exception as err:  # noqa: BLE001 - recorded, reported with the rest
            record.outcome = "error"
            failures.exception("request stream", err)
        finally:
            if stream is not None and hasattr(stream, "aclose"):
                try:
                    await asyncio.wait_for(stream.aclose(), 10.0)
                except Exception as err:  # noqa: BLE001
                    failures.exception("stream aclose", err)

    def spawn(index: int) -> None:
        prompt = make_prompt()
        max_tokens = rng.randint(1, MAX_TOKENS)
        bias = {rng.choice(sorted(eos)): 4.0} if rng.random() < 0.25 else None  # EOS likely: "stop" finishes
        params = SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30), max_tokens=max_tokens, logit_bias=bias)
        roll = rng.random()
        plan = "read" if roll < 0.65 else "abort" if roll < 0.77 else "close" if roll < 0.88 else "cancel"
        use_generate = rng.random() < 0.3
        abort_after = rng.randint(0, max_tokens)  # 0: before the first token (abort: before reading at all)
        if plan == "close" or use_generate:  # generate() submits on the first read: nothing to abort before it
            abort_after = max(1, abort_after)
        record = Record(f"stress-{seed}-{index}", len(prompt), max_tokens, plan)
        records[record.request_id] = record
        task = loop.create_task(consume(record, prompt, params, abort_after, use_generate))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if plan == "cancel":
            loop.call_later(rng.uniform(0.0, 1.5), task.cancel)

    def check_ledger(ledger) -> None:  # dcpserve.engine.protocol.KvLedger
        nonlocal tpb, capacity
        tally.ledgers += 1
        per = dict(ledger.per_request)
        if ledger.committed_blocks != sum(per.values()):
            failures.add("ledger: committed_blocks != sum(per_request)",
                         f"committed {ledger.committed_blocks}, sum {sum(per.values())}, per_request {per}")
        if not 0 <= ledger.used_blocks <= ledger.capacity_blocks:
            failures.add("ledger: used_blocks outside [0, capacity]",
                         f"used {ledger.used_blocks}, capacity {ledger.capacity_blocks}")
        negative = {k: v for k, v in per.items() if v < 0}
        if negative:
            failures.add("ledger: negative per_request", f"{negative} in {per}")
        unknown = [k for k in per if k not in records]
        if unknown:
            failures.add("ledger: unknown request id", f"{unknown[:3]}")
        if ledger.headroom_blocks < 0:
            failures.add("ledger: negative headroom", f"{ledger.headroom_blocks}")
        if capacity is not None and ledger.capacity_blocks != capacity:
            failures.add("ledger: capacity changed", f"{ledger.capacity_blocks} != {capacity}")
        tpb = ledger.tokens_per_block
        tally.max_committed = max(tally.max_committed, ledger.committed_blocks)
        tally.max_used = max(tally.max_used, ledger.used_blocks)
        tally.max_per_request = max(tally.max_per_request, len(per))

    def check_snapshot(snap) -> None:  # core.CoreSnapshot: ledger, stats and request states at one instant
        tally.snapshots += 1
        unfinished = snap.running | snap.waiting
        if set(snap.ledger.per_request) != unfinished:
            failures.add("snapshot: ledger requests != running + waiting",
                         f"ledger {sorted(snap.ledger.per_request)}, running {sorted(snap.running)}, "
                         f"waiting {sorted(snap.waiting)}")
        if snap.running & snap.waiting or unfinished & snap.finished:
            failures.add("snapshot: a request in two states",
                         f"running {sorted(snap.running)}, waiting {sorted(snap.waiting)}, "
                         f"finished {sorted(snap.finished)}")
        if (snap.stats.num_running, snap.stats.num_waiting) != (len(snap.running), len(snap.waiting)):
            failures.add("snapshot: stats' sequences != request states",
                         f"stats {snap.stats.num_running} running / {snap.stats.num_waiting} waiting, states "
                         f"{len(snap.running)} / {len(snap.waiting)}")
        if snap.stats.kv_blocks_used != snap.ledger.used_blocks:
            failures.add("snapshot: stats' used blocks != the ledger's",
                         f"{snap.stats.kv_blocks_used} != {snap.ledger.used_blocks}")
        if not snap.stats.kv_blocks_used <= snap.stats.kv_blocks_reserved <= snap.stats.kv_blocks_total:
            failures.add("snapshot: used <= reserved <= total broken",
                         f"{snap.stats.kv_blocks_used}, {snap.stats.kv_blocks_reserved}, {snap.stats.kv_blocks_total}")

    previous_counters: dict[str, int] = {}

    def check_stats(stats) -> None:  # dcpserve.engine.protocol.EngineStats
        nonlocal capacity
        if capacity is None:
            capacity = stats.kv_blocks_total
        used, reserved, total = stats.kv_blocks_used, stats.kv_blocks_reserved, stats.kv_blocks_total
        if total != capacity:
            failures.add("stats: kv_blocks_total changed", f"{total} != {capacity}")
        if not 0 <= used <= reserved <= total:
            failures.add("stats: not 0 <= used <= reserved <= total",
                         f"used {used}, reserved {reserved}, total {total}")
        if not 0 <= stats.kv_blocks_cached <= total:
            failures.add("stats: kv_blocks_cached outside [0, total]", f"{stats.kv_blocks_cached} of {total}")
        if stats.num_running < 0 or stats.num_waiting < 0:
            failures.add("stats: negative sequence count", f"running {stats.num_running}, waiting {stats.num_waiting}")
        for name in ("num_steps", "num_preemptions", "num_recomputed_tokens", "tokens_computed", "generation_tokens",
                     "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions"):
            value = getattr(stats, name)
            if value < previous_counters.get(name, 0):
                failures.add(f"stats: {name} went back", f"{previous_counters[name]} -> {value}")
            previous_counters[name] = value

    def check_report(report) -> None:  # dcpserve.engine.core.prefix_cache.PrefixReport | None
        if report is None:
            failures.add("prefix_report: None with prefix caching on", "")
            return
        if not report.full:
            failures.add("prefix_report(None, 0): not a full report", f"version {report.version}")
        bad = {h: s for h, s in report.changes.items() if s not in (PINNED, CACHED)}
        if bad:
            failures.add("prefix_report: state neither PINNED nor CACHED", f"{list(bad.items())[:3]}")
        if capacity is not None and len(report.changes) > capacity:
            failures.add("prefix_report: more blocks than the pool", f"{len(report.changes)} > {capacity}")

    async def query_set() -> None:
        try:
            check_stats(engine.stats())
        except Exception as err:  # noqa: BLE001
            failures.exception("stats()", err)
        try:
            check_ledger(engine.kv_ledger())
        except Exception as err:  # noqa: BLE001
            failures.exception("kv_ledger()", err)
        if hasattr(engine, "snapshot"):  # the engine core's snapshots (dcpserve.engine.core.core)
            try:
                check_snapshot(engine.snapshot())
            except Exception as err:  # noqa: BLE001
                failures.exception("snapshot()", err)
        prompt = make_prompt()
        try:
            need = await engine.admission_need(prompt, rng.randint(1, MAX_TOKENS))
            if tpb is not None and not 1 <= need <= math.ceil(len(prompt) / tpb):
                failures.add("admission_need outside [1, prompt blocks]",
                             f"need {need} for a prompt of {len(prompt)} tokens ({tpb} per block)")
        except Exception as err:  # noqa: BLE001
            failures.exception("admission_need()", err)
        try:
            check_report(await _prefix_report(engine, None, 0))
        except Exception as err:  # noqa: BLE001
            failures.exception("prefix_report()", err)
        tally.sets += 1

    async def query() -> None:
        while not stop_queries.is_set():
            for _ in range(burst):
                await query_set()
            tally.rounds += 1
            await asyncio.sleep(0)

    started = time.monotonic()
    index = 0
    query_task = loop.create_task(query())
    summary: dict = {}
    try:
        target = rng.randint(MIN_IN_FLIGHT, MAX_IN_FLIGHT)
        while time.monotonic() - started < STRESS_SECONDS:
            if query_task.done():
                break
            while len(tasks) < target:
                spawn(index)
                index += 1
            if rng.random() < 0.05:
                target = rng.randint(MIN_IN_FLIGHT, MAX_IN_FLIGHT)
            await asyncio.sleep(rng.uniform(0.0, 0.02))
        load_seconds = time.monotonic() - started
        rounds_under_load, sets_under_load = tally.rounds, tally.sets
        # Drain: every stream in flight must end (bounded), the queries go on meanwhile.
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=DRAIN_TIMEOUT_S)
            for task in pending:
                task.cancel()
            if pending:
                failures.add("stream did not end within DRAIN_TIMEOUT_S", f"{len(pending)} tasks")
                await asyncio.wait(pending, timeout=10.0)
        stop_queries.set()
        try:
            await asyncio.wait_for(query_task, 10.0)
        except Exception as err:  # noqa: BLE001
            failures.exception("query task", err)

        outcomes: dict[str, int] = {}
        for record in records.values():
            key = record.outcome if record.outcome != "finished" else f"finished:{record.finish_reason}"
            outcomes[key] = outcomes.get(key, 0) + 1
            if record.outcome not in ("finished", "aborted"):
                failures.add(f"request neither finished nor aborted ({record.outcome})",
                             f"{record.request_id} plan={record.plan} tokens={len(record.tokens)}")

        # The drained state: nothing committed, nothing used; the prefix cache keeps unreferenced blocks only.
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            ledger, stats = engine.kv_ledger(), engine.stats()
            settled = (not ledger.per_request and ledger.used_blocks == 0 and stats.kv_blocks_used == 0
                       and stats.num_running == 0 and stats.num_waiting == 0 and stats.num_pending == 0)
            if settled or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        report = await _prefix_report(engine, None, 0)
        if ledger.per_request or ledger.committed_blocks != 0 or ledger.used_blocks != 0:
            failures.add("after the drain: ledger not empty",
                         f"per_request {dict(ledger.per_request)}, committed {ledger.committed_blocks}, "
                         f"used {ledger.used_blocks}")
        if stats.kv_blocks_used != 0 or stats.kv_blocks_reserved != 0:
            failures.add("after the drain: KV still used or reserved",
                         f"used {stats.kv_blocks_used}, reserved {stats.kv_blocks_reserved}, "
                         f"cached {stats.kv_blocks_cached}")
        if stats.num_running or stats.num_waiting or stats.num_pending:
            failures.add("after the drain: sequences left",
                         f"running {stats.num_running}, waiting {stats.num_waiting}, pending {stats.num_pending}")
        if report is None or len(report.changes) != stats.kv_blocks_cached:
            failures.add("after the drain: prefix report != kv_blocks_cached",
                         f"{None if report is None else len(report.changes)} vs {stats.kv_blocks_cached}")
        if report is not None and any(s != CACHED for s in report.changes.values()):
            failures.add("after the drain: a cached block still PINNED",
                         f"{sum(s == PINNED for s in report.changes.values())} pinned")
        # The load did what it is for.
        for what, count in (("preemptions", stats.num_preemptions), ("prefix cache hits", stats.prefix_cache_hits),
                            ("prefix cache evictions", stats.prefix_cache_evictions),
                            ("aborts", outcomes.get("aborted", 0)), ("EOS finishes", outcomes.get("finished:stop", 0)),
                            ("max_tokens finishes", outcomes.get("finished:length", 0))):
            if count == 0:
                failures.add(f"load: no {what}", str(outcomes))
        if hasattr(engine, "snapshot") and tally.snapshots == 0:
            failures.add("queries: no snapshot checked", "engine.snapshot() exists but was never read")
        summary = {
            "seed": seed, "load_seconds": round(load_seconds, 2), "requests": len(records), "outcomes": outcomes,
            "burst": burst, "query_rounds": tally.rounds, "rounds_per_s": round(rounds_under_load / load_seconds),
            "query_sets_per_s": round(sets_under_load / load_seconds), "ledgers": tally.ledgers,
            "snapshots": tally.snapshots,
            "max_committed": tally.max_committed, "max_used": tally.max_used,
            "max_ledger_requests": tally.max_per_request, "preemptions": stats.num_preemptions,
            "steps": stats.num_steps, "prefix_hits": stats.prefix_cache_hits,
            "evictions": stats.prefix_cache_evictions, "cached_after": stats.kv_blocks_cached,
            "failures": dict(failures.counts),
        }
    finally:
        stop_queries.set()
        for task in list(tasks):
            task.cancel()
        query_task.cancel()
        await asyncio.wait([*tasks, query_task], timeout=10.0)
        await asyncio.wait_for(engine.shutdown(), 30.0)
    return failures, summary


@pytest.mark.parametrize("seed", [1, 2])
def test_queries_stay_consistent_while_the_engine_steps(tiny: Path, seed: int) -> None:
    """The public queries, called as fast as the event loop allows while a preempting, aborting, prefix-sharing load
    runs, never raise and always show a consistent ledger; the load drains completely (module docstring)."""
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        failures, summary = asyncio.run(_stress(tiny, seed))
    finally:
        sys.setswitchinterval(switch_interval)
    print(f"\nstress summary: {json.dumps(summary)}")
    assert not failures.counts, f"{failures.report()}\nsummary: {json.dumps(summary)}"
