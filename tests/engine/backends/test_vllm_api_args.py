"""The vLLM backend given what the OpenAI surface needs (dcpserve/engine/backends/vllm/args.py): trust_remote_code and
generation_config reach vLLM's own engine arguments (and vLLM reads the same sampling defaults from a Qwen3-shaped
directory as dcpserve/engine/generation_defaults.py), and a JSON schema compiles to the very grammar the native engine
compiles: our rewrite, vLLM's own additionalProperties rewrite off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.generation_defaults import read_generation_defaults
from dcpserve.engine.structured_output import Grammars, StructuredOutput
from dcpserve.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.vllm

QWEN3_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},  # rewritten
    {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                 {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},  # as sent
    {"$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
     "$ref": "#/$defs/base", "properties": {"b": {"type": "integer"}}, "required": ["a", "b"]},  # as sent
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = write_tiny_model(tmp_path_factory.mktemp("vllm-api") / "model")
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, **QWEN3_SAMPLING}))
    return model


def test_trust_remote_code_and_generation_config_reach_vllm(qwen3_dir: Path) -> None:
    import vllm

    from dcpserve.engine.backends.vllm.args import vllm_engine_kwargs

    cases: tuple[tuple[bool, Literal["auto", "vllm"]], ...] = ((False, "auto"), (True, "vllm"))
    for trust, mode in cases:
        args = EngineArgs(str(qwen3_dir), backend="vllm", block_size=32, trust_remote_code=trust,
                          generation_config=mode)
        kwargs = vllm_engine_kwargs(args, "cpu")
        assert (kwargs["trust_remote_code"], kwargs["generation_config"]) == (trust, mode)
        model_config = vllm.AsyncEngineArgs(**kwargs).create_model_config()
        assert model_config.trust_remote_code is trust
        # vLLM's reading of the file and ours agree (vllm: none).
        ours = read_generation_defaults(qwen3_dir, mode).sampling()
        assert model_config.get_diff_sampling_param() == ours
        assert ours == (QWEN3_SAMPLING if mode == "auto" else {})


@pytest.mark.parametrize("schema", SCHEMAS, ids=["plain", "allOf", "ref"])
def test_a_schema_compiles_to_the_native_engines_grammar(qwen3_dir: Path, schema: dict[str, object]) -> None:
    from vllm.v1.structured_output.backend_guidance import serialize_guidance_grammar
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    from dcpserve.engine.backends.vllm.args import structured_outputs_config, to_vllm_structured_outputs

    constraint = StructuredOutput.json(schema)
    config = structured_outputs_config()
    params = to_vllm_structured_outputs(constraint)
    assert params.json == constraint.json_schema()
    vllms = serialize_guidance_grammar(StructuredOutputOptions.JSON, params.json, config.disable_any_whitespace,
                                       config.disable_additional_properties)
    tokenizer = load_tokenizer(qwen3_dir)
    assert tokenizer is not None
    assert vllms == Grammars.for_tokenizer(tokenizer, 512).compile(constraint)
