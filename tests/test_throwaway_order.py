"""The order recipe of docs/architecture.md, kept true by a throw-away order run through every path.

The order is the kernel's arithmetic with its block scales rounded to E4M3 half up (ggml's
``ggml_fp32_to_ue4m3``) instead of to nearest even: a new combination of existing step members,
built at run time the way the recipe's last paragraph says users may (``dataclasses.replace``)
and put into :data:`nvfp4lab.orders.ORDERS` for this test only. Its oracle is written here from
the steps (the kernel oracle's scale, element and code steps, ggml's rounding for the scale).

Finding: an order cannot be registered under a NEW name at run time. ``ORDERS`` is keyed by
:class:`~nvfp4lab.vocab.OrderName`, a ``StrEnum`` that cannot grow, and
``ArithmeticOrder.convention`` must be one of its members (``orders.check_steps``); so the
throw-away order borrows the kernel's name and is registered in place of the kernel's entry.
Likewise a step member that no enum holds yet cannot be added at run time (the recipe's step 4
edits ``orders.py``); the kernels' declining of unknown members is checked by
``tests/kernels/test_steps.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nvfp4lab import orders
from nvfp4lab.codec import dequantize, fake_quantize, quantize
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.execution import gptq
from nvfp4lab.execution.gptq import gptq_quantize
from nvfp4lab.kernels import block_encode, gptq_columns, graphs, lut_decode, steps
from nvfp4lab.oracles.numbers import (
    F32_ONE_SIXTH,
    decode_e2m1_code,
    decode_e4m3,
    round_e2m1,
    round_f32,
)
from nvfp4lab.oracles.nvfp4 import ggml_fp32_to_ue4m3
from nvfp4lab.orders import E4M3Rounding
from nvfp4lab.vocab import OrderName

E4M3_MAX = 448.0
E2M1_MAX = 6.0

#: The throw-away order: the kernel's steps but the E4M3 rounding of the block scale.
HALF_UP_KERNEL = dataclasses.replace(
    orders.ORDERS[OrderName.VLLM_KERNEL],
    e4m3_rounding=E4M3Rounding.HALF_UP_UE4M3,
    source="a throw-away order of tests/test_throwaway_order.py",
)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> orders.ArithmeticOrder:
    """The throw-away order registered in ``ORDERS`` (under the kernel's name) for one test."""
    monkeypatch.setitem(orders.ORDERS, OrderName.VLLM_KERNEL, HALF_UP_KERNEL)
    return HALF_UP_KERNEL


def oracle(x: torch.Tensor, gs: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [..., K], scales float32 [..., K/16]) of float32 ``x`` in the throw-away
    order, one Python float at a time; ``gs``: the ENCODE tensor scale."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float64).tolist()
    codes: list[list[int]] = []
    scales: list[list[float]] = []
    for row in rows:
        row_codes: list[int] = []
        row_scales: list[float] = []
        for start in range(0, len(row), BLOCK_SIZE):
            block = row[start:start + BLOCK_SIZE]
            amax = max(abs(v) for v in block)
            pre = min(round_f32(gs * round_f32(amax * F32_ONE_SIXTH)), E4M3_MAX)
            scale = decode_e4m3(ggml_fp32_to_ue4m3(pre))  # the one changed step
            multiplier = (0.0 if scale == 0.0
                          else round_f32(1.0 / round_f32(scale * round_f32(1.0 / gs))))
            row_codes += [round_e2m1(min(max(round_f32(v * multiplier), -E2M1_MAX), E2M1_MAX))
                          for v in block]
            row_scales.append(scale)
        codes.append(row_codes)
        scales.append(row_scales)
    return (torch.tensor(codes, dtype=torch.uint8).reshape(x.shape),
            torch.tensor(scales, dtype=torch.float32).reshape(*x.shape[:-1], -1))


def oracle_decode(codes: torch.Tensor, scales: torch.Tensor, gs: float) -> torch.Tensor:
    """float32 ``value(code) * f32(s / gs)`` per element (the kernel's decode)."""
    factors = [round_f32(s / gs) for s in scales.reshape(-1).tolist()]
    values = [round_f32(decode_e2m1_code(c) * factors[i // BLOCK_SIZE])
              for i, c in enumerate(codes.reshape(-1).tolist())]
    return torch.tensor(values, dtype=torch.float32).reshape(codes.shape)


def sample(rows: int = 8, k: int = 64, seed: int = 0) -> torch.Tensor:
    """float32 ``[rows, k]``: normal values with a range of block magnitudes (scales that land
    between E4M3 neighbours, where half up and nearest even differ) and one all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x *= torch.logspace(-3, 2, rows).unsqueeze(1)
    x[0, :BLOCK_SIZE] = 0.0
    return x


def test_the_order_is_new_arithmetic() -> None:
    """The throw-away order's scales differ from the kernel's somewhere on the sample (else the
    test below could pass with the kernel's arithmetic)."""
    x = sample()
    ours = quantize(x, convention=HALF_UP_KERNEL, fused=False)
    kernel = quantize(x, convention=OrderName.VLLM_KERNEL, fused=False)
    assert not torch.equal(ours.scales.float(), kernel.scales.float())


@pytest.mark.parametrize("by_name", [False, True], ids=["order-object", "registered-name"])
def test_eager_quantize_dequantize_fake_quantize_match_the_oracle(
        registered: orders.ArithmeticOrder, by_name: bool) -> None:
    x = sample()
    convention = OrderName.VLLM_KERNEL if by_name else registered
    q = quantize(x, convention=convention, fused=False)
    gs = float(q.global_scale)
    assert gs == round_f32(2688.0 / float(x.abs().max()))
    codes, scales = oracle(x, gs)
    assert torch.equal(q.codes(), codes)
    assert torch.equal(q.scales.float(), scales)
    want = oracle_decode(codes, scales, gs)
    assert torch.equal(dequantize(q, torch.float32, fused=False), want)
    assert torch.equal(fake_quantize(x, convention=convention, fused=False), want)


def test_fused_route_declines_or_agrees(registered: orders.ArithmeticOrder) -> None:
    """Each kernel's step table decides by the steps: the compiled graphs lack half-up E4M3
    rounding and decline; ``quantize(fused=True)`` still gives the eager (oracle) answer."""
    assert not graphs.supports(registered)
    assert steps.missing(graphs.STEPS, registered) == ["e4m3_rounding"]
    x = sample()
    fused = quantize(x, convention=registered, fused=True)
    eager = quantize(x, convention=registered, fused=False)
    assert torch.equal(fused.packed, eager.packed)
    assert torch.equal(fused.scales.float(), eager.scales.float())
    assert torch.equal(fake_quantize(x, convention=registered, fused=True),
                       fake_quantize(x, convention=registered, fused=False))
    # GPTQ's C++ column loop and the LUT decode take the codec's E4M3 scales, whatever rounded them
    assert gptq_columns.supports(registered)
    assert lut_decode.supports(registered)


def test_cpp_block_encode_declines_or_agrees(registered: orders.ArithmeticOrder) -> None:
    """The C++ block encode implements each step of the order (half-up rounding is llama.cpp's)
    and then agrees with the oracle bit for bit; an order it lacks a step of is refused."""
    if not block_encode.supports(registered):
        with pytest.raises(ValueError, match="does not implement every step"):
            block_encode.order_flags(registered)
        return
    try:
        x = sample()
        gs = torch.tensor([round_f32(2688.0 / float(x.abs().max()))])
        packed, scales = block_encode.encode(x, gs, registered)
    except (RuntimeError, ImportError, OSError) as exc:  # no compiler here
        pytest.skip(f"C++ block encode unavailable: {exc}")
    codes, want_scales = oracle(x, float(gs))
    assert torch.equal(scales.float(), want_scales)
    assert torch.equal(packed, quantize(x, convention=registered, fused=False).packed)
    assert torch.equal(quantize(x, convention=registered, fused=False).codes(), codes)


def test_unknown_step_combination_is_declined_by_the_cpp_encode() -> None:
    """A combination the C++ encode has no bits for (pre-scaled elements with even ties) is
    declined by its table rule, not mapped onto another order."""
    odd = dataclasses.replace(HALF_UP_KERNEL,
                              element_scaling=orders.ElementScaling.PRESCALE_ONLY)
    assert not block_encode.supports(odd)
    assert not graphs.supports(odd)


@pytest.mark.parametrize("loop", ["cpp", "eager"])
def test_gptq_runs_the_order(registered: orders.ArithmeticOrder, loop: str,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """GPTQ with an identity Hessian is RTN in the order, bit for bit, on its C++ column loop and
    on the eager loop (which runs where the C++ loop declines an order's step)."""
    if loop == "eager":
        monkeypatch.setattr(gptq, "native_columns_support", lambda order: False)
    w = sample(rows=8, k=32, seed=1)
    h = torch.eye(32)
    got = gptq_quantize(w, h, convention=registered).weight
    want = quantize(w, convention=registered, fused=False)
    assert torch.equal(got.packed, want.packed)
    assert torch.equal(got.scales.float(), want.scales.float())
    codes, scales = oracle(w, float(want.global_scale))
    assert torch.equal(got.codes(), codes)
    assert torch.equal(got.scales.float(), scales)
