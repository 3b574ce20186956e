"""The dcpserve command line: each command run once as a user would (the installed console script), and its other
cases, the checks of its arguments and the planner's output through the same entry point in this process (`cli`):
the same parsing, output and exit status, without a new interpreter importing torch for each of them."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dcpserve.cli import main
from dcpserve.cluster.published_models import DEEPSEEK_V2_LITE, DEEPSEEK_V3


def dcpserve(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, in a process of its own."""
    exe = shutil.which("dcpserve") or str(Path(sys.executable).parent / "dcpserve")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """dcpserve.cli.main, the console script's entry point, in this process: a SystemExit with a message ends with
    status 1 and the message on stderr, as the interpreter ends the script."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
    return subprocess.CompletedProcess(["dcpserve", *args], code, out.getvalue(), err.getvalue())


def test_python_m_dcpserve_is_the_command_line() -> None:
    """`python -m dcpserve` runs the same command line as the console script (an environment without it on PATH)."""
    result = subprocess.run([sys.executable, "-m", "dcpserve", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: dcpserve ")
    assert "tiny-model" in result.stdout and "simulate" in result.stdout


def test_layout_prints_the_worked_example() -> None:
    result = dcpserve("layout", "--tokens", "9", "--dcp", "3", "--block-size", "2", "--interleave", "2")
    assert result.returncode == 0, result.stderr
    assert "rank 0: local_seq_len 4, positions [0, 1, 6, 7]" in result.stdout
    assert "rank 2: local_seq_len 2, positions [4, 5]" in result.stdout
    # position 8: rank 1, page 1, offset 0, slot 2
    assert any(line.split() == ["8", "1", "1", "0", "2"] for line in result.stdout.splitlines())


def test_layout_with_pcp_shows_who_computes_each_query() -> None:
    """12 tokens in chunks of 8 at pcp=2: the first chunk's parts of 2 go 0, 1, 1, 0; the 4-token chunk's parts
    of 1 go 0, 1, 1, 0 too. DCP rank 1 is PCP group 1's."""
    result = cli("layout", "--tokens", "12", "--dcp", "2", "--block-size", "2", "--pcp", "2", "--chunk", "8")
    assert result.returncode == 0, result.stderr
    assert "PCP rank 0 computes the queries (and K/V) of positions [0, 1, 6, 7, 8, 11]" in result.stdout
    assert "PCP rank 1 computes the queries (and K/V) of positions [2, 3, 4, 5, 9, 10]" in result.stdout
    assert "rank 1 (PCP group 1, TP rank 0 of its run): local_seq_len 6" in result.stdout
    # position 9: DCP rank 1, page 2, offset 0, slot 4, query on PCP rank 1
    assert any(line.split() == ["9", "1", "2", "0", "4", "1"] for line in result.stdout.splitlines())


@pytest.mark.parametrize("args,message", [
    (("--tokens", "9", "--dcp", "3", "--pcp", "2"), "dcp=3 with pcp=2: dcp must be 1 or a multiple of pcp"),
    (("--tokens", "9", "--dcp", "2", "--block-size", "3", "--interleave", "2"),
     "interleave=2 must divide block_size=3"),
    (("--tokens", "9", "--dcp", "0"), "dcp_size must be a positive integer, got 0"),
    (("--tokens", "-1", "--dcp", "2"), "--tokens must be >= 0, got -1"),
])
def test_layout_rejects_bad_values_clearly(args, message) -> None:
    result = cli("layout", *args)
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
    again = cli("tiny-model", str(directory))  # a tiny model may be rewritten without --force
    assert again.returncode == 0, again.stderr


