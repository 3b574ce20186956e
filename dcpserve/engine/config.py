"""Engine configuration: frozen dataclasses, read once (model directory, user arguments), validated up front.

ModelConfig comes from a Hugging Face model directory's config.json (Llama / Qwen, and DeepSeek-V2 / V3 with the
fields of dcpserve/engine/deepseek_config.py); ParallelConfig holds the TP x DCP layout and its rules (docs/dcp.md);
CacheConfig and SchedulerConfig hold the KV and batching knobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from dcpserve.engine.deepseek_config import MLA_ARCHITECTURES, MlaConfig, MoeConfig, read_deepseek_fields, read_int
from dcpserve.engine.kv_cache import KvCacheSpec
from dcpserve.engine.model_support import check_fields, context_limit, supported_architecture
from dcpserve.engine.quantization import QUANTIZED_ALTERNATIVE, Fp8BlockQuantization, read_quantization_config
from dcpserve.engine.qwen_moe_config import (
    QK_NORM_ARCHITECTURES,
    QKV_BIAS_ARCHITECTURES,
    QWEN_MOE_ARCHITECTURES,
    read_qwen_moe_fields,
)
from dcpserve.engine.rope_config import LinearScaling, RopeScaling, YarnScaling, read_rope

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ARCHITECTURES = LLAMA_ARCHITECTURES + MLA_ARCHITECTURES + QWEN_MOE_ARCHITECTURES
# The architectures whose model code loads FP8 block-quantized checkpoints (dcpserve/engine/quantization.py).
FP8_ARCHITECTURES: tuple[str, ...] = LLAMA_ARCHITECTURES + MLA_ARCHITECTURES
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_config_json(model: str | Path) -> tuple[dict[str, Any], Path]:
    """config.json of a Hugging Face model directory (or the file itself), parsed, and its path; errors name the path
    and the fix."""
    path = Path(model)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise FileNotFoundError(
            f"no config.json at {config_path}: pass a Hugging Face model directory (or its config.json); "
            f"`dcpserve tiny-model DIR` writes a small one"
        )
    try:
        return json.loads(config_path.read_text()), config_path
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from err


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only model: a Llama-family one (Llama, Qwen2, Qwen3) or a
    DeepSeek-V2 / V3 one (mla and moe set). For MLA, num_key_value_heads is 1 (the latent: one KV head every query
    head uses, which tensor parallelism cannot split) and head_dim is that head's width, kv_lora_rank +
    qk_rope_head_dim; intermediate_size is the dense MLP layers'."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | LinearScaling | YarnScaling | None
    max_position_embeddings: int  # the longest context the engine serves the model to (see context_limit_reason)
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    torch_dtype: str  # the checkpoint's dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    mla: MlaConfig | None = None  # DeepSeek-V2 / V3: multi-head latent attention
    moe: MoeConfig | None = None  # DeepSeek-V2 / V3, Qwen3 / Qwen2-MoE (QwenMoeConfig): routed experts (None: dense)
    context_limit_reason: str = ""  # why max_position_embeddings is below the config's ('' when it is not)
    quantization: Fp8BlockQuantization | None = None  # FP8 block-quantized weights (None: the checkpoint's dtype)

    @classmethod
    def from_pretrained(cls, model: str | Path) -> ModelConfig:
        """Reads config.json (and generation_config.json for EOS ids) from a model directory or a config path."""
        raw, config_path = read_config_json(model)
        generation = {}
        generation_path = config_path.parent / "generation_config.json"
        if generation_path.is_file():
            generation = json.loads(generation_path.read_text())
        return cls.from_dict(raw, generation, source=str(config_path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None,
                  source: str = "config") -> ModelConfig:
        architecture = supported_architecture(raw, SUPPORTED_ARCHITECTURES, source)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ValueError(f"{source}: missing required fields {missing}")
        check_fields(raw, architecture, source)
        heads = read_int(raw, "num_attention_heads", source)
        kv_heads = read_int(raw, "num_key_value_heads", source, default=heads)
        hidden = read_int(raw, "hidden_size", source)
        head_dim = read_int(raw, "head_dim", source, default=hidden // heads)
        quantization = read_quantization_config(raw, source)
        if quantization is not None and architecture not in FP8_ARCHITECTURES:
            raise ValueError(
                f"{source}: FP8 block-quantized weights are not supported by the native engine for {architecture} "
                f"(it loads them for {', '.join(FP8_ARCHITECTURES)}); {QUANTIZED_ALTERNATIVE}"
            )
        mla, moe = None, None
        if architecture in MLA_ARCHITECTURES:
            mla, moe = read_deepseek_fields(raw, architecture, source)
            # One latent KV head of kv_lora_rank + rope values per token (the config's num_key_value_heads and
            # head_dim describe transformers' expanded heads, which are never cached).
            kv_heads, head_dim = 1, mla.cache_head_dim
        elif architecture in QWEN_MOE_ARCHITECTURES:
            moe = read_qwen_moe_fields(raw, architecture, source)
        if heads % kv_heads != 0:
            raise ValueError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        max_positions, limit_reason = context_limit(raw, source)
        rope = read_rope(raw, int(raw.get("max_position_embeddings", 2048)), source)
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", "")
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            max_position_embeddings=max_positions,
            context_limit_reason=limit_reason,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", raw.get("qkv_bias", architecture in QKV_BIAS_ARCHITECTURES))),
            qk_norm=architecture in QK_NORM_ARCHITECTURES,
            torch_dtype=dtype if dtype in DTYPES else "float32",
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=raw.get("bos_token_id"),
            mla=mla,
            moe=moe,
            quantization=quantization,
        )

    def kv_cache_spec(self, tp: int) -> KvCacheSpec:
        """The paged KV cache one rank of a tp-way group holds: kv_heads / tp heads (at least one whole head) of K
        and V; for MLA the one latent head, whole on every rank, and no V cache (the values are the latent)."""
        kv_heads_per_rank = max(1, self.num_key_value_heads // tp)
        return KvCacheSpec(self.num_hidden_layers, kv_heads_per_rank, self.head_dim, has_value_cache=self.mla is None)

    def kv_bytes_per_token_per_rank(self, tp: int, dtype: torch.dtype) -> int:
        """KV bytes one token takes on one rank, all layers (before DCP sharding)."""
        return self.kv_cache_spec(tp).bytes_per_token(dtype)


class HeadCounts(Protocol):
    """What ParallelConfig.validate reads of a model (a ModelConfig, or the planner's model specs)."""

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor-parallel, decode-context-parallel and prefill-context-parallel sizes of one replica: pcp groups of tp
    ranks (tp * pcp in all); DCP reuses those ranks (docs/dcp.md)."""

    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    rank_transport: str = "auto"  # the ranks' collectives: dcpserve/engine/worker/rank_transport.py

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.decode_context_parallel_size

    @property
    def pcp(self) -> int:
        return self.prefill_context_parallel_size

    @property
    def world_size(self) -> int:
        """Ranks (devices) of one replica."""
        return self.tp * self.pcp

    def dcp_rank_of(self, rank: int) -> int:
        """The DCP rank of world rank `rank` (TP rank rank % tp of PCP group rank // tp:
        dcpserve/engine/worker/parallel.py)."""
        if self.dcp == 1:
            return 0
        within = self.dcp // self.pcp if self.pcp > 1 else self.dcp
        return (rank // self.tp) * within + (rank % self.tp) % within

    def validate(self, model: HeadCounts) -> None:
        """Layout rules of docs/dcp.md, with errors that name the values and the fix."""
        tp, dcp, pcp = self.tp, self.dcp, self.pcp
        heads, kv = model.num_attention_heads, model.num_key_value_heads
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if not isinstance(dcp, int) or dcp < 1:
            raise ValueError(f"decode_context_parallel_size must be a positive integer, got {dcp!r}")
        if not isinstance(pcp, int) or pcp < 1:
            raise ValueError(f"prefill_context_parallel_size must be a positive integer, got {pcp!r}")
        if heads % tp != 0:
            raise ValueError(f"tp={tp} must divide the model's {heads} attention heads; choose tp among its divisors")
        if tp < kv and kv % tp != 0:
            raise ValueError(f"tp={tp} must divide the model's {kv} KV heads (or be a multiple of it)")
        if tp > kv and tp % kv != 0:
            raise ValueError(f"tp={tp} must be a multiple of the model's {kv} KV heads when it exceeds them")
        if dcp == 1:
            return
        if pcp > 1:
            if dcp % pcp != 0:
                valid = sorted({1, pcp, pcp * max(1, tp // kv)})
                raise ValueError(
                    f"dcp={dcp} with pcp={pcp} must be 1 or a multiple of pcp: a DCP group spans every PCP group "
                    f"(its KV shards are each PCP group's ranks of one KV head). Valid here: dcp in {valid}"
                )
            within = dcp // pcp  # consecutive TP ranks of each PCP group in the DCP group
            if within > 1:
                self._check_dcp_within_tp(within, tp, heads, kv, f"dcp={dcp} with pcp={pcp} puts dcp / pcp = "
                                          f"{within} TP ranks of each PCP group in a DCP group, so ")
            return
        self._check_dcp_within_tp(dcp, tp, heads, kv, "")

    @staticmethod
    def _check_dcp_within_tp(dcp: int, tp: int, heads: int, kv: int, context: str) -> None:
        """The rules for a run of `dcp` consecutive TP ranks sharing one KV head."""
        what = f"{context}dcp={dcp}" if not context else f"{context}{dcp}"
        if tp % dcp != 0:
            raise ValueError(f"{what} must divide tp={tp}: DCP groups are runs of consecutive TP ranks")
        if tp <= kv:
            raise ValueError(
                f"{what} needs tp > kv_heads: model has {kv} KV heads, tp={tp}. With tp <= kv_heads no KV "
                f"head is duplicated, so there is nothing to shard: use dcp=1 or raise tp above {kv}"
            )
        if dcp > tp // kv:
            raise ValueError(
                f"{what} must be <= tp // kv_heads = {tp} // {kv} = {tp // kv}: only ranks holding copies of "
                f"the same KV head can shard it; use dcp <= {tp // kv}"
            )
        if (heads // kv) % dcp != 0:
            raise ValueError(
                f"{what} must divide the {heads // kv} query heads per KV head ({heads} heads / {kv} KV heads)"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: page size on each rank and the per-rank memory budget.

    gpu_memory_utilization has vLLM's meaning: the fraction of each device's TOTAL memory this engine may use for
    weights, activations and KV cache together. Without kv_cache_memory_bytes a CUDA rank's KV cache gets
    total * gpu_memory_utilization less what the process holds once the weights are loaded (`cuda_kv_budget`).
    There is no profiling run: activations, the CUDA context and NCCL buffers are not measured, so they live in
    the (1 - gpu_memory_utilization) share that is left; keep it below 1.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # per rank; None: the gpu_memory_utilization budget on CUDA
    gpu_memory_utilization: float = 0.9  # of the device's total memory, weights + activations + KV
    cpu_default_kv_bytes: int = 128 << 20  # per rank on CPU when no byte budget is set
    enable_prefix_caching: bool = False  # EngineArgs turns it on by default
    prefix_hash_seed: bytes = b""  # dcpserve.engine.core.prefix_cache.prefix_hash_seed of the model and dtype
    # kv_host_tier (EngineArgs): bytes per rank, or a share of the host's available memory over its ranks; None: off.
    host_tier_bytes: int | None = None
    host_tier_share: float | None = None
    host_tier_blocks: int = 0  # host slots per rank, resolved at engine start (dcpserve/engine/core/host_tier.py)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def cuda_kv_budget(self, total_bytes: int, in_use_bytes: int, free_bytes: int) -> int:
        """KV bytes of one CUDA rank without kv_cache_memory_bytes: total_bytes * gpu_memory_utilization less
        in_use_bytes (what this process holds after loading the weights). free_bytes is the device's free memory
        now; a budget above it means other processes hold memory this engine was meant to have."""
        utilization = self.gpu_memory_utilization
        allowed = int(total_bytes * utilization)
        budget = allowed - in_use_bytes
        gib = 1 << 30
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} allows "
                f"{allowed / gib:.2f} GiB of the device's {total_bytes / gib:.2f} GiB, and the loaded weights already "
                f"take {in_use_bytes / gib:.2f} GiB; raise gpu_memory_utilization, spread the weights over more GPUs "
                f"(tensor_parallel_size), or set kv_cache_memory_bytes"
            )
        if budget > free_bytes:
            raise ValueError(
                f"gpu_memory_utilization={utilization} gives the KV cache {budget / gib:.2f} GiB, but only "
                f"{free_bytes / gib:.2f} GiB of the device's {total_bytes / gib:.2f} GiB are free (other processes, "
                f"or this one's CUDA context, hold the rest); lower gpu_memory_utilization or set "
                f"kv_cache_memory_bytes"
            )
        return budget


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and the KV admission policy."""

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # "full": reserve prompt + max_tokens blocks at admission, never preempt.
    # "usage": admit by the prompt's blocks plus kv_headroom; when blocks run out, preempt the newest request
    # (it recomputes prompt + outputs so far, first in line).
    admission: Literal["full", "usage"] = "usage"
    # usage only: admission leaves this fraction of the KV (and at least one block per running sequence) free as
    # growth room for the running sequences. More: fewer preemptions; less: more concurrency.
    kv_headroom: float = 0.05

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill off: a long prompt could never be scheduled. "
                f"Increase max_num_batched_tokens, lower max_model_len, or enable chunked prefill."
            )
        if self.admission not in ("full", "usage"):
            raise ValueError(f"admission must be 'full' or 'usage', got {self.admission!r}")
        if not 0 <= self.kv_headroom < 1:
            raise ValueError(
                f"kv_headroom must be a fraction of the KV cache in [0, 1), got {self.kv_headroom}; 0.05 keeps 5% "
                f"free for the running sequences to grow into"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one replica needs, validated together."""

    model: str
    model_config: ModelConfig
    parallel: ParallelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graph capture of decode (dcpserve/engine/worker/cuda_graphs.py)
    step_trace_path: str | None = None  # one JSON line per step appended here (dcpserve.engine.core.step_trace)
    trust_remote_code: bool = False  # the model directory's own tokenizer code may run (EngineArgs' help)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def resolve_dtype(requested: str, model: ModelConfig, device: str) -> str:
    """'auto' means the checkpoint's dtype on CUDA and float32 on CPU."""
    if requested == "auto":
        return model.torch_dtype if device.startswith("cuda") else "float32"
    if requested not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {requested!r}")
    return requested
