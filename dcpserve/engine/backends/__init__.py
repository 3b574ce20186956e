"""The engine protocol's backends, by name: `start_engine(args)` starts the one `EngineArgs.backend` names,
`validate_engine_args` checks up front what would stop it from starting, `model_limits` gives the serving front
what it needs to check and count a request before any replica sees it.

dcpserve.engine.protocol defines the protocol and imports no implementation; this package is the one place that knows
them (each imported only when chosen: the vLLM adapter needs vLLM). It holds the vLLM adapter
(dcpserve.engine.backends.vllm); this module may import engine's top-level modules at the top, and the backends
themselves (dcpserve.engine.frontend.async_engine, dcpserve.engine.backends.vllm) only inside the function that starts
or validates the one chosen.
"""

from __future__ import annotations

from collections.abc import Callable

from dcpserve.engine.args import EngineArgs
from dcpserve.engine.protocol import EngineClient, EngineStats, ModelLimits


def model_limits(args: EngineArgs) -> ModelLimits:
    """The native engine's validated config, or (vLLM) the model's config.json read through transformers with the
    same meaning of max_model_len (unset: the model's max_position_embeddings). The replica stays the authority: a
    request vLLM refuses after this check is still a 400."""
    if args.backend == "native":
        config = args.create_engine_config()
        return ModelLimits(
            model=config.model, max_model_len=config.scheduler.max_model_len,
            vocab_size=config.model_config.vocab_size,
            tokens_per_block=config.cache.block_size * config.parallel.dcp, admission=config.scheduler.admission,
            eos_token_ids=config.model_config.eos_token_ids,
            prefix_caching=config.cache.enable_prefix_caching, prefix_hash_seed=config.cache.prefix_hash_seed,
        )
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(args.model, local_files_only=True, trust_remote_code=args.trust_remote_code)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    limit = int(getattr(text, "max_position_embeddings", 0) or 0)
    max_model_len = args.max_model_len or limit
    if limit and max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}; use at most {limit}"
        )
    eos = getattr(text, "eos_token_id", None)
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
    return ModelLimits(
        model=str(args.model), max_model_len=max_model_len, vocab_size=int(text.vocab_size),
        tokens_per_block=args.block_size * args.decode_context_parallel_size, admission=args.admission,
        eos_token_ids=eos_ids, prefix_caching=args.enable_prefix_caching, prefix_hash_seed=args.prefix_hash_seed(),
    )


def validate_engine_args(args: EngineArgs, device: str) -> None:
    """Everything that would stop a replica of this backend from starting on `device`, checked up front (`serve
    deploy`, `dcpserve generate`): raises ValueError (FileNotFoundError for a missing model) naming the value and
    the fix."""
    if args.backend == "native":
        args.create_engine_config()
    elif args.backend == "vllm":
        from dcpserve.engine.backends.vllm.args import validate_vllm_args

        validate_vllm_args(args, device)
    else:
        raise ValueError(f"backend must be 'native' or 'vllm', got {args.backend!r}")


def start_engine(args: EngineArgs, on_step: Callable[[EngineStats], None] | None = None) -> EngineClient:
    """Starts the backend `args.backend` names (blocking: loads weights, sizes the KV cache). on_step(stats), when
    given, runs on the event loop after every engine step."""
    if args.backend == "native":
        from dcpserve.engine.frontend.async_engine import AsyncEngine

        return AsyncEngine(args.create_engine_config(), on_step)
    if args.backend == "vllm":
        from dcpserve.engine.backends.vllm.engine import VllmEngine

        return VllmEngine(args, on_step)
    raise ValueError(f"backend must be 'native' or 'vllm', got {args.backend!r}")
