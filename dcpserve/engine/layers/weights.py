"""Checkpoint tensors as sliceable sources, and the weight loaders parameters carry.

A WeightSource is anything that gives its full shape and reads a slice without reading the rest: safetensors'
`safe_open(...).get_slice(name)` handle, or an in-memory tensor wrapped in TensorSource.

Every parameter carries `param.weight_loader(param, source, checkpoint_name, shard_id)`. A ShardedLoader holds
only numbers (one ShardSpec per shard id), never its layer: a loader that referenced its layer would make a
reference cycle (layer -> param -> loader -> layer) that keeps layers, and the process groups they hold, alive
until the cyclic garbage collector runs, possibly at interpreter shutdown, where tearing down gloo aborts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class WeightSource(Protocol):
    """A checkpoint tensor readable in slices (safetensors' get_slice handle has exactly this surface)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class TensorSource:
    """An in-memory tensor presented as a WeightSource."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


ShardId = str | int | tuple[int, str | int | None] | None
WeightLoader = Callable[[torch.nn.Parameter, WeightSource, str, ShardId], None]


def as_weight_source(weight: WeightSource | torch.Tensor) -> WeightSource:
    """Wraps a plain tensor; passes a WeightSource through."""
    return TensorSource(weight) if isinstance(weight, torch.Tensor) else weight


def check_shape(source: WeightSource, expected: tuple[int, ...], name: str) -> None:
    """Raises ValueError naming the tensor when the checkpoint shape is not the model's."""
    found = tuple(int(n) for n in source.get_shape())
    if found != tuple(expected):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {found} but the model expects {tuple(expected)}: the "
            f"checkpoint does not match config.json (wrong model directory, or an edited config)"
        )


@dataclass(frozen=True)
class ShardSpec:
    """This rank's part of one checkpoint tensor: [start, start + length) along `dim` (None: all of it), copied
    into the parameter's rows [offset, offset + length) when dim is 0, or into the whole parameter otherwise."""

    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    length: int = 0
    offset: int = 0


class ShardedLoader:
    """A parameter's weight loader: checks the full checkpoint shape, reads only this rank's slice, copies it.
    source_dtype: the dtype the checkpoint tensor must have (an FP8 weight: a float tensor would be cast to FP8
    without its scales); None casts whatever it reads to the parameter's dtype."""

    def __init__(self, specs: dict[ShardId, ShardSpec], source_dtype: torch.dtype | None = None) -> None:
        self.specs = specs
        self.source_dtype = source_dtype

    def __call__(self, param: torch.Tensor, source: WeightSource, name: str, shard_id: ShardId = None) -> None:
        spec = self.specs.get(shard_id)
        if spec is None:
            known = sorted(map(repr, self.specs))
            raise ValueError(f"{name!r}: shard id {shard_id!r} is not one of this parameter's shard ids {known}")
        check_shape(source, spec.full_shape, name)
        target: torch.Tensor
        loaded: torch.Tensor | None
        if spec.dim is None:
            target, loaded = param, source[:]
        elif spec.dim == 0:
            target = param[spec.offset : spec.offset + spec.length]
            loaded = source[spec.start : spec.start + spec.length] if spec.length else None
        elif spec.dim == 1:
            target, loaded = param, source[:, spec.start : spec.start + spec.length]
        else:
            raise ValueError(f"ShardSpec.dim must be None, 0 or 1, got {spec.dim}")
        if loaded is None:  # this rank holds no rows of the tensor (a padded vocabulary shard)
            return
        if self.source_dtype is not None and loaded.dtype != self.source_dtype:
            raise ValueError(
                f"checkpoint tensor {name!r} is {loaded.dtype} but the model holds it as {self.source_dtype} (an "
                f"FP8 block-quantized weight, as config.json's quantization_config says): the checkpoint does not "
                f"match its config"
            )
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"checkpoint tensor {name!r}: this rank's slice has shape {tuple(loaded.shape)} but the parameter "
                f"shard is {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(loaded)  # casts to the parameter's dtype and moves to its device


class StackedLoader:
    """The loader of a parameter that stacks one tensor per index along dim 0 (a MoE layer's experts): shard id
    (index, part) loads the checkpoint tensor into param[index] by `specs[part]`, as ShardedLoader would."""

    def __init__(self, num_indices: int, specs: dict[ShardId, ShardSpec], source_dtype: torch.dtype | None = None
                 ) -> None:
        self.num_indices = num_indices
        self.part_loader = ShardedLoader(specs, source_dtype)

    def __call__(
        self, param: torch.nn.Parameter, source: WeightSource, name: str, shard_id: ShardId = None
    ) -> None:
        if (not isinstance(shard_id, tuple) or not isinstance(shard_id[0], int)
                or not 0 <= shard_id[0] < self.num_indices):
            raise ValueError(f"{name!r}: shard id {shard_id!r} must be (index in [0, {self.num_indices}), part)")
        index, part = shard_id
        self.part_loader(param[index], source, name, part)


def new_parameter(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, loader: WeightLoader | None = None
) -> torch.nn.Parameter:
    """An inference parameter (no grad) carrying its weight loader as `param.weight_loader`; without one the
    parameter is replicated: the checkpoint tensor must have its shape and is copied whole."""
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader or ShardedLoader({None: ShardSpec(tuple(shape))})  # type: ignore[attr-defined]  # an attribute of ours on torch's class
    return param
