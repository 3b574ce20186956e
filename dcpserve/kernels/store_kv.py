"""Write new tokens' K/V into this rank's paged cache at their DCP slots; slot -1 means another rank owns it.

A cache may hold keys only (value and v_cache None): MLA caches one [latent, rope key] vector per token and reads
its values from it."""

from __future__ import annotations

import torch

from dcpserve.kernels._attention_common import NUM_STAGES, NUM_WARPS
from dcpserve.kernels._triton import jit, require_triton_device, tl, triton

STORE_BLOCK_T = 16  # tokens per program


def store_block_d(head_dim: int) -> int:
    """The store kernel's one tile of channels: a head's, rounded up to a power of two."""
    return int(triton.next_power_of_2(head_dim))


def _check_store_args(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    if (value is None) != (v_cache is None):
        raise ValueError(
            "pass value and v_cache together, or neither (a key-only cache, e.g. MLA's latent cache): got "
            f"value {'None' if value is None else 'given'} and v_cache {'None' if v_cache is None else 'given'}"
        )
    if key.dim() != 3 or (value is not None and key.shape != value.shape):
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)} "
            f"and {tuple(value.shape) if value is not None else None}"
        )
    if k_cache.dim() != 4 or (v_cache is not None and k_cache.shape != v_cache.shape):
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape) if v_cache is not None else None}"
        )
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key has (num_kv_heads, head_dim) = {tuple(key.shape[1:])} but the cache holds "
            f"{tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if key.dtype != k_cache.dtype or (value is not None and v_cache is not None and value.dtype != v_cache.dtype):
        raise TypeError(
            f"key/value dtype ({key.dtype}, {value.dtype if value is not None else None}) must match the cache's "
            f"({k_cache.dtype}, {v_cache.dtype if v_cache is not None else None}); cast before storing"
        )


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    all_owned: bool = False,
) -> None:
    """Torch reference of store_kv: k_cache[slot // B, slot % B] = key (and v_cache = value) for every slot >= 0.
    all_owned: the caller knows no slot is -1 (no DCP: every token is this rank's), which skips looking for them.
    It finds the owned rows in every call; the CPU engine finds them once per step (StorePlan, store_kv_planned).
    The arguments are checked there (StorePlan checks slot_mapping's own shape and dtype first)."""
    store_kv_planned(key, value, k_cache, v_cache, slot_mapping, StorePlan(slot_mapping, all_owned))


class StorePlan:
    """Which rows of a step's new K/V this rank stores, and where: derived from the step's slot_mapping once and
    reused by every layer (store_kv_planned), where store_kv_ref looks for the unowned slots (-1) again in each one.
    `slots` are the stored rows' flat cache slots (int64), None when this rank owns none of the step's tokens (at
    DCP, a batch-1 decode on every rank but its owner); `rows` the stored rows' indices, None when it owns them
    all."""

    __slots__ = ("slots", "rows")

    def __init__(self, slot_mapping: torch.Tensor, all_owned: bool = False) -> None:
        if slot_mapping.dim() != 1:
            raise ValueError(f"slot_mapping must be [num_tokens], got {tuple(slot_mapping.shape)}")
        if slot_mapping.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
        slots = slot_mapping.to(torch.int64)
        self.slots: torch.Tensor | None = slots
        self.rows: torch.Tensor | None = None
        if all_owned:
            return
        keep = slots >= 0
        owned = int(keep.sum())
        if owned == 0:
            self.slots = None
        elif owned < slots.numel():  # DCP: tokens another rank owns
            self.rows = keep.nonzero().squeeze(1)
            self.slots = slots.index_select(0, self.rows)


def store_kv_planned(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    plan: StorePlan,
) -> None:
    """store_kv_ref's result with the step's StorePlan (made from this slot_mapping): the owned rows' one
    index_copy_ per cache, and nothing at all where this rank owns none of the tokens."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    if plan.slots is None:
        return
    caches = [(key, k_cache)] + ([(value, v_cache)] if value is not None and v_cache is not None else [])
    block_size = k_cache.shape[1]
    for rows, cache in caches:
        if plan.rows is not None:
            rows = rows.index_select(0, plan.rows)
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, plan.slots, rows.to(cache.dtype))
        else:
            cache[plan.slots // block_size, plan.slots % block_size] = rows


@jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its arguments are typed by Triton at launch
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    head_dim,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    block_size: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_VALUE: tl.constexpr,
):
    # One program: BLOCK_T tokens of one KV head. Tokens another rank owns (slot -1) are masked out.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    owned = slots >= 0
    pages = slots // block_size
    offsets = slots % block_size
    d = tl.arange(0, BLOCK_D)
    mask = owned[:, None] & (d < head_dim)[None, :]
    rows = tokens.to(tl.int64)[:, None]
    k = tl.load(key_ptr + rows * stride_key_t + head * stride_key_h + d[None, :], mask=mask)
    k_dst = k_cache_ptr + pages[:, None] * stride_kc_b + offsets[:, None] * stride_kc_s + head * stride_kc_h
    tl.store(k_dst + d[None, :], k, mask=mask)
    if HAS_VALUE:
        v = tl.load(value_ptr + rows * stride_value_t + head * stride_value_h + d[None, :], mask=mask)
        v_dst = v_cache_ptr + pages[:, None] * stride_vc_b + offsets[:, None] * stride_vc_s + head * stride_vc_h
        tl.store(v_dst + d[None, :], v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    all_owned: bool = False,
) -> None:
    """Triton store_kv: key/value [num_tokens, num_kv_heads, head_dim] into [num_blocks, block_size,
    num_kv_heads, head_dim] caches at slot_mapping [num_tokens] (page * block_size + offset), skipping -1; value and
    v_cache None: a key-only cache. all_owned is store_kv_ref's hint; the kernel masks -1 slots at no cost either
    way."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    require_triton_device(key, value, k_cache, v_cache, slot_mapping)
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got {t.stride()}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    has_value = value is not None and v_cache is not None
    # Placeholders keep the launch signature fixed; HAS_VALUE=False never reads them.
    value_arg = value if value is not None else key
    v_cache_arg = v_cache if v_cache is not None else k_cache
    grid = (triton.cdiv(num_tokens, STORE_BLOCK_T), num_kv_heads)
    _store_kv_kernel[grid](
        key,
        value_arg,
        k_cache,
        v_cache_arg,
        slot_mapping,
        num_tokens,
        head_dim,
        key.stride(0),
        key.stride(1),
        value_arg.stride(0),
        value_arg.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache_arg.stride(0),
        v_cache_arg.stride(1),
        v_cache_arg.stride(2),
        block_size=k_cache.shape[1],
        BLOCK_T=STORE_BLOCK_T,
        BLOCK_D=store_block_d(head_dim),
        HAS_VALUE=has_value,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
