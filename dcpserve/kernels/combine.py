"""Exact merge of partial attentions computed over disjoint key sets (DCP shards, or splits of one shard).

    L = logsumexp_r lse_r;  O = sum_r exp(lse_r - L) * O_r

Stable form with m = max_r lse_r. NaN and +inf lse count as -inf (weight 0, and their out is never read into
the sum, so garbage there cannot leak); a row whose every shard is -inf gives out = 0 and lse = -inf.
The sum is accumulated in fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from dcpserve.kernels._attention_common import NUM_STAGES, NUM_WARPS, output_buffers
from dcpserve.kernels._triton import jit, require_triton_device, tl, triton


def _check_combine_args(outs: torch.Tensor, lses: torch.Tensor) -> None:
    if outs.dim() != 4:
        raise ValueError(f"outs must be [N, num_seqs, num_heads, head_dim], got shape {tuple(outs.shape)}")
    if lses.shape != outs.shape[:3]:
        raise ValueError(f"lses must be [N, num_seqs, num_heads] = {tuple(outs.shape[:3])}, got {tuple(lses.shape)}")
    if not lses.dtype.is_floating_point or not outs.dtype.is_floating_point:
        raise TypeError(f"outs and lses must be floating point, got {outs.dtype} and {lses.dtype}")
    if outs.shape[0] < 1:
        raise ValueError("combine_lse needs at least one partial attention (N >= 1)")


def combine_lse_ref(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: outs [N, S, H, D], lses [N, S, H] -> (out [S, H, D] in outs' dtype, lse [S, H] fp32),
    written into out / lse_out when given."""
    _check_combine_args(outs, lses)
    out, lse_out = output_buffers(outs[0], outs.shape[2], out, lse_out)
    neg_inf = torch.tensor(float("-inf"), device=lses.device)
    lse = lses.float()
    lse = torch.where(torch.isnan(lse) | (lse == float("inf")), neg_inf, lse)
    max_lse = lse.amax(dim=0)
    safe_max = torch.where(max_lse == float("-inf"), torch.zeros_like(max_lse), max_lse)
    weights = torch.exp(lse - safe_max)  # [N, S, H]; exactly 0 for empty shards
    total = weights.sum(dim=0)
    valid = total > 0
    combined_lse = torch.where(valid, safe_max + torch.log(torch.where(valid, total, 1.0)), neg_inf)
    scale = torch.where(valid, weights / torch.where(valid, total, 1.0), torch.zeros_like(weights))
    contributions = torch.where(scale[..., None] > 0, scale[..., None] * outs.float(), 0.0)
    out.copy_(contributions.sum(dim=0))
    lse_out.copy_(combined_lse)
    return out, lse_out


