"""One protocol-level suite, run against both engine backends (dcpserve.engine.protocol.EngineClient): the native engine
here, vLLM's AsyncLLM behind dcpserve.engine.backends.vllm.engine in `make test-vllm` (the real CPU wheel, no mock).

What the serving layer relies on: greedy tokens equal transformers' on the same random weights, the KV ledger in
logical blocks (capacity, per-request commitments, KvFull when full), abort frees the request inside the engine,
bad requests are ValueErrors before anything is queued, typed stats, health and shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.backends import start_engine
from dcpserve.engine.protocol import EngineClient, EngineStats, KvFull, KvLedger, RequestDelta
from dcpserve.engine.sampling_params import SamplingParams
from tests.engine.llm_checks import hf_greedy

PROMPTS = [[7], list(range(10, 42)), list(range(100, 171)), [300, 301, 302]]  # 1 token, 1 block, several, short
MAX_TOKENS = 12
# vLLM's CPU attention pages KV in multiples of 32 tokens, and vLLM wants one max_model_len request to fit the pool:
# 1 MiB of the tiny model's KV (16 KiB per 32-token page) is 64 pages, 63 after vLLM's null block.
BLOCK_SIZE = 32
KV_BYTES = 1 << 20
MAX_MODEL_LEN = 1024

BACKENDS = [
    pytest.param("native", id="native"),
    pytest.param("vllm", id="vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(600)]),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def hf_expected(tiny: Path) -> dict[tuple[int, ...], list[int]]:
    return hf_greedy(tiny, PROMPTS, MAX_TOKENS)


def engine_args(tiny: Path, backend: str, **overrides: object) -> EngineArgs:
    options: dict[str, object] = dict(
        model=str(tiny), backend=backend, dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory_bytes=KV_BYTES,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=8, admission="full", device="cpu",
    )
    options.update(overrides)
    return EngineArgs(**options)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest, tiny: Path):
    """One engine per backend for the module, on an event loop of its own (vLLM binds its output loop to it)."""
    loop = asyncio.new_event_loop()

    async def start() -> EngineClient:
        return start_engine(engine_args(tiny, request.param))

    client = loop.run_until_complete(start())
    try:
        yield loop, client
    finally:
        loop.run_until_complete(client.shutdown())
        loop.close()


async def _collect(client: EngineClient, prompt: list[int], params: SamplingParams, request_id: str,
                   check_kv: bool = False) -> tuple[list[int], str | None]:
    tokens: list[int] = []
    reason = None
    stream = await client.submit(sampling_params=params, prompt_token_ids=prompt, request_id=request_id,
                                 check_kv=check_kv)
    async for delta in stream:
        tokens += delta.new_token_ids
        if delta.finished:
            reason = delta.finish_reason
    return tokens, reason


async def _settle(client: EngineClient, timeout_s: float = 30.0) -> EngineStats:
    """Waits until the engine runs nothing and its ledger holds nothing (the stat logger of vLLM lags a step)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = client.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and not client.kv_ledger().per_request:
            return stats
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the engine still holds requests: {stats}, {client.kv_ledger()}")
        await asyncio.sleep(0.05)


def test_satisfies_the_protocol(engine) -> None:
    _, client = engine
    assert isinstance(client, EngineClient)
    assert client.backend in ("native", "vllm")
    assert client.tokenizer is not None


def test_greedy_tokens_equal_transformers(engine, hf_expected) -> None:
    """Every prompt alone and all of them batched together: the tokens transformers' generate picks."""
    loop, client = engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run() -> list[tuple[list[int], str | None]]:
        return list(await asyncio.gather(*(_collect(client, p, params, f"greedy-{i}") for i, p in enumerate(PROMPTS))))

    for prompt, (tokens, reason) in zip(PROMPTS, loop.run_until_complete(run()), strict=True):
        assert tokens == hf_expected[tuple(prompt)], prompt
        assert reason == "length"


