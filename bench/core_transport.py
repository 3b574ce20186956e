"""Micro-benchmark of an engine core's transports: the core as a thread vs a process, and the wire format of output
batches (pickled dataclasses vs msgspec), on this machine's CPUs.

The engine is being split so that one "engine core" loop alone owns the scheduler and KV state: the replica's event
loop sends it typed messages (add request, abort, queries) and gets back one output batch per engine step (each
request's new tokens, text, logprobs, finish reason). Two choices are measured here, side by side in one run:

1. handoff: one output batch of B RequestDeltas (dcpserve.engine.protocol) from a producer loop to an asyncio consumer,
   and one add-request message (a 2k-token prompt) the other way: a core THREAD (outputs through
   loop.call_soon_threadsafe, inputs through a queue.Queue) vs a core PROCESS (pickle over a multiprocessing Pipe, read
   with loop.add_reader, as vLLM v1's EngineCore does over ZMQ). Lockstep: each item waits for the previous one to be
   consumed, with an idle gap in between, as steps milliseconds apart do.
2. wire format of a batch crossing the replica -> ingress hop: pickle of a list of the dataclasses, today's asdict()
   dict pickled once per delta, msgspec msgpack of Structs (array_like, omit_defaults: vLLM's EngineCoreOutputs
   shape) and msgspec msgpack of the same dataclasses; encode, decode (to typed objects) and bytes.
3. in the loop: the tiny model's real decode steps (LLMEngine, tp=1) driven by today's AsyncEngine pattern
   (asyncio.to_thread per step), a core thread and a core process, while the event loop does today's per-token
   replica work (a queue and a task per request, asdict + pickle of each delta): step time, tokens/s, handoff.
4. (unless --skip-ray) a Ray actor's async generator streaming to the driver: one stream item per token per request
   (today: a stream per request) vs one item per engine step carrying the whole batch.

    python bench/core_transport.py                  # console only
    python bench/core_transport.py --write-docs     # also updates this script's section of docs/benchmarks.md
    python bench/core_transport.py --quick          # fewer repetitions, no Ray
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import multiprocessing
import os
import pickle
import platform
import queue
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Running `python bench/core_transport.py` puts bench/ first on sys.path, where bench/engine.py would shadow the
# `engine` package (here, in the spawned core processes and in Ray's workers, which inherit the driver's sys.path).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from dcpserve.local.serve import bind_ray_to_loopback  # noqa: E402

bind_ray_to_loopback()  # the local Ray this bench may start listens on 127.0.0.1 only (ray is imported later)

import msgspec  # noqa: E402  (measurement only: not a dependency of dcpserve)

from bench.docs_section import DocsSection  # noqa: E402
from dcpserve.engine.core.request import Request  # noqa: E402
from dcpserve.engine.protocol import RequestDelta, TokenLogprob  # noqa: E402
from dcpserve.engine.sampling_params import SamplingParams  # noqa: E402

DOCS = DocsSection("bench/core_transport.py")
PICKLE = pickle.HIGHEST_PROTOCOL
perf = time.perf_counter  # CLOCK_MONOTONIC: one clock for every process on the machine


# ---- payloads ---------------------------------------------------------------------------------------------------

class LogprobStruct(msgspec.Struct, array_like=True, frozen=True):
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class DeltaStruct(msgspec.Struct, array_like=True, omit_defaults=True):
    """RequestDelta as a msgspec Struct, encoded as an array with defaults left out (vLLM's EngineCoreOutput)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[LogprobStruct] | None = None
    prompt_logprobs: list[LogprobStruct | None] | None = None


def make_batch(size: int, logprobs: bool, seed: int = 0) -> list[RequestDelta]:
    """One decode step's output for `size` requests: one token each, its text, and (logprobs) the token's logprob
    with 5 top alternatives."""
    rng = random.Random(seed)
    words = ["the", " of", " and", " model", "ing", " serve", ".", " KV", " token", "\n"]
    batch = []
    for _ in range(size):
        token = rng.randrange(32000)
        lp = None
        if logprobs:
            top = tuple((rng.randrange(32000), -rng.random() * 8) for _ in range(5))
            lp = [TokenLogprob(token, top[0][1], 1, ((token, top[0][1]), *top[1:]))]
        batch.append(RequestDelta(
            request_id=f"{rng.getrandbits(128):032x}", new_token_ids=[token], new_text=rng.choice(words),
            finished=False, finish_reason=None, num_prompt_tokens=2048, num_output_tokens=rng.randrange(1, 512),
            logprobs=lp,
        ))
    return batch


def as_structs(batch: list[RequestDelta]) -> list[DeltaStruct]:
    return [DeltaStruct(d.request_id, d.new_token_ids, d.new_text, d.finished, d.finish_reason, d.num_prompt_tokens,
                        d.num_output_tokens,
                        None if d.logprobs is None else [LogprobStruct(p.token_id, p.logprob, p.rank, p.top)
                                                         for p in d.logprobs]) for d in batch]


def add_request(prompt_len: int, lean: bool, seed: int = 0) -> Any:
    """An add-request message with a prompt of `prompt_len` random token ids: dcpserve.engine.core.request.Request as it
    is today (it pickles prompt_token_ids and its copy all_token_ids), or a lean message (id, prompt ids,
    SamplingParams, arrival time) like vLLM's EngineCoreRequest."""
    rng = random.Random(seed)
    prompt = [rng.randrange(32000) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=256, seed=1234, stop=("\n\n",))
    if lean:
        return (f"{rng.getrandbits(128):032x}", prompt, params, time.monotonic())
    return Request(f"{rng.getrandbits(128):032x}", prompt, params)


# ---- 1. handoff: lockstep, idle consumer ------------------------------------------------------------------------

def thread_outputs(batch: list[RequestDelta], reps: int, gap_s: float) -> tuple[list[float], list[float]]:
    """A producer thread hands `batch` to an event loop reps times; (produce -> callback, producer cost) each."""
    loop = asyncio.new_event_loop()
    latency: list[float] = []
    cost: list[float] = []
    consumed = threading.Event()

    def on_batch(t0: float, items: list[RequestDelta]) -> None:
        latency.append(perf() - t0)
        consumed.set()

    def producer() -> None:
        for _ in range(reps):
            time.sleep(gap_s)
            t0 = perf()
            loop.call_soon_threadsafe(on_batch, t0, batch)
            cost.append(perf() - t0)
            consumed.wait()
            consumed.clear()
        loop.call_soon_threadsafe(loop.stop)

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    loop.run_forever()
    thread.join()
    loop.close()
    return latency, cost


def thread_inputs(message: Any, reps: int, gap_s: float) -> tuple[list[float], list[float]]:
    """The event loop's thread puts `message` on a queue.Queue a core thread blocks on; (put -> core has it, put)."""
    inbox: queue.Queue[Any] = queue.Queue()
    latency: list[float] = []
    cost: list[float] = []
    received = threading.Event()

    def core() -> None:
        while (item := inbox.get()) is not None:
            latency.append(perf() - item[0])
            received.set()

    thread = threading.Thread(target=core, daemon=True)
    thread.start()
    for _ in range(reps):
        time.sleep(gap_s)
        t0 = perf()
        inbox.put((t0, message))
        cost.append(perf() - t0)
        received.wait()
        received.clear()
    inbox.put(None)
    thread.join()
    return latency, cost


def _stamped_encoder(batch: list[RequestDelta], codec: str) -> Callable[[float], bytes]:
    """encode(stamp) -> the wire bytes of (stamp, batch): pickled dataclasses, or msgspec msgpack of Structs."""
    if codec == "pickle":
        return lambda stamp: pickle.dumps((stamp, batch), PICKLE)
    encoder, structs = msgspec.msgpack.Encoder(), as_structs(batch)
    return lambda stamp: encoder.encode((stamp, structs))


def _echo_core(conn: Any) -> None:
    """The process side of the handoff measurements (spawned): produces output batches, receives inputs."""
    while True:
        command = pickle.loads(conn.recv_bytes())
        if command[0] == "stop":
            return
        if command[0] == "out":
            _, size, logprobs, reps, gap_s, codec = command
            encode = _stamped_encoder(make_batch(size, logprobs), codec)
            cost = []
            for _ in range(reps):
                conn.recv_bytes()  # the consumer took the previous batch
                time.sleep(gap_s)
                t0 = perf()
                conn.send_bytes(encode(t0))
                cost.append(perf() - t0)
            conn.send_bytes(pickle.dumps(cost, PICKLE))
        elif command[0] == "in":
            latency = []
            for _ in range(command[1]):
                t0, _message = pickle.loads(conn.recv_bytes())
                latency.append(perf() - t0)
                conn.send_bytes(b"a")
            conn.send_bytes(pickle.dumps(("latency", latency), PICKLE))


class EchoProcess:
    """A spawned core process on the other end of a multiprocessing Pipe (a socketpair)."""

    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_echo_core, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def outputs(self, size: int, logprobs: bool, reps: int, gap_s: float,
                codec: str) -> tuple[list[float], list[float], list[float], int]:
        """(produce -> consumer holds the objects, producer encode + send, consumer recv + decode, bytes), with
        codec "pickle" (of the dataclasses) or "msgspec" (Structs, decoded to Structs)."""
        loop = asyncio.new_event_loop()
        latency: list[float] = []
        consumer: list[float] = []
        size_bytes = [0]
        done: asyncio.Future[list[float]] = loop.create_future()
        decode = pickle.loads if codec == "pickle" else msgspec.msgpack.Decoder(tuple[float, list[DeltaStruct]]).decode

        def readable() -> None:
            if len(latency) == reps:  # then the producer's costs
                done.set_result(pickle.loads(self.conn.recv_bytes()))
                return
            start = perf()
            data = self.conn.recv_bytes()
            message = decode(data)
            end = perf()
            latency.append(end - message[0])
            consumer.append(end - start)
            size_bytes[0] = len(data)
            if len(latency) < reps:
                self.conn.send_bytes(b"g")

        loop.add_reader(self.conn.fileno(), readable)
        self.conn.send_bytes(pickle.dumps(("out", size, logprobs, reps, gap_s, codec), PICKLE))
        self.conn.send_bytes(b"g")
        cost = loop.run_until_complete(done)
        loop.remove_reader(self.conn.fileno())
        loop.close()
        return latency, cost, consumer, size_bytes[0]

    def inputs(self, message: Any, reps: int, gap_s: float) -> tuple[list[float], list[float], int]:
        """(send -> core holds the object, loop-side pickle + send, bytes)."""
        cost = []
        size = 0
        self.conn.send_bytes(pickle.dumps(("in", reps), PICKLE))
        for _ in range(reps):
            time.sleep(gap_s)
            t0 = perf()
            data = pickle.dumps((t0, message), PICKLE)
            self.conn.send_bytes(data)
            cost.append(perf() - t0)
            size = len(data)
            self.conn.recv_bytes()
        return pickle.loads(self.conn.recv_bytes())[1], cost, size

    def close(self) -> None:
        self.conn.send_bytes(pickle.dumps(("stop",), PICKLE))
        self.process.join(10)
        self.conn.close()


def measure_handoff(args: argparse.Namespace, ctx: Any) -> tuple[list[list[str]], list[list[str]], dict[str, Any]]:
    gap_s = args.gap_us * 1e-6
    echo = EchoProcess(ctx)
    out: dict[tuple[int, bool], dict[str, list[float]]] = {}
    size_of: dict[tuple[int, bool], int] = {}
    try:
        for _ in range(args.rounds):
            for logprobs in (False, True):
                for size in args.batches:
                    key = (size, logprobs)
                    samples = out.setdefault(key, {k: [] for k in ("t_lat", "t_cost", "p_lat", "p_cost", "p_cons",
                                                                     "m_lat", "m_cost", "m_cons")})
                    lat, cost = thread_outputs(make_batch(size, logprobs), args.reps, gap_s)
                    samples["t_lat"] += lat
                    samples["t_cost"] += cost
                    lat, cost, cons, size_of[key] = echo.outputs(size, logprobs, args.reps, gap_s, "pickle")
                    samples["p_lat"] += lat
                    samples["p_cost"] += cost
                    samples["p_cons"] += cons
                    lat, cost, cons, _ = echo.outputs(size, logprobs, args.reps, gap_s, "msgspec")
                    samples["m_lat"] += lat
                    samples["m_cost"] += cost
                    samples["m_cons"] += cons
        inputs: dict[bool, dict[str, list[float]]] = {}
        in_bytes: dict[bool, int] = {}
        for _ in range(args.rounds):
            for lean in (False, True):
                message = add_request(args.prompt_len, lean)
                samples = inputs.setdefault(lean, {k: [] for k in ("t_lat", "t_cost", "p_lat", "p_cost")})
                lat, cost = thread_inputs(message, args.reps, gap_s)
                samples["t_lat"] += lat
                samples["t_cost"] += cost
                lat, cost, in_bytes[lean] = echo.inputs(message, args.reps, gap_s)
                samples["p_lat"] += lat
                samples["p_cost"] += cost
    finally:
        echo.close()
    rows = []
    summary: dict[str, Any] = {}
    for (size, logprobs), s in sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rows.append([str(size), "top 5" if logprobs else "none", f"{size_of[(size, logprobs)]:,}",
                     us(s["t_lat"]), us(s["t_cost"]), us(s["p_lat"]), us(s["p_cost"]), us(s["p_cons"]),
                     us(s["m_lat"]), us(s["m_cost"]), us(s["m_cons"])])
        summary[f"out {size} {logprobs}"] = {k: statistics.median(v) for k, v in s.items()}
    input_rows = []
    for lean, s in sorted(inputs.items()):
        label = ("lean message (id, prompt ids, SamplingParams, arrival)" if lean else
                 "dcpserve.engine.core.request.Request (prompt_token_ids + its copy all_token_ids)")
        input_rows.append([label, f"{in_bytes[lean]:,}", us(s["t_lat"]), us(s["t_cost"]), us(s["p_lat"]),
                           us(s["p_cost"])])
        summary[f"in {lean}"] = {k: statistics.median(v) for k, v in s.items()}
    return rows, input_rows, summary


# ---- 2. wire formats ---------------------------------------------------------------------------------------------

def formats(batch: list[RequestDelta]) -> dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]:
    """name -> (encode() -> wire, decode(wire) -> objects) for one batch."""
    structs = as_structs(batch)
    struct_encoder, struct_decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[DeltaStruct])
    dc_encoder, dc_decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[RequestDelta])
    return {
        "pickle list[RequestDelta]": (lambda: pickle.dumps(batch, PICKLE), pickle.loads),
        "asdict + pickle per delta (today)": (lambda: [pickle.dumps(asdict(d), PICKLE) for d in batch],
                                              lambda wire: [pickle.loads(b) for b in wire]),
        "msgspec Structs (array_like)": (lambda: struct_encoder.encode(structs), struct_decoder.decode),
        "msgspec of the dataclasses": (lambda: dc_encoder.encode(batch), dc_decoder.decode),
    }


