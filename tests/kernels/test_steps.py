"""Every kernel declines every arithmetic step it does not implement (issue 32, case 15).

The C++ block encode used to map an E4M3 rounding, decode rule or tie rule it did not know onto
the kernel order's, so an order added by the recipe (a new step member) came back from
``quantize`` with the kernel order's scales. Each kernel now holds a table of the step members it
implements (:mod:`nvfp4lab.kernels.steps`); here, for each shipped order and each step field,
the step is swapped for every member a kernel does not list, for a member of an enum made up
here and for a plain sentinel object, and each kernel must decline (its ``supports`` False, so
the eager pipeline runs). Then the tables are checked against the eager codec: every single-step
swap the block encode accepts gives the eager bits.
"""

from __future__ import annotations

import dataclasses
from enum import Enum, auto
from types import ModuleType

import pytest
import torch

import nvfp4lab
from nvfp4lab import kernels
from nvfp4lab.kernels import block_encode, gptq_columns, graphs, lut_decode, native
from nvfp4lab.kernels.steps import STEP_FIELDS, implements, missing
from nvfp4lab.orders import ORDERS, ArithmeticOrder, E4M3Rounding
from nvfp4lab.vocab import OrderName

#: Every kernel that reads an arithmetic order, with its table.
KERNELS: tuple[ModuleType, ...] = (graphs, block_encode, gptq_columns, lut_decode)


class NewStep(Enum):
    """A member no kernel has been taught: what a new order's new step looks like."""

    INVENTED = auto()


#: Not even an enum member (a fake order object's step).
SENTINEL = object()


def step_enum(name: str) -> type[Enum]:
    return type(getattr(ORDERS[OrderName.VLLM_KERNEL], name))


def unimplemented(kernel: ModuleType, name: str) -> list[object]:
    """The values of step ``name`` the kernel's table does not list: real members, the made-up
    member and the sentinel."""
    listed = kernel.STEPS[name]
    return [m for m in step_enum(name) if m not in listed] + [NewStep.INVENTED, SENTINEL]


def swapped(order: ArithmeticOrder, name: str, value: object) -> ArithmeticOrder:
    return dataclasses.replace(order, **{name: value})


def test_the_step_fields_are_the_orders_enum_fields() -> None:
    assert STEP_FIELDS == ("scale_form", "tensor_scale", "block_scale", "e4m3_rounding",
                           "element_scaling", "e2m1_ties", "decode")
    for kernel in KERNELS:
        assert set(kernel.STEPS) == set(STEP_FIELDS), kernel.__name__
        for name, members in kernel.STEPS.items():
            assert members and all(isinstance(m, step_enum(name)) for m in members)


def test_every_kernel_declines_every_step_it_does_not_implement() -> None:
    cpu = torch.device("cpu")
    declined = 0
    for order in ORDERS.values():
        for name in STEP_FIELDS:
            for kernel in KERNELS:
                for value in unimplemented(kernel, name):
                    other = swapped(order, name, value)
                    assert not kernel.supports(other), (kernel.__name__, order.name, name, value)
                    assert name in missing(kernel.STEPS, other)
                    declined += 1
            for value in (NewStep.INVENTED, SENTINEL):  # no kernel: the route stays eager
                other = swapped(order, name, value)
                for fused in (None, True):
                    assert not kernels.fused_route(1 << 16, 256, torch.bfloat16, cpu, fused,
                                                   order=other, native=True)
    assert declined >= 4 * len(STEP_FIELDS) * len(KERNELS) * 2


def test_a_table_without_a_step_field_declines() -> None:
    table = dict(block_encode.STEPS)
    del table["e4m3_rounding"]
    assert not implements(table, ORDERS[OrderName.VLLM_KERNEL])
    assert implements(block_encode.STEPS, ORDERS[OrderName.VLLM_KERNEL])


def test_the_shipped_orders_keep_their_kernels() -> None:
    assert all(block_encode.supports(o) and lut_decode.supports(o) for o in ORDERS.values())
    assert [o.name for o in ORDERS.values() if graphs.supports(o)] == [
        OrderName.VLLM_KERNEL, OrderName.COMPRESSED_TENSORS]
    assert [o.name for o in ORDERS.values() if gptq_columns.supports(o)] == [OrderName.VLLM_KERNEL]


