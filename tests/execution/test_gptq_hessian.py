"""``gptq_hessian.all_finite``: the one-pass sum test and its element-by-element fallback,
against ``torch.isfinite(m).all()`` on matrices with every kind of non-finite value placed
anywhere, and on finite matrices whose sum overflows."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.execution.gptq_hessian import all_finite


def _oracle(m: torch.Tensor) -> bool:
    return bool(torch.isfinite(m).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_all_finite_matches_isfinite_everywhere(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(300, 300, generator=gen, dtype=torch.float64).to(dtype)
    assert all_finite(base) is True
    cases = []
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in ((0, 0), (299, 299), (257, 3), (3, 257)):  # both sides of a 256-row chunk
            m = base.clone()
            m[where] = bad
            cases.append(m)
    both = base.clone()
    both[1, 1], both[280, 7] = float("inf"), float("-inf")  # the sum is NaN, not inf
    cases.append(both)
    for m in cases:
        assert all_finite(m) is _oracle(m) is False


def test_all_finite_finite_matrix_whose_sum_overflows() -> None:
    big = torch.finfo(torch.float64).max / 2
    m = torch.full((300, 300), big, dtype=torch.float64)
    assert not torch.isfinite(m.sum())  # the fast test cannot decide: the fallback must
    assert all_finite(m) is _oracle(m) is True
    m[299, 0] = float("nan")
    assert all_finite(m) is _oracle(m) is False


def test_all_finite_empty() -> None:
    assert all_finite(torch.empty(0, 0, dtype=torch.float64)) is True
