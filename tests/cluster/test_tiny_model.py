"""The embedded default model: loads in transformers, runs, is deterministic, and guards existing directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpserve.cluster.tiny_model import (
    MARKER_FILE,
    TinyMlaSpec,
    TinyModelSpec,
    is_tiny_model_dir,
    write_tiny_mla_model,
    write_tiny_model,
)
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.rope_config import YarnScaling

WRITTEN_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", MARKER_FILE)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_writes_the_expected_files(tiny_dir: Path) -> None:
    assert sorted(p.name for p in tiny_dir.iterdir()) == sorted(WRITTEN_FILES)
    assert is_tiny_model_dir(tiny_dir)


def test_loads_in_transformers_and_runs_a_forward_pass(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # output_loading_info=True: (model, info), where transformers' annotation has the model alone.
    loaded: Any = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True, output_loading_info=True)
    model, info = loaded
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert model.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert len(tokenizer) == model.config.vocab_size == 512
    ids = tokenizer("def main():\n    return 1", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()


def test_model_config_and_layouts(tiny_dir: Path) -> None:
    model = ModelConfig.from_pretrained(tiny_dir)
    assert (model.architecture, model.num_key_value_heads, model.num_attention_heads, model.head_dim) == (
        "LlamaForCausalLM", 1, 4, 32)
    assert (model.hidden_size, model.intermediate_size, model.num_hidden_layers) == (128, 256, 2)
    assert model.max_position_embeddings == 8192
    assert model.torch_dtype == "float32"
    assert model.eos_token_ids == (1, 4)  # <|end_of_text|>, <|eot_id|>
    assert model.bos_token_id == 0
    for tp, dcp in ((2, 2), (4, 4), (4, 2), (1, 1)):
        ParallelConfig(tp, dcp).validate(model)
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["torch_dtype"] == raw["dtype"] == "float32"


def test_same_seed_gives_identical_files(tiny_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_model(tmp_path / "again", seed=0)
    for name in WRITTEN_FILES:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_other_seed_changes_weights_only(tiny_dir: Path, tmp_path: Path) -> None:
    other = write_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_global_rng_is_left_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    write_tiny_model(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_refuses_a_foreign_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty and is not a dcpserve tiny model.*--force"):
        write_tiny_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_force_overwrites_model_files_and_keeps_others(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "pytorch_model.bin").write_text("stale weights")
    write_tiny_model(tmp_path, force=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "pytorch_model.bin").exists()
    assert is_tiny_model_dir(tmp_path)


def test_rewrites_an_existing_tiny_model_without_force(tiny_dir: Path, tmp_path: Path) -> None:
    target = write_tiny_model(tmp_path / "m", seed=1)
    write_tiny_model(target, seed=0)
    assert (target / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_rejects_a_file_path_and_bad_specs(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        write_tiny_model(tmp_path / "f")
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        TinyModelSpec(vocab_size=100)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads=3"):
        TinyModelSpec(num_attention_heads=4, num_key_value_heads=3)


def test_progress_lines(tmp_path: Path) -> None:
    lines: list[str] = []
    out = write_tiny_model(tmp_path / "m", log=lines.append)
    assert lines[0].startswith("training tokenizer")
    assert lines[1].startswith("writing weights")
    assert lines[2] == f"wrote {out}"
    assert "410,240 parameters" in lines[3]


# ---- the tiny DeepSeek-V2 (MLA + MoE) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mla_model(tmp_path_factory.mktemp("tiny_mla") / "model", seed=0)


def test_mla_model_loads_in_transformers_and_in_the_engine(tiny_mla_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in tiny_mla_dir.iterdir()) == sorted(WRITTEN_FILES)
    loaded: Any = AutoModelForCausalLM.from_pretrained(tiny_mla_dir, local_files_only=True, output_loading_info=True)
    model, info = loaded  # (model, info), as above
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    config = ModelConfig.from_pretrained(tiny_mla_dir)
    assert config.mla is not None and config.moe is not None and config.mla.q_lora_rank is None
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (1, 40 + 12, 512)
    assert [config.moe.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert isinstance(config.rope_scaling, YarnScaling)
    for tp, dcp in ((4, 4), (4, 2), (2, 2), (1, 1)):
        ParallelConfig(tp, dcp).validate(config)
    # Norms are random, not transformers' ones: a load that drops one shows.
    assert not torch.equal(model.model.layers[0].self_attn.kv_a_layernorm.weight, torch.ones(40))


def test_mla_model_is_deterministic_and_takes_its_spec(tiny_mla_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_mla_model(tmp_path / "again", seed=0)
    for name in WRITTEN_FILES:
        assert (again / name).read_bytes() == (tiny_mla_dir / name).read_bytes(), name
    spec = TinyMlaSpec(q_lora_rank=24, yarn_factor=None, num_hidden_layers=2)
    other = write_tiny_mla_model(tmp_path / "other", seed=0, spec=spec)
    config = ModelConfig.from_pretrained(other)
    assert config.mla is not None and config.mla.q_lora_rank == 24 and config.rope_scaling is None
    assert json.loads((other / MARKER_FILE).read_text())["spec"]["q_lora_rank"] == 24
    with pytest.raises(ValueError, match="qk_rope_head_dim=7 must be even"):
        TinyMlaSpec(qk_rope_head_dim=7)
