"""The capture-safety check: what, in a forward, a CUDA graph could not capture or would replay wrongly.

A CUDA graph records the kernels a forward launches and replays them on the same buffers; nothing the forward does
on the host is replayed. So a captured forward must not read a device value back to the host (the capture fails: a
stream sync is not permitted while capturing, and the value would be frozen anyway), must not make a tensor whose
shape depends on tensor values (its size is read back, and a replay keeps the captured size), and must not copy
between the host and the device (a copy from pageable memory synchronizes; a pinned one replays stale host data).

`CaptureSafetyMode` is a TorchDispatchMode that sees every aten op the forward runs and records each one of those
(`CaptureViolation`: the op, why, and the forward's own frames, file:line): on any device it catches the host reads
(`aten._local_scalar_dense`: `.item()`, `int(t)`, `float(t)`, `bool(t)`, `.tolist()`; `aten.equal`) and the
data-dependent shapes (`nonzero` / `argwhere` / `torch.where(cond)`, `masked_select`, `unique*`, `bincount`,
`repeat_interleave` without `output_size`, boolean-mask indexing and index assignment); on a device it also catches
copies to the CPU (`.cpu()`, `.to("cpu")`, `.tolist()`), copies from the CPU, and CPU tensors handed to device ops
(an implicit copy). On CPU every tensor is a CPU tensor, so the first two kinds are the signals there; they are what
the fast tier checks the decode forward for (tests/engine/worker/test_capture_safety*.py).

Ops run inside the Triton interpreter (TRITON_INTERPRET=1: a kernel launch on CPU) are not the forward's: on a
device a launch is one graph node, so they are skipped. `torch.cuda.synchronize()` is not an aten op; a forward that
calls it also fails a real capture, which the engine's capture reports (dcpserve/engine/worker/cuda_graphs.py).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READ = "reads a device value back to the host"
DYNAMIC_SHAPE = "makes a tensor whose shape depends on tensor values (read back to the host)"
TO_HOST = "copies a device tensor to the CPU"
FROM_HOST = "copies a CPU tensor to the device"
HOST_OPERAND = "hands a CPU tensor to a device op (an implicit host-to-device copy)"

_aten = torch.ops.aten
# Ops that synchronize whatever their arguments: their result is a host value.
_HOST_READS = {_aten._local_scalar_dense.default, _aten.equal.default}
# Ops whose output shape is the count of something in the input's values.
_DYNAMIC_SHAPES = {
    _aten.nonzero.default, _aten.masked_select.default, _aten._unique.default, _aten._unique2.default,
    _aten.unique_dim.default, _aten.unique_consecutive.default, _aten.unique_dim_consecutive.default,
    _aten.bincount.default,
}
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
_REPEAT_INTERLEAVE = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}
_COPIES = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default}

# Frames of these are the machinery, not the forward: left out of a violation's stack.
_MACHINERY = (str(Path(torch.__file__).parent), str(Path(__file__)))
_TRITON_INTERPRETER = ("triton/runtime/interpreter.py", "triton/runtime/jit.py")
STACK_FRAMES = 4  # the innermost frames of the forward kept with a violation


@dataclass(frozen=True)
class CaptureViolation:
    """One op a captured forward cannot run: the aten op, why (HOST_READ, DYNAMIC_SHAPE, ...) and the innermost
    frames of the code that called it, `path:line in function`, innermost last."""

    op: str
    reason: str
    stack: tuple[str, ...]

    def __str__(self) -> str:
        where = self.stack[-1] if self.stack else "<no Python frame>"
        return f"{self.op} {self.reason}, at {where}"


class CaptureSafetyError(RuntimeError):
    """A forward that a CUDA graph cannot capture: every violation found, one per line."""

    def __init__(self, what: str, violations: list[CaptureViolation]) -> None:
        self.violations = violations
        lines = "\n".join(f"  {v.op}: {v.reason}\n    " + "\n    ".join(v.stack) for v in violations)
        super().__init__(f"{what} is not safe to capture in a CUDA graph ({len(violations)} violations; run it "
                         f"eagerly, or remove each host read, data-dependent shape and host copy):\n{lines}")


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]


def _is_mask(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.bool, torch.uint8)


def classify(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why the aten op `func` on these arguments cannot be captured, or None when it can."""
    if func in _HOST_READS:
        return HOST_READ
    if func in _DYNAMIC_SHAPES:
        return DYNAMIC_SHAPE
    if func in _REPEAT_INTERLEAVE:
        return DYNAMIC_SHAPE if kwargs.get("output_size") is None else None
    if func in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return DYNAMIC_SHAPE if any(_is_mask(i) for i in indices or ()) else None
    tensors = _tensors(args, kwargs)
    if func in _COPIES:
        if func is _aten._to_copy.default:  # _to_copy(source, *, device=None, ...)
            source, target = args[0], kwargs.get("device") or args[0].device
        else:  # copy_(target, source) / copy(target, source)
            target, source = args[0].device, args[1]
        source_device = source.device if isinstance(source, torch.Tensor) else torch.device("cpu")
        target_device = torch.device(target)
        if source_device.type != "cpu" and target_device.type == "cpu":
            return TO_HOST
        if source_device.type == "cpu" and target_device.type != "cpu" and isinstance(source, torch.Tensor) \
                and source.dim() > 0:
            return FROM_HOST
        return None
    on_device = any(t.device.type != "cpu" for t in tensors)
    if on_device and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
        return HOST_OPERAND
    return None


