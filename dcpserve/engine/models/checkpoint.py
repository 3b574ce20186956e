"""Loading a checkpoint's tensors into a model's parameters: the part every model class shares.

A model says which Hugging Face tensor names it expects, how a name maps to one of its parameters (and the shard id
of that parameter's loader: q / k / v of a merged QKV, an expert of stacked experts, ...) and which names to skip
(buffers some checkpoints save, layers it does not run); `load_named_weights` does the rest and names every
missing, unexpected or repeated tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dcpserve.engine.layers.weights import ShardId, WeightSource, as_weight_source


def load_named_weights(
    params: dict[str, torch.nn.Parameter],
    weights: Iterable[tuple[str, WeightSource | torch.Tensor]],
    expected: set[str],
    resolve: Callable[[str], tuple[str, ShardId]],
    skip: Callable[[str], bool],
    describe: str,
) -> None:
    """Copies this rank's shard of every expected checkpoint tensor into params[resolve(name)[0]].

    Raises ValueError naming the tensors when some are missing or unexpected (describe: what the checkpoint was
    expected to be, for the message), or one appears twice; the loaders raise on a shape that does not match."""
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, weight in weights:
        if skip(name):
            continue
        if name not in expected:
            unexpected.append(name)
            continue
        if name in loaded:
            raise ValueError(f"checkpoint tensor {name!r} appears twice (in two files of a sharded checkpoint?)")
        param_name, shard_id = resolve(name)
        param = params[param_name]
        param.weight_loader(param, as_weight_source(weight), name, shard_id)  # type: ignore[attr-defined]  # new_parameter attached it
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensors: {preview(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} tensors: {preview(sorted(unexpected))}")
        raise ValueError(f"checkpoint does not match {describe}: " + "; ".join(problems))


def preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