@pytest.mark.parametrize("fused", [None, True])
def test_quantize_with_an_unknown_e4m3_rounding_never_returns_the_kernel_orders_scales(
    fused: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVFP4LAB_FUSED", "on")
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    kernel = nvfp4lab.quantize(x, convention=OrderName.VLLM_KERNEL, fused=False)
    for value in (NewStep.INVENTED, SENTINEL):
        order = swapped(ORDERS[OrderName.VLLM_KERNEL], "e4m3_rounding", value)
        try:
            got = nvfp4lab.quantize(x, convention=order, fused=fused)
        except (NotImplementedError, ValueError) as err:  # the options or eager codec refuse it
            assert "E4M3 rounding" in str(err) or "e4m3_rounding step" in str(err)
            continue
        assert not torch.equal(got.scales.view(torch.uint8), kernel.scales.view(torch.uint8))
        eager = nvfp4lab.quantize(x, convention=order, fused=False)
        assert torch.equal(got.scales.view(torch.uint8), eager.scales.view(torch.uint8))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _outcome(x: torch.Tensor, order: ArithmeticOrder, fused: bool
             ) -> tuple[str, ...] | tuple[torch.Tensor, ...]:
    """(packed, scale bytes, fake bits) of ``x`` in ``order``, or the error's type name."""
    try:
        q = nvfp4lab.quantize(x, convention=order, fused=fused)
        fake = nvfp4lab.fake_quantize(x, convention=order, fused=fused)
    except (NotImplementedError, ValueError) as err:
        return (type(err).__name__,)
    return q.packed, q.scales.view(torch.uint8), _bits(fake)


@pytest.mark.skipif(not native.available(), reason="the native C++ library cannot be built here")
def test_every_swap_the_block_encode_accepts_gives_the_eager_bits(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tables are honest: each single-step swap of each shipped order to another real member
    that the block encode still takes gives eager's bits (or both refuse the order)."""
    monkeypatch.setenv("NVFP4LAB_FUSED", "on")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 256, generator=g) * torch.logspace(-4, 4, 256)
    x[0, :16] = 0  # a zero block
    accepted = 0
    for order in ORDERS.values():
        for name in STEP_FIELDS:
            for member in step_enum(name):
                other = swapped(order, name, member)
                if not block_encode.supports(other):
                    continue
                accepted += 1
                for dtype in (torch.float32, torch.bfloat16):
                    xd = x.to(dtype)
                    fused = _outcome(xd, other, True)
                    eager = _outcome(xd, other, False)
                    assert len(fused) == len(eager), (order.name, name, member, fused, eager)
                    for a, b in zip(fused, eager, strict=True):
                        same = a == b if isinstance(a, str) else torch.equal(a, b)
                        assert same, (order.name, name, member, dtype)
    assert accepted > len(ORDERS) * len(STEP_FIELDS)


def test_an_unknown_e4m3_rounding_reaches_no_kernel_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ encode's flags exist only for listed members: asking for another is an error."""
    order = swapped(ORDERS[OrderName.VLLM_KERNEL], "e4m3_rounding", NewStep.INVENTED)
    with pytest.raises(ValueError, match="does not implement every step"):
        block_encode.order_flags(order)
    assert block_encode.order_flags(ORDERS[OrderName.VLLM_KERNEL]) == block_encode.order_flags(
        swapped(ORDERS[OrderName.VLLM_KERNEL], "e4m3_rounding", E4M3Rounding.NEAREST_EVEN))


@pytest.mark.skipif(not native.available(), reason="the native C++ library cannot be built here")
def test_a_quantize_reads_an_orders_steps_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block encode's flags are asked three times per quantize (the route, the first pass,
    the encode): each read every step of the order (~2 us, 4 us added to a 90 us small
    quantize). Now once per order object, and the answer stays the order's own."""
    read: list[ArithmeticOrder] = []
    real = block_encode.implements

    def counting(table: object, order: ArithmeticOrder) -> bool:
        read.append(order)
        return real(table, order)  # type: ignore[arg-type]

    monkeypatch.setattr(block_encode, "implements", counting)
    order = dataclasses.replace(ORDERS[OrderName.VLLM_KERNEL])  # a new object: never seen
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    got = [nvfp4lab.quantize(x, convention=order, fused=True) for _ in range(3)]
    assert read == [order]
    eager = nvfp4lab.quantize(x, convention=order, fused=False)
    assert all(torch.equal(q.packed, eager.packed) for q in got)
    other = swapped(order, "e4m3_rounding", NewStep.INVENTED)
    assert block_encode.supports(order) and not block_encode.supports(other)
    many = [dataclasses.replace(order) for _ in range(3 * block_encode._FLAGS_SEEN_MAX)]
    assert all(block_encode.supports(o) for o in many)
    assert len(block_encode._FLAGS_SEEN) <= block_encode._FLAGS_SEEN_MAX  # bounded
