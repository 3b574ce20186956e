"""Every launch configuration the engine can choose for its production Triton kernels, for compiling them ahead of
any GPU (tests/kernels/test_compile_targets.py compiles each one for sm_90 and sm_100 with Triton's own compiler).

A configuration is what Triton compiles one binary for: the kernel, its constexprs, the type of every runtime
argument and the arguments the runtime specializes (an integer equal to 1 becomes a constant; pointers and integers
that are multiples of 16 get tt.divisibility=16), num_warps and num_stages. The tiles come from the functions the
launchers call (decode_tiles, prefill_tiles, combine_block_d, store_block_d, fp8_gemm_tiles, num_splits_for), over
the shapes the supported models run at: GQA heads of 64 / 128 channels at every query-heads-per-KV-head group the
layout rules allow (DCP gathers a KV head's query heads, up to 64), MLA's [latent 512, rope 64] cache at 2 to 128
heads, DeepSeek's 128 x 128 FP8 blocks; in bf16 and fp16. The runtime arguments are those of representative launches
(one sequence, a few, a full batch), specialized as Triton's runtime does (`specialize`); configurations that
specialize alike are one.

`OFFSET_AUDIT` is the worst case of the element offsets the kernels compute, for the supported shapes (several pass
2^31): the kernels compute each in 64 bits, and the audit says how.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dcpserve.kernels._attention_common import NUM_STAGES, NUM_WARPS
from dcpserve.kernels.combine import combine_block_d
from dcpserve.kernels.decode_attention import decode_tiles, num_splits_for, split_target
from dcpserve.kernels.fp8_gemm import fp8_gemm_tiles
from dcpserve.kernels.prefill_attention import prefill_tiles
from dcpserve.kernels.store_kv import STORE_BLOCK_T, store_block_d

INT32_MAX = 2**31 - 1
DTYPES = (torch.bfloat16, torch.float16)  # the models' dtypes (fp32 runs only in tests)
BLOCK_SIZE = 16  # CacheConfig's default page (the kernels' block_size constexpr follows --block-size)
TP_SIZES = (1, 2, 4, 8)  # one node's GPUs
GPU_SMS = {"H100": 132, "H200": 132, "B200": 148}  # decode's split count follows the SM count
MAX_NUM_SEQS = 256  # SchedulerConfig's default batch
FP8_BLOCK = (128, 128)  # DeepSeek-V3 / Kimi-K2 weight_block_size
# DeepSeek-V3's FP8 linear shapes (out, in), at tp=1: fused q_a + kv_a, q_b, o_proj, a dense MLP's gate_up and down.
FP8_SHAPES = ((2112, 7168), (24576, 1536), (7168, 16384), (36864, 7168), (7168, 18432))
FP8_ROWS = (1, 7, 16, 32, 100, 2048)  # activation rows: each of the launcher's block_m choices, M = 1 specialized


@dataclass(frozen=True)
class GqaModel:
    """A supported GQA attention shape: query heads, KV heads, head width."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class MlaModel:
    """A supported MLA attention shape: query heads over one latent KV head of kv_lora_rank + rope_dim channels."""

    name: str
    q_heads: int
    kv_lora_rank: int = 512
    rope_dim: int = 64


GQA_MODELS = (
    GqaModel("llama-3.1-8b", 32, 8, 128), GqaModel("llama-3.1-70b", 64, 8, 128), GqaModel("llama-3.2-1b", 32, 8, 64),
    GqaModel("llama-3.2-3b", 24, 8, 128), GqaModel("qwen3-8b", 32, 8, 128), GqaModel("qwen3-32b", 64, 8, 128),
    GqaModel("qwen3-30b-a3b", 32, 4, 128), GqaModel("qwen3-235b-a22b", 64, 4, 128),
    # The widest group a Llama-architecture config may have within decode's head packing (BLOCK_G <= 64): MQA.
    GqaModel("mqa-64", 64, 1, 128),
)
MLA_MODELS = (MlaModel("deepseek-v3", 128), MlaModel("kimi-k2", 64), MlaModel("deepseek-v2-lite", 16))


