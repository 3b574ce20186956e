"""Multi-turn sessions and the trace's hash block size: AIPerf-style rows (`session_id`, `delay`) in 64-token blocks
and Mooncake's 512, replayed with each later turn sent its think time after the previous turn's answer, and
`dcpserve simulate --trace-block-size` / `--host-kv-per-node` on the command line."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import Acquire, ServiceLevel
from dcpserve.engine.config import SchedulerConfig
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.step_fit import LinearStepModel
from dcpserve.simulator.synth import parse_preset_or_path
from dcpserve.simulator.trace import TraceError, expected_hash_ids, read_trace
from tests.simulator.test_simulation import simulate_cli

STEP_MODEL = LinearStepModel(c0=2e-3, c_tok=20e-6, c_seq=0.0, c_ctx=1e-9, c_pair=0.0)


def session_rows(block_tokens: int, turns: int = 3, first: int = 1000, grow: int = 700,
                 delay_ms: float = 1500.0) -> list[dict[str, object]]:
    """One session of `turns` turns in AIPerf's mooncake_trace form: the first with a timestamp, later ones with
    `delay`; each turn's hash ids the previous turn's whole blocks and new ids after."""
    rows: list[dict[str, object]] = []
    length, ids = first, list(range(expected_hash_ids(first, block_tokens)))
    next_id = len(ids)
    for turn in range(turns):
        if turn:
            kept = length // block_tokens
            length += grow
            fresh = expected_hash_ids(length, block_tokens) - kept
            ids = ids[:kept] + list(range(next_id, next_id + fresh))
            next_id += fresh
        row: dict[str, object] = {"session_id": "agent-1", "input_length": length, "output_length": 20,
                                  "hash_ids": list(ids)}
        row.update({"delay": delay_ms} if turn else {"timestamp": 0})
        rows.append(row)
    return rows


def write(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("block_tokens", [64, 512])
def test_a_multi_turn_trace_is_read_at_its_block_size_and_refused_at_another(tmp_path: Path,
                                                                             block_tokens: int) -> None:
    path = write(tmp_path, session_rows(block_tokens))
    requests = read_trace(path, block_tokens)
    assert [r.input_length for r in requests] == [1000, 1700, 2400]
    assert [r.timestamp_ms for r in requests] == [0.0, None, None]
    assert [r.delay_ms for r in requests] == [None, 1500.0, 1500.0]
    assert {r.session_id for r in requests} == {"agent-1"}
    assert [len(r.hash_ids) for r in requests] == [expected_hash_ids(n, block_tokens) for n in (1000, 1700, 2400)]
    other = 512 if block_tokens == 64 else 64
    with pytest.raises(TraceError, match=f"{path}:1: 'hash_ids' has .* one per {other}-token block"):
        read_trace(path, other)
    assert parse_preset_or_path(str(path), 10, 0, block_tokens=block_tokens) == requests
    with pytest.raises(ValueError, match="presets are generated in 512-token blocks"):
        parse_preset_or_path("agentic", 10, 0, block_tokens=64)


def shape(num_blocks: int = 400) -> ReplicaShape:
    scheduler = SchedulerConfig(max_model_len=8192, max_num_seqs=16, max_num_batched_tokens=1024)
    return ReplicaShape(tp=1, dcp=1, num_blocks=num_blocks, block_size=16, scheduler=scheduler)


@pytest.mark.parametrize("block_tokens", [64, 512])
def test_a_later_turn_goes_its_delay_after_the_previous_answer_and_hits_its_history(tmp_path: Path,
                                                                                    block_tokens: int) -> None:
    requests = read_trace(write(tmp_path, session_rows(block_tokens)), block_tokens)
    config = SimulationConfig(shape(), num_replicas=1, serve=ServeSettings(), trace_block_tokens=block_tokens)
    simulation = Simulation(config, STEP_MODEL)
    summary = simulation.run(requests)
    records = sorted(simulation.recorder.records.values(), key=lambda r: r.arrival)
    assert [r.turn for r in records] == [0, 1, 2]
    for previous, later in zip(records, records[1:], strict=False):
        assert previous.finished_at is not None
        assert later.arrival == pytest.approx(previous.finished_at + 1.5)  # the answer, then the think time
    # Each later turn finds its whole history: the previous prompt's whole trace blocks, in the replica's blocks.
    queried = sum(r.input_length for r in records)
    hits = summary["prefix_hit_rate"] * queried
    assert hits >= (1000 // block_tokens * block_tokens // 16 * 16) + (1700 // block_tokens * block_tokens // 16 * 16)
    assert summary["turns"]["first"]["requests"] == 1 and summary["turns"]["later"]["requests"] == 2


def test_simulate_reads_a_64_token_trace_and_runs_a_host_tier(tmp_path: Path) -> None:
    path = write(tmp_path, session_rows(64, turns=4))
    base = ["--trace", str(path), "--model", "deepseek-v2-lite", "--gpu", "h100", "--layout", "tp=1",
            "--max-model-len", "8192"]
    status, _, err = simulate_cli(*base)
    assert status == 1 and f"{path}:1" in err and "512-token block" in err  # read as Mooncake's 512 by default
    status, out, err = simulate_cli(*base, "--trace-block-size", "64", "--host-kv-per-node", "4x")
    assert status == 0, err
    assert "host KV tokens per replica" in out and "later turns" in out
    status, _, err = simulate_cli(*base, "--trace-block-size", "64", "--host-kv-per-node", "4y")
    assert status != 0 and "4y" in err
    status, _, err = simulate_cli(*base, "--trace-block-size", "64", "--host-kv-per-node", "4x",
                                  "--no-prefix-caching")
    assert status == 1 and "--no-prefix-caching" in err


def test_each_turn_reaches_the_queue_with_its_session_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if "session" not in {f.name for f in dataclasses.fields(ServiceLevel)}:
        pytest.skip("this queue takes no session key")
    requests = read_trace(write(tmp_path, session_rows(512)), 512)
    seen: list[str | None] = []
    original = AdmissionQueue.acquire_reply

    async def spy(self: AdmissionQueue, request: Acquire, retry_after_s: int) -> object:
        seen.append(request.level.session)
        return await original(self, request, retry_after_s)

    monkeypatch.setattr(AdmissionQueue, "acquire_reply", spy)
    Simulation(SimulationConfig(shape(), num_replicas=2, serve=ServeSettings()), STEP_MODEL).run(requests)
    assert seen == ["agent-1"] * 3


@pytest.mark.parametrize("clients", [1, 3])
def test_a_closed_loop_with_more_clients_than_sessions_says_so_before_it_runs(tmp_path: Path, clients: int) -> None:
    """Two sessions for three clients: one client never sends, so the run is not at the concurrency asked for; the
    progress stream says how many sessions for how many clients (and nothing when every client has one)."""
    rows = session_rows(512) + [{**row, "session_id": "agent-2"} for row in session_rows(512)]
    requests = read_trace(write(tmp_path, rows), 512)
    out = io.StringIO()
    config = SimulationConfig(shape(), num_replicas=1, serve=ServeSettings(), concurrency=clients, progress=out,
                              progress_label="case")
    summary = Simulation(config, STEP_MODEL).run(requests)
    assert summary["finished"] == 6
    notes = [line for line in out.getvalue().splitlines() if "note:" in line]
    if clients == 1:
        assert notes == []
    else:
        assert notes == ["case: note: 2 sessions for 3 clients: the closed loop runs 1 short of its concurrency (the "
                         "trace's sessions run out first); more requests per client fill it"]
