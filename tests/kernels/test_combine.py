"""combine_lse merges partial attentions exactly; empty, NaN and +inf shards weigh nothing."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.impls import IMPLS, TEST_DTYPES, poisoned
from tests.kernels.sharding import assert_close_rows, dense_attention_f64

INF = float("inf")


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("dtype", TEST_DTYPES, ids=str)
@pytest.mark.parametrize("num_parts", [1, 2, 3, 8])
def test_combine_of_disjoint_parts_equals_whole(num_parts, dtype, impl, device) -> None:
    """Split keys into disjoint parts (some empty), attend to each in float64, merge: equals attending to all."""
    gen = torch.Generator().manual_seed(num_parts)
    num_keys, heads, head_dim = 37, 4, 64
    q = torch.randn(3, heads, head_dim, generator=gen)
    keys = torch.randn(num_keys, heads, head_dim, generator=gen)
    values = torch.randn(num_keys, heads, head_dim, generator=gen)
    owner = torch.randint(0, num_parts, (num_keys,), generator=gen)
    if num_parts > 1:
        owner[owner == num_parts - 1] = 0  # the last part stays empty
    outs, lses = [], []
    for part in range(num_parts):
        sel = owner == part
        o, lse = dense_attention_f64(q, keys[sel], values[sel], 0.2)
        outs.append(o)
        lses.append(lse)
    stacked_out = torch.stack(outs).to(dtype).to(device)
    stacked_lse = torch.stack(lses).float().to(device)
    out = poisoned((3, heads, head_dim), dtype, device)
    lse = poisoned((3, heads), torch.float32, device)
    IMPLS[impl]["combine"](stacked_out, stacked_lse, out=out, lse_out=lse)
    ref_out, ref_lse = dense_attention_f64(q, keys, values, 0.2)
    # Inputs were rounded to dtype once, so fp16 carries that rounding too: still within its bound.
    assert_close_rows(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_combine_ignores_bad_shards_and_zeroes_empty_rows(impl, device) -> None:
    outs = torch.randn(3, 4, 2, 16, device=device)
    lses = torch.randn(3, 4, 2, device=device)
    outs[1, 0] = float("nan")  # garbage in a shard whose lse says it is empty
    lses[1, 0] = -INF
    lses[2, 1] = float("nan")
    outs[2, 1] = INF
    lses[0, 2] = INF
    lses[:, 3, 0] = -INF  # every shard empty
    out, lse = IMPLS[impl]["combine"](outs, lses)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[3, 0], torch.zeros(16, device=device)) and lse[3, 0] == -INF
    # A row with one valid shard returns that shard exactly (weight 1).
    keep = torch.full((3, 1, 1), -INF, device=device)
    keep[1] = 0.5
    single_out, single_lse = IMPLS[impl]["combine"](outs[:, 3:4, 1:2], keep)
    torch.testing.assert_close(single_out[0, 0], outs[1, 3, 1], rtol=1e-6, atol=1e-6)
    assert abs(single_lse.item() - 0.5) < 1e-6
    # Bad shards are treated exactly like -inf ones.
    clean = lses.clone()
    clean[torch.isnan(clean) | (clean == INF)] = -INF
    clean_outs = torch.where((clean == -INF)[..., None], torch.zeros_like(outs), outs)
    ref_out, ref_lse = IMPLS["ref"]["combine"](clean_outs, clean)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_combine_is_stable_for_large_lse(impl, device) -> None:
    outs = torch.randn(2, 1, 1, 8, device=device)
    lses = torch.tensor([[[1000.0]], [[1000.0]]], device=device)
    out, lse = IMPLS[impl]["combine"](outs, lses)
    torch.testing.assert_close(out[0, 0], outs.mean(0)[0, 0], rtol=1e-6, atol=1e-6)
    assert abs(lse.item() - (1000.0 + torch.log(torch.tensor(2.0)).item())) < 1e-4


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_combine_rejects_bad_shapes(impl, device) -> None:
    with pytest.raises(ValueError, match="lses must be"):
        IMPLS[impl]["combine"](torch.zeros(2, 3, 4, 8, device=device), torch.zeros(2, 3, device=device))
    with pytest.raises(ValueError, match="outs must be"):
        IMPLS[impl]["combine"](torch.zeros(3, 4, 8, device=device), torch.zeros(3, 4, device=device))


def test_the_cpu_combine_is_the_reference_bit_for_bit() -> None:
    """combine_lse_cpu clamps where the reference selects: the same bits on random partials with empty shards (lse
    -inf, NaN or +inf over garbage outs, whole rows of them), in every dtype, N = 1 included."""
    from dcpserve.kernels import combine_lse_cpu, combine_lse_ref

    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        parts, rows = (int(torch.randint(1, 5, (1,), generator=generator)), int(torch.randint(1, 6, (1,),
                                                                                             generator=generator)))
        outs = torch.randn(parts, rows, 3, 8, generator=generator)
        lses = torch.randn(parts, rows, 3, generator=generator) * 5
        draw = torch.rand(parts, rows, 3, generator=generator)
        lses[draw < 0.2] = float("-inf")
        lses[(draw >= 0.2) & (draw < 0.25)] = float("nan")
        lses[(draw >= 0.25) & (draw < 0.3)] = float("inf")
        outs[..., 0][draw < 0.3] = float("nan")  # an empty shard's out is garbage
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            ref_out, ref_lse = combine_lse_ref(outs.to(dtype), lses)
            out, lse = combine_lse_cpu(outs.to(dtype), lses)
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_the_finite_cpu_combine_is_the_reference_bit_for_bit_on_clean_partials() -> None:
    """combine_lse_cpu_finite drops the guards: on partials that keep the CPU kernels' contract (an empty shard is
    out 0 / lse -inf; whole rows of them) it still gives the reference's bits, in every dtype, N = 1 included."""
    from dcpserve.kernels import combine_lse_cpu_finite, combine_lse_ref

    generator = torch.Generator().manual_seed(1)
    for _ in range(100):
        parts = int(torch.randint(1, 5, (1,), generator=generator))
        rows = int(torch.randint(1, 6, (1,), generator=generator))
        outs = torch.randn(parts, rows, 3, 8, generator=generator)
        lses = torch.randn(parts, rows, 3, generator=generator) * 5
        empty = torch.rand(parts, rows, 3, generator=generator) < 0.3
        empty[:, 0] = True  # a row that no shard sees
        lses[empty] = float("-inf")
        outs[empty] = 0.0
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            ref_out, ref_lse = combine_lse_ref(outs.to(dtype), lses)
            out, lse = combine_lse_cpu_finite(outs.to(dtype), lses)
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
            assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == float("-inf")).all())
