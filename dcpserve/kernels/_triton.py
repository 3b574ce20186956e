"""Triton import with a clear failure where it is missing (macOS, some CPU installs).

The engine uses the fused CPU kernels (*_cpu) and the torch references on CPU, so a machine without Triton can still
run everything but the Triton kernels; calling one of those there raises an error that says so instead of an
ImportError at import.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _MissingTriton:
        """Stands in for triton so kernel modules import; any Triton launch explains what is missing."""

        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (n - 1).bit_length())

    class _MissingLanguage:
        constexpr = Any

    triton = _MissingTriton()
    tl = _MissingLanguage()

# triton.jit with a type (triton ships none, so mypy sees the decorator as untyped): the kernels are decorated with it.
jit: Callable[[Callable[..., Any]], Any] = triton.jit


def triton_interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1, tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton_device(*tensors: Any) -> None:
    """Raises a clear error when a Triton kernel cannot run on these tensors."""
    if not HAS_TRITON:
        raise RuntimeError(
            "Triton is not installed; use the *_cpu or *_ref kernels (the engine does so on CPU) or install triton>=3.6"
        )
    if triton_interpreting():
        return
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise RuntimeError(
                f"Triton kernels run on CUDA tensors, got a tensor on {t.device}. On CPU use the *_cpu or *_ref kernel "
                f"(or set TRITON_INTERPRET=1 before importing kernels, for tests only)."
            )


__all__ = ["HAS_TRITON", "jit", "require_triton_device", "tl", "triton", "triton_interpreting"]
