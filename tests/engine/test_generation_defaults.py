"""The model's generation_config.json sampling defaults (dcpserve/engine/generation_defaults.py): read as vLLM's
--generation-config auto reads them, applied by a request body to exactly the fields it omits, off with "vllm", and
a file no request could use refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcpserve.deployments.api import protocol
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.generation_defaults import NO_DEFAULTS, GenerationDefaults, read_generation_defaults

DEEPSEEK_R1 = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95}


def model_dir(tmp_path: Path, generation: dict[str, object] | None) -> Path:
    (tmp_path / "config.json").write_text("{}")
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_the_files_sampling_fields_are_read_and_the_rest_ignored(tmp_path: Path) -> None:
    generation = {"eos_token_id": [1, 2], "temperature": 0.7, "top_p": 0.8, "top_k": -1, "repetition_penalty": 1.05,
                  "min_p": 0.05, "max_new_tokens": 512, "do_sample": True, "max_length": 99}
    defaults = read_generation_defaults(model_dir(tmp_path, generation) / "config.json")  # a config.json path too
    assert defaults.sampling() == {"temperature": 0.7, "top_p": 0.8, "top_k": 0, "repetition_penalty": 1.05}
    assert defaults.max_tokens == 512
    assert defaults.ignored == (("min_p", 0.05),)  # no min_p sampler here: said, not applied
    assert read_generation_defaults(tmp_path, "vllm") == NO_DEFAULTS
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not read_generation_defaults(model_dir(empty, None))  # no file: the OpenAI defaults


@pytest.mark.parametrize("generation,match", [
    ({"temperature": -1}, "temperature must be a number >= 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"repetition_penalty": 3}, "repetition_penalty must be a number in"),
    ({"max_new_tokens": 0}, "max_new_tokens=0 must be an integer >= 1"),
])
def test_a_default_no_request_may_use_is_refused_naming_it(tmp_path: Path, generation: dict[str, object],
                                                           match: str) -> None:
    with pytest.raises(ValueError, match=f"generation_config.json.*{match}.*generation_config: vllm"):
        read_generation_defaults(model_dir(tmp_path, generation))
    with pytest.raises(ValueError, match="generation_config must be 'auto'.*or 'vllm'"):
        read_generation_defaults(tmp_path, "model")


def chat(**fields: object) -> protocol.ChatCompletionRequest:
    return protocol.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_request_keeps_what_it_sets_and_takes_the_models_defaults_for_the_rest(tmp_path: Path) -> None:
    defaults = read_generation_defaults(model_dir(tmp_path, {**DEEPSEEK_R1, "presence_penalty": 0.5}))
    unset = chat().sampling_params(context_left=100, defaults=defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.presence_penalty) == (0.6, 0.95, 0, 0.5)
    # Sent values win, even when they equal the OpenAI defaults (1.0 is a choice, not an omission).
    own = chat(temperature=1.0, presence_penalty=0.0).sampling_params(context_left=100, defaults=defaults)
    assert (own.temperature, own.top_p, own.presence_penalty) == (1.0, 0.95, 0.0)
    assert chat().sampling_params(context_left=100) == chat().sampling_params(context_left=100, defaults=NO_DEFAULTS)
    assert chat().sampling_params(context_left=100).temperature == 1.0


def test_max_new_tokens_bounds_only_a_request_without_max_tokens() -> None:
    defaults = GenerationDefaults(max_tokens=64)
    assert chat().sampling_params(context_left=1000, defaults=defaults).max_tokens == 64
    assert chat().sampling_params(context_left=10, defaults=defaults).max_tokens == 10  # the context is less
    assert chat(max_tokens=200).sampling_params(context_left=1000, defaults=defaults).max_tokens == 200


def test_the_engine_argument_takes_vllms_two_names() -> None:
    assert EngineArgs("m").generation_config == "auto"
    assert EngineArgs("m", generation_config="vllm").generation_config == "vllm"
    with pytest.raises(ValueError, match="generation_config must be 'auto'.*or 'vllm'"):
        EngineArgs("m", generation_config="path/to/dir")  # type: ignore[arg-type]
    assert EngineArgs("m").trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code must be true or false"):
        EngineArgs("m", trust_remote_code="yes")  # type: ignore[arg-type]
