"""The fitted step-time model: constants fitted to measured step times (a CPU engine's or a GPU's), with the fit's
error, saved to and loaded from JSON (`dcpserve simulate --step-model FIT.json`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dcpserve.simulator.step_time import StepWork


@dataclass(frozen=True)
class FitReport:
    """How well a LinearStepModel fits its samples (relative error: |predicted - measured| / measured)."""

    num_samples: int
    median_relative_error: float
    p90_relative_error: float

    def format(self) -> str:
        return (f"fit on {self.num_samples} steps: median relative error {self.median_relative_error:.1%}, "
                f"p90 {self.p90_relative_error:.1%}")


_COEFFICIENTS = ("c0", "c_tok", "c_seq", "c_ctx", "c_pair")
_JSON_KIND = "dcpserve.simulator.LinearStepModel"


def _features(work: StepWork) -> list[float]:
    return [1.0, work.num_tokens, work.num_seqs, work.context_tokens, work.attention_pairs]


def _nnls(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """min ||matrix @ x - target|| subject to x >= 0 (Lawson and Hanson's active-set method, bounded iterations)."""
    num_columns = matrix.shape[1]
    x = np.zeros(num_columns)
    passive = np.zeros(num_columns, dtype=bool)
    tolerance = 1e-12 * max(1.0, float(np.abs(matrix.T @ target).max()))
    for _ in range(3 * num_columns):
        gradient = matrix.T @ (target - matrix @ x)
        if passive.all() or gradient[~passive].max() <= tolerance:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, gradient)))] = True
        for _ in range(num_columns):  # each pass drops at least one column from the passive set
            trial = np.zeros(num_columns)
            trial[passive] = np.linalg.lstsq(matrix[:, passive], target, rcond=None)[0]
            if (trial[passive] > 0).all():
                x = trial
                break
            blocked = passive & (trial <= 0)
            step = float(np.min(x[blocked] / (x[blocked] - trial[blocked])))
            x = x + step * (trial - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
            if not passive.any():
                break
    return x


def read_step_trace(path: str | Path, with_gaps: bool = True) -> list[tuple[StepWork, float]]:
    """(the step's work, its seconds) for every line of an engine's step trace (dcpserve.engine.core.step_trace).
    with_gaps: each step's seconds include the host's gap before it where the engine had work all along, the time
    between steps that the simulator's back-to-back steps leave out (the step model then covers the whole cycle). A line
    that is not a step is refused with the file's name and its line number."""
    samples: list[tuple[StepWork, float]] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                step = json.loads(line)
                seconds = float(step["seconds"])
                gap = step.get("gap_s")
                rows = [(int(start), int(new)) for start, new in step["rows"]]
                work = StepWork.from_rows(rows)
                if not (math.isfinite(seconds) and seconds > 0) or not rows:
                    raise ValueError(f"a step needs seconds > 0 and at least one row, got seconds={seconds!r}, "
                                     f"{len(rows)} rows")
                if with_gaps and gap is not None:
                    seconds += float(gap)
            except (ValueError, TypeError, KeyError) as err:
                raise ValueError(f"{path}:{number}: not a step of an engine step trace ({err!r}); the lines are "
                                 f"what step_trace_path writes (dcpserve/engine/core/step_trace.py)") from err
            samples.append((work, seconds))
    return samples


@dataclass(frozen=True)
class LinearStepModel:
    """The fitted model: c0 + c_tok * num_tokens + c_seq * num_seqs + c_ctx * context_tokens + c_pair * pairs."""

    c0: float
    c_tok: float
    c_seq: float
    c_ctx: float
    c_pair: float
    report: FitReport | None = None  # None: constants set by hand

    def __post_init__(self) -> None:
        for name in _COEFFICIENTS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LinearStepModel.{name} must be a finite number >= 0, got {value!r}")

    @property
    def name(self) -> str:
        return "linear"

    def describe(self) -> str:
        fit = f"; {self.report.format()}" if self.report else ""
        return (f"linear: {self.c0 * 1e3:.3g} ms + {self.c_tok * 1e6:.3g} us/token + {self.c_seq * 1e6:.3g} us/seq "
                f"+ {self.c_ctx * 1e9:.3g} ns/context token + {self.c_pair * 1e12:.3g} ps/pair{fit}")

    def scaled(self, factor: float) -> LinearStepModel:
        """Every constant times `factor` (a step of the same work taking `factor` times as long), same fit report:
        the model of the same engine on a slower or busier host."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"scale factor must be a finite number > 0, got {factor!r}")
        constants = {name: getattr(self, name) * factor for name in _COEFFICIENTS}
        return LinearStepModel(**constants, report=self.report)

    def step_seconds(self, work: StepWork) -> float:
        if work.num_tokens == 0:
            return 0.0
        constants = [getattr(self, name) for name in _COEFFICIENTS]
        return float(sum(c * f for c, f in zip(constants, _features(work), strict=True)))

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepWork, float]]) -> tuple[LinearStepModel, FitReport]:
        """Non-negative least squares on relative error (each sample weighted by 1 / its seconds, so short decode
        steps count as much as long prefills), on measured (work, seconds) pairs; then one factor on every constant
        so that the predicted steps add up to the measured ones. A fit of relative error sits below the mean of noisy
        steps (a step slowed by another process on the host is a large absolute error but a bounded relative one),
        and the simulator's clock runs on the sum of its steps."""
        if len(samples) < len(_COEFFICIENTS):
            raise ValueError(f"fit needs at least {len(_COEFFICIENTS)} samples, got {len(samples)}")
        seconds = np.array([s for _, s in samples], dtype=float)
        bad = [s for s in seconds if not (math.isfinite(s) and s > 0)]
        if bad:
            raise ValueError(f"measured step seconds must be finite and > 0, got {bad[:3]}")
        features = np.array([_features(work) for work, _ in samples], dtype=float)
        weighted = features / seconds[:, None]
        scale = np.linalg.norm(weighted, axis=0)
        scale[scale == 0] = 1.0  # a feature that is 0 in every sample: its constant stays 0
        solution = _nnls(weighted / scale, np.ones(len(samples))) / scale
        predicted_total = float((features @ solution).sum())
        if predicted_total > 0:
            solution *= float(seconds.sum()) / predicted_total
        errors = np.abs(features @ solution - seconds) / seconds
        report = FitReport(len(samples), float(np.median(errors)), float(np.percentile(errors, 90)))
        constants = {name: float(value) for name, value in zip(_COEFFICIENTS, solution, strict=True)}
        return cls(**constants, report=report), report

    def to_json(self) -> str:
        report = None if self.report is None else {
            "num_samples": self.report.num_samples, "median_relative_error": self.report.median_relative_error,
            "p90_relative_error": self.report.p90_relative_error}
        constants = {name: getattr(self, name) for name in _COEFFICIENTS}
        return json.dumps({"kind": _JSON_KIND, "constants": constants, "report": report}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> LinearStepModel:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"not a LinearStepModel JSON: {err}") from err
        if not isinstance(data, dict) or data.get("kind") != _JSON_KIND:
            raise ValueError(f"not a LinearStepModel JSON: expected \"kind\": \"{_JSON_KIND}\"")
        constants = data.get("constants") or {}
        missing = [name for name in _COEFFICIENTS if name not in constants]
        if missing:
            raise ValueError(f"LinearStepModel JSON lacks constants {missing}")
        raw_report = data.get("report")
        report = None
        if raw_report is not None:
            report = FitReport(int(raw_report["num_samples"]), float(raw_report["median_relative_error"]),
                               float(raw_report["p90_relative_error"]))
        return cls(**{name: constants[name] for name in _COEFFICIENTS}, report=report)
