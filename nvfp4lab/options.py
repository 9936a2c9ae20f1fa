"""The options of the NVFP4 quantization pipeline (:mod:`nvfp4lab.codec`), validated once.

Plain NVFP4 is the default of every option: ``block_size=16`` (or a ``(rows, cols)`` tile),
``convention="kernel"``, ``pad=False``, ``nonfinite="raise"``, ``rounding="rne"``,
``scale_selection="amax"``, no ``hadamard`` rotation. See the codec's docstring for what each
option does; :func:`nvfp4_options` checks them and names the accepted values of a bad one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nvfp4lab.blocks import check_stochastic
from nvfp4lab.constants import BLOCK_SIZE, E2M1_MAX, GLOBAL_SCALE_NUMERATOR
from nvfp4lab.hadamard import check_seed
from nvfp4lab.orders import ArithmeticOrder, check_steps
from nvfp4lab.orders import get as get_order
from nvfp4lab.vocab import NonFinite, OrderName, Rounding, ScaleSelection, check_choice

__all__ = [
    "DEFAULT_SEARCH_TARGETS",
    "FOUR_OVER_SIX_SCALE_MAX",
    "NVFP4Options",
    "block_shape",
    "nvfp4_options",
    "order_argument",
]

#: E4M3 "max" in the tensor scale of the non-default scale selections (Four Over Six paper).
FOUR_OVER_SIX_SCALE_MAX: float = 256.0
#: Targets (the value a block's max maps to) tried by ``scale_selection="mse_search"``.
DEFAULT_SEARCH_TARGETS: tuple[float, ...] = (6.0, 7.0, 6.5, 5.5, 5.0, 4.5, 4.0, 3.5)
_FOUR_OVER_SIX_TARGETS: tuple[float, ...] = (6.0, 4.0)


# --------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NVFP4Options:
    """Validated options of the pipeline (build with :func:`nvfp4_options`).

    ``block_shape`` is ``(rows, cols)``: ``(1, 16)`` for plain NVFP4 blocks along K.
    """

    block_shape: tuple[int, int] = (1, BLOCK_SIZE)
    convention: OrderName = OrderName.VLLM_KERNEL
    pad: bool = False
    nonfinite: NonFinite = NonFinite.RAISE
    rounding: Rounding = Rounding.RNE
    generator: torch.Generator | int | None = None
    scale_selection: ScaleSelection = ScaleSelection.AMAX
    search_targets: tuple[float, ...] | None = None
    hadamard: int | None = None
    arithmetic: ArithmeticOrder | None = None  #: a custom order given as ``convention=``

    @property
    def order(self) -> ArithmeticOrder:
        """The :class:`~nvfp4lab.orders.ArithmeticOrder` the pipeline runs: the custom one given
        as ``convention=``, else the registered order of ``convention``."""
        return self.arithmetic if self.arithmetic is not None else get_order(self.convention)

    @property
    def plain(self) -> bool:
        """Whether the options are plain NVFP4 apart from the order and padding (1-D blocks, RNE,
        amax scales, no rotation, NaN/Inf raising): what the fused kernels implement."""
        return (
            self.block_shape[0] == 1
            and self.rounding == Rounding.RNE
            and self.scale_selection == ScaleSelection.AMAX
            and self.hadamard is None
            and self.nonfinite == NonFinite.RAISE
        )

    @property
    def targets(self) -> tuple[float, ...]:
        """Block-max targets tried per block (6 = plain amax scaling)."""
        if self.scale_selection == ScaleSelection.FOUR_OVER_SIX:
            return _FOUR_OVER_SIX_TARGETS
        if self.scale_selection == ScaleSelection.MSE_SEARCH:
            return self.search_targets or DEFAULT_SEARCH_TARGETS
        return (E2M1_MAX,)

    @property
    def global_scale_numerator(self) -> float:
        """2688 (= 448·6) for amax scaling; 1536 (= 256·6) for the other selections."""
        if self.scale_selection == ScaleSelection.AMAX:
            return GLOBAL_SCALE_NUMERATOR
        return FOUR_OVER_SIX_SCALE_MAX * E2M1_MAX

    @property
    def block_elements(self) -> int:
        return self.block_shape[0] * self.block_shape[1]

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element, tensor scale excluded (4 + 8 / elements per block scale)."""
        return 4.0 + 8.0 / self.block_elements


