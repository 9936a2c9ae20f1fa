"""Issue 33's renames ("one word per idea", docs/architecture.md's glossary): the new names do
the same as the old ones, bit for bit, and each old public name still works one release with a
DeprecationWarning."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nvfp4lab
from nvfp4lab import vocab
from nvfp4lab.checkpoint.formats import FORMATS
from nvfp4lab.codec import compute_global_scale, fake_quantize, quantize
from nvfp4lab.execution import NVFP4Linear, quantize_model
from nvfp4lab.orders import ORDERS
from nvfp4lab.vocab import OrderName


def test_order_name_is_the_vocabulary_and_the_old_names_warn() -> None:
    assert [m.value for m in OrderName] == [o.value for o in ORDERS]
    assert OrderName.KERNEL is OrderName.VLLM_KERNEL and OrderName("kernel").name == "VLLM_KERNEL"
    with pytest.warns(DeprecationWarning, match="use OrderName"):
        old = vocab.Convention
    assert old is OrderName
    with pytest.warns(DeprecationWarning, match="use OrderName"):
        assert nvfp4lab.Convention is OrderName
    assert nvfp4lab.ORDER_NAMES == nvfp4lab.CONVENTIONS == tuple(OrderName)


@pytest.mark.parametrize("order", list(OrderName))
def test_order_keyword_equals_convention_keyword(order: OrderName) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 3
    new, old = quantize(x, order=order), quantize(x, convention=order)
    assert torch.equal(new.packed, old.packed) and torch.equal(new.scales, old.scales)
    assert torch.equal(new.global_scale, old.global_scale)
    assert torch.equal(fake_quantize(x, order=order), fake_quantize(x, convention=order))
    assert torch.equal(compute_global_scale(x, order=order),
                       compute_global_scale(x, convention=order))


def test_order_and_convention_that_disagree_are_refused() -> None:
    x = torch.ones(1, 16)
    with pytest.raises(ValueError, match="order='modelopt' and convention='kernel' disagree"):
        quantize(x, order="modelopt", convention="kernel")
    assert torch.equal(quantize(x, order="modelopt", convention="modelopt").packed,
                       quantize(x, order="modelopt").packed)


def test_quantize_model_and_the_layer_take_order() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8))
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(a, backend="emulation", order="compressed-tensors", ignore=())
    quantize_model(b, backend="emulation", convention="compressed-tensors", ignore=())
    x = torch.randn(4, 32)
    assert torch.equal(a(x), b(x))
    new = NVFP4Linear.from_linear(model[0], order="modelopt")
    old = NVFP4Linear.from_linear(model[0], convention="modelopt")
    assert torch.equal(new.weight_packed, old.weight_packed)
    assert torch.equal(new.weight_global_scale, old.weight_global_scale)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_layer_names_old_fields_warn_and_read_the_new_ones(fmt: str) -> None:
    names = FORMATS[fmt].names
    for old, new in (("scale", "block_scale"), ("global_scale", "tensor_scale"),
                     ("decode", "decode_form")):
        with pytest.warns(DeprecationWarning, match=f"LayerNames.{old} is deprecated: use {new}"):
            assert getattr(names, old) == getattr(names, new)


def _fresh_import(name: str) -> object:
    import importlib
    import sys

    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_formats_packages_moved_to_number_formats_and_the_old_paths_warn() -> None:
    from nvfp4lab import number_formats
    from nvfp4lab.studies import number_formats as study

    with pytest.warns(DeprecationWarning, match="import nvfp4lab.number_formats"):
        old = _fresh_import("nvfp4lab.formats")
    assert old.get is number_formats.get and old.available() == number_formats.available()
    import nvfp4lab.formats.base as old_base

    assert old_base is number_formats.base
    with pytest.warns(DeprecationWarning, match="import nvfp4lab.studies.number_formats"):
        old_study = _fresh_import("nvfp4lab.studies.formats")
    assert old_study.default_configs is study.default_configs