def _forward_frames() -> tuple[tuple[str, ...], bool]:
    """(the innermost STACK_FRAMES frames outside torch and this module, whether the op runs inside the Triton
    interpreter)."""
    frames = traceback.extract_stack()
    if any(f.filename.endswith(_TRITON_INTERPRETER) for f in frames):
        return (), True
    kept = [f for f in frames if not f.filename.startswith(_MACHINERY)]
    return tuple(f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in kept[-STACK_FRAMES:]), False


def _short(filename: str) -> str:
    """A path from the repository's package (dcpserve/...) or tests, as written in the code; others whole."""
    parts = Path(filename).parts
    for root in ("dcpserve", "tests", "bench"):
        if root in parts:
            return str(Path(*parts[len(parts) - 1 - parts[::-1].index(root):]))
    return filename


class _DispatchRecorder(TorchDispatchMode):
    """The aten side of CaptureSafetyMode: classifies every op (`classify`) and runs it as usual."""

    def __init__(self, check: CaptureSafetyMode) -> None:
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.check.inside_flagged_call:
            reason = classify(func, args, kwargs)
            if reason is not None:
                self.check.record(str(func), reason)
        return func(*args, **kwargs)


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether Tensor.to(*args, **kwargs) names the CPU as its device."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu":
            return True
    return False


class _FunctionRecorder(TorchFunctionMode):
    """The Python side of CaptureSafetyMode: the host reads that a CPU tensor may serve without an aten op
    (`.item()`, `int(t)` and the other scalar conversions under inference_mode; `.tolist()`, `.numpy()`, `.cpu()`,
    `.to("cpu")`, `torch.allclose`), which on a device read or copy to the host."""

    def __init__(self, check: CaptureSafetyMode) -> None:
        super().__init__()
        self.check = check

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        reason = None
        if not self.check.inside_flagged_call:
            if func in _HOST_READ_METHODS:
                reason = HOST_READ
            elif func in _TO_HOST_METHODS:
                reason = TO_HOST
            elif func is torch.Tensor.to and _to_host(args, kwargs):
                reason = TO_HOST
        if reason is None:
            return func(*args, **kwargs)
        self.check.record("torch.allclose" if func is torch.allclose else f"Tensor.{func.__name__}", reason)
        self.check.inside_flagged_call = True  # its own aten ops (a copy, a scalar read) are this one violation
        try:
            return func(*args, **kwargs)
        finally:
            self.check.inside_flagged_call = False


# A scalar read of a CPU tensor under inference_mode takes a path without an aten op: caught here as called.
_HOST_READ_METHODS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                      torch.Tensor.__index__, torch.Tensor.__complex__, torch.allclose}
_TO_HOST_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}


class CaptureSafetyMode:
    """A context in which every op that a CUDA graph cannot capture (module docstring) is recorded in
    `violations`; every op still runs as usual."""

    def __init__(self) -> None:
        self.violations: list[CaptureViolation] = []
        self.inside_flagged_call = False
        self._modes = (_FunctionRecorder(self), _DispatchRecorder(self))

    def record(self, op: str, reason: str) -> None:
        stack, in_interpreter = _forward_frames()
        if not in_interpreter:
            self.violations.append(CaptureViolation(op, reason, stack))

    def __enter__(self) -> CaptureSafetyMode:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def capture_violations(fn: Callable[[], Any]) -> tuple[Any, list[CaptureViolation]]:
    """Runs fn() under CaptureSafetyMode: (its result, the violations found)."""
    with CaptureSafetyMode() as mode:
        result = fn()
    return result, mode.violations


def check_capture_safety(fn: Callable[[], Any], what: str = "the forward") -> Any:
    """Runs fn() under CaptureSafetyMode and returns its result; raises CaptureSafetyError naming every violation,
    also when fn itself failed after one (a real capture fails at the first host sync, with CUDA's terse error: the
    violations say where)."""
    mode = CaptureSafetyMode()
    try:
        with mode:
            result = fn()
    except Exception as err:
        if mode.violations:
            raise CaptureSafetyError(what, mode.violations) from err
        raise
    if mode.violations:
        raise CaptureSafetyError(what, mode.violations)
    return result
