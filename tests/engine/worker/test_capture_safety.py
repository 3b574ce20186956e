"""The capture-safety check (dcpserve/engine/worker/capture_safety.py) on toy forwards: each kind of op a CUDA graph
cannot capture is found, with its op and the toy's own file:line, and a forward of capturable ops passes. The
device-copy rules are checked on meta tensors (a device that is not the CPU) through `classify`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dcpserve.engine.worker.capture_safety import (
    DYNAMIC_SHAPE,
    FROM_HOST,
    HOST_OPERAND,
    HOST_READ,
    TO_HOST,
    CaptureSafetyError,
    capture_violations,
    check_capture_safety,
    classify,
)

X = torch.arange(1.0, 9.0)
MASK = X > 4
REPEATS = torch.tensor([1, 2, 1, 1, 1, 1, 1, 3])

# One toy forward per way of breaking a capture: (the op the check names, why).
UNSAFE: dict[str, tuple[Callable[[torch.Tensor], object], str, str]] = {
    "item": (lambda x: x.sum().item(), "Tensor.item", HOST_READ),
    "int": (lambda x: torch.zeros(int(x.max())), "Tensor.__int__", HOST_READ),
    "float": (lambda x: x * float(x[0]), "Tensor.__float__", HOST_READ),
    "bool": (lambda x: x if bool((x > 0).all()) else -x, "Tensor.__bool__", HOST_READ),
    "index": (lambda x: [1, 2, 3][x[1].long()], "Tensor.__index__", HOST_READ),
    "equal": (lambda x: torch.equal(x, x + 1), "aten.equal.default", HOST_READ),
    "allclose": (lambda x: torch.allclose(x, x), "torch.allclose", HOST_READ),
    "tolist": (lambda x: x.tolist(), "Tensor.tolist", TO_HOST),
    "numpy": (lambda x: x.numpy(), "Tensor.numpy", TO_HOST),
    "cpu": (lambda x: x.cpu(), "Tensor.cpu", TO_HOST),
    "to_cpu": (lambda x: x.to("cpu"), "Tensor.to", TO_HOST),
    "to_cpu_device": (lambda x: x.to(device=torch.device("cpu")), "Tensor.to", TO_HOST),
    "nonzero": (lambda x: (x > 4).nonzero(), "aten.nonzero.default", DYNAMIC_SHAPE),
    "where_one_argument": (lambda x: torch.where(x > 4), "aten.nonzero.default", DYNAMIC_SHAPE),
    "argwhere": (lambda x: torch.argwhere(x > 4), "aten.nonzero.default", DYNAMIC_SHAPE),
    "masked_select": (lambda x: x.masked_select(x > 4), "aten.masked_select.default", DYNAMIC_SHAPE),
    "mask_index": (lambda x: x[x > 4], "aten.index.Tensor", DYNAMIC_SHAPE),
    "mask_assign": (lambda x: x.clone().__setitem__(x > 4, 0.0), "aten.index_put_.default", DYNAMIC_SHAPE),
    "unique": (lambda x: x.unique(), "aten._unique2.default", DYNAMIC_SHAPE),
    "unique_consecutive": (lambda x: x.unique_consecutive(), "aten.unique_consecutive.default", DYNAMIC_SHAPE),
    "repeat_interleave": (lambda x: x.repeat_interleave(REPEATS), "aten.repeat_interleave.Tensor", DYNAMIC_SHAPE),
    "bincount": (lambda x: torch.bincount(x.long()), "aten.bincount.default", DYNAMIC_SHAPE),
}


def _safe_forward(x: torch.Tensor) -> torch.Tensor:
    """Capturable: static shapes and no host reads, including the data-dependent ops' static forms."""
    scores = (x[None, :] * x[:, None]).softmax(dim=-1)
    top = scores.topk(2, dim=-1)
    order = top.indices.reshape(-1).sort(stable=True).indices
    ends = torch.searchsorted(top.indices.reshape(-1).sort().values, torch.arange(1, 9), out_int32=True)
    spread = x.repeat_interleave(REPEATS, output_size=11)[:8] + x.repeat_interleave(2)[::2]
    masked = torch.where(x > 4, x, 0.0).masked_fill(x < 2, -1.0)
    static = torch.nonzero_static(x > 4, size=8, fill_value=-1)
    return (scores.sum(0) + spread + masked + order[:8] + ends[:8] + static[:, 0] + x.index_select(0, order[:8] % 8)
            + x[torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])])


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_each_unsafe_op_is_found_with_its_line(name: str) -> None:
    forward, op, reason = UNSAFE[name]
    _, violations = capture_violations(lambda: forward(X))
    assert [(v.op, v.reason) for v in violations] == [(op, reason)]
    this_file = str(Path(*Path(__file__).parts[-4:]))
    assert violations[0].stack and violations[0].stack[-1].startswith(f"{this_file}:"), violations[0].stack


@pytest.mark.parametrize("inference", [False, True])
def test_a_safe_forward_passes(inference: bool) -> None:
    """Also under inference_mode, where a CPU tensor's scalar reads skip aten (the check sees them as calls)."""
    with torch.inference_mode(inference):
        out = check_capture_safety(lambda: _safe_forward(X))
        assert out.shape == (8,)
        _, violations = capture_violations(lambda: UNSAFE["int"][0](X))
    assert [v.op for v in violations] == ["Tensor.__int__"]


def test_the_error_names_every_violation() -> None:
    def forward() -> torch.Tensor:
        y = X[MASK]
        return y * y.sum().item()

    with pytest.raises(CaptureSafetyError) as raised:
        check_capture_safety(forward, "the toy forward")
    message = str(raised.value)
    assert "the toy forward is not safe to capture" in message and "2 violations" in message
    assert "aten.index.Tensor" in message and "Tensor.item" in message and "test_capture_safety.py:" in message
    assert len(raised.value.violations) == 2


def test_a_flagged_call_is_one_violation() -> None:
    """tolist() reads every element: one violation, not one per element (nor the copy inside)."""
    _, violations = capture_violations(lambda: torch.arange(100).tolist())
    assert len(violations) == 1


def test_copies_between_host_and_device() -> None:
    """On a device (meta stands in for one here) copies either way, and CPU operands of device ops, are found; CPU
    scalars (wrapped numbers) and copies within one side are not."""
    aten = torch.ops.aten
    device = torch.ones(4, device="meta")
    host = torch.ones(4)
    assert classify(aten._to_copy.default, (device,), {"device": torch.device("cpu")}) == TO_HOST
    assert classify(aten._to_copy.default, (host,), {"device": torch.device("meta")}) == FROM_HOST
    assert classify(aten.copy_.default, (host, device), {}) == TO_HOST
    assert classify(aten.copy_.default, (device, host), {}) == FROM_HOST
    assert classify(aten.add.Tensor, (device, host), {}) == HOST_OPERAND
    assert classify(aten.add.Tensor, (device, torch.tensor(2.0)), {}) is None
    assert classify(aten._to_copy.default, (device,), {"dtype": torch.float16}) is None
    assert classify(aten.copy_.default, (host, host.clone()), {}) is None
    assert classify(aten.index.Tensor, (device, [torch.ones(4, dtype=torch.bool, device="meta")]), {}) == DYNAMIC_SHAPE
    assert classify(aten.index.Tensor, (device, [torch.zeros(2, dtype=torch.int64, device="meta")]), {}) is None
