"""Builds the model for this rank and fills it from a Hugging Face safetensors checkpoint.

Single-file (model.safetensors) and sharded (model-0000i-of-0000n.safetensors + model.safetensors.index.json)
checkpoints are read with safetensors.safe_open; each tensor is handed to the model as a get_slice handle, so
a rank reads only its own rows or columns of a TP-sharded weight. Tensors are cast to the requested dtype.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from dcpserve.engine.config import ModelConfig
from dcpserve.engine.layers.weights import WeightSource
from dcpserve.engine.models import MODEL_CLASSES, CausalLM
from dcpserve.engine.worker.parallel import ParallelState

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: those the index names when there is one, else every *.safetensors file."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist")
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index_path} is not a safetensors index (needs a 'weight_map' object): {err}") from err
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(
                f"{index_path} names checkpoint files that are not in {directory}: {absent}; the download is "
                f"incomplete, fetch the missing shards"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        present = sorted(p.name for p in directory.iterdir())[:10]
        raise FileNotFoundError(
            f"no *.safetensors files in {directory} (found {present}): dcpserve loads Hugging Face checkpoints "
            f"saved as model.safetensors or sharded model-*.safetensors with {INDEX_FILE}; convert a .bin "
            f"checkpoint with transformers' save_pretrained(..., safe_serialization=True)"
        )
    return files


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, WeightSource]]:
    """(name, slice handle) for every tensor of every file; a handle stays valid until the next file opens."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_slice(name)


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    parallel: ParallelState,
    dtype: torch.dtype,
    device: torch.device,
) -> CausalLM:
    """This rank's model with its shard of the checkpoint's weights, in `dtype` on `device`, ready for inference."""
    model_class = MODEL_CLASSES.get(config.architecture)
    if model_class is None:
        raise ValueError(f"architecture {config.architecture!r} has no model class; supported: {sorted(MODEL_CLASSES)}")
    files = safetensors_files(model_dir)
    model = model_class(config, parallel, dtype, torch.device(device))
    model.load_weights(iterate_weights(files))
    return model.eval()
