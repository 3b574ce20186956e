"""dcpserve/simulator/trace.py and dcpserve/simulator/synth.py: the Mooncake JSONL reader and writer, and the generated
traces."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dcpserve.simulator.synth import PRESETS, LengthDist, TraceShape, generate, parse_preset_or_path, preset
from dcpserve.simulator.trace import (
    MOONCAKE_BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    expected_hash_ids,
    read_trace,
    trace_stats,
    write_trace,
)

BLOCK = MOONCAKE_BLOCK_TOKENS

# Two rows of Mooncake's FAST'25 trace (kvcache-ai/Mooncake FAST25-release/README.md).
MOONCAKE_ROWS = (
    '{"timestamp": 27482, "input_length": 6955, "output_length": 52, '
    '"hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}\n'
    '{"timestamp": 30535, "input_length": 6472, "output_length": 26, '
    '"hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2366]}\n'
)


def _write(tmp_path: Path, text: str, name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _row(**fields: object) -> str:
    row: dict[str, object] = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
    row.update(fields)
    return json.dumps({key: value for key, value in row.items() if value is not None}) + "\n"


def _sessions(requests: list[TraceRequest]) -> dict[str, list[TraceRequest]]:
    sessions: dict[str, list[TraceRequest]] = {}
    for request in requests:
        assert request.session_id is not None
        sessions.setdefault(request.session_id, []).append(request)
    return sessions


# ---- reading and writing ---------------------------------------------------------------------------------------


def test_reads_mooncake_rows(tmp_path: Path) -> None:
    requests = read_trace(_write(tmp_path, MOONCAKE_ROWS))
    assert [r.timestamp_ms for r in requests] == [27482.0, 30535.0]
    assert requests[1] == TraceRequest(timestamp_ms=30535.0, input_length=6472, output_length=26,
                                       hash_ids=(*range(46, 58), 2366))
    stats = trace_stats(requests)
    assert (stats.count, stats.sessions, stats.duration_ms, stats.hash_blocks) == (2, 2, 3053.0, 27)
    assert stats.prefix_sharing_ratio == pytest.approx(12 / 27)  # the second row's 12 leading blocks


@pytest.mark.parametrize("name", ["agentic", "chat", "8k-1k"])
def test_round_trip(tmp_path: Path, name: str) -> None:
    requests = generate(PRESETS[name], 300, seed=3)
    requests[0] = replace(requests[0], max_tokens=requests[0].output_length + 7, timestamp_ms=0.125)
    path = tmp_path / "out.jsonl"
    write_trace(path, requests)
    assert read_trace(path) == requests


def test_sessions_delays_aliases_and_unknown_fields(tmp_path: Path) -> None:
    text = "".join([
        _row(session_id="s", timestamp=5, delay=0, extra={"nvext": 1}),  # a first turn's delay 0 is dropped
        "\n   \n",
        _row(session_id="s", timestamp=None, input_length=1100, hash_ids=[1, 3, 4]),  # neither: delay 0
        _row(session_id="s", timestamp=None, delay_ms=250.5, input_length=1200, hash_ids=[1, 3, 5]),
        json.dumps({"created_time": 7, "input_tokens": 1, "output_tokens": 2, "hash_ids": [9], "priority": 3}),
    ])
    requests = read_trace(_write(tmp_path, text))
    assert [(r.timestamp_ms, r.delay_ms) for r in requests] == [(5.0, None), (None, 0.0), (None, 250.5), (7.0, None)]
    assert requests[3] == TraceRequest(timestamp_ms=7.0, input_length=1, output_length=2, hash_ids=(9,))


def test_unsorted_sessions_are_sorted_stably_by_their_start(tmp_path: Path) -> None:
    text = "".join([
        _row(timestamp=30, hash_ids=[1, 2]),
        _row(session_id="a", timestamp=10, hash_ids=[3, 4]),
        _row(timestamp=10, hash_ids=[5, 6]),
        _row(session_id="a", timestamp=None, delay=1, hash_ids=[3, 7]),
        _row(timestamp=0, hash_ids=[8, 9]),
    ])
    requests = read_trace(_write(tmp_path, text))
    assert [r.hash_ids for r in requests] == [(8, 9), (3, 4), (5, 6), (3, 7), (1, 2)]


GOOD = _row()
BAD_CASES = [
    # (lines, 1-based line of the error, what the message names)
    ([GOOD, '{"timestamp": 0, "input_length": 600,\n'], 2, "not valid JSON"),
    (["[1, 2, 3]\n"], 1, "not an object"),
    ([GOOD, GOOD, _row(input_length=None)], 3, "'input_length'"),
    ([_row(input_length=None, text_input="hello")], 1, "text_input"),
    ([_row(output_length=None)], 1, "'output_length'"),
    ([_row(hash_ids=None)], 1, "'hash_ids'"),
    ([_row(timestamp=None)], 1, "'timestamp'"),
    ([_row(input_length=True)], 1, "'input_length'"),
    ([_row(output_length=5.5)], 1, "'output_length'"),
    ([_row(timestamp="0")], 1, "'timestamp'"),
    ([_row(timestamp=-1)], 1, "'timestamp'"),
    (['{"timestamp": NaN, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}\n'], 1, "'timestamp'"),
    ([_row(input_length=0, hash_ids=[])], 1, "'input_length'"),
    ([_row(output_length=0)], 1, "'output_length'"),
    ([_row(output_length=-3)], 1, "'output_length'"),
    ([_row(input_length=1025, hash_ids=[1, 2])], 1, "expected ceil(1025 / 512) = 3"),
    ([_row(input_length=512, hash_ids=[1, 2])], 1, "expected ceil(512 / 512) = 1"),
    ([_row(hash_ids="1, 2")], 1, "'hash_ids'"),
    ([_row(hash_ids=[1, False])], 1, "'hash_ids'"),
    ([_row(hash_ids=[1, -2])], 1, "'hash_ids'"),
    ([_row(session_id=7)], 1, "'session_id'"),
    ([_row(max_tokens=9)], 1, "'max_tokens'"),
    ([_row(max_tokens="many")], 1, "'max_tokens'"),
    ([_row(input_length=600, input_tokens=600)], 1, "'input_tokens'"),
    ([_row(session_id="s", delay=5)], 1, "'delay'"),
    ([_row(session_id="s", timestamp=9), "\n", _row(session_id="s", timestamp=4)], 3, "'timestamp' 4 goes back"),
    ([_row(session_id="s"), _row(session_id="s", timestamp=4, delay=2)], 2, "both 'timestamp' and 'delay'"),
    ([_row(session_id="s"), _row(session_id="s", timestamp=None, delay=-2)], 2, "'delay'"),
    ([GOOD, "\n", b"\xff\xfe\n"], 3, "UTF-8"),
    ([], 1, "no requests"),
    (["\n", "  \n"], 1, "no requests"),
]


@pytest.mark.parametrize(("lines", "line", "names"), BAD_CASES)
def test_bad_lines_name_file_line_and_field(tmp_path: Path, lines: list[str | bytes], line: int, names: str) -> None:
    path = tmp_path / "bad-trace.jsonl"
    path.write_bytes(b"".join(part if isinstance(part, bytes) else part.encode() for part in lines))
    with pytest.raises(TraceError) as raised:
        read_trace(path)
    message = str(raised.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert names in message, message
    assert ";" in message, message  # what is wrong; how to fix


def test_write_refuses_what_read_would_refuse(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"request 1 .*expected ceil\(600 / 512\) = 2"):
        write_trace(tmp_path / "x.jsonl", [TraceRequest(0.0, 600, 1, (1, 2)), TraceRequest(1.0, 600, 1, (1,))])
    with pytest.raises(ValueError, match="missing 'timestamp'"):
        write_trace(tmp_path / "x.jsonl", [TraceRequest(None, 600, 1, (1, 2), session_id="s", delay_ms=3.0)])


# ---- generation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_generate_is_deterministic(name: str) -> None:
    first = generate(PRESETS[name], 500, seed=11)
    assert first == generate(PRESETS[name], 500, seed=11)
    assert len(first) == 500
    assert first != generate(PRESETS[name], 500, seed=12)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hash_ids_cover_every_prompt_block(name: str) -> None:
    for request in generate(PRESETS[name], 2000, seed=0):
        assert len(request.hash_ids) == expected_hash_ids(request.input_length)
        assert len(set(request.hash_ids)) == len(request.hash_ids)


def test_agentic_preset_statistics() -> None:
    stats = trace_stats(generate(PRESETS["agentic"], 10_000, seed=0))
    assert abs(stats.input_tokens.p50 - 67_000) <= 0.15 * 67_000, stats.input_tokens
    assert abs(stats.output_tokens.p50 - 400) <= 0.25 * 400, stats.output_tokens
    assert stats.input_tokens.maximum <= 200_000
    assert stats.input_tokens.p99 > 2 * stats.input_tokens.p50  # a heavy tail
    assert stats.turns_per_session.p50 >= 10
    assert stats.prefix_sharing_ratio > 0.8  # growing sessions repeat their earlier turns


def test_chat_preset_statistics() -> None:
    stats = trace_stats(generate(PRESETS["chat"], 10_000, seed=0))
    assert 1_000 <= stats.input_tokens.p50 <= 2_000, stats.input_tokens
    assert 200 <= stats.output_tokens.p50 <= 300, stats.output_tokens
    assert 1 <= stats.turns_per_session.p50 <= 3


@pytest.mark.parametrize(("name", "input_length", "output_length"),
                         [("1k-1k", 1024, 1024), ("8k-1k", 8192, 1024), ("8k-8k", 8192, 8192)])
def test_fixed_presets_are_exact(name: str, input_length: int, output_length: int) -> None:
    requests = generate(PRESETS[name], 1000, seed=0)
    assert {(r.input_length, r.output_length, r.session_id, r.delay_ms) for r in requests} == {
        (input_length, output_length, None, None)}
    timestamps = [r.timestamp_ms for r in requests if r.timestamp_ms is not None]
    assert len(timestamps) == len(requests) and timestamps[0] == 0.0 and timestamps == sorted(timestamps)
    stats = trace_stats(requests)
    assert stats.prefix_sharing_ratio == 0.0
    # Poisson at the preset's rate: 999 gaps of mean 1 / rate.
    assert stats.duration_ms / 999 == pytest.approx(1000 / PRESETS[name].rate_per_s, rel=0.1)


@pytest.mark.parametrize("name", ["agentic", "chat"])
def test_later_turns_extend_the_previous_prompt(name: str) -> None:
    requests = generate(PRESETS[name], 3000, seed=5)
    sessions = _sessions(requests)
    assert any(len(turns) > 1 for turns in sessions.values())
    for turns in sessions.values():
        assert turns[0].timestamp_ms is not None and turns[0].delay_ms is None
        for previous, turn in zip(turns, turns[1:], strict=False):
            assert turn.timestamp_ms is None and turn.delay_ms is not None and turn.delay_ms >= 0
            assert turn.input_length > previous.input_length + previous.output_length
            whole = previous.input_length // BLOCK
            assert turn.hash_ids[:whole] == previous.hash_ids[:whole]
            # The block that was partial before holds more now: a new id, as is every block after it.
            assert not set(turn.hash_ids[whole:]) & set(previous.hash_ids)


def test_prefix_groups_share_leading_ids_and_nothing_else() -> None:
    shape = PRESETS["agentic"]
    prefix_blocks = shape.shared_prefix_tokens // BLOCK
    sessions = _sessions(generate(shape, 5000, seed=2))
    prefixes = {turns[0].hash_ids[:prefix_blocks] for turns in sessions.values()}
    assert len(prefixes) == shape.num_prefix_groups
    assert len({block for prefix in prefixes for block in prefix}) == shape.num_prefix_groups * prefix_blocks
    owner: dict[int, str] = {}
    for session_id, turns in sessions.items():
        for turn in turns:
            assert turn.hash_ids[:prefix_blocks] in prefixes
            for block in turn.hash_ids[prefix_blocks:]:
                assert owner.setdefault(block, session_id) == session_id  # a session's own blocks are its own


def test_partial_prefix_block_is_not_shared() -> None:
    shape = TraceShape(name="p", arrival="poisson", rate_per_s=1.0, input_tokens=LengthDist.constant(2000),
                       output_tokens=LengthDist.constant(5), shared_prefix_tokens=700, num_prefix_groups=1)
    first, second = generate(shape, 2, seed=0)
    assert first.hash_ids[0] == second.hash_ids[0]  # the prefix's one whole block
    assert not set(first.hash_ids[1:]) & set(second.hash_ids)


def test_bursty_arrivals_are_burstier_than_poisson() -> None:
    def gap_cv(shape: TraceShape) -> float:
        times = [r.timestamp_ms for r in generate(shape, 4000, seed=1) if r.timestamp_ms is not None]
        gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        mean = sum(gaps) / len(gaps)
        return float((sum((gap - mean) ** 2 for gap in gaps) / len(gaps)) ** 0.5 / mean)

    poisson = PRESETS["1k-1k"]
    assert gap_cv(poisson) == pytest.approx(1.0, abs=0.1)
    assert gap_cv(replace(poisson, arrival="bursty", arrival_cv=3.0)) > 2.0


def test_shapes_and_presets_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="choose one of agentic, chat, 1k-1k, 8k-1k, 8k-8k"):
        preset("agentic-long")
    assert preset("chat") is PRESETS["chat"]
    with pytest.raises(ValueError, match="bursty arrivals need a CV above 1"):
        replace(PRESETS["1k-1k"], arrival="bursty")
    with pytest.raises(ValueError, match="go together"):
        replace(PRESETS["chat"], think_time_ms=None)
    with pytest.raises(ValueError, match="must exceed shared_prefix_tokens"):
        replace(PRESETS["chat"], shared_prefix_tokens=4096)
    with pytest.raises(ValueError, match="minimum"):
        LengthDist(median=10, sigma=1.0, minimum=20, maximum=30)
    with pytest.raises(ValueError, match="at least 1 request"):
        generate(PRESETS["chat"], 0, seed=0)


def test_parse_preset_or_path(tmp_path: Path) -> None:
    path = _write(tmp_path, MOONCAKE_ROWS)
    assert parse_preset_or_path(str(path), num_requests=5, seed=0) == read_trace(path)
    assert parse_preset_or_path("chat", num_requests=5, seed=4) == generate(PRESETS["chat"], 5, seed=4)
    faster = parse_preset_or_path("1k-1k", num_requests=50, seed=4, rate_per_s=80.0)
    assert faster == generate(replace(PRESETS["1k-1k"], rate_per_s=80.0), 50, seed=4)
    with pytest.raises(ValueError, match="drop the rate"):
        parse_preset_or_path(str(path), num_requests=5, seed=0, rate_per_s=2.0)
    with pytest.raises(ValueError, match="is no file and no preset.*agentic"):
        parse_preset_or_path(str(tmp_path / "missing.jsonl"), num_requests=5, seed=0)
    with pytest.raises(ValueError, match="is a directory"):
        parse_preset_or_path(str(tmp_path), num_requests=5, seed=0)


def test_a_mix_of_presets_keeps_each_sessions_turns_together_in_arrival_order_with_no_shared_block() -> None:
    chat, agentic = generate(PRESETS["chat"], 200, seed=4), generate(PRESETS["agentic"], 200, seed=5)
    mixed = parse_preset_or_path("chat+agentic", 400, seed=4)
    assert len(mixed) == 400
    starts = [r.timestamp_ms for r in mixed if r.timestamp_ms is not None]
    assert starts == sorted(starts)
    assert mixed[0].timestamp_ms is not None
    # Each session's turns contiguous and in their order: the mix reads back as the two traces.
    for source, name in ((chat, "chat"), (agentic, "agentic")):
        mine = [r for r in mixed if (r.session_id or "").startswith(f"{name}-")]
        assert [(r.input_length, r.output_length, r.session_id) for r in mine] == [
            (r.input_length, r.output_length, r.session_id) for r in source]
    sessions = [r.session_id for r in mixed]
    assert all(sessions.index(s) + sessions.count(s) - 1 == len(sessions) - 1 - sessions[::-1].index(s)
               for s in set(sessions))
    chat_ids = {i for r in mixed if (r.session_id or "").startswith("chat-") for i in r.hash_ids}
    agentic_ids = {i for r in mixed if (r.session_id or "").startswith("agentic-") for i in r.hash_ids}
    assert chat_ids and agentic_ids and not chat_ids & agentic_ids


def test_a_mix_refuses_a_preset_twice_and_fewer_requests_than_presets() -> None:
    with pytest.raises(ValueError, match="names a preset twice"):
        parse_preset_or_path("chat+chat", 10, seed=0)
    with pytest.raises(ValueError, match="cannot be split over 2 presets"):
        parse_preset_or_path("chat+agentic", 1, seed=0)
