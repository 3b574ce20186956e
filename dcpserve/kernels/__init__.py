"""DCP attention backend: Triton kernels, their exact torch references (name / name_ref, same signature), and fast
CPU versions of the attention kernels (name_cpu, same signature: what the engine runs on CPU).

Set TRITON_INTERPRET=1 before importing this package to run the Triton kernels on CPU (tests only).
"""

from __future__ import annotations

from dcpserve.kernels._triton import HAS_TRITON
from dcpserve.kernels.combine import combine_lse, combine_lse_cpu, combine_lse_cpu_finite, combine_lse_ref
from dcpserve.kernels.cpu_attention import (
    CpuDecodePlan,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    plan_decode_cpu,
)
from dcpserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from dcpserve.kernels.exchange import DcpAttentionExchange, PcpAttentionExchange
from dcpserve.kernels.fp8_gemm import dequantize_fp8_block, fp8_block_gemm, fp8_block_gemm_ref
from dcpserve.kernels.layout import dcp_local_seq_lens, dcp_slot_mapping, dcp_token_owner
from dcpserve.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from dcpserve.kernels.store_kv import StorePlan, store_kv, store_kv_planned, store_kv_ref

__all__ = [
    "CpuDecodePlan",
    "HAS_TRITON",
    "DcpAttentionExchange",
    "PcpAttentionExchange",
    "combine_lse",
    "combine_lse_cpu",
    "combine_lse_cpu_finite",
    "combine_lse_ref",
    "dcp_local_seq_lens",
    "dcp_slot_mapping",
    "dcp_token_owner",
    "dequantize_fp8_block",
    "fp8_block_gemm",
    "fp8_block_gemm_ref",
    "paged_decode_attention",
    "paged_decode_attention_cpu",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_cpu",
    "paged_prefill_attention_ref",
    "plan_decode_cpu",
    "StorePlan",
    "store_kv",
    "store_kv_planned",
    "store_kv_ref",
]