FORMAT_SHORT = {"pickle list[RequestDelta]": "pickle dataclasses", "asdict + pickle per delta (today)": "asdict+pickle",
                "msgspec Structs (array_like)": "msgspec Structs", "msgspec of the dataclasses": "msgspec dataclasses"}


def wire_bytes(wire: Any) -> int:
    return sum(len(b) for b in wire) if isinstance(wire, list) else len(wire)


def measure_formats(args: argparse.Namespace) -> tuple[list[str], list[list[str]], dict[str, Any]]:
    times: dict[tuple[int, bool, str], tuple[list[float], list[float]]] = {}
    sizes: dict[tuple[int, bool, str], int] = {}
    cases = [(size, logprobs) for logprobs in (False, True) for size in args.batches]
    for size, logprobs in cases:  # check that every format round-trips the batch
        batch = make_batch(size, logprobs)
        for name, (encode, decode) in formats(batch).items():
            back = decode(encode())
            if name.startswith("msgspec Structs"):
                back = [RequestDelta(d.request_id, d.new_token_ids, d.new_text, d.finished, d.finish_reason,
                                     d.num_prompt_tokens, d.num_output_tokens,
                                     None if d.logprobs is None else [TokenLogprob(p.token_id, p.logprob, p.rank,
                                                                                   p.top) for p in d.logprobs])
                        for d in back]
            elif name.startswith("asdict"):
                back = [RequestDelta(**{**d, "logprobs": None if d["logprobs"] is None else
                                        [TokenLogprob(p["token_id"], p["logprob"], p["rank"],
                                                      tuple(tuple(t) for t in p["top"])) for p in d["logprobs"]]})
                        for d in back]
            if back != batch:
                raise RuntimeError(f"{name} does not round-trip a batch of {size}")
    for _ in range(args.format_rounds):
        for size, logprobs in cases:
            batch = make_batch(size, logprobs)
            inner = max(1, 2048 // size)
            for name, (encode, decode) in formats(batch).items():
                wire = encode()
                start = perf()
                for _ in range(inner):
                    encode()
                mid = perf()
                for _ in range(inner):
                    decode(wire)
                end = perf()
                enc, dec = times.setdefault((size, logprobs, name), ([], []))
                enc.append((mid - start) / inner)
                dec.append((end - mid) / inner)
                sizes[(size, logprobs, name)] = wire_bytes(wire)
    names = list(formats(make_batch(1, False)))
    columns = ["B", "logprobs"] + [f"{FORMAT_SHORT[n]} enc / dec us" for n in names] + \
        [f"{FORMAT_SHORT[n]} bytes" for n in names]
    rows = []
    summary: dict[str, Any] = {}
    for size, logprobs in cases:
        cells = [str(size), "top 5" if logprobs else "none"]
        for name in names:
            enc, dec = times[(size, logprobs, name)]
            cells.append(f"{1e6 * statistics.median(enc):,.1f} / {1e6 * statistics.median(dec):,.1f}")
            summary[f"{size} {logprobs} {name}"] = (statistics.median(enc), statistics.median(dec),
                                                    sizes[(size, logprobs, name)])
        cells += [f"{sizes[(size, logprobs, name)]:,}" for name in names]
        rows.append(cells)
    return columns, rows, summary


# ---- 3. in the loop: the tiny model's decode steps -------------------------------------------------------------

def build_engine(model_dir: Path, batch: int, prompt_len: int, max_tokens: int) -> Any:
    import torch

    from dcpserve.engine.args import EngineArgs
    from dcpserve.engine.core.engine import LLMEngine

    torch.set_num_threads(1)
    kv_bytes_per_token = 2 * 2 * 1 * 32 * 4  # tiny model: 2 layers, 1 KV head, head_dim 32, float32
    engine = LLMEngine(EngineArgs(
        str(model_dir),
        kv_cache_memory_bytes=2 * batch * (prompt_len + max_tokens + 64) * kv_bytes_per_token + (1 << 20),
        block_size=32, max_num_seqs=max(256, batch), max_num_batched_tokens=max(2048, batch * prompt_len),
    ).create_engine_config())
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(2):
        engine.add_request(prompt_token_ids=[1] * prompt_len, sampling_params=warm, request_id=f"warm-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def stamped_step(engine: Any) -> tuple[float, float, float, list[RequestDelta]]:
    """(step end, step seconds, the step's CPU seconds in its thread, deltas): what a core hands over after each
    step."""
    start, cpu = perf(), time.thread_time()
    deltas = engine.step()
    end = perf()
    return end, end - start, time.thread_time() - cpu, deltas


def core_loop(engine: Any, get_input: Callable[[bool], Any], emit: Callable[[Any], None]) -> None:
    """The engine core: applies queued messages between steps (blocking only when it has nothing to run), steps,
    hands each step's output batch over."""
    while True:
        message = get_input(not engine.has_unfinished_requests())
        while message is not None:
            if message[0] == "stop":
                return
            request = message[1]
            engine.add_request(prompt_token_ids=request.prompt_token_ids, sampling_params=request.sampling_params,
                               request_id=request.request_id)
            message = get_input(False)
        if engine.has_unfinished_requests():
            emit(stamped_step(engine))


def _engine_core(conn: Any, model_dir: Path, batch: int, prompt_len: int, max_tokens: int) -> None:
    """The core process (spawned): inputs and output batches pickled over the Pipe."""
    engine = build_engine(model_dir, batch, prompt_len, max_tokens)
    conn.send_bytes(b"ready")

    def get_input(block: bool) -> Any:
        return pickle.loads(conn.recv_bytes()) if block or conn.poll(0) else None

    core_loop(engine, get_input, lambda out: conn.send_bytes(pickle.dumps(out, PICKLE)))
    engine.shutdown()


class LoopRound:
    """One round on the event loop: B requests in, their deltas consumed the way today's replica does (a queue and a
    task per request; each delta asdict()-ed and pickled, the work of yielding it into a Ray stream)."""

    def __init__(self, requests: list[Request]) -> None:
        self.queues: dict[str, asyncio.Queue[RequestDelta]] = {r.request_id: asyncio.Queue() for r in requests}
        self.arrivals: list[float] = []
        self.handoffs: list[float] = []
        self.steps: list[float] = []
        self.step_cpu: list[float] = []
        self.tokens = 0

    def on_output(self, out: tuple[float, float, float, list[RequestDelta]]) -> None:
        now = perf()
        step_end, step_s, step_cpu, deltas = out
        self.arrivals.append(now)
        self.handoffs.append(now - step_end)
        self.steps.append(step_s)
        self.step_cpu.append(step_cpu)
        for delta in deltas:
            self.queues[delta.request_id].put_nowait(delta)

    async def consume(self) -> None:
        async def reader(q: asyncio.Queue[RequestDelta]) -> None:
            while True:
                delta = await q.get()
                pickle.dumps(asdict(delta), PICKLE)
                self.tokens += len(delta.new_token_ids)
                if delta.finished:
                    return

        await asyncio.gather(*(reader(q) for q in self.queues.values()))

    def samples(self) -> dict[str, list[float]]:
        """Decode steps only: the first batch (prefill and first token) is left out."""
        arrivals = self.arrivals[1:]
        return {"step": self.steps[1:], "step_cpu": self.step_cpu[1:], "handoff": self.handoffs[1:],
                "interval": [b - a for a, b in itertools.pairwise(arrivals)]}


def round_requests(n: int, prompt_len: int, max_tokens: int, round_id: int, logprobs: int | None) -> list[Request]:
    rng = random.Random(round_id)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return [Request(f"r{round_id}-{i}", [rng.randrange(512) for _ in range(prompt_len)], params) for i in range(n)]


def run_alone(engine: Any, requests: list[Request]) -> dict[str, list[float]]:
    for r in requests:
        engine.add_request(prompt_token_ids=r.prompt_token_ids, sampling_params=r.sampling_params,
                           request_id=r.request_id)
    steps, step_cpu = [], []
    while engine.has_unfinished_requests():
        _, wall, cpu, _ = stamped_step(engine)
        steps.append(wall)
        step_cpu.append(cpu)
    return {"step": steps[1:], "step_cpu": step_cpu[1:], "interval": steps[1:], "handoff": []}


async def run_today(engine: Any, requests: list[Request]) -> LoopRound:
    """AsyncEngine today: the loop task adds the requests, then awaits each step in asyncio.to_thread."""
    rnd = LoopRound(requests)
    consumer = asyncio.ensure_future(rnd.consume())
    for r in requests:
        engine.add_request(prompt_token_ids=r.prompt_token_ids, sampling_params=r.sampling_params,
                           request_id=r.request_id)
    while engine.has_unfinished_requests():
        rnd.on_output(await asyncio.to_thread(stamped_step, engine))
    await consumer
    return rnd


async def run_thread_core(engine: Any, requests: list[Request]) -> LoopRound:
    """A core thread: inputs through a queue.Queue, output batches through loop.call_soon_threadsafe."""
    loop = asyncio.get_running_loop()
    rnd = LoopRound(requests)
    inbox: queue.Queue[Any] = queue.Queue()

    def get_input(block: bool) -> Any:
        try:
            return inbox.get(block)
        except queue.Empty:
            return None

    thread = threading.Thread(target=core_loop, daemon=True,
                              args=(engine, get_input, lambda out: loop.call_soon_threadsafe(rnd.on_output, out)))
    thread.start()
    consumer = asyncio.ensure_future(rnd.consume())
    for r in requests:
        inbox.put(("add", r))
    await consumer
    inbox.put(("stop",))
    await asyncio.to_thread(thread.join)
    return rnd


class ProcessCore:
    """A core process: inputs and output batches pickled over a multiprocessing Pipe, read with loop.add_reader."""

    def __init__(self, ctx: Any, model_dir: Path, batch: int, prompt_len: int, max_tokens: int) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_engine_core, args=(child, model_dir, batch, prompt_len, max_tokens),
                                   daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(300):
            raise RuntimeError("the core process did not start within 300 s")
        self.conn.recv_bytes()  # ready

    async def run(self, requests: list[Request]) -> LoopRound:
        loop = asyncio.get_running_loop()
        rnd = LoopRound(requests)
        loop.add_reader(self.conn.fileno(), lambda: rnd.on_output(pickle.loads(self.conn.recv_bytes())))
        consumer = asyncio.ensure_future(rnd.consume())
        for r in requests:
            self.conn.send_bytes(pickle.dumps(("add", r), PICKLE))
        await consumer
        loop.remove_reader(self.conn.fileno())
        return rnd

    def close(self) -> None:
        self.conn.send_bytes(pickle.dumps(("stop",), PICKLE))
        self.process.join(30)
        self.conn.close()


THREAD_SWITCH = "core thread, sys.setswitchinterval(0.001)"
ENGINE_MODES = ["alone (no loop)", "today: asyncio.to_thread per step", "core thread", THREAD_SWITCH, "core process"]


def measure_engine(args: argparse.Namespace, ctx: Any, work_dir: Path) -> tuple[list[list[str]], dict[str, Any]]:
    from dcpserve.cluster.tiny_model import write_tiny_model

    model_dir = write_tiny_model(work_dir / "tiny", seed=0)
    rows = []
    summary: dict[str, Any] = {}
    for batch in args.engine_batches:
        samples: dict[str, dict[str, list[float]]] = {
            m: {k: [] for k in ("step", "step_cpu", "interval", "handoff", "cpu")} for m in ENGINE_MODES}
        engine = build_engine(model_dir, batch, args.engine_prompt_len, args.engine_tokens)
        core = None
        try:
            core = ProcessCore(ctx, model_dir, batch, args.engine_prompt_len, args.engine_tokens)
            for round_id in range(args.engine_rounds):
                for mode in ENGINE_MODES:
                    requests = round_requests(batch, args.engine_prompt_len, args.engine_tokens,
                                              round_id * len(ENGINE_MODES) + ENGINE_MODES.index(mode),
                                              args.engine_logprobs)
                    cpu = time.process_time(), _cpu_seconds(core.process.pid)
                    if mode.startswith("alone"):
                        got = run_alone(engine, requests)
                    else:
                        run = {"today": run_today, "core thread": run_thread_core}.get(mode.split(":")[0].split(",")[0])
                        switch = sys.getswitchinterval()
                        if mode == THREAD_SWITCH:  # the GIL changes hands every 1 ms instead of every 5 ms
                            sys.setswitchinterval(0.001)
                        try:
                            rnd = asyncio.run(run(engine, requests) if run else core.run(requests))
                        finally:
                            sys.setswitchinterval(switch)
                        if rnd.tokens != batch * args.engine_tokens:
                            raise RuntimeError(f"{mode}: {rnd.tokens} tokens of {batch * args.engine_tokens}")
                        got = rnd.samples()
                    # CPU of this process (the loop and, but for the process mode, the core) and of the core
                    # process, per engine step (one token per request per step; the prefill step included)
                    got["cpu"] = [(time.process_time() - cpu[0] + _cpu_seconds(core.process.pid) - cpu[1])
                                  / args.engine_tokens]
                    for key, values in got.items():
                        samples[mode][key] += values
        finally:
            if core is not None:
                core.close()
            engine.shutdown()
        for mode in ENGINE_MODES:
            s = samples[mode]
            handoff = [us(s["handoff"]), us(s["handoff"], 0.9)] if s["handoff"] else ["-", "-"]
            tok_s = batch / statistics.median(s["interval"])
            rows.append([mode, str(batch), ms(s["step"]), ms(s["step_cpu"]), ms(s["interval"]), f"{tok_s:,.0f}",
                         *handoff, ms(s["cpu"])])
            summary[f"{mode} {batch}"] = {"tok_s": tok_s, **{k: statistics.median(v) for k, v in s.items() if v}}
    return rows, summary


# ---- 4. Ray streaming generator ----------------------------------------------------------------------------------

def measure_ray(args: argparse.Namespace) -> tuple[list[list[str]], dict[str, Any]]:
    import ray

    @ray.remote
    class Streamer:
        """Yields prebuilt items as fast as the stream takes them."""

        def __init__(self, deltas: list[RequestDelta], encoded: bytes, steps: int) -> None:
            self.steps = steps
            self.per_delta = [asdict(d) for d in deltas]
            self.batch = deltas
            self.encoded = encoded

        def ready(self) -> bool:
            return True

        async def one_request(self, i: int):  # an async generator: one stream
            for _ in range(self.steps):
                yield self.per_delta[i]

        async def batches(self, kind: str):  # an async generator: one stream
            item = self.encoded if kind == "msgspec" else self.batch
            for _ in range(self.steps):
                yield item

    batch, steps = args.ray_batch, args.ray_steps
    ray_dir = tempfile.mkdtemp(prefix="dcpbench-", dir="/tmp")  # Ray's socket paths must stay short
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir)
    decoder = msgspec.msgpack.Decoder(list[DeltaStruct])
    try:
        deltas = make_batch(batch, False)  # built here: this module's Structs do not survive cloudpickle
        actor = Streamer.remote(deltas, msgspec.msgpack.encode(as_structs(deltas)), steps)  # type: ignore[attr-defined]  # mypy applies no class decorator: an ActorClass
        ray.get(actor.ready.remote())

        async def per_request() -> int:
            async def one(i: int) -> int:
                n = 0
                async for ref in actor.one_request.remote(i):
                    await ref
                    n += 1
                return n
            return sum(await asyncio.gather(*(one(i) for i in range(batch))))

        async def per_step(kind: str) -> int:
            n = 0
            async for ref in actor.batches.remote(kind):
                item = await ref
                n += len(decoder.decode(item) if kind == "msgspec" else item)
            return n

        cases: dict[str, Callable[[], Any]] = {
            f"one item per token per request ({batch} streams, asdict dicts: today)": per_request,
            "one item per step (list[RequestDelta], Ray's pickle)": lambda: per_step("pickle"),
            "one item per step (msgspec Structs bytes, decoded)": lambda: per_step("msgspec"),
        }
        asyncio.run(per_step("pickle"))  # warm the actor and the stream path
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.ray_rounds):
            for name, case in cases.items():
                start = perf()
                delivered = asyncio.run(case())
                times[name].append(perf() - start)
                if delivered != batch * steps:
                    raise RuntimeError(f"{name}: {delivered} deltas of {batch * steps}")
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    rows = []
    summary: dict[str, Any] = {}
    for name, values in times.items():
        per_step_s = statistics.median(values) / steps
        items = batch * steps if "per request" in name else steps
        rows.append([name, f"{items:,}", f"{1e6 * per_step_s:,.0f}",
                     f"{1e6 * statistics.median(values) / items:,.0f}"])
        summary[name] = per_step_s
    return rows, summary