def test_tiny_model_mla_writes_a_deepseek_v2_model(tmp_path: Path) -> None:
    result = cli("tiny-model", "--mla", str(tmp_path / "mla"))
    assert result.returncode == 0, result.stderr
    assert "DeepseekV2ForCausalLM" in result.stdout and "one latent KV head of 40 + 12" in result.stdout
    config = json.loads((tmp_path / "mla" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and config["kv_lora_rank"] == 40


def test_tiny_model_refuses_a_foreign_directory_without_force(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    result = cli("tiny-model", str(tmp_path))
    assert result.returncode != 0
    assert f"dcpserve tiny-model: {tmp_path} is not empty and is not a dcpserve tiny model" in result.stderr
    assert "--force" in result.stderr
    forced = cli("tiny-model", str(tmp_path), "--force")
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
    result = cli("plan", "--model", str(config), "--gpu-memory", "80GiB", "--context", "128k")
    assert result.returncode == 0, result.stderr
    assert "70.55B parameters" in result.stdout
    one = next(line for line in result.stdout.splitlines() if line.split()[:2] == ["1", "1"])
    assert one.endswith("weights do not fit")


def plan_rows(stdout: str) -> dict[tuple[int, int], list[str]]:
    """The plan's table rows by (tp, dcp), split into cells."""
    return {(int(line.split()[0]), int(line.split()[1])): line.split()
            for line in stdout.splitlines() if line[:4].strip().isdigit()}


def write_config(directory: Path, config: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_plan_reads_a_deepseek_v2_lite_directory_as_mla(tmp_path: Path) -> None:
    model = write_config(tmp_path / "DeepSeek-V2-Lite-Chat", DEEPSEEK_V2_LITE)
    result = cli("plan", "--model", str(model), "--gpus-per-node", "8", "--gpu-memory", "141GB",
                      "--context", "128k", "--block-size", "64")
    assert result.returncode == 0, result.stderr
    assert "DeepseekV2ForCausalLM, 15.71B parameters" in result.stdout
    assert "MLA: 1 latent KV head of 512 + 64 = 576 values per token per layer" in result.stdout
    rows = plan_rows(result.stdout)
    assert list(rows) == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4), (8, 8)]
    tokens = {key: int(cells[5].replace(",", "")) for key, cells in rows.items()}
    assert tokens[(8, 8)] == 8 * tokens[(8, 1)] == 8 * 3_951_616
    assert rows[(8, 1)][4] == rows[(8, 8)][4] == "31,104"  # KV bytes per token per rank: the same latent on every rank
    assert rows[(8, 8)][6:9] == ["8", "->", "1"]  # KV head copies: 8 at dcp=1, none left at dcp=8
    assert "(8x)" in result.stdout


def test_plan_says_when_deepseek_v3_weights_do_not_fit(tmp_path: Path) -> None:
    model = write_config(tmp_path / "DeepSeek-V3", DEEPSEEK_V3)
    common = ("plan", "--model", str(model), "--gpu-memory", "141GB", "--context", "128k", "--block-size", "64")
    bf16 = cli(*common, "--weight-dtype", "bfloat16")
    assert bf16.returncode == 0, bf16.stderr
    assert "671.03B parameters" in bf16.stdout
    assert all(cells[-4:] == ["weights", "do", "not", "fit"] for cells in plan_rows(bf16.stdout).values())
    assert "no layout fits the weights" in bf16.stdout and "--weight-dtype auto plans them as shipped" in bf16.stdout
    fp8 = cli(*common, "--weight-dtype", "float8")
    assert fp8.returncode == 0, fp8.stderr
    rows = plan_rows(fp8.stdout)
    assert rows[(4, 4)][-4:] == ["weights", "do", "not", "fit"]
    assert (rows[(8, 1)][9], rows[(8, 8)][9]) == ("4", "36")  # sequences of 128k per replica
    assert "weights float8, KV cache bfloat16" in fp8.stdout


def test_plan_names_tp_sizes_an_mla_model_cannot_use(tmp_path: Path) -> None:
    model = write_config(tmp_path / "v2-lite", DEEPSEEK_V2_LITE)
    result = cli("plan", "--model", str(model), "--gpus-per-node", "32", "--gpu-memory", "141GB",
                      "--context", "128k")
    assert result.returncode == 0, result.stderr
    assert (16, 16) in plan_rows(result.stdout)
    assert "tp=32 not shown: tp=32 must divide the model's 16 attention heads" in result.stdout


def test_plan_refuses_an_mla_config_it_cannot_count(tmp_path: Path) -> None:
    model = write_config(tmp_path / "minicpm3", {**DEEPSEEK_V2_LITE, "architectures": ["MiniCPM3ForCausalLM"],
                                                 "qk_rope_head_dim": None})
    result = cli("plan", "--model", str(model), "--gpu-memory", "141GB", "--context", "128k")
    assert result.returncode != 0
    assert "dcpserve plan:" in result.stderr and "missing required fields ['qk_rope_head_dim']" in result.stderr


@pytest.mark.parametrize("args,message", [
    (("--gpu-memory", "80XB", "--context", "128k"), "argument --gpu-memory: memory size '80XB' has unknown unit 'XB'"),
    (("--gpu-memory", "80GiB", "--context", "lots"), "argument --context: cannot parse token count 'lots'"),
    (("--gpu-memory", "80GiB", "--context", "0.3k"), "must be a positive whole number of tokens"),
    (("--gpu-memory", "80GiB", "--context", "128k", "--gpu-memory-utilization", "2"),
     "dcpserve plan: gpu_memory_utilization must be in (0, 1], got 2.0"),
    (("--gpu-memory", "80GiB", "--context", "128k", "--weight-dtype", "int4"),
     "argument --weight-dtype: invalid choice: 'int4'"),
])
def test_plan_rejects_bad_values_clearly(tiny_model: TinyModelRun, args: tuple[str, ...], message: str) -> None:
    directory, _ = tiny_model
    result = cli("plan", "--model", str(directory), *args)
    assert result.returncode != 0
    assert message in result.stderr


def test_plan_without_a_model_config(tmp_path: Path) -> None:
    result = cli("plan", "--model", str(tmp_path), "--gpu-memory", "80GiB", "--context", "128k")
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
    long = cli("generate", *common, "--tensor-parallel-size", "1", "--kv-cache-memory-bytes", "1048576",
               "--block-size", "8", "--no-enable-chunked-prefill", "--max-model-len", "256", "--engine-seed", "9",
               "--device", "cpu")
    assert long.returncode == 0, long.stderr
    assert long.stdout == result.stdout  # the request's own seed decides its tokens, not the engine seed


@pytest.mark.parametrize("args,message", [
    pytest.param(("--backend", "vllm"), "dcpserve generate: backend='vllm' but vLLM is not installed",
                 marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")),
    pytest.param(("--backend", "vllm", "--block-size", "16", "--device", "cpu"), "dcpserve generate: block_size=16",
                 marks=pytest.mark.vllm),
    (("--gpu-memory-utilization", "1.5"), "dcpserve generate: gpu_memory_utilization must be a fraction in (0, 1]"),
    (("--admission", "prompt"), "argument --admission: invalid choice: 'prompt'"),
])
def test_generate_rejects_bad_engine_args_clearly(tiny_model: TinyModelRun, args: tuple[str, ...],
                                                  message: str) -> None:
    directory, _ = tiny_model
    result = cli("generate", "--model", str(directory), "--prompt", "hi", *args)
    assert result.returncode != 0
    assert message in result.stderr
