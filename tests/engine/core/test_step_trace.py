"""The engine's step trace (step_trace_path): one line per step that reconstructs the step's work, read back by the
simulator's fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.backends.vllm.args import vllm_engine_kwargs
from dcpserve.engine.core.step_trace import StepTraceWriter
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.simulator.step_fit import LinearStepModel, read_step_trace
from dcpserve.simulator.step_time import StepWork
from tests.engine.llm_parts import engine_of


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_every_step_is_one_line_with_its_rows(tiny: Path, tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    prompts = [[(7 * i + j) % 97 + 3 for j in range(40 + 37 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(tiny, max_num_batched_tokens=64, step_trace_path=str(trace)) as llm:
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
        engine = engine_of(llm)
        num_steps, num_tokens = engine.num_steps, engine.num_tokens_computed
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == num_steps
    assert sum(new for line in lines for _, new in line["rows"]) == num_tokens
    assert max(sum(new for _, new in line["rows"]) for line in lines) <= 64  # chunked: the token budget held
    assert lines[0]["gap_s"] is None  # nothing ran before the first step
    assert all(line["gap_s"] is not None and line["gap_s"] >= 0 for line in lines[1:])  # work all along
    assert all(line["seconds"] > 0 and line["exchange_s"] == 0 for line in lines)
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)
    # The first step prefills from position 0; the last ones decode one token per row at the prompts' ends.
    assert all(start == 0 and new > 1 for start, new in lines[0]["rows"])
    assert all(new == 1 for _, new in lines[-1]["rows"])

    samples = read_step_trace(trace, with_gaps=False)
    assert [seconds for _, seconds in samples] == [line["seconds"] for line in lines]
    assert samples[0][0] == StepWork.from_rows(tuple(row) for row in lines[0]["rows"])
    with_gaps = read_step_trace(trace)
    assert [s for _, s in with_gaps] == [line["seconds"] + (line["gap_s"] or 0) for line in lines]
    model, report = LinearStepModel.fit(with_gaps)
    assert report.num_samples == len(lines) and model.step_seconds(samples[0][0]) > 0


def test_a_second_engine_appends_and_an_idle_wait_is_not_a_gap(tiny: Path, tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        with LLM(tiny, step_trace_path=str(trace)) as llm:
            llm.generate(prompt_token_ids=[[5] * 20], sampling_params=params)  # 3 steps, then no work
            llm.generate(prompt_token_ids=[[6] * 20], sampling_params=params)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == 12
    # Each generate's first step follows a wait with no work (or nothing at all): no gap.
    assert [line["gap_s"] is None for line in lines] == [True, False, False] * 4


def test_bad_traces_and_arguments_are_refused_clearly(tiny: Path, tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    good = {"t": 1.0, "seconds": 0.01, "gap_s": None, "rows": [[0, 4]], "exchange_s": 0.0, "pid": 1}
    trace.write_text(json.dumps(good) + "\n" + '{"seconds": 0.01}\n')
    with pytest.raises(ValueError, match=r"steps\.jsonl:2: not a step"):
        read_step_trace(trace)
    trace.write_text(json.dumps({**good, "seconds": 0}) + "\n")
    with pytest.raises(ValueError, match=r"steps\.jsonl:1: .*seconds > 0"):
        read_step_trace(trace)
    with pytest.raises(ValueError, match="step_trace_path must be a file path"):
        EngineArgs(str(tiny), step_trace_path="")
    missing = tmp_path / "no-such-dir" / "steps.jsonl"
    with pytest.raises(ValueError, match="no-such-dir.* does not exist"):
        LLM(tiny, step_trace_path=str(missing))
    with pytest.raises(ValueError, match="native engine's steps.*backend: native"):
        vllm_engine_kwargs(EngineArgs(str(tiny), backend="vllm", step_trace_path=str(trace)), "cpu")


def test_a_step_without_rows_has_no_line_and_its_time_goes_to_the_next_gap(tmp_path: Path) -> None:
    writer = StepTraceWriter(str(tmp_path / "steps.jsonl"))
    writer.record(10.0, 10.5, [(0, 8)], 0.0, busy_after=True)
    writer.record(10.6, 10.7, [], 0.0, busy_after=True)  # only finished requests' notices
    writer.record(10.8, 11.0, [(8, 1)], 0.0, busy_after=False)
    writer.record(12.0, 12.1, [(9, 1)], 0.0, busy_after=True)  # after a wait with no work
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["gap_s"] for line in lines] == [None, pytest.approx(0.3), None]
    assert [line["seconds"] for line in lines] == [pytest.approx(0.5), pytest.approx(0.2), pytest.approx(0.1)]