def block_shape(block_size: object) -> tuple[int, int]:
    shape = tuple(block_size) if isinstance(block_size, tuple | list) else (1, block_size)

    def ok(n: object, even: bool) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n > 0 and not (even and n % 2)

    if len(shape) != 2 or not (ok(shape[0], False) and ok(shape[1], True)):
        raise ValueError(
            f"block_size must be a positive even integer (elements per scale along K) or a "
            f"(rows, cols) tile with cols even, e.g. 16 or (16, 16); got {block_size!r}"
        )
    return shape  # type: ignore[return-value]


def _search_targets(targets: object) -> tuple[float, ...]:
    try:
        if isinstance(targets, str | bytes):
            raise TypeError
        values = tuple(float(t) for t in targets)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        values = ()
    if not values or not all(0.0 < t < float("inf") for t in values):
        raise ValueError(
            f"search_targets must be a non-empty sequence of finite numbers > 0 (the value a "
            f"block's max maps to; 6 = amax scaling), got {targets!r}"
        )
    return values


def order_argument(
    order: str | ArithmeticOrder | None, convention: str | ArithmeticOrder | None
) -> str | ArithmeticOrder:
    """The arithmetic order a call names: ``order=`` (its keyword since issue 33) or
    ``convention=`` (the old keyword, still accepted); the default order (``"kernel"``, vLLM's
    CUDA quantize kernel's arithmetic) when neither is given. Both given and different:
    ValueError naming both."""
    if order is None:
        return OrderName.VLLM_KERNEL if convention is None else convention
    if convention is not None and convention != order:
        raise ValueError(
            f"order={order!r} and convention={convention!r} disagree: convention= is the old "
            "name of order=, give only order="
        )
    return order


def nvfp4_options(
    *,
    block_size: int | tuple[int, int] = BLOCK_SIZE,
    order: str | ArithmeticOrder | None = None,
    convention: str | ArithmeticOrder | None = None,
    pad: bool = False,
    nonfinite: str = NonFinite.RAISE,
    rounding: str = Rounding.RNE,
    generator: torch.Generator | int | None = None,
    scale_selection: str = ScaleSelection.AMAX,
    search_targets: Sequence[float] | None = None,
    hadamard: int | None = None,
) -> NVFP4Options:
    """Validate the pipeline's options; ValueError names the bad one and the accepted values.

    ``order`` (or its old name ``convention``, :func:`order_argument`): an
    :class:`~nvfp4lab.vocab.OrderName` name, or an :class:`~nvfp4lab.orders.ArithmeticOrder` (a
    custom order, e.g. a registered one with a step changed by ``dataclasses.replace``).
    """
    convention = order_argument(order, convention)
    shape = block_shape(block_size)
    custom = check_steps(convention) if isinstance(convention, ArithmeticOrder) else None
    conv = custom.convention if custom else check_choice("convention", convention, OrderName)
    policy = check_choice("nonfinite policy", nonfinite, NonFinite)
    rnd = check_choice("rounding", rounding, Rounding)
    selection = check_choice("scale_selection", scale_selection, ScaleSelection)
    if not isinstance(pad, bool):
        raise ValueError(f"pad must be True or False, got {pad!r}")
    if pad and shape[0] != 1:
        raise ValueError(f"pad=True only applies to 1-D blocks along K, got block_size {shape}")
    if rnd == Rounding.STOCHASTIC and generator is None:
        raise ValueError(
            "rounding='stochastic' needs generator=<torch.Generator or int seed> so that results "
            "are reproducible"
        )
    if rnd == Rounding.STOCHASTIC:
        check_stochastic(custom if custom is not None else get_order(conv))
    if rnd == Rounding.STOCHASTIC and not isinstance(generator, torch.Generator):
        check_seed(generator, "generator")
    if rnd == Rounding.RNE and generator is not None:
        raise ValueError("generator= only applies to rounding='stochastic' (rounding is 'rne')")
    if search_targets is not None:
        if selection != ScaleSelection.MSE_SEARCH:
            raise ValueError("search_targets= only applies to scale_selection='mse_search'")
        search_targets = _search_targets(search_targets)
    if hadamard is not None:
        check_seed(hadamard, "hadamard")
        if pad:
            raise ValueError(
                "pad=True cannot be combined with hadamard (the rotation needs K % 16 == 0)"
            )
    return NVFP4Options(
        shape, conv, pad, policy, rnd, generator, selection, search_targets, hadamard, custom  # type: ignore[arg-type]
    )