def gqa_groups(model: GqaModel) -> set[tuple[int, int]]:
    """(query heads per KV head as one rank's kernels see them, KV heads per rank) over tp and dcp: each rank holds
    q_heads / tp query heads of max(1, kv_heads / tp) KV heads, and DCP (dcp <= tp / kv_heads, ParallelConfig's
    rule) gathers dcp ranks' query heads of one KV head."""
    shapes = set()
    for tp in TP_SIZES:
        if model.q_heads % tp or (tp < model.kv_heads and model.kv_heads % tp):
            continue
        kv = max(1, model.kv_heads // tp)
        group = model.q_heads // tp // kv
        for dcp in range(1, max(1, tp // model.kv_heads) + 1):
            if tp % dcp == 0 and (model.q_heads // model.kv_heads) % dcp == 0:
                shapes.add((group * dcp, kv))
    return shapes


def mla_groups(model: MlaModel) -> set[int]:
    """Query heads on the one latent KV head: q_heads / tp, times dcp (any divisor of tp) once gathered."""
    return {model.q_heads // tp * dcp for tp in TP_SIZES for dcp in TP_SIZES if tp % dcp == 0}


@dataclass(frozen=True)
class Pointer:
    """A tensor argument: Triton sees its element type (torch allocations are 16-byte aligned: divisibility 16)."""

    dtype: torch.dtype


TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
ArgValue = Pointer | int | float


def specialize(value: ArgValue) -> tuple[str, Any, bool]:
    """(Triton type, constant, divisible by 16) of a runtime argument as Triton's launcher specializes it: an int
    equal to 1 is the constant 1, ints are i32 when they fit, else i64; multiples of 16 and pointers are divisible."""
    if isinstance(value, Pointer):
        return "*" + TRITON_TYPES[value.dtype], None, True
    if isinstance(value, bool) or not isinstance(value, int):
        return "fp32", None, False
    if value == 1:
        return "constexpr", 1, False
    kind = "i32" if -(2**31) <= value < 2**31 else "i64"
    return kind, None, value % 16 == 0


@dataclass(frozen=True)
class LaunchConfig:
    """One binary Triton compiles: the kernel (module, name), its runtime arguments' values by name (in the
    kernel's order), its constexprs, num_warps / num_stages; `case` says where the engine launches it."""

    kernel: str
    module: str
    function: str
    case: str
    dtype: str
    args: tuple[tuple[str, ArgValue], ...]
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int

    @property
    def key(self) -> tuple[Any, ...]:
        """What the compiled binary depends on: configurations with equal keys are one."""
        return (self.module, self.function, tuple((n, specialize(v)) for n, v in self.args), self.constexprs,
                self.num_warps, self.num_stages)

    @property
    def name(self) -> str:
        """kernel-case-dtype: the test id (without the target)."""
        return f"{self.kernel}-{self.case}-{self.dtype}"

    def jit_function(self) -> Any:
        """The kernel's triton.jit function (a JITFunction unless the interpreter was on at import)."""
        return getattr(importlib.import_module(self.module), self.function)

    def signature(self) -> tuple[dict[str, str], dict[str, Any], list[str]]:
        """(signature, constexprs, the arguments with tt.divisibility=16) for triton.compile's ASTSource."""
        signature: dict[str, str] = {}
        constants = dict(self.constexprs)
        divisible = []
        for name, value in self.args:
            kind, constant, aligned = specialize(value)
            signature[name] = kind
            if kind == "constexpr":
                constants[name] = constant
            if aligned:
                divisible.append(name)
        for name, _ in self.constexprs:
            signature[name] = "constexpr"
        return signature, constants, divisible


def _strides(*shape: int) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _short(dtype: torch.dtype) -> str:
    return TRITON_TYPES[dtype]


def _decode_batches(kv_heads: int) -> list[tuple[int, int]]:
    """(num_seqs, num_splits) of representative batches (one sequence, a few, a full batch) on each GPU."""
    return sorted({(seqs, num_splits_for(seqs * kv_heads, split_target(sms)))
                   for seqs in (1, 3, MAX_NUM_SEQS) for sms in GPU_SMS.values()})


def _decode(case: str, dtype: torch.dtype, group: int, kv: int, head_dim: int, v_dim: int,
            shared: bool) -> Iterator[LaunchConfig]:
    tiles = decode_tiles(group, head_dim, v_dim, cuda_tiles=True)
    heads = group * kv
    cache = _strides(2, BLOCK_SIZE, kv, head_dim)
    for seqs, splits in _decode_batches(kv):
        q, po, pl = _strides(seqs, heads, head_dim), _strides(splits, seqs, heads, v_dim), _strides(splits, seqs, heads)
        args: dict[str, ArgValue] = {
            "q_ptr": Pointer(dtype), "k_cache_ptr": Pointer(dtype), "v_cache_ptr": Pointer(dtype),
            "block_table_ptr": Pointer(torch.int32), "seq_lens_ptr": Pointer(torch.int32),
            "part_out_ptr": Pointer(torch.float32), "part_lse_ptr": Pointer(torch.float32), "scale": 0.1,
            "head_dim": head_dim, "v_head_dim": v_dim, "num_splits": splits, "stride_q_s": q[0], "stride_q_h": q[1],
            "stride_kc_b": cache[0], "stride_kc_s": cache[1], "stride_kc_h": cache[2], "stride_vc_b": cache[0],
            "stride_vc_s": cache[1], "stride_vc_h": cache[2], "stride_bt_s": 2048, "stride_po_p": po[0],
            "stride_po_s": po[1], "stride_po_h": po[2], "stride_pl_p": pl[0], "stride_pl_s": pl[1],
            "stride_pl_h": pl[2],
        }
        yield LaunchConfig(
            "decode", "dcpserve.kernels.decode_attention", "_paged_decode_kernel", f"{case}-s{seqs}x{splits}",
            _short(dtype),
            tuple(args.items()),
            (("GROUP", group), ("HEAD_BLOCKS", tiles.head_blocks), ("BLOCK_G", tiles.block_g),
             ("BLOCK_N", tiles.block_n), ("BLOCK_DV", tiles.channels.block_dv), ("BLOCK_DR", tiles.channels.block_dr),
             ("HAS_REST", tiles.channels.has_rest), ("SHARED_KV", shared), ("block_size", BLOCK_SIZE),
             ("DOT_PRECISION", None)),
            tiles.num_warps, tiles.num_stages,
        )


def _prefill(case: str, dtype: torch.dtype, group: int, kv: int, head_dim: int, v_dim: int,
             shared: bool) -> Iterator[LaunchConfig]:
    tiles = prefill_tiles(head_dim, v_dim, cuda_tiles=True)
    heads = group * kv
    cache = _strides(2, BLOCK_SIZE, kv, head_dim)
    q, new, out, lse = (_strides(64, heads, head_dim), _strides(64, kv, head_dim), _strides(64, heads, v_dim),
                        _strides(64, heads))
    for has_new in (True, False):  # the chunk's own tokens (local, or merged after DCP) / DCP's context part
        args: dict[str, ArgValue] = {
            "q_ptr": Pointer(dtype), "key_ptr": Pointer(dtype), "value_ptr": Pointer(dtype),
            "k_cache_ptr": Pointer(dtype), "v_cache_ptr": Pointer(dtype), "block_table_ptr": Pointer(torch.int32),
            "query_start_loc_ptr": Pointer(torch.int32), "context_lens_ptr": Pointer(torch.int32),
            "out_ptr": Pointer(dtype), "lse_ptr": Pointer(torch.float32), "scale": 0.1, "head_dim": head_dim,
            "v_head_dim": v_dim, "stride_q_t": q[0], "stride_q_h": q[1],
            "stride_key_t": (new if has_new else q)[0], "stride_key_h": (new if has_new else q)[1],
            "stride_value_t": (new if has_new else q)[0], "stride_value_h": (new if has_new else q)[1],
            "stride_kc_b": cache[0], "stride_kc_s": cache[1], "stride_kc_h": cache[2], "stride_vc_b": cache[0],
            "stride_vc_s": cache[1], "stride_vc_h": cache[2], "stride_bt_s": 2048, "stride_out_t": out[0],
            "stride_out_h": out[1], "stride_lse_t": lse[0], "stride_lse_h": lse[1],
        }
        yield LaunchConfig(
            "prefill", "dcpserve.kernels.prefill_attention", "_paged_prefill_kernel",
            f"{case}-{'new' if has_new else 'context'}", _short(dtype), tuple(args.items()),
            (("GROUP", group), ("HAS_NEW", has_new), ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n),
             ("BLOCK_DV", tiles.channels.block_dv), ("BLOCK_DR", tiles.channels.block_dr),
             ("HAS_REST", tiles.channels.has_rest), ("SHARED_KV", shared), ("block_size", BLOCK_SIZE),
             ("DOT_PRECISION", None)),
            tiles.num_warps, tiles.num_stages,
        )


def _combine(case: str, parts: int, seqs: int, heads: int, dim: int, outs_dtype: torch.dtype,
             out_dtype: torch.dtype, packed: bool) -> LaunchConfig:
    """packed: the exchange's received [parts, seqs, heads, dim + 1] buffer, outs and lses its views."""
    outs = _strides(parts, seqs, heads, dim + 1) if packed else _strides(parts, seqs, heads, dim)
    lses = outs[:3] if packed else _strides(parts, seqs, heads)
    out, lse = _strides(seqs, heads, dim), _strides(seqs, heads)
    args: dict[str, ArgValue] = {
        "outs_ptr": Pointer(outs_dtype), "lses_ptr": Pointer(torch.float32), "out_ptr": Pointer(out_dtype),
        "lse_ptr": Pointer(torch.float32), "num_parts": parts, "num_heads": heads, "head_dim": dim,
        "stride_outs_n": outs[0], "stride_outs_s": outs[1], "stride_outs_h": outs[2], "stride_lses_n": lses[0],
        "stride_lses_s": lses[1], "stride_lses_h": lses[2], "stride_out_s": out[0], "stride_out_h": out[1],
        "stride_lse_s": lse[0], "stride_lse_h": lse[1],
    }
    return LaunchConfig("combine", "dcpserve.kernels.combine", "_combine_lse_kernel", case, _short(out_dtype),
                        tuple(args.items()), (("BLOCK_D", combine_block_d(dim)),), NUM_WARPS, NUM_STAGES)


def _combines(dtype: torch.dtype) -> Iterator[LaunchConfig]:
    heads_by_dim = {64: 4, 128: 8, 512: 128}  # decode's and the exchange's heads at each value width
    for dim, heads in heads_by_dim.items():
        for seqs, splits in _decode_batches(1):  # decode's splits, fp32 partials into the model's dtype
            yield _combine(f"d{dim}-s{seqs}x{splits}", splits, seqs, heads, dim, torch.float32, dtype, packed=False)
        # Prefill's own tokens merged into the context part, in the model's dtype.
        yield _combine(f"d{dim}-own", 2, 64, heads, dim, dtype, dtype, packed=False)
        if dtype == DTYPES[0]:  # the DCP exchange merges fp32 partials of dcp ranks into fp32, whatever the model
            for dcp in (2, 8):
                yield _combine(f"d{dim}-dcp{dcp}", dcp, 64, heads, dim, torch.float32, torch.float32, packed=True)


def _stores(dtype: torch.dtype) -> Iterator[LaunchConfig]:
    shapes = {"gqa-d64": (8, 64, True), "gqa-d128": (8, 128, True), "mla": (1, 576, False)}
    for case, (kv, dim, has_value) in shapes.items():
        cache, rows = _strides(2, BLOCK_SIZE, kv, dim), _strides(2, kv, dim)
        for tokens in (1, 7, 2048):  # one decode, a few, a prefill chunk: the token count's specializations
            args: dict[str, ArgValue] = {
                "key_ptr": Pointer(dtype), "value_ptr": Pointer(dtype), "k_cache_ptr": Pointer(dtype),
                "v_cache_ptr": Pointer(dtype), "slot_ptr": Pointer(torch.int64), "num_tokens": tokens,
                "head_dim": dim, "stride_key_t": rows[0], "stride_key_h": rows[1], "stride_value_t": rows[0],
                "stride_value_h": rows[1], "stride_kc_b": cache[0], "stride_kc_s": cache[1], "stride_kc_h": cache[2],
                "stride_vc_b": cache[0], "stride_vc_s": cache[1], "stride_vc_h": cache[2],
            }
            yield LaunchConfig(
                "store_kv", "dcpserve.kernels.store_kv", "_store_kv_kernel", f"{case}-t{tokens}", _short(dtype),
                tuple(args.items()),
                (("block_size", BLOCK_SIZE), ("BLOCK_T", STORE_BLOCK_T), ("BLOCK_D", store_block_d(dim)),
                 ("HAS_VALUE", has_value)), NUM_WARPS, NUM_STAGES,
            )


def _fp8_gemms(dtype: torch.dtype) -> Iterator[LaunchConfig]:
    for n, k in FP8_SHAPES:
        for m in FP8_ROWS:
            tiles = fp8_gemm_tiles(m, FP8_BLOCK[1])
            scales = _strides(-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
            args: dict[str, ArgValue] = {
                "x_ptr": Pointer(dtype), "w_ptr": Pointer(torch.float8_e4m3fn), "scale_ptr": Pointer(torch.float32),
                "bias_ptr": Pointer(dtype), "out_ptr": Pointer(dtype), "M": m, "N": n, "K": k, "stride_xm": k,
                "stride_xk": 1, "stride_wn": k, "stride_wk": 1, "stride_sn": scales[0], "stride_sk": scales[1],
                "stride_om": n, "stride_on": 1,
            }
            yield LaunchConfig(
                "fp8_gemm", "dcpserve.kernels.fp8_gemm", "_fp8_block_gemm_kernel", f"n{n}-k{k}-m{m}",
                _short(dtype), tuple(args.items()),
                (("QUANT_BLOCK_N", FP8_BLOCK[0]), ("QUANT_BLOCK_K", FP8_BLOCK[1]), ("HAS_BIAS", False),
                 ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n), ("BLOCK_K", tiles.block_k),
                 ("DOT_PRECISION", None)),
                tiles.num_warps, tiles.num_stages,
            )


def _all() -> Iterator[LaunchConfig]:
    gqa = sorted({(model.head_dim, group, kv) for model in GQA_MODELS for group, kv in gqa_groups(model)})
    mla = sorted({(model.kv_lora_rank, model.rope_dim, group) for model in MLA_MODELS for group in mla_groups(model)})
    for dtype in DTYPES:
        for head_dim, group, kv in gqa:
            yield from _decode(f"gqa-d{head_dim}-g{group}-kv{kv}", dtype, group, kv, head_dim, head_dim, False)
            yield from _prefill(f"gqa-d{head_dim}-g{group}-kv{kv}", dtype, group, kv, head_dim, head_dim, False)
        for latent, rope, group in mla:
            yield from _decode(f"mla-g{group}", dtype, group, 1, latent + rope, latent, True)
            yield from _prefill(f"mla-g{group}", dtype, group, 1, latent + rope, latent, True)
        yield from _combines(dtype)
        yield from _stores(dtype)
        yield from _fp8_gemms(dtype)


def launch_configs() -> list[LaunchConfig]:
    """Every distinct configuration, in a fixed order; the first case of equal keys names it."""
    seen: dict[tuple[Any, ...], LaunchConfig] = {}
    for config in _all():
        seen.setdefault(config.key, config)
    return list(seen.values())


# The offset audit's limits: the longest chunk one step may carry (a whole 128k-token prompt: with chunked prefill
# off, max_num_batched_tokens must reach max_model_len), a decode batch, and one layer's cache on the largest GPU
# (B200: 192 GB, all of it KV, the fewest layers of a supported model: 32).
MAX_CHUNK_TOKENS = 131072
MAX_DECODE_SEQS = 1024
MAX_LAYER_CACHE_ELEMENTS = 192 * 10**9 // 32 // 2  # 2-byte elements


@dataclass(frozen=True)
class OffsetBound:
    """The largest element offset one term of a kernel's address arithmetic reaches at the supported shapes, and
    how the kernel computes it in 64 bits (every term: those below 2^31 too, at the cost of a wide multiply)."""

    kernel: str
    term: str
    elements: int
    int64_by: str


def _offset_audit() -> tuple[OffsetBound, ...]:
    heads, latent, cache_width = MLA_MODELS[0].q_heads, MLA_MODELS[0].kv_lora_rank, 576
    splits = max((num_splits_for(seqs, split_target(max(GPU_SMS.values()))) - 1) * seqs
                 for seqs in range(1, MAX_DECODE_SEQS + 1))
    gemm_n = max(n for n, _ in FP8_SHAPES)
    gemm_k = max(k for _, k in FP8_SHAPES)
    return (
        OffsetBound("combine", "part n x stride_outs_n (prefill's own tokens: 2 parts of [chunk, 128 heads, 512])",
                    MAX_CHUNK_TOKENS * heads * latent, "64-bit pointers advanced part by part"),
        OffsetBound("combine", "part n x stride_outs_n (the exchange: dcp 8 parts of [chunk, 16 heads, 513])",
                    7 * MAX_CHUNK_TOKENS * heads // 8 * (latent + 1), "64-bit pointers advanced part by part"),
        OffsetBound("combine", "seq x stride_out_s ([chunk, 128 heads, 512])", MAX_CHUNK_TOKENS * heads * latent,
                    "seq cast to int64"),
        OffsetBound("decode", "seq x stride_q_s ([seqs, 128 gathered heads, 576])",
                    MAX_DECODE_SEQS * heads * cache_width, "seq cast to int64"),
        OffsetBound("decode", "split x stride_po_p (fp32 partials)", splits * heads * latent, "split cast to int64"),
        OffsetBound("decode / prefill", "page x stride_kc_b (one layer's cache)", MAX_LAYER_CACHE_ELEMENTS,
                    "page loaded as int64 (load_paged_tile)"),
        OffsetBound("prefill", "token x stride_q_t ([chunk, 128 heads, 576])", MAX_CHUNK_TOKENS * heads * cache_width,
                    "token cast to int64"),
        OffsetBound("store_kv", "slot page x stride_kc_b", MAX_LAYER_CACHE_ELEMENTS, "slot loaded as int64"),
        OffsetBound("fp8_gemm", "row x stride_om ([chunk, N])", MAX_CHUNK_TOKENS * gemm_n, "rows cast to int64"),
        OffsetBound("fp8_gemm", "row x stride_xm ([chunk, K])", MAX_CHUNK_TOKENS * gemm_k, "rows cast to int64"),
        OffsetBound("fp8_gemm", "column x stride_wn (weight [N, K])", gemm_n * gemm_k, "columns cast to int64"),
    )


OFFSET_AUDIT = _offset_audit()
