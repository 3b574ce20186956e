"""EngineArgs is the one definition of the engine's arguments: AppArgs, the `dcpserve generate` flags and LLM's
keywords all derive from it, its checks name the value and the fix, and the command line round-trips."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dcpserve.cli import main as dcpserve_main
from dcpserve.deployments.config import AppArgs, parse_args
from dcpserve.engine.args import EngineArgs, cli_flags
from dcpserve.engine.frontend.llm import LLM

FIELDS = dataclasses.fields(EngineArgs)
ROOT = Path(__file__).resolve().parents[2]

# A value other than the default for every field (a new field must be added here, and so is covered).
NON_DEFAULT: dict[str, Any] = {
    "model": "/models/some-model",
    "backend": "vllm",
    "tensor_parallel_size": 4,
    "decode_context_parallel_size": 2,
    "prefill_context_parallel_size": 2,
    "dtype": "bfloat16",
    "block_size": 32,
    "kv_cache_memory_bytes": 2 << 20,
    "gpu_memory_utilization": 0.75,
    "max_model_len": 4096,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "enable_chunked_prefill": False,
    "enable_prefix_caching": False,
    "kv_host_tier": "8GiB",
    "seed": 7,
    "admission": "full",
    "kv_headroom": 0.2,
    "device": "cpu",
    "enforce_eager": True,
    "rank_transport": "gloo",
    "generation_config": "vllm",
    "trust_remote_code": True,
    "step_trace_path": "/tmp/steps.jsonl",
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A directory with just a config.json: enough for create_engine_config (no weights are read)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    }))
    return tmp_path


def test_every_field_has_help_and_a_non_default_value_here() -> None:
    assert [f.name for f in FIELDS][0] == "model" and FIELDS[0].default is dataclasses.MISSING
    assert set(NON_DEFAULT) == {f.name for f in FIELDS}
    for f in FIELDS:
        assert len(f.metadata["help"]) > 20, f"{f.name} needs a help text that says what it does"
        assert NON_DEFAULT[f.name] != f.default, f.name


def test_app_args_carry_every_engine_field_with_its_default_and_help(tmp_path: Path) -> None:
    for f in FIELDS:
        assert f.name in AppArgs.model_fields, f"AppArgs lacks engine field {f.name}"
        app_field = AppArgs.model_fields[f.name]
        assert app_field.description == f.metadata["help"]
        if f.default is dataclasses.MISSING:
            assert app_field.is_required()
        else:
            assert app_field.default == f.default, f.name
    args = parse_args({"model": str(tmp_path)})
    assert args.engine_args() == EngineArgs(str(tmp_path))
    chosen = {**NON_DEFAULT, "backend": "native"}
    assert parse_args(chosen).engine_args() == EngineArgs(**chosen)


def test_app_args_use_the_engine_checks_and_still_refuse_unknown_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"invalid dcpserve app args: block_size must be >= 1, got 0"):
        parse_args({"model": str(tmp_path), "block_size": 0})
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\], got 1.5"):
        parse_args({"model": str(tmp_path), "gpu_memory_utilization": 1.5})
    with pytest.raises(ValueError, match="backend: Input should be 'native' or 'vllm'"):
        parse_args({"model": str(tmp_path), "backend": "sglang"})
    with pytest.raises(ValueError, match="gpu_memory_fraction: Extra inputs are not permitted"):
        parse_args({"model": str(tmp_path), "gpu_memory_fraction": 0.5})


def generate_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        dcpserve_main(["generate", "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_generate_help_lists_every_engine_flag(capsys: pytest.CaptureFixture[str]) -> None:
    text = generate_help(capsys)
    for f in FIELDS:
        for flag in cli_flags(f.name):
            assert flag in text, f"`dcpserve generate --help` lacks {flag} ({f.name})"
    assert "--tp" in text and "--dcp" in text and "--kv-cache-memory" in text  # the short flags it always had
    assert "--backend {native,vllm}" in text and "--admission {full,usage}" in text
    assert "--seed SAMPLING_SEED" in text  # --seed stays the per-request sampling seed; the engine's is --engine-seed


def cli_argv(values: dict[str, Any]) -> list[str]:
    argv = []
    for name, value in values.items():
        flag = cli_flags(name)[0]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def test_cli_round_trip() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--model", "m"])) == EngineArgs("m")
    assert EngineArgs.from_cli_args(parser.parse_args(cli_argv(NON_DEFAULT))) == EngineArgs(**NON_DEFAULT)
    short = parser.parse_args(["--model", "m", "--tp", "4", "--dcp", "2", "--kv-cache-memory", "2MiB"])
    assert EngineArgs.from_cli_args(short) == EngineArgs(
        "m", tensor_parallel_size=4, decode_context_parallel_size=2, kv_cache_memory_bytes=2 << 20
    )


@pytest.mark.parametrize("argv,message", [
    (["--kv-cache-memory", "2XB"], "argument --kv-cache-memory-bytes/--kv-cache-memory: memory size '2XB' has unknown"),
    (["--backend", "sglang"], "argument --backend: invalid choice: 'sglang'"),
    (["--tp", "two"], "argument --tensor-parallel-size/--tp: invalid int value: 'two'"),
])
def test_cli_names_a_bad_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("change,message", [
    ({"backend": "foo"}, "backend must be 'native' or 'vllm', got 'foo'"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
    ({"decode_context_parallel_size": -1}, "decode_context_parallel_size must be >= 1, got -1"),
    ({"tensor_parallel_size": 2.0}, "tensor_parallel_size must be an integer, got 2.0"),
    ({"block_size": 0}, "block_size must be >= 1, got 0"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be >= 1, got 0"),
    ({"max_model_len": 0}, "max_model_len must be >= 1, got 0"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
    ({"dtype": "fp8"}, r"dtype must be 'auto' or one of \['bfloat16', 'float16', 'float32'\], got 'fp8'"),
    ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be a fraction in \(0, 1\], got 0"),
    ({"gpu_memory_utilization": 1.2}, r"gpu_memory_utilization must be a fraction in \(0, 1\], got 1.2"),
    ({"admission": "prompt"}, "admission must be 'full' or 'usage', got 'prompt'"),
    ({"kv_headroom": 1.0}, r"kv_headroom must be a fraction of the KV cache in \[0, 1\), got 1.0"),
    ({"device": "tpu"}, "device must be 'cuda', 'cpu' or None"),
    ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill must be true or false, got 'yes'"),
    ({"seed": None}, "seed must be an integer, got None"),
])
def test_validation_names_the_value(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs("m", **change)


def test_llm_takes_exactly_the_engine_args(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown engine argument tensor_parallel; the engine arguments are: model, "
                                        r"backend, tensor_parallel_size, "):
        LLM(tmp_path, tensor_parallel=2)
    with pytest.raises(TypeError, match="unknown engine arguments gpu_memory, tp;"):
        LLM(tmp_path, tp=2, gpu_memory=0.5)
    with pytest.raises(TypeError):
        LLM(tmp_path, 2)  # type: ignore[call-arg]  # keyword arguments only, as EngineArgs' fields are named
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        LLM(tmp_path, tensor_parallel_size=0)


def test_create_engine_config(model_dir: Path) -> None:
    # A Path: EngineArgs takes os.PathLike too, and stores it as a str.
    config = EngineArgs(model_dir, device="cpu", gpu_memory_utilization=0.5, block_size=8, admission="full",  # type: ignore[arg-type]  # see above
                        enable_chunked_prefill=False, seed=3).create_engine_config()
    assert config.model == str(model_dir) and config.device == "cpu" and config.dtype == "float32"
    assert (config.cache.block_size, config.cache.gpu_memory_utilization) == (8, 0.5)
    assert config.scheduler.max_model_len == 1024 == config.scheduler.max_num_batched_tokens  # no chunking
    assert (config.scheduler.admission, config.seed) == ("full", 3)
    with pytest.raises(ValueError, match="the vLLM backend builds its own config"):
        EngineArgs(str(model_dir), backend="vllm").create_engine_config()
    with pytest.raises(ValueError, match="max_model_len=2048 exceeds the model's max_position_embeddings=1024"):
        EngineArgs(str(model_dir), max_model_len=2048).create_engine_config()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EngineArgs(str(model_dir / "missing")).create_engine_config()


def test_operations_doc_lists_every_engine_arg() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("## Engine arguments"):]
    section = section[: section.index("\n## ", 1)]
    for f in FIELDS:
        assert f"| {f.name} |" in section, f"docs/operations.md's engine arguments table lacks {f.name}"
