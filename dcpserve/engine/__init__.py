"""One replica's inference engine: configs, scheduling, KV blocks, model runner.

`from dcpserve.engine import LLM, SamplingParams, AsyncEngine` works; the names load on first use so that light entry
points (the CLI's `layout` and `plan`) do not import the model stack.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLM": "dcpserve.engine.frontend.llm",
    "SamplingParams": "dcpserve.engine.sampling_params",
    "RequestOutput": "dcpserve.engine.core.request",
    "CompletionOutput": "dcpserve.engine.core.request",
    "AsyncEngine": "dcpserve.engine.frontend.async_engine",
    "LLMEngine": "dcpserve.engine.core.engine",
    "EngineArgs": "dcpserve.engine.args",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
