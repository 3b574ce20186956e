"""The model's own sampling defaults (generation_config.json), for the fields a request leaves unset.

vLLM's `--generation-config auto` (its default): the sampling fields a model's generation_config.json sets replace
the OpenAI defaults for every request that omits them (Qwen3 ships temperature 0.6, top_p 0.95, top_k 20; DeepSeek-R1
temperature 0.6, top_p 0.95); a request's own values always win, and `generation_config: vllm` turns this off (the
neutral defaults: temperature 1, top_p 1, no top-k). The fields are vLLM's (vllm/config/model.py
get_diff_sampling_param): temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty,
and max_new_tokens, which bounds max_tokens when the request sets none. min_p has no sampler here (neither backend's
requests carry it): a model default other than 0 is reported in `ignored`, never silently half-applied.

ModelConfig (dcpserve/engine/config.py) reads the same file for the EOS ids only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATION_CONFIG_MODES = ("auto", "vllm")
# The fields applied to requests (SamplingParams' names), and those read but without a sampler here.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty")
UNSUPPORTED_FIELDS = ("min_p",)


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling values a model's generation_config.json sets (None: it sets none, the OpenAI default holds)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens: the most a request without max_tokens gets
    ignored: tuple[tuple[str, float], ...] = ()  # fields set but not applied here (min_p), with their values
    source: str = ""

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams fields the model sets, by name (max_tokens apart: it bounds the context left)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    def __bool__(self) -> bool:
        return bool(self.sampling()) or self.max_tokens is not None


NO_DEFAULTS = GenerationDefaults()


def read_generation_defaults(model_dir: str | Path, mode: str = "auto") -> GenerationDefaults:
    """The model directory's sampling defaults under `mode` ("auto": its generation_config.json; "vllm": none).
    A value no request could carry is a ValueError naming the file, the field and the way out."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config must be 'auto' (the model's generation_config.json sampling defaults) "
                         f"or 'vllm' (the neutral OpenAI defaults), got {mode!r}")
    path = Path(model_dir)
    path = (path.parent if path.is_file() else path) / "generation_config.json"
    if mode == "vllm" or not path.is_file():
        return NO_DEFAULTS
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read ({err}); repair it, or set generation_config: vllm") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object; repair it, or set generation_config: vllm")
    values: dict[str, Any] = {name: raw[name] for name in SAMPLING_FIELDS if raw.get(name) is not None}
    if "top_k" in values and _is_int(values["top_k"]) and values["top_k"] < 0:
        values["top_k"] = 0  # -1 (vLLM's spelling of "off") is 0 here
    max_new = raw.get("max_new_tokens")
    if max_new is not None and (not _is_int(max_new) or max_new < 1):
        raise ValueError(f"{path}: max_new_tokens={max_new!r} must be an integer >= 1; repair it, or set "
                         f"generation_config: vllm")
    ignored = tuple((name, float(raw[name])) for name in UNSUPPORTED_FIELDS
                    if isinstance(raw.get(name), (int, float)) and raw[name] != 0)
    _check(values, path)
    return GenerationDefaults(**values, max_tokens=max_new, ignored=ignored, source=str(path))


def _check(values: dict[str, Any], path: Path) -> None:
    """The values as SamplingParams would take them: its own checks, with the file named."""
    from dcpserve.engine.sampling_params import SamplingParams

    try:
        SamplingParams(**values)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: a sampling default no request may use ({err}); repair it, or set "
                         f"generation_config: vllm to ignore the file's sampling defaults") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

