"""nvfp4lab.options: plain NVFP4 is the defaults; every bad option names itself and its value."""

from __future__ import annotations

import re

import pytest
import torch

from nvfp4lab.options import (
    DEFAULT_SEARCH_TARGETS,
    FOUR_OVER_SIX_SCALE_MAX,
    NVFP4Options,
    block_shape,
    nvfp4_options,
)


def test_defaults_are_plain_nvfp4() -> None:
    opts = nvfp4_options()
    assert opts == NVFP4Options()
    assert (opts.block_shape, opts.convention, opts.pad, opts.nonfinite, opts.rounding) == (
        (1, 16), "kernel", False, "raise", "rne")
    assert (opts.generator, opts.scale_selection, opts.search_targets, opts.hadamard) == (
        None, "amax", None, None)
    assert opts.targets == (6.0,)
    assert opts.global_scale_numerator == 2688.0 == 448.0 * 6.0
    assert opts.block_elements == 16 and opts.bits_per_element == 4.5


@pytest.mark.parametrize(
    ("selection", "targets", "numerator"),
    [
        ("amax", (6.0,), 2688.0),
        ("four_over_six", (6.0, 4.0), 1536.0),
        ("mse_search", (6.0, 7.0, 6.5, 5.5, 5.0, 4.5, 4.0, 3.5), 1536.0),
    ],
)
def test_targets_and_numerator_per_scale_selection(
    selection: str, targets: tuple[float, ...], numerator: float
) -> None:
    opts = nvfp4_options(scale_selection=selection)
    assert opts.targets == targets
    assert opts.global_scale_numerator == numerator
    assert numerator == (448.0 if selection == "amax" else FOUR_OVER_SIX_SCALE_MAX) * 6.0


def test_search_targets_become_floats_and_replace_the_default() -> None:
    opts = nvfp4_options(scale_selection="mse_search", search_targets=[6, 5.25, "4"])
    assert opts.search_targets == (6.0, 5.25, 4.0) == opts.targets
    assert all(type(t) is float for t in opts.targets)
    assert DEFAULT_SEARCH_TARGETS[0] == 6.0  # the amax target is tried first by default


@pytest.mark.parametrize(
    ("size", "shape", "bits"),
    [(16, (1, 16), 4.5), (32, (1, 32), 4.25), (2, (1, 2), 8.0), ((16, 16), (16, 16), 4 + 8 / 256),
     ([4, 8], (4, 8), 4.25), ((3, 2), (3, 2), 4 + 8 / 6)],
)
def test_block_shapes(size: object, shape: tuple[int, int], bits: float) -> None:
    assert block_shape(size) == shape
    opts = nvfp4_options(block_size=size)  # type: ignore[arg-type]
    assert opts.block_shape == shape and opts.bits_per_element == bits


@pytest.mark.parametrize("size", [15, 0, -16, True, 16.0, "16", (16, 15), (0, 16), (1, 2, 3), ()])
def test_bad_block_size_names_the_value(size: object) -> None:
    with pytest.raises(ValueError, match=rf"block_size must be .*; got {re.escape(repr(size))}$"):
        nvfp4_options(block_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"convention": "kernal"}, r"unknown convention 'kernal'; accepted values: 'kernel', "
                                   r"'compressed-tensors', 'modelopt'"),
        ({"nonfinite": "ignore"}, r"unknown nonfinite policy 'ignore'; accepted values: "
                                  r"'raise', 'propagate'"),
        ({"rounding": "nearest"}, r"unknown rounding 'nearest'; accepted values: 'rne', "
                                  r"'stochastic'"),
        ({"scale_selection": "max"}, r"unknown scale_selection 'max'; accepted values: 'amax', "
                                     r"'four_over_six', 'mse_search'"),
        ({"pad": 1}, r"pad must be True or False, got 1"),
        ({"pad": True, "block_size": (2, 16)}, r"pad=True only applies to 1-D blocks.*\(2, 16\)"),
        ({"rounding": "stochastic"}, r"rounding='stochastic' needs generator="),
        ({"rounding": "stochastic", "generator": -3}, r"generator must be a non-negative "
                                                      r"integer seed.*got -3"),
        ({"generator": 4}, r"generator= only applies to rounding='stochastic'"),
        ({"search_targets": [6.0]}, r"search_targets= only applies to "
                                    r"scale_selection='mse_search'"),
        ({"scale_selection": "mse_search", "search_targets": []}, r"got \[\]"),
        ({"scale_selection": "mse_search", "search_targets": [6.0, 0.0]}, r"got \[6\.0, 0\.0\]"),
        ({"scale_selection": "mse_search", "search_targets": "6"}, r"got '6'"),
        ({"scale_selection": "mse_search", "search_targets": [float("inf")]}, r"got \[inf\]"),
        ({"scale_selection": "mse_search", "search_targets": ["x"]}, r"got \['x'\]"),
        ({"hadamard": -1}, r"hadamard must be a non-negative integer seed.*got -1"),
        ({"hadamard": "0"}, r"hadamard must be a non-negative integer seed.*got '0'"),
        ({"hadamard": 0, "pad": True}, r"pad=True cannot be combined with hadamard"),
    ],
)
def test_each_bad_option_is_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        nvfp4_options(**options)


def test_valid_non_default_options_are_kept() -> None:
    gen = torch.Generator().manual_seed(0)
    opts = nvfp4_options(convention="compressed-tensors", pad=True, nonfinite="propagate",
                         rounding="stochastic", generator=gen, scale_selection="four_over_six")
    assert opts.convention == "compressed-tensors" and opts.pad and opts.generator is gen
    assert opts.nonfinite == "propagate" and opts.rounding == "stochastic"
    assert nvfp4_options(rounding="stochastic", generator=7).generator == 7
    assert nvfp4_options(hadamard=3).hadamard == 3
    assert nvfp4_options(convention="modelopt").global_scale_numerator == 2688.0
    with pytest.raises(AttributeError):
        opts.pad = False  # type: ignore[misc]  # frozen: validated once
