"""The dcpserve command line, run as a user would (the installed console script)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def dcpserve(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("dcpserve") or str(Path(sys.executable).parent / "dcpserve")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_layout_prints_the_worked_example() -> None:
    result = dcpserve("layout", "--tokens", "9", "--dcp", "3", "--block-size", "2", "--interleave", "2")
    assert result.returncode == 0, result.stderr
    assert "rank 0: local_seq_len 4, positions [0, 1, 6, 7]" in result.stdout
    assert "rank 2: local_seq_len 2, positions [4, 5]" in result.stdout
    # position 8: rank 1, page 1, offset 0, slot 2
    assert any(line.split() == ["8", "1", "1", "0", "2"] for line in result.stdout.splitlines())


@pytest.mark.parametrize("args,message", [
    (("--tokens", "9", "--dcp", "2", "--block-size", "3", "--interleave", "2"), "interleave=2 must divide block_size=3"),
    (("--tokens", "9", "--dcp", "0"), "dcp_size must be a positive integer, got 0"),
    (("--tokens", "-1", "--dcp", "2"), "--tokens must be >= 0, got -1"),
])
def test_layout_rejects_bad_values_clearly(args, message) -> None:
    result = dcpserve("layout", *args)
    assert result.returncode != 0
    assert message in result.stderr


LLAMA_70B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
}

TinyModelRun = tuple[Path, subprocess.CompletedProcess[str]]  # the directory and the `tiny-model` run that wrote it


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModelRun:
    directory = tmp_path_factory.mktemp("cli") / "tiny"
    return directory, dcpserve("tiny-model", str(directory))


def test_tiny_model_writes_a_model_and_reports_progress(tiny_model: TinyModelRun) -> None:
    directory, result = tiny_model
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("training tokenizer")
    assert lines[1].startswith("writing weights")
    assert f"wrote {directory}" in lines
    assert "410,240 parameters" in result.stdout
    assert (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file()
    again = dcpserve("tiny-model", str(directory))  # a tiny model may be rewritten without --force
    assert again.returncode == 0, again.stderr


def test_tiny_model_refuses_a_foreign_directory_without_force(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    result = dcpserve("tiny-model", str(tmp_path))
    assert result.returncode != 0
    assert f"dcpserve tiny-model: {tmp_path} is not empty and is not a dcpserve tiny model" in result.stderr
    assert "--force" in result.stderr
    forced = dcpserve("tiny-model", str(tmp_path), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_plan_for_the_tiny_model(tiny_model: TinyModelRun) -> None:
    directory, _ = tiny_model
    result = dcpserve("plan", "--model", str(directory), "--gpus-per-node", "8", "--gpu-memory", "80GiB",
                      "--context", "128k")
    assert result.returncode == 0, result.stderr
    rows = {tuple(line.split()[:2]): line.split() for line in result.stdout.splitlines() if line[:4].strip().isdigit()}
    assert list(rows) == [("1", "1"), ("2", "1"), ("2", "2"), ("4", "1"), ("4", "2"), ("4", "4")]
    tokens = {key: int(cells[5].replace(",", "")) for key, cells in rows.items()}
    assert tokens[("4", "4")] == 4 * tokens[("4", "1")]
    assert "131,072 tokens per sequence" in result.stdout


def test_plan_for_a_70b_config(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B_CONFIG))
    result = dcpserve("plan", "--model", str(config), "--gpu-memory", "80GiB", "--context", "128k")
    assert result.returncode == 0, result.stderr
    assert "70.55B parameters" in result.stdout
    one = next(line for line in result.stdout.splitlines() if line.split()[:2] == ["1", "1"])
    assert one.endswith("weights do not fit")


@pytest.mark.parametrize("args,message", [
    (("--gpu-memory", "80XB", "--context", "128k"), "argument --gpu-memory: memory size '80XB' has unknown unit 'XB'"),
    (("--gpu-memory", "80GiB", "--context", "lots"), "argument --context: cannot parse token count 'lots'"),
    (("--gpu-memory", "80GiB", "--context", "0.3k"), "must be a positive whole number of tokens"),
    (("--gpu-memory", "80GiB", "--context", "128k", "--gpu-memory-utilization", "2"),
     "dcpserve plan: gpu_memory_utilization must be in (0, 1], got 2.0"),
])
def test_plan_rejects_bad_values_clearly(tiny_model: TinyModelRun, args: tuple[str, ...], message: str) -> None:
    directory, _ = tiny_model
    result = dcpserve("plan", "--model", str(directory), *args)
    assert result.returncode != 0
    assert message in result.stderr


def test_plan_without_a_model_config(tmp_path: Path) -> None:
    result = dcpserve("plan", "--model", str(tmp_path), "--gpu-memory", "80GiB", "--context", "128k")
    assert result.returncode != 0
    assert "dcpserve plan: no config.json at" in result.stderr


def test_generate_takes_the_engine_args_flags(tiny_model: TinyModelRun) -> None:
    """`generate`'s engine flags come from EngineArgs.add_cli_args: the short and long spellings, byte sizes, and a
    bool flag reach the engine; --seed stays the per-request sampling seed."""
    directory, _ = tiny_model
    common = ("--model", str(directory), "--prompt", "hello", "--max-tokens", "4", "--temperature", "1", "--seed", "5")
    result = dcpserve("generate", *common, "--tp", "1", "--kv-cache-memory", "1MiB", "--block-size", "8",
                      "--no-enable-chunked-prefill", "--max-model-len", "256", "--engine-seed", "3", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    # The tiny model on CPU: K and V x 2 layers x 1 KV head x 32 dims x 4 B (fp32) = 512 B per token; 1 MiB = 2048.
    assert "KV capacity: 2048 tokens per replica" in result.stderr
    assert "4 tokens, finish_reason=length" in result.stdout
    long = dcpserve("generate", *common, "--tensor-parallel-size", "1", "--kv-cache-memory-bytes", "1048576",
                    "--block-size", "8", "--no-enable-chunked-prefill", "--max-model-len", "256", "--engine-seed", "9",
                    "--device", "cpu")
    assert long.returncode == 0, long.stderr
    assert long.stdout == result.stdout  # the request's own seed decides its tokens, not the engine seed


@pytest.mark.parametrize("args,message", [
    (("--backend", "vllm"), "dcpserve generate: backend='vllm' is not available yet"),
    (("--gpu-memory-utilization", "1.5"), "dcpserve generate: gpu_memory_utilization must be a fraction in (0, 1]"),
    (("--admission", "prompt"), "argument --admission: invalid choice: 'prompt'"),
])
def test_generate_rejects_bad_engine_args_clearly(tiny_model: TinyModelRun, args: tuple[str, ...], message: str) -> None:
    directory, _ = tiny_model
    result = dcpserve("generate", "--model", str(directory), "--prompt", "hi", *args)
    assert result.returncode != 0
    assert message in result.stderr
