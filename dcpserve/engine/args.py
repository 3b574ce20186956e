"""EngineArgs: the one definition of the engine's user arguments (modelled on vLLM's EngineArgs).

Every way of starting an engine derives from these fields: `LLM(model, **kwargs)` takes exactly them, the
`dcpserve generate` flags come from `EngineArgs.add_cli_args`, and the app's `AppArgs` (dcpserve/deployments/config.py)
generates its engine fields from them. A field added here appears in all three. Each field carries its help text in
`metadata["help"]`; simple ranges are checked at construction, the checks that need the model directory in
`create_engine_config()`.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, Union, get_args, get_origin, get_type_hints

import torch

from dcpserve.engine.config import (
    DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from dcpserve.engine.core.prefix_cache import prefix_hash_seed

BACKENDS = ("native", "vllm")
CHUNKED_STEP_TOKENS = 2048  # max_num_batched_tokens by default with chunked prefill


class _AddsArguments(Protocol):
    """An argparse parser or argument group."""

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action: ...


_Parser = TypeVar("_Parser", bound=_AddsArguments)


@dataclass(frozen=True)
class EngineArgs:
    """The user-facing arguments of one replica's engine, validated at construction."""

    model: str = field(metadata={"help": (
        "local Hugging Face model directory (config.json + *.safetensors), present on every node; "
        "`dcpserve tiny-model DIR` writes a small one"
    )})
    backend: Literal["native", "vllm"] = field(default="native", metadata={"help": (
        "which engine runs the model: native (dcpserve's own, with decode context parallelism) or vllm (vLLM's)"
    )})
    tensor_parallel_size: int = field(default=1, metadata={"help": (
        "TP ranks (= GPUs) per replica; more than 1 runs a Ray worker group"
    )})
    decode_context_parallel_size: int = field(default=1, metadata={"help": (
        "DCP group size: the KV cache is sharded along the sequence over this many ranks; adds no GPUs. At pcp = 1 "
        "it divides tp; at pcp > 1 it is 1 or a multiple of pcp (pcp: each PCP group's ranks of one KV head; "
        "tp * pcp when the model has one KV head)"
    )})
    prefill_context_parallel_size: int = field(default=1, metadata={"help": (
        "PCP groups per replica (vLLM's name): each is tp ranks, so a replica has tp * pcp GPUs on one node; every "
        "prefill chunk's tokens split across the groups (one early and one late part each), cutting a long "
        "prompt's time to first token; the groups run decodes together"
    )})
    rank_transport: Literal["auto", "shm", "gloo"] = field(default="auto", metadata={"help": (
        "what carries the collectives between a replica's ranks (tp * pcp > 1): auto (NCCL on CUDA; on CPU shared "
        "memory when the ranks share a node, else gloo, falling back to gloo with a warning if shared memory "
        "cannot be set up) | shm (shared memory, refused where it cannot run) | gloo (torch.distributed: NCCL on "
        "CUDA, gloo over TCP on CPU). Native backend only (vLLM picks its own)"
    )})
    dtype: str = field(default="auto", metadata={"help": (
        "weights and KV cache dtype: auto (the checkpoint's on CUDA, float32 on CPU) | float32 | float16 | bfloat16"
    )})
    block_size: int = field(default=16, metadata={"help": (
        "tokens per KV page on one rank; a logical block is block_size * dcp tokens"
    )})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={"help": (
        "KV cache bytes per rank, e.g. 2GiB on the command line; set, it replaces gpu_memory_utilization's budget "
        "(default: on CUDA what gpu_memory_utilization leaves after the weights, on CPU 128 MiB)"
    )})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": (
        "fraction of each GPU's total memory this engine may use for weights, activations and KV cache together "
        "(vLLM's meaning); the KV cache gets this share of the device less what the loaded weights hold"
    )})
    max_model_len: int | None = field(default=None, metadata={"help": (
        "longest prompt + output in tokens; a longer request is refused at once (default: the model's "
        "max_position_embeddings)"
    )})
    max_num_seqs: int = field(default=256, metadata={"help": "sequences one engine step may batch"})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": (
        "token budget of one step, prefill chunks plus decodes (default: 2048 with chunked prefill, else "
        "max_model_len)"
    )})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": (
        "split long prompts over several steps within the token budget, beside the running decodes"
    )})
    enable_prefix_caching: bool = field(default=True, metadata={"help": (
        "keep the KV of full logical blocks (block_size * dcp tokens) after their requests finish, named by a hash "
        "of the tokens from the start, and start a request from its longest cached prefix; the app routes a "
        "request to the replica that caches most of its prefix"
    )})
    kv_host_tier: str | int | None = field(default=None, metadata={"help": (
        "host-memory KV tier under the prefix cache, per rank: a size (8GiB, 512MiB, bytes) or a share of the "
        "host's available memory split over its ranks (0.25 or 25%); cached blocks the device pool evicts are "
        "copied there (each rank its own shard) and copied back on a hit instead of recomputed; needs "
        "enable_prefix_caching; refused at start when larger than the host's available memory (default: off)"
    )})
    seed: int = field(default=0, metadata={"help": (
        "engine seed: the sampling generator of requests without a seed of their own"
    )})
    admission: Literal["full", "usage"] = field(default="usage", metadata={"help": (
        "full: reserve prompt + max_tokens per request, never preempt; usage: admit by the prompt's KV plus "
        "kv_headroom, preempt (and recompute, losing nothing) when decode runs out"
    )})
    kv_headroom: float = field(default=0.05, metadata={"help": (
        "usage: fraction of a replica's KV (and at least one block per sequence) kept free for running sequences "
        "to grow into; more means fewer preemptions, less means more concurrency"
    )})
    device: Literal["cuda", "cpu"] | None = field(default=None, metadata={"help": (
        "cuda or cpu (default: cuda where available)"
    )})
    enforce_eager: bool = field(default=False, metadata={"help": (
        "run every decode step eagerly: no CUDA graph capture at start (CUDA only)"
    )})
    generation_config: Literal["auto", "vllm"] = field(default="auto", metadata={"help": (
        "auto: the sampling defaults of the model's generation_config.json (temperature, top_p, top_k, penalties, "
        "max_new_tokens) replace the OpenAI defaults for the fields an API request omits, as vLLM's "
        "--generation-config auto; vllm: the neutral OpenAI defaults"
    )})
    trust_remote_code: bool = field(default=False, metadata={"help": (
        "let transformers run the Python code a model directory ships (a tokenizer class of its own, named by "
        "tokenizer_config.json's auto_map; Kimi-K2's); off, such a model is refused naming this argument"
    )})
    step_trace_path: str | None = field(default=None, metadata={"help": (
        "append one JSON line per engine step (its rows and seconds) to this file, to fit the simulator's step "
        "model to the served app's own steps (`python -m bench step_fit --from-steps FILE`; native backend only)"
    )})

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))  # LLM(Path(...)) as well as LLM("...")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model directory path, got {self.model!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be 'native' or 'vllm', got {self.backend!r}")
        for name in ("tensor_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size",
                     "block_size", "max_num_seqs"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("kv_cache_memory_bytes", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1, or_none=True)
        _check_int("seed", self.seed)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        utilization = self.gpu_memory_utilization
        if not _is_number(utilization) or not 0 < utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be a fraction in (0, 1], got {utilization!r}; 0.9 lets the engine use "
                f"90% of each GPU's memory"
            )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be true or false, got {self.enable_chunked_prefill!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.kv_host_tier is not None:
            parse_host_tier(self.kv_host_tier)
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' (the model's sampling defaults) or 'vllm' (the neutral "
                             f"OpenAI defaults), got {self.generation_config!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"trust_remote_code must be true or false, got {self.trust_remote_code!r}")
        if self.admission not in ("full", "usage"):
            raise ValueError(f"admission must be 'full' or 'usage', got {self.admission!r}")
        if not _is_number(self.kv_headroom) or not 0 <= self.kv_headroom < 1:
            raise ValueError(
                f"kv_headroom must be a fraction of the KV cache in [0, 1), got {self.kv_headroom!r}; 0.05 keeps 5% "
                f"free for the running sequences to grow into"
            )
        if self.step_trace_path is not None and (not isinstance(self.step_trace_path, str) or not self.step_trace_path):
            raise ValueError(f"step_trace_path must be a file path or None, got {self.step_trace_path!r}")
        if self.device not in (None, "cuda", "cpu"):
            raise ValueError(f"device must be 'cuda', 'cpu' or None (cuda where available), got {self.device!r}")
        if self.rank_transport not in ("auto", "shm", "gloo"):
            raise ValueError(f"rank_transport must be 'auto', 'shm' or 'gloo', got {self.rank_transport!r}")
        if self.rank_transport == "shm" and self.device == "cuda":
            raise ValueError("rank_transport='shm' carries CPU ranks only; CUDA ranks use NCCL: set rank_transport "
                             "to 'auto'")

    # ---- the native engine's config ----------------------------------------------------------------------------

    def create_engine_config(self) -> EngineConfig:
        """The native engine's EngineConfig: reads the model directory and checks what needs it (TP x DCP layout
        rules, max_model_len against the model, dtype). Errors name the value and the fix."""
        if self.backend != "native":
            raise ValueError(
                f"create_engine_config() builds the native engine's config, but backend={self.backend!r}: the vLLM "
                f"backend builds its own config from these arguments"
            )
        model_path = Path(self.model)
        if not model_path.is_dir():
            raise FileNotFoundError(
                f"model directory {self.model!r} does not exist: pass a local Hugging Face model directory "
                f"(config.json + *.safetensors); `dcpserve tiny-model DIR` writes a small one"
            )
        model_config = ModelConfig.from_pretrained(model_path)
        parallel = ParallelConfig(self.tensor_parallel_size, self.decode_context_parallel_size,
                                  self.prefill_context_parallel_size, self.rank_transport)
        parallel.validate(model_config)
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        limit = model_config.max_position_embeddings
        max_model_len = self.max_model_len if self.max_model_len is not None else limit
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}; "
                f"use at most {limit}" + (f" ({model_config.context_limit_reason})"
                                          if model_config.context_limit_reason else "")
            )
        tokens_per_block = self.block_size * self.decode_context_parallel_size
        if self.enable_prefix_caching and tokens_per_block >= max_model_len:
            raise ValueError(
                f"enable_prefix_caching caches full logical blocks of block_size * dcp = {self.block_size} * "
                f"{self.decode_context_parallel_size} = {tokens_per_block} tokens, but max_model_len={max_model_len} "
                f"leaves no request a full block before its last token: lower block_size, or set "
                f"enable_prefix_caching=false"
            )
        if self.kv_host_tier is not None and not self.enable_prefix_caching:
            raise ValueError(
                f"kv_host_tier={self.kv_host_tier!r} keeps the prefix cache's evicted blocks in host memory, but "
                f"enable_prefix_caching is off: turn enable_prefix_caching on, or leave kv_host_tier unset"
            )
        max_num_batched_tokens = self.step_token_budget() or max_model_len
        tier_bytes, tier_share = parse_host_tier(self.kv_host_tier) if self.kv_host_tier is not None else (None, None)
        return EngineConfig(
            model=str(model_path),
            model_config=model_config,
            parallel=parallel,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_hash_seed=self.prefix_hash_seed(),
                host_tier_bytes=tier_bytes,
                host_tier_share=tier_share,
            ),
            scheduler=SchedulerConfig(
                max_model_len=max_model_len,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                admission=self.admission,
                kv_headroom=self.kv_headroom,
            ),
            dtype=resolve_dtype(self.dtype, model_config, device),
            device=device,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            step_trace_path=self.step_trace_path,
            trust_remote_code=self.trust_remote_code,
        )

    def step_token_budget(self) -> int:
        """The tokens one step takes (max_num_batched_tokens as the engine resolves it), or 0 where that is the
        max_model_len the model's config decides (no chunked prefill and none set)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CHUNKED_STEP_TOKENS if self.enable_chunked_prefill else self.max_model_len or 0

    def prefix_hash_seed(self) -> bytes:
        """The seed of this deployment's prefix block hashes (dcpserve.engine.core.prefix_cache.prefix_hash_seed): the
        model and the dtype as written here, so the ingress and every replica, on any node, compute the same one."""
        return prefix_hash_seed(self.model, self.dtype)

    # ---- keyword arguments and the command line ----------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike[str], **kwargs: Any) -> EngineArgs:
        """EngineArgs(model, **kwargs), with every unknown keyword named in one TypeError beside the valid ones."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(
                f"unknown engine argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"the engine arguments are: {', '.join(names)}"
            )
        return cls(model=model, **kwargs)  # type: ignore[arg-type]  # a PathLike model: __post_init__ stores a str

    @classmethod
    def add_cli_args(cls, parser: _Parser) -> _Parser:
        """Adds one --flag per field (dashes for underscores, plus the short aliases of CLI_ALIASES), with the
        field's type, choices, default and help; the namespace attribute is the field's name."""
        hints = get_type_hints(cls)
        for f in fields(cls):
            base = _without_none(hints[f.name])
            kwargs: dict[str, Any] = {"dest": f.name}
            if f.default is MISSING:
                kwargs["required"] = True
            else:
                kwargs["default"] = f.default
            if base is bool:
                kwargs["action"] = argparse.BooleanOptionalAction  # --flag / --no-flag
            elif get_origin(base) is Literal:
                kwargs["choices"] = get_args(base)
            else:
                kwargs["type"] = cli_type(CLI_PARSERS[f.name]) if f.name in CLI_PARSERS else base
                if f.name in CLI_CHOICES:
                    kwargs["choices"] = CLI_CHOICES[f.name]
            action = parser.add_argument(*cli_flags(f.name), **kwargs)
            action.help = _cli_help(f)  # after construction: some Pythons' BooleanOptionalAction edit the help
        return parser

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace that add_cli_args' flags filled in (other attributes are ignored)."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})