def combine_lse_cpu(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """combine_lse_ref's result, bit for bit, in half its torch ops (the CPU engine's merge: a decode step of a small
    model is op overhead, and DCP merges once per layer). Where the reference selects, this one clamps:
    - an empty shard's lse (NaN or +inf) becomes -inf (nan_to_num);
    - with every shard empty the max is -inf, clamped to the float range, so the weights exp(lse - max) are all 0;
    - the weights' sum is >= 1 whenever a shard is not empty (the largest weighs exp(0)), so clamping it to 1 changes
      nothing then and keeps 0 / 0 from the all-empty rows, whose lse is then max + log(0) = -inf."""
    _check_combine_args(outs, lses)
    out, lse_out = output_buffers(outs[0], outs.shape[2], out, lse_out)
    neg_inf = float("-inf")
    lse = lses.float().nan_to_num(nan=neg_inf, posinf=neg_inf, neginf=neg_inf)  # (its default makes -inf finite)
    safe_max = lse.amax(dim=0).clamp_(min=torch.finfo(torch.float32).min)
    weights = (lse - safe_max).exp_()  # [N, S, H]; exactly 0 for empty shards
    total = weights.sum(dim=0)
    lse_out.copy_(total.log().add_(safe_max))
    scale = (weights / total.clamp(min=1.0))[..., None]
    # An empty shard's out may be garbage (even NaN): selected away, never multiplied in.
    out.copy_(torch.where(scale > 0, scale * outs.float(), 0.0).sum(dim=0))
    return out, lse_out


def combine_lse_cpu_finite(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """combine_lse_cpu without its guards against garbage, for partials that keep the CPU kernels' contract
    (dcpserve/kernels/cpu_attention.py): an empty shard is out 0 and lse -inf, never NaN or +inf. On such partials it
    gives combine_lse_ref's bits (the same operations in the same order, less the two selects that change nothing
    there) in 8 torch ops instead of 17: at the tiny model's decode (2 ranks, 2 heads, batch 1-64) 19-21 us against
    45-55 us, paid once per layer by every rank of a DCP group. A NaN in the input shows in the output instead of
    being selected away, which is what a broken partial should do on this path."""
    _check_combine_args(outs, lses)
    out, lse_out = output_buffers(outs[0], outs.shape[2], out, lse_out)
    lse = lses.float()
    safe_max = lse.amax(dim=0).clamp_(min=torch.finfo(torch.float32).min)  # every shard empty: weights all 0
    weights = (lse - safe_max).exp_()  # [N, S, H]; exactly 0 for empty shards
    total = weights.sum(dim=0)
    lse_out.copy_(total.log().add_(safe_max))  # all empty: log(0) = -inf
    weights /= total.clamp_(min=1.0)  # total >= 1 unless every shard is empty (then 0 / 1)
    out.copy_((weights[..., None] * outs.float()).sum(dim=0))
    return out, lse_out


@jit
def _combine_lse_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its arguments are typed by Triton at launch
    outs_ptr,
    lses_ptr,
    out_ptr,
    lse_ptr,
    num_parts,
    num_heads,
    head_dim,
    stride_outs_n,
    stride_outs_s,
    stride_outs_h,
    stride_lses_n,
    stride_lses_s,
    stride_lses_h,
    stride_out_s,
    stride_out_h,
    stride_lse_s,
    stride_lse_h,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    # Offsets past 2^31 elements (128 heads x dcp 8 x a long chunk, launch_configs.OFFSET_AUDIT): seq is int64, and
    # the parts are reached by advancing 64-bit pointers, never by an int32 product n * stride.
    seq = (row // num_heads).to(tl.int64)
    head = row % num_heads
    lse_base = lses_ptr + seq * stride_lses_s + head * stride_lses_h
    # Pass 1: the max over shards, ignoring NaN / +inf (treated as empty).
    max_lse = float("-inf")
    lse_part = lse_base
    for _ in range(0, num_parts):
        part = tl.load(lse_part).to(tl.float32)
        lse_part += stride_lses_n
        part = tl.where((part != part) | (part == float("inf")), float("-inf"), part)
        max_lse = tl.maximum(max_lse, part)
    safe_max = tl.where(max_lse == float("-inf"), 0.0, max_lse)
    # Pass 2: weighted sum of the outputs, in fp32.
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = 0.0
    lse_part = lse_base
    out_part = outs_ptr + seq * stride_outs_s + head * stride_outs_h + d
    for _ in range(0, num_parts):
        part = tl.load(lse_part).to(tl.float32)
        lse_part += stride_lses_n
        part = tl.where((part != part) | (part == float("inf")), float("-inf"), part)
        weight = tl.exp(part - safe_max)
        o = tl.load(out_part, mask=mask, other=0.0).to(tl.float32)
        out_part += stride_outs_n
        # An empty shard's out may be garbage (even NaN): select, never multiply it in.
        acc += tl.where(weight > 0, weight * o, 0.0)
        total += weight
    valid = total > 0
    result = tl.where(valid, acc / tl.where(valid, total, 1.0), 0.0)
    combined = tl.where(valid, safe_max + tl.log(tl.where(valid, total, 1.0)), float("-inf"))
    tl.store(out_ptr + seq * stride_out_s + head * stride_out_h + d, result.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + seq * stride_lse_s + head * stride_lse_h, combined)


def combine_block_d(head_dim: int) -> int:
    """The combine kernel's one tile of channels: a head's, rounded up to a power of two."""
    return int(triton.next_power_of_2(head_dim))


def combine_lse_into(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Launches the combine kernel writing into preallocated out [S, H, D] and lse [S, H] (fp32)."""
    num_parts, num_seqs, num_heads, head_dim = outs.shape
    if num_seqs * num_heads == 0:
        return
    for name, t in (("outs", outs), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got {t.stride()}")
    _combine_lse_kernel[(num_seqs * num_heads,)](
        outs,
        lses,
        out,
        lse,
        num_parts,
        num_heads,
        head_dim,
        outs.stride(0),
        outs.stride(1),
        outs.stride(2),
        lses.stride(0),
        lses.stride(1),
        lses.stride(2),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        BLOCK_D=combine_block_d(head_dim),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )


def combine_lse(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton combine: outs [N, S, H, D], lses [N, S, H] -> (out [S, H, D] in outs' dtype, lse [S, H] fp32),
    written into out / lse_out when given."""
    _check_combine_args(outs, lses)
    require_triton_device(outs, lses)
    out, lse_out = output_buffers(outs[0], outs.shape[2], out, lse_out)
    combine_lse_into(outs, lses, out, lse_out)
    return out, lse_out