# ---- report ------------------------------------------------------------------------------------------------------

def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def us(seconds: list[float], q: float = 0.5) -> str:
    if q == 0.5:
        return f"{1e6 * statistics.median(seconds):,.1f}"
    ordered = sorted(seconds)
    return f"{1e6 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]:,.1f}"


def us_diff(a: list[float], b: list[float]) -> str:
    return f"{1e6 * (statistics.median(a) - statistics.median(b)):+,.1f}"


def ms(seconds: list[float]) -> str:
    return f"{1e3 * statistics.median(seconds):.2f}"


def markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|:---|" + "---:|" * (len(columns) - 1),
            *["| " + " | ".join(row) + " |" for row in rows]]


HANDOFF_COLUMNS = ["B", "logprobs", "pickled bytes", "thread: produce -> callback us", "thread: producer us",
                   "process pickle: produce -> callback us", "process pickle: producer us (dumps + send)",
                   "process pickle: loop us (recv + loads)", "process msgspec: produce -> callback us",
                   "process msgspec: producer us (encode + send)", "process msgspec: loop us (recv + decode)"]
INPUT_COLUMNS = ["add-request message (2k-token prompt)", "pickled bytes", "thread: put -> core us",
                 "thread: loop us (put)", "process: send -> core us", "process: loop us (pickle + send)"]