# Command-line spelling beyond `--field-name`: the short flags `dcpserve generate` has always had, and `seed`, whose
# `--seed` there is the per-request sampling seed (SamplingParams.seed), so the engine's seed is --engine-seed.
CLI_NAMES: dict[str, str] = {"seed": "--engine-seed"}
CLI_ALIASES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("--tp",),
    "decode_context_parallel_size": ("--dcp",),
    "prefill_context_parallel_size": ("--pcp",),
    "kv_cache_memory_bytes": ("--kv-cache-memory",),
}
CLI_CHOICES: dict[str, tuple[str, ...]] = {"dtype": ("auto", *sorted(DTYPES))}


def cli_flags(name: str) -> tuple[str, ...]:
    """The option strings of one EngineArgs field: its --flag first, then its aliases."""
    return (CLI_NAMES.get(name, "--" + name.replace("_", "-")), *CLI_ALIASES.get(name, ()))


def cli_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` that reports the parser's own message (argparse would say only "invalid value")."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    convert.__name__ = getattr(parse, "__name__", "value")  # argparse names the type in its "invalid" message
    return convert


# ---- text forms of sizes (the command line's byte and token counts) ---------------------------------------------

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,  # bare letters are binary, like `ls -h`
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_TOKEN_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}  # 128k = 131072, as model cards count context
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Memory size: 80GiB, 80GB (10^9), 141G (binary, = GiB), 512MiB, or a plain number of bytes."""
    value, unit = _parse_number(text, "memory size", "e.g. 80GiB, 80GB, 141G or 85899345920")
    factor = _BYTE_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"memory size {text!r} has unknown unit {unit!r}; use B, KiB/MiB/GiB/TiB (or K/M/G/T, also binary), "
            f"or KB/MB/GB/TB (powers of 10), e.g. 80GiB"
        )
    size = int(value * factor)
    if size <= 0:
        raise ValueError(f"memory size {text!r} must be positive, e.g. 80GiB")
    return size


def parse_host_tier(value: str | int) -> tuple[int | None, float | None]:
    """kv_host_tier as (bytes per rank, None) or (None, share of the host's available memory): an int is bytes,
    "8GiB" / "512MiB" / "4096" bytes, "0.25" or "25%" a share in (0, 1]. Raises ValueError naming the value."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"kv_host_tier must be a size (8GiB, 512MiB, bytes) or a share (0.25, 25%), got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"kv_host_tier must be positive, got {value} bytes; leave it unset to turn the tier off")
        return value, None
    text = value.strip()
    percent = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", text)
    if percent is not None or re.fullmatch(r"0?\.\d+|1\.0*", text):
        share = float(percent.group(1)) / 100 if percent is not None else float(text)
        if not 0 < share <= 1:
            raise ValueError(f"kv_host_tier={value!r} is a share of the host's memory outside (0, 1]; e.g. 0.25")
        return None, share
    try:
        return parse_bytes(text), None
    except ValueError as err:
        raise ValueError(f"kv_host_tier={value!r}: {err}; or a share of host memory such as 0.25 or 25%") from err


def _host_tier_text(text: str) -> str:
    parse_host_tier(text)
    return text


def parse_tokens(text: str) -> int:
    """Token count: 128k (= 131072), 1M (= 1048576), or a plain number such as 131072."""
    value, unit = _parse_number(text, "token count", "e.g. 128k, 1M or 131072")
    factor = _TOKEN_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"token count {text!r} has unknown unit {unit!r}; use k (1024) or M (1048576), e.g. 128k")
    tokens = value * factor
    if tokens != int(tokens) or tokens < 1:
        raise ValueError(f"token count {text!r} must be a positive whole number of tokens, e.g. 128k or 131072")
    return int(tokens)


def _parse_number(text: str, what: str, example: str) -> tuple[float, str]:
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"cannot parse {what} {text!r}: write a number with an optional unit, {example}")
    return float(match.group(1)), match.group(2)


# Fields whose command-line text is not a plain number.
CLI_PARSERS: dict[str, Callable[[str], Any]] = {"kv_cache_memory_bytes": parse_bytes, "kv_host_tier": _host_tier_text}


# ---- helpers ------------------------------------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int | None = None, or_none: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        kind = "an integer or None" if or_none else "an integer"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _without_none(hint: Any) -> Any:
    """X for `X | None`; any other hint as it is."""
    args = get_args(hint)
    if get_origin(hint) in (Union, type(int | None)) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else Union[tuple(rest)]  # noqa: UP007 - its members known at run time only
    return hint


def _cli_help(f: Field[Any]) -> str:
    text = f.metadata["help"].replace("%", "%%")  # argparse %-formats help strings
    if f.default is not MISSING and f.default is not None:
        text += " (default: %(default)s)"
    return text
