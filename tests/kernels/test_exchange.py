"""DcpAttentionExchange across real processes (torch.multiprocessing; the session's spawn_pool, tests/spawn_pool.py),
over each CPU transport: gloo on loopback and shared memory (dcpserve/engine/worker/rank_transport.py).

Every process builds the same sequences, keeps only its own shard and its own query heads, runs the gather ->
local attention -> exchange -> combine path, and checks the result against the single-process merge of all
shards and against float64 dense attention."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bench.harness.model_harness import free_port
from dcpserve.engine.worker.rank_transport import group_collectives, publish_node
from dcpserve.kernels import (
    DcpAttentionExchange,
    combine_lse_ref,
    dcp_local_seq_lens,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from dcpserve.kernels.exchange import ExchangeMethod
from tests.kernels.sharding import assert_close_rows, dense_attention_f64, shard_kv
from tests.spawn_pool import SpawnPool

HEADS_PER_RANK = 2
HEAD_DIM = 32
BLOCK_SIZE = 4


def _check_decode(exchange: DcpAttentionExchange, dcp_size: int, dcp_rank: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lengths = [0, 1, BLOCK_SIZE * dcp_size - 1, BLOCK_SIZE * dcp_size + 1, 97]
    keys = [torch.randn(n, 1, HEAD_DIM, generator=gen) for n in lengths]
    values = [torch.randn(n, 1, HEAD_DIM, generator=gen) for n in lengths]
    q = torch.randn(len(lengths), dcp_size * HEADS_PER_RANK, HEAD_DIM, generator=gen)
    shards = shard_kv(keys, values, dcp_size, BLOCK_SIZE, 1, store_kv_ref, gen, torch.device("cpu"))
    own = slice(dcp_rank * HEADS_PER_RANK, (dcp_rank + 1) * HEADS_PER_RANK)
    scale = 1.0 / math.sqrt(HEAD_DIM)

    q_group = exchange.gather_queries(q[:, own].contiguous())
    assert torch.equal(q_group, q)
    local = paged_decode_attention_ref(q_group, shards.k_caches[dcp_rank], shards.v_caches[dcp_rank],
                                       shards.block_table, shards.local_lens[dcp_rank], scale)
    out, lse = exchange.combine(*local)

    partials = [paged_decode_attention_ref(q, shards.k_caches[r], shards.v_caches[r], shards.block_table,
                                           shards.local_lens[r], scale) for r in range(dcp_size)]
    merged_out, merged_lse = combine_lse_ref(torch.stack([p[0] for p in partials]),
                                             torch.stack([p[1] for p in partials]))
    torch.testing.assert_close(out, merged_out[:, own], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, merged_lse[:, own], rtol=1e-6, atol=1e-6)
    for i in range(len(lengths)):
        ref_out, ref_lse = dense_attention_f64(q[i : i + 1, own], keys[i], values[i], scale)
        assert_close_rows(out[i : i + 1], lse[i : i + 1], ref_out, ref_lse, torch.float32)


def _check_prefill_context(exchange: DcpAttentionExchange, dcp_size: int, dcp_rank: int, seed: int) -> None:
    """Chunked prefill: context part through the exchange, new part local, then the local two-way merge."""
    gen = torch.Generator().manual_seed(seed + 1)
    spec = [(0, 3), (BLOCK_SIZE * dcp_size + 1, 5), (41, 1)]
    full_k = [torch.randn(c + n, 1, HEAD_DIM, generator=gen) for c, n in spec]
    full_v = [torch.randn(c + n, 1, HEAD_DIM, generator=gen) for c, n in spec]
    q = torch.randn(sum(n for _, n in spec), dcp_size * HEADS_PER_RANK, HEAD_DIM, generator=gen)
    shards = shard_kv([k[:c] for k, (c, _) in zip(full_k, spec, strict=True)],
                      [v[:c] for v, (c, _) in zip(full_v, spec, strict=True)],
                      dcp_size, BLOCK_SIZE, 1, store_kv_ref, gen, torch.device("cpu"))
    starts = torch.tensor([0] + [n for _, n in spec]).cumsum(0).to(torch.int32)
    context = torch.tensor([c for c, _ in spec], dtype=torch.int32)
    own = slice(dcp_rank * HEADS_PER_RANK, (dcp_rank + 1) * HEADS_PER_RANK)
    q_own = q[:, own].contiguous()
    scale = 0.2
    kc, vc = shards.k_caches[dcp_rank], shards.v_caches[dcp_rank]

    local_ctx = dcp_local_seq_lens(context, dcp_size, dcp_rank)
    ctx_out, ctx_lse = exchange.combine(*paged_prefill_attention_ref(
        exchange.gather_queries(q_own), None, None, kc, vc, shards.block_table, starts, local_ctx, scale))
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, spec, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, spec, strict=True)])
    new_out, new_lse = paged_prefill_attention_ref(q_own, new_k, new_v, kc, vc, shards.block_table, starts,
                                                   torch.zeros_like(context), scale)
    out, lse = combine_lse_ref(torch.stack([ctx_out, new_out]), torch.stack([ctx_lse, new_lse]))
    row = 0
    for (ctx, n), k, v in zip(spec, full_k, full_v, strict=True):
        ref_out, ref_lse = dense_attention_f64(q_own[row : row + n], k, v, scale, causal_offset=ctx)
        assert_close_rows(out[row : row + n], lse[row : row + n], ref_out, ref_lse, torch.float32)
        row += n


def _worker(rank: int, world_size: int, dcp_size: int, port: int, method: ExchangeMethod, transport: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size=world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        publish_node(store, rank)
        # DCP groups are runs of dcp_size consecutive ranks; every process creates every torch group.
        members = [list(range(s, s + dcp_size)) for s in range(0, world_size, dcp_size)]
        groups = [dist.new_group(m) for m in members]
        mine = rank // dcp_size
        collectives = group_collectives(store, "dcp", members[mine], rank, groups[mine], "cpu", transport, 60.0)
        assert collectives.transport == transport
        exchange = DcpAttentionExchange(collectives, method=method)
        assert exchange.world_size == dcp_size and exchange.rank == rank % dcp_size
        seed = 1000 + rank // dcp_size  # the groups hold different data
        _check_decode(exchange, dcp_size, rank % dcp_size, seed)
        _check_prefill_context(exchange, dcp_size, rank % dcp_size, seed)
        collectives.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size,dcp_size,method,transport", [
    (2, 2, "all_to_all", "gloo"),
    (2, 2, "all_to_all", "shm"),
    (4, 4, "all_to_all", "shm"),
    (4, 2, "all_to_all", "gloo"),  # two DCP groups of 2 inside one world of 4
    (4, 2, "all_to_all", "shm"),
    (2, 2, "all_gather", "gloo"),
    (4, 4, "all_gather", "shm"),
])
def test_exchange_matches_single_process_merge(world_size: int, dcp_size: int, method: ExchangeMethod,
                                              transport: str, spawn_pool: SpawnPool) -> None:
    spawn_pool.spawn(_worker, (world_size, dcp_size, free_port(), method, transport), world_size)


def test_torch_collectives_need_an_initialized_process_group() -> None:
    from dcpserve.kernels.collectives import TorchCollectives

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchCollectives()
