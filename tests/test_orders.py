"""Arithmetic orders as data: the registry is complete and consistent, every order reaches the
codec, the fused kernels and GPTQ unchanged, and an order that exists only as data (no name in
any caller) runs through all three and agrees with an oracle built from the slow reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nvfp4lab import fake_quantize, orders, quantize
from nvfp4lab.codec import compute_global_scale
from nvfp4lab.e2m1 import unpack_fp4
from nvfp4lab.execution.gptq import gptq_quantize
from nvfp4lab.kernels import compiler_available, fused_route
from nvfp4lab.kernels.graphs import supports
from nvfp4lab.kernels.steps import STEP_FIELDS
from nvfp4lab.oracles import numbers as ref_numbers
from nvfp4lab.oracles import nvfp4 as ref_nvfp4
from nvfp4lab.orders import ORDERS, ArithmeticOrder, DecodeRule, ScaleForm, TensorScaleRule
from nvfp4lab.vocab import OrderName


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_every_convention_has_one_order() -> None:
    assert set(ORDERS) == set(OrderName)
    for convention, order in ORDERS.items():
        assert order.convention is convention and order.name == convention.value
        assert orders.get(convention.value) is order and orders.get(order) is order
        assert order.source  # where the order comes from
    with pytest.raises(ValueError, match="unknown convention 'llama'; accepted values: 'kernel'"):
        orders.get("llama")


@pytest.mark.parametrize("order", list(ORDERS.values()), ids=lambda o: o.name)
def test_the_scale_form_decides_tensor_scale_and_decode(order: ArithmeticOrder) -> None:
    """An order written in the DECODE form computes the DECODE scale and decodes with it."""
    decode_form = order.scale_form is ScaleForm.DECODE
    assert decode_form == (order.tensor_scale is TensorScaleRule.DECODE_FLOAT32_DIVISION)
    assert decode_form == (order.decode is DecodeRule.SCALE_TIMES_DECODE)


def test_the_graphs_implement_the_encode_orders_only() -> None:
    assert supports(ORDERS[OrderName.VLLM_KERNEL])
    assert supports(ORDERS[OrderName.COMPRESSED_TENSORS])
    assert not supports(ORDERS[OrderName.MODELOPT])
    x = torch.randn(4, 64)
    assert not fused_route(x.numel(), 64, x.dtype, x.device, True,
                           order=ORDERS[OrderName.MODELOPT])


#: An order that exists only as data: the kernel order with compressed-tensors' replacement of a
#: zero block scale by 0.125. No caller names it; the fused graphs implement its steps.
KERNEL_WITH_EPS = dataclasses.replace(
    ORDERS[OrderName.VLLM_KERNEL], zero_scale_replacement=0.125, source="test"
)
#: Another: the kernel order with ModelOpt's lower clamp of block scales to 2**-9 (eager only).
KERNEL_WITH_FLOOR = dataclasses.replace(
    ORDERS[OrderName.VLLM_KERNEL], min_block_scale=2.0**-9, source="test"
)


def _oracle(
    x: torch.Tensor, gs: float, order: ArithmeticOrder
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float32 scales) of the kernel order in the slow reference, with the variant's one
    changed step applied to the scales and the affected blocks re-encoded by hand."""
    codes, scales = ref_nvfp4.quantize_blocks(x, gs, "kernel")
    if order.zero_scale_replacement is not None:
        fixed = torch.where(scales == 0, order.zero_scale_replacement, scales)
    else:
        fixed = scales.clamp(min=order.min_block_scale)
    changed = fixed != scales
    blocks = x.reshape(*x.shape[:-1], -1, 16).float()
    for index in changed.nonzero().tolist():
        s = float(fixed[tuple(index)])
        m = ref_numbers.round_f32(1.0 / ref_numbers.round_f32(s * ref_numbers.round_f32(1.0 / gs)))
        for j, v in enumerate(blocks[tuple(index)].tolist()):
            scaled = max(-6.0, min(6.0, ref_numbers.round_f32(v * m)))
            codes[(*index[:-1], index[-1] * 16 + j)] = ref_numbers.round_e2m1(scaled)
    return codes, fixed


@pytest.mark.parametrize("order", [KERNEL_WITH_EPS, KERNEL_WITH_FLOOR], ids=["eps", "floor"])
def test_an_order_given_as_data_runs_everywhere(order: ArithmeticOrder) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 64, generator=g)
    x[0, :16] = 0.0  # an all-zero block: scale 0 in the kernel order
    x[1, 16:32] *= 1e-9  # blocks whose kernel scale underflows E4M3
    x[2, 0] = 40.0  # sets the tensor scale
    gs = float(compute_global_scale(x, convention=order))
    assert gs == ref_nvfp4.global_scale(x, "kernel")
    want_codes, want_scales = _oracle(x, gs, order)
    assert not torch.equal(want_scales, ref_nvfp4.quantize_blocks(x, gs, "kernel")[1])

    eager = quantize(x, convention=order, fused=False)
    assert torch.equal(unpack_fp4(eager.packed), want_codes)
    assert torch.equal(eager.scales.float(), want_scales)
    assert torch.equal(_raw(quantize(x, convention=order.name).scales),
                       _raw(quantize(x, fused=False).scales))  # the registered kernel order

    gptq = gptq_quantize(x, torch.eye(64), convention=order).weight
    assert gptq is not None and torch.equal(gptq.packed, eager.packed)
    assert torch.equal(_raw(gptq.scales), _raw(eager.scales))

    routed = fused_route(x.numel(), 64, x.dtype, x.device, True, order=order)
    assert routed == (supports(order) and compiler_available("cpu"))
    assert supports(order) == (order is KERNEL_WITH_EPS)
    fused = quantize(x, convention=order, fused=True)  # eager again where not supported
    assert torch.equal(fused.packed, eager.packed)
    assert torch.equal(_raw(fused.scales), _raw(eager.scales))
    assert torch.equal(fake_quantize(x, convention=order, fused=True),
                       fake_quantize(x, convention=order, fused=False))


def test_check_steps_evaluates_no_type_hints_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_steps`` runs on every quantize / fake_quantize given an order object: it evaluated
    ArithmeticOrder's type hints each time (~0.14 ms, more than a small quantize itself). The
    enum fields are read once, at import; the check still names a bad step."""
    import typing

    def no_hints(*args: object, **kwargs: object) -> None:
        raise AssertionError("type hints evaluated on a call")

    monkeypatch.setattr(typing, "get_type_hints", no_hints)
    kernel = ORDERS[OrderName.VLLM_KERNEL]
    assert all(orders.check_steps(order) is order for order in ORDERS.values())
    assert fake_quantize(torch.randn(4, 32), convention=kernel).shape == (4, 32)
    bad = dataclasses.replace(kernel, e2m1_ties="even")
    with pytest.raises(ValueError, match=r"^the kernel order's e2m1_ties step is 'even', not a "
                       r"member of E2M1Ties \(EVEN, FIRST_NEAREST_SCALED_TABLE\)"):
        orders.check_steps(bad)
    nameless = dataclasses.replace(kernel, convention="mine")  # no OrderName: still one message
    with pytest.raises(ValueError, match=r"^the 'mine' order's convention step is 'mine', not a "
                       r"member of OrderName"):
        orders.check_steps(nameless)
    assert set(orders.ENUM_FIELDS) == {"convention", *STEP_FIELDS}