ENGINE_COLUMNS = ["mode", "batch", "core step ms", "core step CPU ms", "step interval at the loop ms", "decode tok/s",
                  "handoff us (p50)", "handoff us (p90)", "CPU ms per step (all processes)"]
RAY_COLUMNS = ["Ray stream (actor async generator -> driver)", "items", "us per engine step", "us per item"]


def header_lines(args: argparse.Namespace) -> list[str]:
    import importlib.metadata

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.machine())
    return [
        f"CPU RUN: {cpu}, {os.cpu_count()} cores shared with other jobs; python {platform.python_version()}, "
        f"msgspec {version('msgspec')} (installed for this measurement only, not a dependency), ray "
        f"{version('ray')}, torch {version('torch')}; date {datetime.datetime.now().isoformat(timespec='seconds')}",
        "all values are medians over every repetition of every round; the variants alternate round by round so "
        "load spikes hit all of them",
    ]


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def section(command: str, info: list[str], parts: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["## Engine core transport: thread vs process, pickle vs msgspec", "", f"Command: `{command}`", "",
             *[f"- {line}" for line in info + parts["findings"]]]
    lines += ["", "### Handoff of one output batch, core -> event loop", "",
              f"- lockstep: {args.rounds} rounds x {args.reps} batches per variant; after each batch is consumed the "
              f"producer idles {args.gap_us} us (the consumer is back in epoll, as between engine steps), then "
              "stamps perf_counter() and hands the batch over; produce -> callback ends when the consumer's "
              "callback holds the RequestDelta objects (for the process: after recv_bytes + pickle.loads)",
              "- thread: loop.call_soon_threadsafe(callback, batch) from a producer thread (producer us: that call); "
              "process pickle: a spawned process pickles (stamp, list[RequestDelta]) and send_bytes over a "
              "multiprocessing Pipe (a socketpair), the loop reads it with loop.add_reader and unpickles; process "
              "msgspec: the same with (stamp, list[DeltaStruct]) through msgspec msgpack (vLLM v1's choice)",
              "- each delta: one token id, a short text, a 32-hex request id, and optionally logprobs (the token "
              "and 5 top alternatives)", "",
              *markdown_table(HANDOFF_COLUMNS, parts["handoff"]),
              "", "### One add-request message, event loop -> core", "",
              f"- a prompt of {args.prompt_len} random token ids (< 32000) and SamplingParams; thread: queue.Queue.put "
              "to a core thread blocked in get(); process: pickle + send_bytes to a process blocked in recv_bytes "
              "(latency ends after its pickle.loads)", "",
              *markdown_table(INPUT_COLUMNS, parts["inputs"])]
    lines += ["", "### Wire format of an output batch (replica -> ingress)", "",
              "- encode and decode of one batch (decode to typed objects: dataclasses, dicts for asdict, Structs), "
              "us; bytes on the wire; every format is checked to round-trip the batch",
              "- asdict+pickle: today's shape, one dict per delta "
              "(dcpserve/deployments/replica/engine_replica.py yields asdict(delta) per "
              "token per request), pickled one by one (Ray pickles each stream item; its own framing comes on top); "
              "msgspec Structs: array_like=True, omit_defaults=True (vLLM's EngineCoreOutputs); msgspec "
              "dataclasses: msgspec.msgpack.Encoder / Decoder(list[RequestDelta]) on the existing dataclasses", "",
              *markdown_table(parts["format_columns"], parts["formats"])]
    if parts.get("engine"):
        lines += ["", "### In the loop: the tiny model's decode steps", "",
                  f"- the tiny model (dcpserve.cluster.tiny_model, tp=1, float32, 1 torch thread per engine), batch "
                  f"{'/'.join(map(str, args.engine_batches))}, {args.engine_prompt_len}-token random prompts, "
                  f"{args.engine_tokens} greedy tokens each (ignore_eos, detokenized, logprobs "
                  f"{args.engine_logprobs}), {args.engine_rounds} rounds per mode; the prefill step is left out",
                  "- the event loop does today's per-token replica work: a queue and a task per request, each delta "
                  "asdict()-ed and pickled (what yielding it into the Ray stream costs), so the loop competes with "
                  "the core for the GIL (thread) or a core (process)",
                  "- core step ms: LLMEngine.step() wall time inside the core; core step CPU ms: the CPU time of the "
                  "core's thread in that step (wall - CPU: time the step waited, for the GIL or for a core); step "
                  "interval: between output batches reaching the loop; decode tok/s: batch / median step interval "
                  "at the loop; handoff: step end -> the loop holds the deltas; CPU ms per "
                  "step: user + system CPU of the replica process (all its threads) and of the core process over "
                  "the round (prefill included), per engine step: less sensitive to the machine's load than wall "
                  "time",
                  "- alone: the engine stepping with no event loop at all (the step's own cost); "
                  "setswitchinterval(0.001): the core thread with the interpreter's GIL switch interval at 1 ms "
                  "instead of the default 5 ms, so the loop waits less for the GIL while the core steps",
                  "- noise: the wall-time columns move with the machine's load; runs during development at load "
                  "averages of 3 to 13 (other jobs on the 2 cores) reordered the tok/s of today, core thread and "
                  "core process, while their CPU ms per step kept the core thread the lowest in every run", "",
                  *markdown_table(ENGINE_COLUMNS, parts["engine"])]
    if parts.get("ray"):
        lines += ["", "### Ray streaming generator items", "",
                  f"- a Ray actor's async generator streams {args.ray_steps} engine steps of {args.ray_batch} deltas "
                  "to an asyncio driver (local Ray, num_cpus=2, the actor yields as fast as the stream takes "
                  f"items); {args.ray_rounds} rounds per case; Serve's handle and router add their own cost on top",
                  "",
                  *markdown_table(RAY_COLUMNS, parts["ray"])]
    return "\n".join(lines)


def findings(args: argparse.Namespace, handoff: dict[str, Any], fmt: dict[str, Any], engine: dict[str, Any],
             ray_summary: dict[str, Any]) -> list[str]:
    lines = []
    for size in (32,) if 32 in args.batches else args.batches[-1:]:
        h = handoff[f"out {size} False"]
        lines.append(
            f"handoff of a {size}-delta batch (no logprobs): thread {1e6 * h['t_lat']:.0f} us produce -> callback, "
            f"{1e6 * h['t_cost']:.1f} us on the core; process with pickle {1e6 * h['p_lat']:.0f} us, "
            f"{1e6 * h['p_cost']:.0f} us on the core (dumps + send) and {1e6 * h['p_cons']:.0f} us on the event loop "
            f"(recv + loads); process with msgspec {1e6 * h['m_lat']:.0f} us, {1e6 * h['m_cost']:.0f} + "
            f"{1e6 * h['m_cons']:.0f} us")
        today = fmt[f"{size} False asdict + pickle per delta (today)"]
        structs = fmt[f"{size} False msgspec Structs (array_like)"]
        pickled = fmt[f"{size} False pickle list[RequestDelta]"]
        lines.append(
            f"wire format at {size} deltas: asdict + pickle per delta (today) {1e6 * (today[0] + today[1]):.0f} us "
            f"and {today[2]:,} bytes; pickle of the dataclass list {1e6 * (pickled[0] + pickled[1]):.0f} us, "
            f"{pickled[2]:,} bytes; msgspec Structs {1e6 * (structs[0] + structs[1]):.0f} us, {structs[2]:,} bytes")
    for batch in args.engine_batches if engine else []:
        alone = engine[f"{ENGINE_MODES[0]} {batch}"]
        modes = ", ".join(f"{mode.split(':')[0]} {engine[f'{mode} {batch}']['tok_s']:,.0f} tok/s (step "
                          f"{1e3 * engine[f'{mode} {batch}']['step']:.2f} ms, "
                          f"{1e3 * engine[f'{mode} {batch}']['cpu']:.2f} CPU ms per step)" for mode in ENGINE_MODES[1:])
        lines.append(
            f"tiny model at batch {batch}: a decode step alone {1e3 * alone['step']:.2f} ms "
            f"({1e3 * alone['cpu']:.2f} CPU ms per step); with the loop's per-token work beside it: {modes}")
    if ray_summary:
        per_request, pickled, encoded = ray_summary.values()
        lines.append(
            f"Ray stream: {args.ray_batch} deltas per step cost {1e6 * per_request:,.0f} us per step as one item per "
            f"token per request vs {1e6 * pickled:,.0f} us as one pickled batch item ({1e6 * encoded:,.0f} us as "
            "msgspec bytes)")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128], help="deltas per output batch")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds of the handoff measurements")
    parser.add_argument("--reps", type=int, default=150, help="handoffs per variant per round (default 150)")
    parser.add_argument("--gap-us", type=int, default=300, help="idle time before each handoff (default 300 us)")
    parser.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens of the add-request message")
    parser.add_argument("--format-rounds", type=int, default=15, help="rounds of the wire-format timings")
    parser.add_argument("--engine-batches", type=int, nargs="*", default=[32],
                        help="batch sizes of the in-the-loop engine measurement (none: skip it)")
    parser.add_argument("--engine-tokens", type=int, default=64, help="greedy tokens per request in the loop test")
    parser.add_argument("--engine-prompt-len", type=int, default=64, help="prompt tokens in the loop test")
    parser.add_argument("--engine-rounds", type=int, default=5, help="rounds per mode in the loop test")
    parser.add_argument("--engine-logprobs", type=int, default=None, help="logprobs per token in the loop test")
    parser.add_argument("--skip-ray", action="store_true", help="skip the Ray streaming-generator measurement")
    parser.add_argument("--ray-batch", type=int, default=32, help="deltas per step in the Ray measurement")
    parser.add_argument("--ray-steps", type=int, default=50, help="steps streamed per case in the Ray measurement")
    parser.add_argument("--ray-rounds", type=int, default=3, help="rounds per case in the Ray measurement")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no Ray")
    parser.add_argument("--write-docs", "--write", action="store_true",
                        help="update this script's section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.reps, args.format_rounds, args.engine_rounds = 2, 50, 5, 1
        args.engine_tokens, args.skip_ray = 32, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_docs:
        DOCS.check()  # fail now, not after the run
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter, as an engine core process would be
    info = header_lines(args)
    print("\n".join(info), flush=True)
    started = perf()
    load_before = load_average()
    parts: dict[str, Any] = {}
    handoff_rows, input_rows, handoff = measure_handoff(args, ctx)
    print(f"handoff: {perf() - started:.0f} s", flush=True)
    parts["handoff"], parts["inputs"] = handoff_rows, input_rows
    print("\n" + "\n".join(markdown_table(HANDOFF_COLUMNS, handoff_rows)), flush=True)
    print("\n" + "\n".join(markdown_table(INPUT_COLUMNS, input_rows)), flush=True)
    mark = perf()
    parts["format_columns"], parts["formats"], fmt = measure_formats(args)
    print(f"formats: {perf() - mark:.0f} s", flush=True)
    mark = perf()
    print("\n" + "\n".join(markdown_table(parts["format_columns"], parts["formats"])), flush=True)
    engine: dict[str, Any] = {}
    if args.engine_batches:
        work_dir = Path(tempfile.mkdtemp(prefix="dcpserve-bench-core-"))
        try:
            parts["engine"], engine = measure_engine(args, ctx, work_dir)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
        print("\n" + "\n".join(markdown_table(ENGINE_COLUMNS, parts["engine"])), flush=True)
        print(f"engine: {perf() - mark:.0f} s", flush=True)
    ray_summary: dict[str, Any] = {}
    if not args.skip_ray:
        parts["ray"], ray_summary = measure_ray(args)
        print("\n" + "\n".join(markdown_table(RAY_COLUMNS, parts["ray"])), flush=True)
    info.append(f"load average (1/5/15 min) {load_before} at the start, {load_average()} at the end; "
                f"{perf() - started:.0f} s in all")
    parts["findings"] = findings(args, handoff, fmt, engine, ray_summary)
    print("\n" + "\n".join(parts["findings"]) + f"\ntotal {perf() - started:.0f} s", flush=True)
    if args.write_docs:
        command = shlex.join(["python", "bench/core_transport.py", *(sys.argv[1:] if argv is None else argv)])
        DOCS.write(section(command, info, parts, args))
        print(f"updated {DOCS.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