def test_kv_ledger_in_logical_blocks(engine) -> None:
    loop, client = engine
    ledger = client.kv_ledger()
    assert isinstance(ledger, KvLedger)
    assert ledger.tokens_per_block == BLOCK_SIZE  # block_size * dcp, dcp = 1
    assert ledger.capacity_blocks * ledger.tokens_per_block >= MAX_MODEL_LEN
    assert client.admission_blocks(40, 30) == 3  # "full": ceil((40 + 30) / 32)
    stats = client.stats()
    assert stats.kv_blocks_total == ledger.capacity_blocks and stats.kv_block_size_tokens == BLOCK_SIZE
    assert stats.kv_capacity_tokens == ledger.capacity_blocks * BLOCK_SIZE
    assert [r.tokens_capacity for r in stats.per_rank] == [ledger.capacity_blocks * BLOCK_SIZE]


def test_kv_full_refuses_and_nothing_is_lost(engine) -> None:
    """Requests that fill the ledger are held at their full commitment; one more is refused with KvFull before it
    is queued; when they finish, the ledger is empty and the refused one is accepted. Each prompt starts with a
    token of its own, so no two share a cached prefix block (the engine steps between two submits)."""
    loop, client = engine
    capacity = client.kv_ledger().capacity_blocks
    per_request = 8  # blocks: 200 prompt + 56 max_tokens = 256 tokens
    num_fill = capacity // per_request
    prompts = [[300 + i] + list(range(21, 220)) for i in range(num_fill + 1)]
    prompt = prompts[-1]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=56, ignore_eos=True)

    async def run() -> None:
        streams = []
        for i in range(num_fill):
            streams.append(await client.submit(sampling_params=params, prompt_token_ids=prompts[i],
                                               request_id=f"fill-{i}", check_kv=True))
        ledger = client.kv_ledger()
        assert ledger.committed_blocks == len(streams) * per_request
        with pytest.raises(KvFull) as refused:
            await client.submit(sampling_params=params, prompt_token_ids=prompt, request_id="one-more",
                                check_kv=True)
        assert refused.value.need == per_request and refused.value.free_blocks == capacity % per_request
        assert not client.has_request("one-more")

        async def drain(stream) -> int:
            return sum([len(d.new_token_ids) async for d in stream])

        assert await asyncio.gather(*(drain(s) for s in streams)) == [56] * len(streams)
        await _settle(client)
        tokens, _ = await _collect(client, prompt, params, "one-more", check_kv=True)
        assert len(tokens) == 56
        assert client.stats().num_preemptions == 0  # "full": what it accepted always fit

    loop.run_until_complete(run())


def test_a_burst_of_adds_is_checked_one_after_another(engine) -> None:
    """Submits that reach the core together are checked in one batch, each against the ledger after the ones before
    it (Scheduler.ledger_with): exactly as many are accepted as fit, whatever the batching."""
    loop, client = engine
    capacity = client.kv_ledger().capacity_blocks
    per_request = 8  # blocks: 200 prompt + 56 max_tokens = 256 tokens ("full")
    num_fill = capacity // per_request
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=56, ignore_eos=True)

    async def submit(i: int) -> Any:
        try:
            return await client.submit(sampling_params=params, prompt_token_ids=[298 + i] + list(range(21, 220)),
                                       request_id=f"burst-{i}", check_kv=True)
        except KvFull as err:
            return err

    async def run() -> None:
        answers = await asyncio.gather(*(submit(i) for i in range(num_fill + 3)))
        streams = [a for a in answers if not isinstance(a, KvFull)]
        assert len(streams) == num_fill and client.kv_ledger().committed_blocks == num_fill * per_request
        for stream in streams:
            assert sum([len(d.new_token_ids) async for d in stream]) == 56
        await _settle(client)
        assert client.kv_ledger().committed_blocks == 0

    loop.run_until_complete(run())


