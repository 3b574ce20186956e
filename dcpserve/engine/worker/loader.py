"""Builds the model for this rank and fills it from a Hugging Face safetensors checkpoint.

Single-file (model.safetensors) and sharded (model-0000i-of-0000n.safetensors + model.safetensors.index.json)
checkpoints are read with safetensors.safe_open; each tensor is handed to the model as a get_slice handle, so
a rank reads only its own rows or columns of a TP-sharded weight. Tensors are cast to the requested dtype, except an
FP8 block-quantized checkpoint's weights, which stay float8_e4m3fn (dcpserve/engine/layers/linear_method.py).

A damaged file fails with its path and the tensor: a truncated file (safetensors refuses to open it) names the
tensors its header places past the end; a read that fails names the tensor; and since FP8 has room for the signs of
corruption, an FP8 weight read with NaN bytes, or a block scale that is not a finite positive number, is refused by
file and tensor before it reaches the model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


class CheckedSlice:
    """A checkpoint tensor's slice handle that names its file and tensor when a read fails or reads corrupt FP8."""

    def __init__(self, handle: WeightSource, path: Path, name: str) -> None:
        self.handle = handle
        self.path = path
        self.name = name

    def get_shape(self) -> list[int]:
        return self.handle.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        try:
            tensor = self.handle[index]
        except Exception as err:
            raise ValueError(f"checkpoint file {self.path}: cannot read tensor {self.name!r}: {err}") from err
        if tensor.dtype == torch.float8_e4m3fn:
            nan = (tensor.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn's only NaN encodings; it has no infinities
            if bool(nan.any()):
                raise ValueError(
                    f"checkpoint file {self.path}: tensor {self.name!r} holds {int(nan.sum())} NaN float8_e4m3fn "
                    f"values: the file is corrupt; download it again"
                )
        elif self.name.endswith("weight_scale_inv") and not bool((torch.isfinite(tensor) & (tensor > 0)).all()):
            raise ValueError(
                f"checkpoint file {self.path}: FP8 block scales {self.name!r} must be finite and positive, found "
                f"{tensor[~(torch.isfinite(tensor) & (tensor > 0))].flatten()[:4].tolist()}: the file is corrupt; "
                f"download it again"
            )
        return tensor


def damaged_file_error(path: Path, err: Exception) -> ValueError:
    """The error for a file safetensors cannot open: its path, and the tensors a truncated file lacks."""
    size = path.stat().st_size
    detail = f"{err}"
    try:
        with path.open("rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_size)) if 8 + header_size <= size else None
    except (OSError, ValueError, struct.error):
        header = None
    if isinstance(header, dict):
        data_size = size - 8 - header_size
        cut = sorted((info["data_offsets"][1], name) for name, info in header.items()
                     if name != "__metadata__" and info["data_offsets"][1] > data_size)
        if cut:
            more = f" and {len(cut) - 1} more tensors" if len(cut) > 1 else ""
            detail = (f"the file is truncated: it holds {size} bytes, but its header places tensor {cut[0][1]!r}"
                      f"{more} past the end ({err})")
    return ValueError(f"checkpoint file {path} cannot be read: {detail}; download it again")


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, WeightSource]]:
    """(name, slice handle) for every tensor of every file; a handle stays valid until the next file opens."""
    for path in files:
        try:
            opened = safe_open(str(path), framework="pt", device="cpu")
        except Exception as err:  # safetensors raises its own SafetensorError (and OSError) for a damaged file
            raise damaged_file_error(path, err) from err
        with opened as handle:
            for name in handle.keys():
                yield name, CheckedSlice(handle.get_slice(name), path, name)


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
