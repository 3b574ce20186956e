"""Write new tokens' K/V into this rank's paged cache at their DCP slots; slot -1 means another rank owns it."""

from __future__ import annotations

import torch

from kernels._triton import require_triton_device, tl, triton


def _check_store_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
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
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise TypeError(
            f"key/value dtype ({key.dtype}, {value.dtype}) must match the cache's ({k_cache.dtype}, "
            f"{v_cache.dtype}); cast before storing"
        )


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference of store_kv: k_cache[slot // B, slot % B] = key for every slot >= 0."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):  # DCP: tokens this rank does not own
        slots, key, value = slots[keep], key[keep], value[keep]
    if k_cache.is_contiguous() and v_cache.is_contiguous():  # the engine's caches: one flat index_copy_ each
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))
        return
    pages, offsets = slots // block_size, slots % block_size
    k_cache[pages, offsets] = key
    v_cache[pages, offsets] = value


@triton.jit
def _store_kv_kernel(
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
    v = tl.load(value_ptr + rows * stride_value_t + head * stride_value_h + d[None, :], mask=mask)
    k_dst = k_cache_ptr + pages[:, None] * stride_kc_b + offsets[:, None] * stride_kc_s + head * stride_kc_h
    v_dst = v_cache_ptr + pages[:, None] * stride_vc_b + offsets[:, None] * stride_vc_s + head * stride_vc_h
    tl.store(k_dst + d[None, :], k, mask=mask)
    tl.store(v_dst + d[None, :], v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton store_kv: key/value [num_tokens, num_kv_heads, head_dim] into [num_blocks, block_size,
    num_kv_heads, head_dim] caches at slot_mapping [num_tokens] (page * block_size + offset), skipping -1."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    require_triton_device(key, value, k_cache, v_cache, slot_mapping)
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got {t.stride()}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_t = 16
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        head_dim,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_size=k_cache.shape[1],
        BLOCK_T=block_t,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
