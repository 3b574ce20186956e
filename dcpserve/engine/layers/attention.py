"""Paged attention of one layer on one rank, exact when the KV cache is sharded over a DCP group (docs/dcp.md).

Rows of a step: decode tokens first (one per decoding sequence), then the prefill chunks.

dcp = 1: store K/V, then decode rows attend over their cached sequence (new token included) and prefill rows
attend over their cached context plus the chunk itself (causal), each with one kernel call.

dcp > 1 (every rank of the group sees the same rows; each holds one shard of the group's KV head):
  1. store this step's K/V at slot_mapping (only the owner of a token stores it);
  2. gather the group's query heads;
  3. decode rows over the local shard, prefill rows over their local cached context (no new tokens);
  4. one exchange.combine merges (out, lse) of all rows exactly over the group -> this rank's own heads;
  5. prefill rows over the chunk's own tokens, locally (every rank has all new K/V), merged with step 4's
     partial by combine_lse.
Every collective runs on every rank of the group whatever the mix of rows, with the same shapes.

pcp > 1 (dcpserve/engine/worker/pcp.py: this rank's rows are every decode and its segments of each prefill chunk):
  1. the PCP peers' prefill K/V gathered; this rank stores the slots it owns of the whole step;
  2. dcp = 1: every rank holds whole sequences, so one local call per kind of row, each segment's context being
     every token before it (cached context and the chunk's earlier parts, stored in 1);
  3. dcp > 1: the DCP group's queries of every PCP rank's rows (PcpAttentionExchange) over the local shard of each
     row's context, merged exactly back to each rank's own rows and heads, then each segment's own tokens
     (causal), locally, merged by combine_lse.

MLA (v_head_dim set): one key-only cache of [latent | rope key] per token; the queries come absorbed into the
latent space ([q_nope W_UK | q_rope]), the values are the latent (the keys' first v_head_dim channels) and the
output is [T, heads, v_head_dim] for the caller's up-projection. The latent is the one KV head, so the DCP path
is the one above, unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import Literal, get_args

import torch

from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.worker.attention_metadata import AttentionMetadata
from dcpserve.engine.worker.parallel import ParallelState
from dcpserve.engine.worker.pcp import gather_prefill_rows
from dcpserve.kernels import (
    DcpAttentionExchange,
    PcpAttentionExchange,
    StorePlan,
    combine_lse,
    combine_lse_cpu_finite,
    combine_lse_ref,
    paged_decode_attention,
    paged_decode_attention_cpu,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_cpu,
    paged_prefill_attention_ref,
    plan_decode_cpu,
    store_kv,
    store_kv_planned,
    store_kv_ref,
)

# Which attention kernels a layer runs: "triton" (CUDA, or Triton's CPU interpreter in tests), "cpu" (torch's fused
# CPU attention, batched: the engine's choice off CUDA), "ref" (the exact torch references, for tests).
KernelBackend = Literal["triton", "cpu", "ref"]
KERNEL_BACKENDS: tuple[KernelBackend, ...] = get_args(KernelBackend)


class Attention(EngineModule):
    """Stores this step's K/V and runs paged decode / prefill attention, merging DCP shards exactly."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        parallel: ParallelState,
        device: torch.device,
        *,
        v_head_dim: int | None = None,
        scale: float | None = None,
    ) -> None:
        """num_heads / num_kv_heads are this rank's (query heads per rank, KV heads held by this rank).
        v_head_dim: a key-only cache whose first v_head_dim channels are the values (MLA); scale: the softmax scale
        (default head_dim ** -0.5)."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} per rank must be a multiple of num_kv_heads={num_kv_heads}")
        if parallel.dcp_heads > 1 and num_kv_heads != 1:
            raise ValueError(
                f"dcp={parallel.dcp_size} needs exactly one KV head per rank (tp > kv_heads), got "
                f"{num_kv_heads}: use dcp=1 or raise tp above the model's KV heads"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim  # None: separate K and V caches of head_dim
        self.value_dim = head_dim if v_head_dim is None else v_head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.dcp_size = parallel.dcp_size
        self.parallel = parallel
        self.exchange: DcpAttentionExchange | None = None
        self.pcp_exchange: PcpAttentionExchange | None = None
        # Triton on CUDA; the fused CPU kernels elsewhere (Triton's interpreter and the references are for tests).
        self.select_kernels("triton" if torch.device(device).type == "cuda" else "cpu")

    def select_kernels(self, kernels: KernelBackend) -> None:
        """Runs the Triton kernels, the fused CPU ones or the exact references (tests select Triton on CPU under
        TRITON_INTERPRET=1, or the references). Off Triton, K/V stores and LSE merges are the (batched) references."""
        if kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_BACKENDS)}, got {kernels!r}")
        self.kernels: KernelBackend = kernels
        use_triton = kernels == "triton"
        self.store = store_kv if use_triton else store_kv_ref
        self.decode = {"triton": paged_decode_attention, "cpu": paged_decode_attention_cpu,
                       "ref": paged_decode_attention_ref}[kernels]
        # On CUDA the step's metadata is built consistent: no value checks reading the device back in every layer.
        triton_prefill = functools.partial(paged_prefill_attention, validate=False)
        prefills: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
            "triton": triton_prefill, "cpu": paged_prefill_attention_cpu, "ref": paged_prefill_attention_ref}
        self.prefill = prefills[kernels]
        combines: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
            # the CPU kernels' partials are clean (an empty shard is 0 / -inf), so their merge skips the guards
            "triton": combine_lse, "cpu": combine_lse_cpu_finite, "ref": combine_lse_ref}
        self.combine = combines[kernels]
        parallel = self.parallel
        if parallel.pcp_size > 1 and parallel.dcp_size > 1:
            assert parallel.dcp_comm is not None  # set whenever dcp_size > 1
            self.pcp_exchange = PcpAttentionExchange(parallel.dcp_comm, parallel.dcp_heads, parallel.pcp_size,
                                                     parallel.pcp_rank, use_triton=use_triton, combine=self.combine)
        elif parallel.dcp_size > 1:
            assert parallel.dcp_comm is not None  # set whenever dcp_size > 1
            self.exchange = DcpAttentionExchange(parallel.dcp_comm, use_triton=use_triton, combine=self.combine)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, heads, D], k / v [T, kv_heads, D]; caches [num_blocks, block_size, kv_heads, D] -> [T, heads, D].
        With v_head_dim (MLA) v and v_cache are not read (pass None): the values are the keys' first v_head_dim
        channels, and the output is [T, heads, v_head_dim]."""
        if self.v_head_dim is not None:
            v, v_cache = None, None
        num_tokens = q.shape[0]
        if k.shape[0] != num_tokens or metadata.slot_mapping.shape != (num_tokens,):
            raise ValueError(
                f"q has {num_tokens} rows, k {k.shape[0]}, slot_mapping {tuple(metadata.slot_mapping.shape)}: "
                f"the metadata was built for another batch"
            )
        num_decodes = metadata.num_decode_tokens
        if not 0 <= num_decodes <= num_tokens:
            raise ValueError(f"num_decode_tokens={num_decodes} must be in [0, num_tokens={num_tokens}]")
        if self.parallel.pcp_size > 1:
            return self._forward_pcp(q, k, v, k_cache, v_cache, metadata)
        self._store(k, v, k_cache, v_cache, metadata, "step", metadata.slot_mapping, metadata.all_slots_owned)
        if self.exchange is None:
            return self._forward_local(q, k, v, k_cache, v_cache, metadata)
        return self._forward_dcp(q, k, v, k_cache, v_cache, metadata)

    def _store(self, k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
               metadata: AttentionMetadata, which: str, slot_mapping: torch.Tensor, all_owned: bool) -> None:
        """The step's new K/V into this rank's cache at slot_mapping (`which` of the step's mappings: its own, or
        with PCP the gathered rows'). The CPU kernels find the rows this rank owns once per step (a StorePlan, like
        the decode plan) and every layer reuses it; at DCP that search was most of a layer's store."""
        if self.kernels != "cpu":
            self.store(k, v, k_cache, v_cache, slot_mapping, all_owned=all_owned)
            return
        key = ("cpu_store", which)
        plan = metadata.kernel_plans.get(key)
        if plan is None:
            plan = metadata.kernel_plans[key] = StorePlan(slot_mapping, all_owned)
        store_kv_planned(k, v, k_cache, v_cache, slot_mapping, plan)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, metadata: AttentionMetadata,
                out: torch.Tensor, lse_out: torch.Tensor | None = None) -> None:
        """The decode rows over the local cache. The CPU kernels check and plan the step's pages and masks once
        (plan_decode_cpu) and every layer reuses that plan."""
        table, lens = metadata.decode_block_table, metadata.decode_local_seq_lens
        if self.kernels != "cpu":
            self.decode(q, k_cache, v_cache, table, lens, self.scale, out=out, lse_out=lse_out,
                        v_head_dim=self.v_head_dim)
            return
        key = ("cpu_decode", q.dtype)
        if key not in metadata.kernel_plans:
            metadata.kernel_plans[key] = plan_decode_cpu(table, lens, k_cache.shape[0], k_cache.shape[1], q.dtype,
                                                             validate=False, finite_tail=metadata.finite_tail)
        paged_decode_attention_cpu(q, k_cache, v_cache, table, lens, self.scale, out=out, lse_out=lse_out,
                                   plan=metadata.kernel_plans[key], v_head_dim=self.v_head_dim)

    def _forward_local(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """No DCP: this rank's cache holds whole sequences."""
        num_decodes = metadata.num_decode_tokens
        out = q.new_empty((q.shape[0], q.shape[1], self.value_dim))
        if num_decodes:
            self._decode(q[:num_decodes], k_cache, v_cache, metadata, out=out[:num_decodes])
        if num_decodes < q.shape[0]:
            self.prefill(
                q[num_decodes:], k[num_decodes:], v[num_decodes:] if v is not None else None, k_cache, v_cache,
                metadata.prefill_block_table, metadata.prefill_query_start_loc,
                metadata.prefill_local_context_lens, self.scale, metadata.prefill_max_query_len,
                out=out[num_decodes:], v_head_dim=self.v_head_dim,
            )
        return out

    def _forward_dcp(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """DCP: partials over the local shard, merged over the group; the chunk's own tokens merged locally."""
        if self.exchange is None:
            raise RuntimeError("_forward_dcp needs the DCP exchange (dcp > 1)")
        timer = metadata.exchange_timer
        with timer.measure() if timer is not None else nullcontext():
            q_group = self.exchange.gather_queries(q)  # [T, dcp * heads, D]
        shard_out, shard_lse = self._shard_partials(
            q_group, k_cache, v_cache, metadata, metadata.prefill_block_table, metadata.prefill_query_start_loc,
            metadata.prefill_local_context_lens, metadata.prefill_max_query_len)
        with timer.measure() if timer is not None else nullcontext():
            out, lse = self.exchange.combine(shard_out, shard_lse)  # [T, heads, D], [T, heads]: the whole cache
        return self._merge_own_tokens(out, lse, q, k, v, k_cache, v_cache, metadata)

    def _shard_partials(
        self,
        q_group: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
        prefill_block_table: torch.Tensor,
        prefill_query_start_loc: torch.Tensor,
        prefill_local_context_lens: torch.Tensor,
        prefill_max_query_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of the group's queries over this rank's shard: the decode rows (metadata's first
        num_decode_tokens) over their sequences, the rows after them over the cached context the prefill arguments
        name (no new tokens)."""
        num_rows, group_heads = q_group.shape[:2]
        num_decodes = metadata.num_decode_tokens
        shard_out = q_group.new_empty((num_rows, group_heads, self.value_dim))
        shard_lse = torch.empty((num_rows, group_heads), dtype=torch.float32, device=q_group.device)
        if num_decodes:
            self._decode(q_group[:num_decodes], k_cache, v_cache, metadata, out=shard_out[:num_decodes],
                         lse_out=shard_lse[:num_decodes])
        if num_decodes < num_rows:
            self.prefill(
                q_group[num_decodes:], None, None, k_cache, v_cache, prefill_block_table, prefill_query_start_loc,
                prefill_local_context_lens, self.scale, prefill_max_query_len,
                out=shard_out[num_decodes:], lse_out=shard_lse[num_decodes:], v_head_dim=self.v_head_dim,
            )
        return shard_out, shard_lse

    def _merge_own_tokens(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """out / lse of this rank's rows over the cached context, with each prefill sequence's own new tokens
        (causal, from k / v: every rank has them) merged in exactly by combine_lse, in place."""
        num_decodes = metadata.num_decode_tokens
        if num_decodes == q.shape[0]:
            return out
        new_out, new_lse = self.prefill(
            q[num_decodes:], k[num_decodes:], v[num_decodes:] if v is not None else None, k_cache, v_cache,
            metadata.prefill_block_table, metadata.prefill_query_start_loc,
            torch.zeros_like(metadata.prefill_local_context_lens), self.scale, metadata.prefill_max_query_len,
            v_head_dim=self.v_head_dim,
        )
        self.combine(
            torch.stack([out[num_decodes:], new_out]),
            torch.stack([lse[num_decodes:], new_lse]),
            out=out[num_decodes:],
        )
        return out

    def _forward_pcp(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """PCP: this rank's rows are every decode and its segments of the prefill chunks (module docstring)."""
        parallel, pcp = self.parallel, metadata.pcp
        num_decodes = metadata.num_decode_tokens
        if pcp is None:  # decodes only: every PCP group has the same rows
            rows_max = 0
            self._store(k, v, k_cache, v_cache, metadata, "step", metadata.slot_mapping, False)
        else:
            rows_max = pcp.rows_max
            k_all = gather_prefill_rows(k, num_decodes, rows_max, parallel.pcp_comm, parallel.pcp_size)
            v_all = (gather_prefill_rows(v, num_decodes, rows_max, parallel.pcp_comm, parallel.pcp_size)
                     if v is not None else None)
            self._store(k_all, v_all, k_cache, v_cache, metadata, "pcp_gathered", pcp.gathered_slot_mapping, False)
        if self.pcp_exchange is None:  # dcp = 1: whole sequences here; each segment's context includes its chunk's
            return self._forward_local(q, k, v, k_cache, v_cache, metadata)  # earlier parts, stored above
        timer = metadata.exchange_timer
        with timer.measure() if timer is not None else nullcontext():
            q_group = self.pcp_exchange.gather_queries(q, num_decodes, rows_max)
        # The gathered layout's prefill sequences (none in a decode-only step, whose q_group holds decode rows only).
        prefill = ((pcp.gathered_block_table, pcp.gathered_query_start_loc, pcp.gathered_local_context_lens,
                    pcp.gathered_max_query_len) if pcp is not None else
                   (metadata.prefill_block_table, metadata.prefill_query_start_loc,
                    metadata.prefill_local_context_lens, 0))
        shard_out, shard_lse = self._shard_partials(q_group, k_cache, v_cache, metadata, *prefill)
        with timer.measure() if timer is not None else nullcontext():
            out, lse = self.pcp_exchange.combine(shard_out, shard_lse, num_decodes, rows_max)
        num_rows = q.shape[0]
        return self._merge_own_tokens(out[:num_rows], lse[:num_rows], q, k, v, k_cache, v_cache, metadata)
