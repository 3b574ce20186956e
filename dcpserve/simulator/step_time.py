"""Step-time models: how long one engine step of one replica takes, from what the scheduler put into the step.

The simulator runs the real scheduler; only the model forward is replaced by a `StepTimeModel`. Two ship:
`RooflineModel` here, from the model's shape and the GPU's datasheet, and `LinearStepModel`
(dcpserve/simulator/step_fit.py), fitted to measured steps.

Modelling assumptions of `RooflineModel` (each is a place where it can be wrong):
1. The tp ranks of a replica run in lockstep and do the same work, so a step takes one rank's time. Imbalance between
   the DCP ranks (a sequence's last, partly filled block) is not modelled.
2. Roofline: within a step compute and HBM traffic overlap perfectly, so the larger of the two counts:
   max(FLOPs / (dense FLOP/s * mfu), bytes / (HBM bytes/s * mbu)).
3. HBM traffic per rank: the weights once per step (MoE: only the routed experts the step's tokens touch; the input
   embedding is a lookup, not streamed), every row's whole KV once (1/dcp of it on each rank: DCP shards the
   sequence) and the new tokens' KV written (the 1/dcp each rank owns). Activations are not counted.
4. MoE routing: every token picks top-k of E routed experts uniformly and independently of the other tokens, so T
   tokens touch E * (1 - (1 - k/E)^T) distinct experts per layer in expectation. Real routers are skewed: fewer
   distinct experts, but a hot expert's tokens take longer. Shared experts, dense layers and attention are always
   read. Experts are split tp ways (1/tp of every expert per rank), as MlaSpec.parameters_per_rank counts them.
5. Linear FLOPs: 2 per parameter per token over the parameters a token uses (attention projections, dense MLPs,
   shared experts and k of E routed experts); the LM head once per row (the one sampled position).
6. Attention FLOPs per query-key pair (causal: a row of n new tokens after c cached ones has n*c + n*(n+1)/2 pairs):
   GQA 4 * head_dim per query head. MLA: decode rows in the absorbed form (per head 2 * (kv_lora_rank +
   qk_rope_head_dim) for the score, 2 * kv_lora_rank for the value: what FlashMLA-style decode kernels run); prefill
   rows in the non-absorbed form (2 * (qk_nope_head_dim + qk_rope_head_dim) + 2 * v_head_dim per head) plus the
   up-projection of the cached context through kv_b_proj (what vLLM's MLA prefill does). DCP does not change the
   FLOPs per rank: each rank computes dcp times the heads (the group's gathered queries) over 1/dcp of the keys.
7. Tensor-core rates: linear layers at the rate of the weight dtype (float8: FP8; nvfp4: FP4 where the GPU has it,
   else dequantized to bf16 (W4A16) at the BF16 rate; float32: TF32, half the BF16 rate on Hopper and Blackwell;
   "auto", the checkpoint's quantization: its format's rate, FP8 for fp8 checkpoints, BF16 for int4 / mxfp4 ones);
   attention at the BF16 rate whatever the KV dtype (fp8 KV is dequantized in the kernel). Weight bytes per
   parameter: the format's average over the rank's parameters (a mixed format's embedding and router included).
   Models read from config.json alone (GenericSpec): every attention layer attends to the whole context (a sliding
   window's smaller reads and KV pool are not modelled: an upper bound) and linear-attention layers' work is not
   modelled.
8. Communication (alpha-beta over NVLink, link bandwidth per direction * link_efficiency, alpha = one ring step's
   latency) does not overlap with compute: each layer waits for its collectives. TP: a ring all-reduce of the bf16
   hidden states twice per layer (after attention, after the MLP / MoE) and once for the vocab-parallel embedding,
   2*(tp-1)/tp * bytes / bw + 2*(tp-1)*alpha each, and a gather of the rows' bf16 logits. DCP, per layer, for every
   decode row and every new token of a prefill row after cached context (docs/dcp.md: the context part goes through
   the shards like a decode; a first chunk needs no exchange): a ring all-gather of the group's bf16 query heads and
   an all-to-all of the fp32 partial outputs and lse, (dcp-1)*alpha + bytes / bw each. MLA widths follow item 6:
   decode rows the absorbed query (kv_lora_rank + qk_rope_head_dim) and latent output (kv_lora_rank), prefill rows
   the non-absorbed query (qk_nope_head_dim + qk_rope_head_dim) and output (v_head_dim).
9. A fixed per-step overhead (step_overhead_s) for the host's work (schedule, prepare inputs, sample) and what the
   roofline misses (kernel launch gaps and tails of small kernels). Not modelled: CUDA-graph batch padding,
   speculative decoding, expert or pipeline parallelism.
10. A step with no tokens takes 0 s (nothing runs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

from dcpserve.cluster.generic_spec import GenericSpec
from dcpserve.cluster.model_specs import GqaSpec, MlaSpec
from dcpserve.cluster.planner import PLAN_DTYPES, PlanRequest, format_bytes, weight_bytes_per_rank, weight_format
from dcpserve.engine.core.block_manager import num_blocks_for_budget
from dcpserve.simulator.gpus import GpuSpec

# NVFP4 (Blackwell's 4-bit format): E2M1 values with one FP8 (E4M3) scale per 16 values and one fp32 scale per tensor:
# 4 + 8/16 bits = 0.5625 bytes per parameter. Every parameter is counted so; real NVFP4 checkpoints (Kimi K2.6,
# DeepSeek-V3 NVFP4) keep the embedding, LM head, norms and router (often attention too) in bf16, so their weights
# are somewhat larger. The planner's dtypes (dcpserve/cluster/planner.py PLAN_DTYPES) have no 4-bit entry.
NVFP4_BYTES_PER_PARAMETER = 0.5625
# "auto": as the checkpoint ships them (its quantization_config, dcpserve/cluster/weight_formats.py; else bf16).
WEIGHT_DTYPES = ("auto", *PLAN_DTYPES, "nvfp4")
Spec = GqaSpec | MlaSpec | GenericSpec
KV_DTYPES = tuple(PLAN_DTYPES)
ACTIVATION_BYTES = 2  # hidden states, queries and logits move between ranks in bf16, whatever the weight dtype
COMBINE_BYTES = 4  # DCP's partial outputs and lse are exchanged and merged in fp32 (docs/dcp.md)
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class StepWork:
    """One engine step as a step-time model sees it (built from the scheduler's SchedulerOutput)."""

    num_seqs: int  # rows scheduled this step
    num_tokens: int  # tokens computed (prefill-chunk tokens + one per decode row)
    num_decode: int  # rows computing exactly one token
    context_tokens: int  # sum over rows of the KV length the row attends to after the step (start + new tokens)
    attention_pairs: int  # sum over rows of query-key pairs (causal): n new after c computed: n*c + n*(n+1)//2
    decode_context_tokens: int  # the decode rows' share of context_tokens (= their share of attention_pairs)
    prefill_context_queries: int  # new tokens of prefill rows (> 1 token) after cached context (start > 0)

    def __post_init__(self) -> None:
        values = (self.num_seqs, self.num_tokens, self.num_decode, self.context_tokens, self.attention_pairs,
                  self.decode_context_tokens, self.prefill_context_queries)
        prefill_rows, prefill_tokens = self.num_seqs - self.num_decode, self.num_tokens - self.num_decode
        # Each decode row attends to at least its own token, each prefill row computes >= 2 tokens and attends to them.
        checks = (
            (self.num_decode <= self.num_seqs, "num_decode <= num_seqs"),
            (prefill_tokens >= 2 * prefill_rows, "num_tokens - num_decode >= 2 * (num_seqs - num_decode)"),
            (self.num_decode <= self.decode_context_tokens <= self.context_tokens,
             "num_decode <= decode_context_tokens <= context_tokens"),
            (self.context_tokens - self.decode_context_tokens >= prefill_tokens,
             "context_tokens - decode_context_tokens >= num_tokens - num_decode"),
            (self.decode_context_tokens <= self.attention_pairs, "decode_context_tokens <= attention_pairs"),
            (self.prefill_context_queries <= prefill_tokens, "prefill_context_queries <= num_tokens - num_decode"),
        )
        # Checked on every simulated step: the consistent case returns here, without naming fields.
        if all(type(value) is int and value >= 0 for value in values) and all(holds for holds, _ in checks):
            return
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"StepWork.{field.name} must be a non-negative integer, got {value!r}")
        for holds, rule in checks:
            if not holds:
                raise ValueError(f"inconsistent StepWork ({rule} does not hold): {self}; build it with from_rows")

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[int, int]]) -> StepWork:
        """The work of rows of (start_position, num_new_tokens): start_position tokens are already in the KV cache."""
        num_seqs = num_tokens = num_decode = context = pairs = decode_context = prefill_context_queries = 0
        for start, new in rows:
            if start < 0:
                raise ValueError(f"start_position must be >= 0, got {start}")
            if new < 1:
                raise ValueError(f"num_new_tokens must be >= 1 (a scheduled row computes a token), got {new}")
            num_seqs += 1
            num_tokens += new
            context += start + new
            pairs += new * start + new * (new + 1) // 2
            if new == 1:
                num_decode += 1
                decode_context += start + 1
            elif start > 0:
                prefill_context_queries += new
        return cls(num_seqs, num_tokens, num_decode, context, pairs, decode_context, prefill_context_queries)

    @classmethod
    def decodes(cls, rows: int, context_tokens: int) -> StepWork:
        """The work of `rows` decode rows whose context after the step (start + 1) sums to context_tokens."""
        return cls(rows, rows, rows, context_tokens, context_tokens, context_tokens, 0)

    def with_decodes(self, rows: int, context_tokens: int) -> StepWork:
        """This work plus `rows` decode rows whose context after the step (start + 1) sums to context_tokens: what
        from_rows gives with those rows added (a decode's query-key pairs are its context)."""
        return StepWork(self.num_seqs + rows, self.num_tokens + rows, self.num_decode + rows,
                        self.context_tokens + context_tokens, self.attention_pairs + context_tokens,
                        self.decode_context_tokens + context_tokens, self.prefill_context_queries)