def test_abort_frees_the_request_inside_the_engine(engine) -> None:
    loop, client = engine

    async def run() -> None:
        stream = await client.submit(sampling_params=SamplingParams(temperature=1.0, seed=1, max_tokens=500,
                                                                    ignore_eos=True),
                                     prompt_token_ids=list(range(50, 90)), request_id="to-abort")
        seen = 0
        async for delta in stream:
            seen += len(delta.new_token_ids)
            if seen >= 3:
                break
        await stream.aclose()  # the client went away
        stats = await _settle(client)
        assert stats.kv_blocks_used == 0 or client.backend == "vllm"  # vLLM's usage figure lags one stat record
        assert not client.has_request("to-abort")
        # Never iterated: abort() alone frees it.
        await client.submit(sampling_params=SamplingParams(max_tokens=5), prompt_token_ids=[1, 2, 3],
                            request_id="never")
        client.abort("never")
        await _settle(client)

    loop.run_until_complete(run())


class _Sink:
    """A DeltaSink that records each delivery (the deltas of one call) and each failure."""

    def __init__(self) -> None:
        self.deliveries: list[list[RequestDelta]] = []
        self.failed: list[tuple[str, BaseException]] = []

    def deliver(self, deltas: Sequence[RequestDelta]) -> None:
        self.deliveries.append(list(deltas))

    def fail(self, request_id: str, error: BaseException) -> None:
        self.failed.append((request_id, error))

    def tokens(self, request_id: str) -> list[int]:
        return [t for batch in self.deliveries for d in batch if d.request_id == request_id for t in d.new_token_ids]


def test_submit_to_delivers_each_requests_deltas_to_its_sink(engine, hf_expected) -> None:
    """Requests bound for one reader share a sink: each gets the tokens a stream of its own would (transformers'),
    in order, ending with one finishing delta; another sink gets only its own request's; an aborted one gets nothing
    after the abort. The native engine hands a sink a whole step of its requests in one call (the one split of its
    step output is by sink); vLLM streams per request, so its deliveries carry one request each."""
    loop, client = engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    shared, other = _Sink(), _Sink()

    async def run() -> None:
        for i, prompt in enumerate(PROMPTS[:3]):
            await client.submit_to(shared, params, prompt, f"shared-{i}")
        await client.submit_to(other, params, PROMPTS[3], "other")
        long = SamplingParams(temperature=1.0, seed=2, max_tokens=500, ignore_eos=True)
        await client.submit_to(other, long, list(range(50, 90)), "aborted")
        while len(other.tokens("aborted")) < 3:
            await asyncio.sleep(0.01)
        client.abort("aborted")
        await _settle(client)
        await asyncio.sleep(0.1)  # anything still in flight for the aborted request would come now

    loop.run_until_complete(run())
    for i, prompt in enumerate(PROMPTS[:3]):
        deltas = [d for batch in shared.deliveries for d in batch if d.request_id == f"shared-{i}"]
        assert shared.tokens(f"shared-{i}") == hf_expected[tuple(prompt)]
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert other.tokens("other") == hf_expected[tuple(PROMPTS[3])]
    assert {d.request_id for batch in other.deliveries for d in batch} == {"other", "aborted"}
    assert not any(d.finished for batch in other.deliveries for d in batch if d.request_id == "aborted")
    assert len(other.tokens("aborted")) < 500 and not client.has_request("aborted")
    assert not shared.failed and not other.failed
    if client.backend == "native":  # every step of the three shared requests came to their sink in one call
        assert max(len(batch) for batch in shared.deliveries) == 3
        assert all(len({d.request_id for d in batch}) == len(batch) for batch in shared.deliveries)
    else:
        assert all(len(batch) == 1 for batch in shared.deliveries + other.deliveries)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_abort_stops_generation_long_before_the_request_would_end(backend: str, tiny: Path) -> None:
    """The client of an 8,000-token request (the tiny model's whole context) goes away after 3 tokens: the engine
    stops generating it. 8,000 tokens take seconds on either backend here (vLLM's ~1 ms a token is the faster),
    against an abort that reaches the engine within milliseconds in this process: an abort that never arrives, or
    that the engine ignores, ends the request at 8,000 tokens."""
    max_tokens = 8_000
    args = engine_args(tiny, backend, max_model_len=8192, kv_cache_memory_bytes=(8192 // BLOCK_SIZE + 1) * 16_384,
                       max_num_seqs=2)
    loop = asyncio.new_event_loop()

    async def run() -> int:
        client = start_engine(args)
        try:
            before = client.stats().generation_tokens
            params = SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True)
            stream = await client.submit(sampling_params=params, prompt_token_ids=[5, 6, 7], request_id="long")
            seen = 0
            async for delta in stream:
                seen += len(delta.new_token_ids)
                if seen >= 3:
                    break
            await stream.aclose()
            stats = await _settle(client)
            return stats.generation_tokens - before
        finally:
            await client.shutdown()

    generated = loop.run_until_complete(run())
    loop.close()
    assert 3 <= generated < max_tokens, generated