class StepTimeModel(Protocol):
    """What the simulator asks of a step-time model."""

    @property
    def name(self) -> str: ...

    def step_seconds(self, work: StepWork) -> float: ...

    def describe(self) -> str:
        """One line for the simulator's table."""
        ...


def expected_experts_touched(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Distinct experts T tokens route to in expectation, each token picking top_k of num_experts uniformly and
    independently of the others: E * (1 - (1 - k/E)^T). T=1 gives k; large T gives E."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def _check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{what} {value!r} is not supported; choose one of {', '.join(choices)}")


def _weight_bytes_per_rank(spec: Spec, tp: int, weight_dtype: str) -> int:
    """The planner's weight bytes per rank; nvfp4, which the planner does not have, at NVFP4_BYTES_PER_PARAMETER."""
    if weight_dtype == "nvfp4":
        return math.ceil(spec.parameters_per_rank(tp) * NVFP4_BYTES_PER_PARAMETER)
    return weight_bytes_per_rank(spec, tp, weight_dtype)


class RooflineModel:
    """Roofline step time of one replica of layout (tp, dcp) on one GPU type (assumptions: the module docstring)."""

    def __init__(self, spec: Spec, gpu: GpuSpec, tp: int, dcp: int = 1, *,
                 weight_dtype: str = "bfloat16", kv_dtype: str = "bfloat16", mfu: float = 0.5, mbu: float = 0.8,
                 link_efficiency: float = 0.8, step_overhead_s: float = 300e-6) -> None:
        # Defaults. mbu 0.8 and mfu 0.5: below the best single kernels (FlashMLA's README: 3000 GB/s of an H800's
        # 3.35 TB/s = 0.9, 580-660 of 989 dense TFLOPS = 0.6-0.67), since a whole step also runs small GEMMs, MoE
        # grouped GEMMs and elementwise kernels. link_efficiency 0.8: nccl-tests all-reduce bus bandwidth on NVLink
        # tops out near 80% of the per-direction link rate. step_overhead_s 300 us: host work per step of a
        # vLLM-class engine with CUDA graphs (schedule, inputs, sampling) is a few hundred us. All four are guesses
        # to calibrate: LinearStepModel.fit on measured steps replaces them.
        _check_choice("weight_dtype", weight_dtype, WEIGHT_DTYPES)
        _check_choice("kv_dtype", kv_dtype, KV_DTYPES)
        for what, fraction in (("mfu", mfu), ("mbu", mbu), ("link_efficiency", link_efficiency)):
            if not 0 < fraction <= 1:
                raise ValueError(f"{what} must be in (0, 1], got {fraction}")
        if step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {step_overhead_s}")
        if isinstance(spec, GqaSpec) and spec.config.mla is not None:
            raise ValueError("an MLA model read as GqaSpec: load it with "
                             "dcpserve.cluster.model_specs.model_spec_from_dict")
        spec.validate_layout(tp, dcp)
        self.spec, self.gpu, self.tp, self.dcp = spec, gpu, tp, dcp
        if weight_dtype == "auto" and spec.quantization is None:
            weight_dtype = "bfloat16"  # an unquantized checkpoint: "auto" is bf16
        self.weight_dtype, self.kv_dtype = weight_dtype, kv_dtype
        # What the weights are counted as, for messages: the dtype, or the checkpoint's quantization format.
        quantization = spec.quantization
        self.weight_format_name = quantization.name if weight_dtype == "auto" and quantization else weight_dtype
        self.mfu, self.mbu, self.link_efficiency, self.step_overhead_s = mfu, mbu, link_efficiency, step_overhead_s
        self.weight_bytes_per_rank = _weight_bytes_per_rank(spec, tp, weight_dtype)
        if self.weight_bytes_per_rank > gpu.memory_bytes:
            raise ValueError(
                f"weights need {self.weight_bytes_per_rank / _GIB:.2f} GiB per rank at tp={tp} "
                f"({self.weight_format_name}) but an {gpu.name} holds {gpu.memory_bytes / _GIB:.2f} GiB; raise tp "
                f"or use a smaller weight dtype"
            )
        self.kv_bytes_per_token_per_rank = spec.kv_bytes_per_token_per_rank(tp, PLAN_DTYPES[kv_dtype])
        self._count_parameters()
        self._count_attention()

    def _count_parameters(self) -> None:
        spec, tp = self.spec, self.tp
        # The parts the roofline treats apart, from the spec's own count: the embedding matrices and the routed
        # experts.
        parts = spec.parameter_parts(tp)
        params = parts.total
        embeddings = parts.embedding + parts.lm_head
        lm_head = parts.lm_head or parts.embedding  # tied: the one matrix is read as the LM head
        input_embedding = embeddings - lm_head  # 0 when tied
        routed, self._num_experts, self._top_k = parts.experts, 0, 0
        if isinstance(spec, MlaSpec):
            self._num_experts, self._top_k = spec.n_routed_experts, spec.num_experts_per_tok
        elif isinstance(spec, GqaSpec) and spec.config.moe is not None:  # Qwen MoE
            self._num_experts, self._top_k = spec.config.moe.n_routed_experts, spec.config.moe.num_experts_per_tok
        elif isinstance(spec, GenericSpec):
            self._num_experts, self._top_k = spec.num_experts, spec.num_experts_per_tok
        self._routed_params = routed
        self._lm_head_params = lm_head
        self._streamed_params = params - input_embedding  # read every step, routed experts in full
        self._params_per_token = params - embeddings - routed + routed * self._top_k // max(1, self._num_experts)
        # Bytes per parameter on average: one dtype's, nvfp4's, or the checkpoint format's mix ("auto").
        self._weight_bytes_per_param = self.weight_bytes_per_rank / params
        gpu = self.gpu
        rate = (weight_format(spec, "auto").tensor_core_dtype if self.weight_dtype == "auto"
                else self.weight_dtype)
        if rate == "float8":
            self._linear_flops_per_s = gpu.fp8_flops_per_s
        elif rate == "nvfp4" and gpu.fp4_flops_per_s is not None:
            self._linear_flops_per_s = gpu.fp4_flops_per_s
        elif rate == "float32":
            self._linear_flops_per_s = gpu.bf16_flops_per_s / 2  # TF32
        else:
            self._linear_flops_per_s = gpu.bf16_flops_per_s

    def _count_attention(self) -> None:
        spec, tp = self.spec, self.tp
        attention_layers = None  # layers with a per-token KV cache, when not every layer has one
        if isinstance(spec, GqaSpec):
            config = spec.config
            layers, heads, self._hidden, self._vocab = (
                config.num_hidden_layers, config.num_attention_heads // tp, config.hidden_size, config.vocab_size)
            self._decode_flops_per_pair = self._prefill_flops_per_pair = 4 * config.head_dim * heads * layers
            self._upprojection_flops_per_token = 0
            decode_widths = prefill_widths = (config.head_dim, config.head_dim)
        elif isinstance(spec, GenericSpec):
            # Every attention layer over the whole context (sliding windows not modelled: an upper bound); linear
            # attention layers' work is not modelled.
            layers, heads, self._hidden, self._vocab = (
                spec.num_hidden_layers, spec.num_attention_heads // tp, spec.hidden_size, spec.vocab_size)
            attention_layers = sum(kind != "linear" for kind in spec.layer_kinds)
            self._decode_flops_per_pair = self._prefill_flops_per_pair = (
                2 * (spec.head_dim + spec.v_head_dim) * heads * attention_layers)
            self._upprojection_flops_per_token = 0
            decode_widths = prefill_widths = (spec.head_dim, spec.v_head_dim)
        else:
            layers, heads, self._hidden, self._vocab = (
                spec.num_hidden_layers, spec.num_attention_heads // tp, spec.hidden_size, spec.vocab_size)
            latent, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
            self._decode_flops_per_pair = heads * layers * (2 * (latent + rope) + 2 * latent)  # absorbed
            self._prefill_flops_per_pair = heads * layers * (
                2 * (spec.qk_nope_head_dim + rope) + 2 * spec.v_head_dim)  # non-absorbed
            # kv_b_proj expands each cached latent into the row's K (nope part) and V for the heads of the rank.
            self._upprojection_flops_per_token = heads * layers * 2 * latent * (spec.qk_nope_head_dim + spec.v_head_dim)
            decode_widths = (latent + rope, latent)  # absorbed: the query and the output live in the latent space
            prefill_widths = (spec.qk_nope_head_dim + rope, spec.v_head_dim)
        self._layers = layers
        self._attention_layers = layers if attention_layers is None else attention_layers
        # DCP, per context query and layer: each rank receives the other dcp-1 ranks' heads of the query (bf16), and
        # sends each of them the output and lse of its heads (fp32).
        self._dcp_bytes_per_decode_query, self._dcp_bytes_per_prefill_query = (
            (self.dcp - 1) * heads * (query * ACTIVATION_BYTES + (output + 1) * COMBINE_BYTES)
            for query, output in (decode_widths, prefill_widths))

    @property
    def name(self) -> str:
        return "roofline"

    def describe(self) -> str:
        return (
            f"roofline {self.spec.architecture} tp={self.tp} dcp={self.dcp} on {self.gpu.name}: weights "
            f"{self.weight_format_name}, KV {self.kv_dtype}, mfu {self.mfu:g}, mbu {self.mbu:g}, link efficiency "
            f"{self.link_efficiency:g}, overhead {self.step_overhead_s * 1e6:.0f} us per step"
        )

    def step_seconds(self, work: StepWork) -> float:
        return self.breakdown(work)["total"]

    def breakdown(self, work: StepWork) -> dict[str, float]:
        """Seconds per component. weights + kv is the memory time; total = max(memory, compute) + tp_comm +
        dcp_comm + overhead (the components do not add up to total: memory and compute overlap)."""
        parts = dict.fromkeys(("weights", "kv", "compute", "tp_comm", "dcp_comm", "overhead", "total"), 0.0)
        if work.num_tokens == 0:
            return parts
        gpu = self.gpu
        hbm = gpu.hbm_bytes_per_s * self.mbu
        untouched = 1.0 - expected_experts_touched(work.num_tokens, self._top_k, self._num_experts) / max(
            1, self._num_experts)
        weight_params = self._streamed_params - self._routed_params * untouched
        parts["weights"] = weight_params * self._weight_bytes_per_param / hbm
        kv_tokens = work.context_tokens + work.num_tokens  # read all attended KV, write the new tokens'
        parts["kv"] = kv_tokens * self.kv_bytes_per_token_per_rank / self.dcp / hbm

        linear = 2 * (work.num_tokens * self._params_per_token + work.num_seqs * self._lm_head_params)
        prefill_pairs = work.attention_pairs - work.decode_context_tokens
        prefill_cached = work.context_tokens - work.decode_context_tokens - (work.num_tokens - work.num_decode)
        attention = (work.decode_context_tokens * self._decode_flops_per_pair
                     + prefill_pairs * self._prefill_flops_per_pair
                     + prefill_cached * self._upprojection_flops_per_token)
        parts["compute"] = (linear / self._linear_flops_per_s + attention / gpu.bf16_flops_per_s) / self.mfu

        bandwidth = gpu.nvlink_bytes_per_s * self.link_efficiency
        alpha = gpu.nvlink_latency_s
        tp = self.tp
        if tp > 1:
            hidden_bytes = work.num_tokens * self._hidden * ACTIVATION_BYTES
            all_reduce = 2 * (tp - 1) / tp * hidden_bytes / bandwidth + 2 * (tp - 1) * alpha
            logits_bytes = work.num_seqs * self._vocab * ACTIVATION_BYTES
            gather = (tp - 1) / tp * logits_bytes / bandwidth + (tp - 1) * alpha
            parts["tp_comm"] = (2 * self._layers + 1) * all_reduce + gather
        dcp = self.dcp
        if dcp > 1 and work.num_decode + work.prefill_context_queries > 0:
            exchanged = (work.num_decode * self._dcp_bytes_per_decode_query
                         + work.prefill_context_queries * self._dcp_bytes_per_prefill_query)
            parts["dcp_comm"] = self._attention_layers * (exchanged / bandwidth + 2 * (dcp - 1) * alpha)
        parts["overhead"] = self.step_overhead_s
        parts["total"] = (max(parts["weights"] + parts["kv"], parts["compute"]) + parts["tp_comm"]
                          + parts["dcp_comm"] + parts["overhead"])
        return parts

    def kv_blocks_per_replica(self, block_size: int = 16, gpu_memory_utilization: float = 0.9,
                              activation_reserve_bytes: int = 0) -> int:
        """The replica's KV pool in logical blocks (block_size * dcp tokens each: one page per rank), sized as the
        planner sizes it: memory * gpu_memory_utilization less the weights per rank, in pages. The engine and the
        planner leave activations to the (1 - gpu_memory_utilization) share; activation_reserve_bytes takes that
        many more bytes per rank from the KV budget (e.g. a measured activation peak)."""
        if activation_reserve_bytes < 0:
            raise ValueError(f"activation_reserve_bytes must be >= 0, got {activation_reserve_bytes}")
        request = PlanRequest(gpus_per_node=self.tp, gpu_memory_bytes=self.gpu.memory_bytes, context_len=1,
                              dtype=self.kv_dtype, block_size=block_size,
                              gpu_memory_utilization=gpu_memory_utilization)
        free = request.budget_bytes_per_rank - self.weight_bytes_per_rank - activation_reserve_bytes
        blocks = num_blocks_for_budget(max(0, free), block_size, self.kv_bytes_per_token_per_rank)
        if blocks < 1:
            raise ValueError(
                f"no KV block fits tp={self.tp} dcp={self.dcp} on {self.gpu.name}: {gpu_memory_utilization:g} of "
                f"{format_bytes(self.gpu.memory_bytes)} is {format_bytes(request.budget_bytes_per_rank)} per rank, "
                f"weights take {format_bytes(self.weight_bytes_per_rank)} ({self.weight_format_name}) and the "
                f"activation reserve {format_bytes(activation_reserve_bytes)}, and one page of {block_size} tokens "
                f"needs {format_bytes(block_size * self.kv_bytes_per_token_per_rank)}; raise tp or "
                f"gpu_memory_utilization, or use a smaller weight dtype"
            )
        return blocks