@pytest.mark.parametrize("prompt,max_tokens,match", [
    ([600], 4, r"prompt_token_ids must be integers in \[0, 512\)"),
    ([], 4, "prompt is empty"),
    ([5 + i % 500 for i in range(1000)], 100, "exceeds max_model_len=1024"),
])
def test_bad_requests_are_value_errors_before_queueing(engine, prompt, max_tokens, match) -> None:
    loop, client = engine

    async def run() -> None:
        with pytest.raises(ValueError, match=match):
            await client.submit(sampling_params=SamplingParams(max_tokens=max_tokens), prompt_token_ids=prompt,
                                request_id="bad")
        assert not client.has_request("bad") and not client.kv_ledger().per_request

    loop.run_until_complete(run())


def test_health_and_stats(engine) -> None:
    loop, client = engine
    loop.run_until_complete(client.check_health())
    before = client.stats().generation_tokens
    # Its own request: the counters must move without relying on the module's other tests having run first.
    tokens, _ = loop.run_until_complete(_collect(client, PROMPTS[1], SamplingParams(max_tokens=3, temperature=0),
                                                 "stats-probe"))
    stats = client.stats()
    assert stats.healthy and stats.backend == client.backend
    assert stats.tp == 1 and stats.dcp == 1 and stats.generation_tokens >= before + len(tokens) == before + 3
    assert stats.as_dict()["kv_capacity_tokens"] == stats.kv_capacity_tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_seeded_prompt_longer_than_the_token_budget(backend: str, tiny: Path) -> None:
    """A client's seed with a prompt past max_num_batched_tokens: the native engine chunks the prefill; vLLM on CPU
    (whose sampler fails on seeded chunked prefills) prefills it in one step. Both answer, reproducibly."""
    loop = asyncio.new_event_loop()

    async def run() -> list[list[int]]:
        client = start_engine(engine_args(tiny, backend, max_num_batched_tokens=64))
        try:
            params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
            prompt = [5 + i % 400 for i in range(300)]
            return [(await _collect(client, prompt, params, f"seeded-{k}"))[0] for k in range(2)]
        finally:
            await client.shutdown()

    try:
        first, second = loop.run_until_complete(run())
    finally:
        loop.close()
    assert len(first) == 8 and first == second


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp", [1, 2])
def test_llm_with_the_vllm_backend_generates_transformers_greedy_tokens(tp: int, tiny: Path, hf_expected) -> None:
    """LLM(..., backend="vllm"): vLLM's multiprocessing executor on CPU at tp=1 and tp=2 (the native engine's tokens
    are the same: the native cases above and tests/engine/worker/test_ray_executor.py check them against
    transformers)."""
    from dcpserve.engine.frontend.llm import LLM

    llm = LLM(tiny, backend="vllm", tensor_parallel_size=tp, dtype="float32", block_size=BLOCK_SIZE,
              kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN, device="cpu")
    try:
        outputs = llm.generate(prompt_token_ids=PROMPTS,
                               sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_expected[tuple(p)] for p in PROMPTS]
