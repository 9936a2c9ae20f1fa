"""NVFP4 research variants: rounding, block-scale selection, 2-D blocks, Hadamard, tensor scale.

Every option is a keyword of :func:`fake_quantize` / :func:`quantize` (and of the ``"nvfp4"``
format in :mod:`nvfp4lab.formats`). The defaults reproduce :mod:`nvfp4lab.quantize` bit for bit;
whenever the options allow it, the call is delegated to that module.

Options
-------
``convention``: ``"kernel"`` (default) | ``"compressed-tensors"`` — the arithmetic order of
    :mod:`nvfp4lab.quantize` (amax/target in the input dtype, division by ``s/gs`` and zero
    scales replaced by 0.125 for compressed-tensors; float32 reciprocal multiply for kernel).
``rounding``: ``"rne"`` (default) | ``"stochastic"``. Stochastic rounding picks the upper E2M1
    neighbour of ``v = x·gs/s`` with probability ``(v - lo)/(hi - lo)``, so ``E[q] = v`` inside
    ``[-6, 6]``; values clamped at ±6 (a block max whose E4M3 scale rounded down, by at most
    1/16 relative) keep a deterministic bias. Needs ``generator=`` (a ``torch.Generator``, or an
    int seed for a new generator on the input's device: CPU and CUDA generators draw different
    streams); with several scale candidates the choice is made with RNE, then the chosen scale
    is encoded stochastically.
``scale_selection``: ``"amax"`` (default, block max → 6) | ``"four_over_six"`` (per block try
    max → 6 and max → 4, i.e. a 1.5× larger scale, keep the lower block squared error, ties keep
    max → 6; "Four Over Six", arXiv 2512.02010) | ``"mse_search"`` (try every target of
    ``search_targets``, default :data:`DEFAULT_SEARCH_TARGETS`; targets above 6 clip the block
    max). With a computed tensor scale, both non-default selections use the paper's
    ``gs = 256·6/amax`` (E4M3 max 448 replaced by 256) so that the 1.5× scale of the largest block
    still fits E4M3 (256·1.5 = 384 ≤ 448); targets below ``6·256/448 ≈ 3.43`` saturate there.
``block_shape``: ``(1, 16)`` (default) | ``(16, 16)``: one scale per 16×16 tile of a 2-D
    ``[M, K]`` tensor (both dims multiples of 16). The packed form stores it as the standard
    ``[M, K/16]`` scale matrix with each tile's scale repeated on its 16 rows, so any NVFP4
    kernel reads it; storage is 4 + 8/256 bits/element when the tile scales are kept once.
``hadamard``: ``None`` (default) | int seed: rotate along K by the seeded 16-point block
    Hadamard of :mod:`nvfp4lab.hadamard` before quantizing. ``fake_quantize`` rotates back, so
    its error is comparable with the other options; ``quantize`` returns a
    :class:`RotatedNVFP4Tensor` holding the ROTATED tensor's codes (what a GEMM consumes; rotate
    the other operand with :func:`nvfp4lab.hadamard.rotate_gemm_operands`) whose ``dequantize``
    rotates back; ``linear``/``NVFP4Linear`` refuse it.
``global_scale``: ``"amax"`` (default: ``2688/amax``, or ``1536/amax`` for the non-default scale
    selections) | an explicit ENCODE-convention float or ``[1]`` tensor | ``None``: no tensor
    scale (``gs = 1``, block scales alone must cover the data's range — E4M3 spans 2^-9..448, so
    data much smaller than ~1e-2 or larger than ~2.7e3 loses blocks to underflow/saturation).
    NOTE: ``None`` here means "no tensor scale", unlike ``nvfp4lab.quantize(x, None)``.
``pad`` (bool, ``(1, 16)`` only) and ``nonfinite`` (``"raise"`` | ``"propagate"``) as in
    :func:`nvfp4lab.quantize.quantize`.

Measured on the seeded 2048×2048 float32 tensors of :func:`nvfp4lab.format_study.sample`
(NMSE; tests/test_variants.py pins the N(0,1) ones):

====================  ========  ===============  ==============================================
option                N(0,1)    Student-t(ν=3)   note
====================  ========  ===============  ==============================================
defaults (amax, RNE)  9.04e-3   8.22e-3          20.44 dB on N(0,1)
four_over_six         7.56e-3   7.57e-3          -16.4 % / -8.0 % vs defaults
mse_search            6.77e-3   7.08e-3          8 targets, ~8× the time of the defaults
stochastic            2.08e-2   2.03e-2          2.3× / 2.5× RNE (uniform-grid theory: 2×)
block_shape (16, 16)  1.24e-2   3.29e-2          heavy tails hurt shared tile scales most
hadamard=0            9.04e-3   9.69e-3          neutral on Gaussian data, WORSE on heavy tails
global_scale=None     9.05e-3   8.23e-3          fine at unit scale; fails for |x| ≲ 1e-2, ≳ 1e3
====================  ========  ===============  ==============================================

Why the Hadamard rotation does not pay here: with 16-element blocks an outlier already only
costs its own block; rotating spreads the outlier's rounding error over its 15 neighbours and
makes each heavy-tailed block Gaussian, whose NMSE (9.0e-3) is higher than the heavy-tailed one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nvfp4lab.constants import (
    BLOCK_SIZE,
    E2M1_MAX,
    E2M1_SIGN_BIT,
    GLOBAL_SCALE_NUMERATOR,
)
from nvfp4lab.e2m1 import pack_fp4, round_to_e2m1_codes
from nvfp4lab.hadamard import check_seed, hadamard_transform
from nvfp4lab.quantize import (
    CONVENTIONS,
    abs_max,
    block_scales,
    compute_global_scale,
    quantize_blocks,
    scale_elements,
)
from nvfp4lab.quantize import fake_quantize as _nvfp4_fake_quantize
from nvfp4lab.quantize import quantize as _nvfp4_quantize
from nvfp4lab.tensor import NVFP4Tensor, as_global_scale, decode_blocks

__all__ = [
    "BLOCK_SHAPES",
    "DEFAULT_SEARCH_TARGETS",
    "FOUR_OVER_SIX_SCALE_MAX",
    "NONFINITE_POLICIES",
    "OPTION_DEFAULTS",
    "ROUNDINGS",
    "SCALE_SELECTIONS",
    "NVFP4Options",
    "RotatedNVFP4Tensor",
    "check_input",
    "dequantize",
    "fake_quantize",
    "global_scale_for",
    "nvfp4_options",
    "options_label",
    "quantize",
    "quantize_blocks_variant",
    "stochastic_round_to_e2m1_codes",
]

ROUNDINGS: tuple[str, ...] = ("rne", "stochastic")
SCALE_SELECTIONS: tuple[str, ...] = ("amax", "four_over_six", "mse_search")
BLOCK_SHAPES: tuple[tuple[int, int], ...] = ((1, BLOCK_SIZE), (BLOCK_SIZE, BLOCK_SIZE))
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "propagate")
#: E4M3 "max" in the global scale of the non-default scale selections (Four Over Six paper).
FOUR_OVER_SIX_SCALE_MAX: float = 256.0
#: Targets (value the block max maps to) tried by ``scale_selection="mse_search"``.
DEFAULT_SEARCH_TARGETS: tuple[float, ...] = (6.0, 7.0, 6.5, 5.5, 5.0, 4.5, 4.0, 3.5)
_FOUR_OVER_SIX_TARGETS: tuple[float, ...] = (6.0, 4.0)
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Accepted option names of the NVFP4 format and their defaults.
OPTION_DEFAULTS: dict[str, Any] = {
    "convention": "kernel",
    "rounding": "rne",
    "generator": None,
    "scale_selection": "amax",
    "search_targets": None,
    "block_shape": (1, BLOCK_SIZE),
    "hadamard": None,
    "global_scale": "amax",
    "pad": False,
    "nonfinite": "raise",
}


def _choice(name: str, value: object, accepted: Sequence[object]) -> None:
    if not isinstance(value, str | tuple) or value not in accepted:
        shown = ", ".join(repr(a) for a in accepted)
        raise ValueError(f"unknown {name} {value!r}; accepted values: {shown}")


@dataclass(frozen=True)
class NVFP4Options:
    """Validated NVFP4 options (see the module docstring); build with :func:`nvfp4_options`."""

    convention: str = "kernel"
    rounding: str = "rne"
    generator: torch.Generator | int | None = None
    scale_selection: str = "amax"
    search_targets: tuple[float, ...] | None = None
    block_shape: tuple[int, int] = (1, BLOCK_SIZE)
    hadamard: int | None = None
    global_scale: str | torch.Tensor | float | None = "amax"
    pad: bool = False
    nonfinite: str = "raise"

    @property
    def targets(self) -> tuple[float, ...]:
        """Block-max targets tried per block (6 = plain amax scaling)."""
        if self.scale_selection == "four_over_six":
            return _FOUR_OVER_SIX_TARGETS
        if self.scale_selection == "mse_search":
            return self.search_targets or DEFAULT_SEARCH_TARGETS
        return (E2M1_MAX,)

    @property
    def foundation_path(self) -> bool:
        """True when :mod:`nvfp4lab.quantize` computes this exactly (after any rotation)."""
        return (
            self.rounding == "rne"
            and self.scale_selection == "amax"
            and self.block_shape == (1, BLOCK_SIZE)
        )

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element, tensor scale excluded (4 + 8 / elements per block scale)."""
        return 4.0 + 8.0 / (self.block_shape[0] * self.block_shape[1])


def nvfp4_options(**options: Any) -> NVFP4Options:
    """Validate NVFP4 keyword options; ValueError names the bad one and lists accepted values."""
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for format 'nvfp4'; accepted options: "
            f"{', '.join(OPTION_DEFAULTS)}"
        )
    o = {**OPTION_DEFAULTS, **options}
    _choice("convention", o["convention"], CONVENTIONS)
    _choice("rounding", o["rounding"], ROUNDINGS)
    _choice("scale_selection", o["scale_selection"], SCALE_SELECTIONS)
    _choice("nonfinite policy", o["nonfinite"], NONFINITE_POLICIES)
    shape = o["block_shape"]
    if isinstance(shape, list):
        shape = tuple(shape)
    _choice("block_shape", shape, BLOCK_SHAPES)
    gen = o["generator"]
    if o["rounding"] == "stochastic":
        if gen is None:
            raise ValueError(
                "rounding='stochastic' needs generator=<torch.Generator or int seed> so that "
                "results are reproducible"
            )
        if not isinstance(gen, torch.Generator):
            check_seed(gen, "generator")
    elif gen is not None:
        raise ValueError("generator= only applies to rounding='stochastic' (rounding is 'rne')")
    targets = o["search_targets"]
    if targets is not None:
        if o["scale_selection"] != "mse_search":
            raise ValueError("search_targets= only applies to scale_selection='mse_search'")
        try:
            if isinstance(targets, str | bytes):
                raise TypeError
            targets = tuple(float(t) for t in targets)
        except (TypeError, ValueError):
            raise ValueError(
                f"search_targets must be a sequence of positive numbers, got {targets!r}"
            ) from None
        if not targets or not all(0.0 < t < float("inf") for t in targets):
            raise ValueError(
                f"search_targets must be a non-empty sequence of finite numbers > 0 (the value "
                f"a block's max maps to; 6 = amax scaling), got {o['search_targets']!r}"
            )
    if o["hadamard"] is not None:
        check_seed(o["hadamard"], "hadamard")
    gs = o["global_scale"]
    if isinstance(gs, str):
        _choice("global_scale", gs, ("amax",))
    elif gs is not None:
        as_global_scale(gs)  # raises ValueError with the reason
    if not isinstance(o["pad"], bool):
        raise ValueError(f"pad must be True or False, got {o['pad']!r}")
    if o["pad"] and shape != (1, BLOCK_SIZE):
        raise ValueError(f"pad=True only applies to block_shape (1, 16), got {shape}")
    if o["pad"] and o["hadamard"] is not None:
        raise ValueError(
            "pad=True cannot be combined with hadamard (the rotation needs K % 16 == 0)"
        )
    return NVFP4Options(**{**o, "block_shape": shape, "search_targets": targets})


def check_input(x: torch.Tensor, nonfinite: str = "raise", what: str = "x") -> None:
    """Raise TypeError/ValueError unless ``x`` is a ≥1-d fp32/bf16/fp16 tensor (finite unless
    ``nonfinite="propagate"``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"{what} must be float32, bfloat16 or float16, got dtype {x.dtype} "
            "(convert with .float())"
        )
    if x.ndim == 0:
        raise ValueError(f"{what} must have at least one dimension (the K axis), got a 0-d tensor")
    if nonfinite == "raise" and not x.is_meta and x.numel() and not bool(x.isfinite().all()):
        bad = int((~x.isfinite()).sum())
        raise ValueError(
            f"{what} of shape {tuple(x.shape)} holds {bad} NaN/Inf value(s); clean the input, "
            "or pass nonfinite='propagate' (NVFP4 only)"
        )


def global_scale_for(
    x: torch.Tensor, numerator: float = GLOBAL_SCALE_NUMERATOR, *, convention: str = "kernel"
) -> torch.Tensor:
    """ENCODE global scale ``numerator / amax(|x|)`` as float32 ``[1]`` (1.0 if not finite).

    ``numerator`` 2688 (= 448·6) is :func:`nvfp4lab.quantize.compute_global_scale`; Four Over
    Six uses 1536 (= 256·6). Same division order per convention as that function.
    """
    return compute_global_scale(x, convention=convention, numerator=numerator)  # type: ignore[arg-type]


def stochastic_round_to_e2m1_codes(
    values: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Stochastically round ``values`` (float, any shape, within [-6, 6]) to E2M1 codes (uint8).

    Rounds up to the next E2M1 magnitude with probability equal to the fractional distance, so
    ``E[decode(code)] = value``. The sign bit is set exactly when the value is < 0 (as RNE).
    Uniforms come from ``generator`` (on its own device, then moved to the values' device).
    """
    v = values.to(torch.float32)
    magnitude = v.abs().clamp_(max=E2M1_MAX)
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    low = torch.floor(magnitude / step) * step  # exact: step is a power of two
    frac = (magnitude - low) / step
    u = torch.rand(v.shape, generator=generator, device=generator.device, dtype=torch.float32)
    rounded = low + step * (u.to(v.device) < frac)
    codes = round_to_e2m1_codes(rounded)  # on-grid values: RNE is the identity
    codes |= (v < 0).to(torch.uint8) * E2M1_SIGN_BIT
    return codes


def _as_generator(generator: torch.Generator | int, device: torch.device) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        return generator
    dev = device if device.type != "meta" else torch.device("cpu")
    return torch.Generator(device=dev).manual_seed(generator)


def quantize_blocks_variant(
    blocks: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    convention: str = "kernel",
    targets: Sequence[float] = (E2M1_MAX,),
    rounding: str = "rne",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nvfp4lab.quantize.quantize_blocks` with scale candidates and stochastic rounding.

    ``blocks``: ``[..., nb, B]`` (any B); ``global_scale``: float32 ``[1]``. For each block and
    each target ``t`` the scale maps the block max to ``t``; the candidate with the lowest
    squared error (RNE codes) wins, earlier targets winning ties. Returns (codes uint8 of the
    blocks' shape, scales float8_e4m3fn ``[..., nb]``). ``targets=(6,)`` with RNE IS
    ``quantize_blocks``.
    """
    if tuple(targets) == (E2M1_MAX,) and rounding == "rne":
        return quantize_blocks(blocks, global_scale, convention)  # type: ignore[arg-type]
    amax = abs_max(blocks, -1)
    best_scales = best_codes = best_err = None
    for target in targets:
        scales = block_scales(amax, global_scale, convention, target)
        if len(targets) == 1:
            best_scales = scales
            break
        codes = round_to_e2m1_codes(scale_elements(blocks, scales, global_scale, convention))
        err = (decode_blocks(codes, scales, global_scale) - blocks.to(torch.float32)).square_()
        err = err.sum(-1)
        if best_err is None:
            best_scales, best_codes, best_err = scales, codes, err
        else:
            better = err < best_err
            best_scales = torch.where(better, scales, best_scales)
            best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
            best_err = torch.where(better, err, best_err)
    assert best_scales is not None
    if rounding == "stochastic" or best_codes is None:
        scaled = scale_elements(blocks, best_scales, global_scale, convention)
        if rounding == "stochastic":
            if generator is None:
                raise ValueError("stochastic rounding needs a torch.Generator")
            best_codes = stochastic_round_to_e2m1_codes(scaled, generator)
        else:
            best_codes = round_to_e2m1_codes(scaled)
    return best_codes, best_scales.to(torch.float8_e4m3fn)


# --------------------------------------------------------------------------------------------
# tensor level


def _global_scale(x: torch.Tensor, opts: NVFP4Options) -> torch.Tensor:
    gs = opts.global_scale
    if gs is None:
        return torch.ones(1, dtype=torch.float32, device=x.device)
    if isinstance(gs, str):
        numerator = (
            GLOBAL_SCALE_NUMERATOR
            if opts.scale_selection == "amax"
            else FOUR_OVER_SIX_SCALE_MAX * E2M1_MAX
        )
        if x.is_meta:
            return torch.empty(1, dtype=torch.float32, device="meta")
        return global_scale_for(x, numerator, convention=opts.convention)
    return as_global_scale(gs, x.device)


def _prepare(x: torch.Tensor, opts: NVFP4Options) -> torch.Tensor:
    """Validate ``x``; return it padded (``pad``) and rotated (``hadamard``), same dtype."""
    check_input(x, opts.nonfinite)
    k = x.shape[-1]
    if opts.block_shape == (BLOCK_SIZE, BLOCK_SIZE):
        if x.ndim != 2 or x.shape[0] % BLOCK_SIZE or k % BLOCK_SIZE:
            raise ValueError(
                f"block_shape (16, 16) needs a 2-D tensor [M, K] with M and K multiples of 16, "
                f"got shape {tuple(x.shape)}"
            )
    elif k % BLOCK_SIZE:
        if not opts.pad:
            raise ValueError(
                f"the last dimension K={k} of shape {tuple(x.shape)} is not a multiple of the "
                f"block size {BLOCK_SIZE}; pass pad=True to zero-pad K to "
                f"{-(-k // BLOCK_SIZE) * BLOCK_SIZE}"
            )
        x = F.pad(x, (0, -k % BLOCK_SIZE))
    if opts.hadamard is not None and not x.is_meta:
        x = hadamard_transform(x, opts.hadamard)
    return x


def _to_blocks(x: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """``[..., K]`` → ``[..., K/16, 16]``, or ``[M, K]`` → ``[M/16, K/16, 256]`` tiles."""
    if block_shape == (1, BLOCK_SIZE):
        return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    m, k = x.shape
    tiles = x.reshape(m // BLOCK_SIZE, BLOCK_SIZE, k // BLOCK_SIZE, BLOCK_SIZE)
    return tiles.permute(0, 2, 1, 3).reshape(m // BLOCK_SIZE, k // BLOCK_SIZE, -1)


def _from_blocks(
    values: torch.Tensor, shape: torch.Size, block_shape: tuple[int, int]
) -> torch.Tensor:
    """Inverse of :func:`_to_blocks` back to ``shape``."""
    if block_shape == (1, BLOCK_SIZE):
        return values.reshape(shape)
    m, k = shape
    tiles = values.reshape(m // BLOCK_SIZE, k // BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE)
    return tiles.permute(0, 2, 1, 3).reshape(m, k)


def _encode(
    xp: torch.Tensor, opts: NVFP4Options
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 ``xp.shape``, scales e4m3 ``[..., K/16]`` per row, gs) of prepared ``xp``."""
    gs = _global_scale(xp, opts)
    generator = (
        _as_generator(opts.generator, xp.device) if opts.generator is not None else None
    )
    codes, scales = quantize_blocks_variant(
        _to_blocks(xp, opts.block_shape),
        gs,
        convention=opts.convention,
        targets=opts.targets,
        rounding=opts.rounding,
        generator=generator,
    )
    codes = _from_blocks(codes, xp.shape, opts.block_shape)
    if opts.block_shape != (1, BLOCK_SIZE):
        scales = scales.repeat_interleave(BLOCK_SIZE, dim=0)  # tile scale on each of its rows
    return codes, scales, gs


def fake_quantize(x: torch.Tensor, **options: Any) -> torch.Tensor:
    """NVFP4 quantize-dequantize of ``x`` (fp32/bf16/fp16 ``[..., K]``) with research options.

    Returns ``x.dtype``, ``x.shape``, in the ORIGINAL basis (a Hadamard rotation is undone in
    float32 after dequantizing). Default options equal :func:`nvfp4lab.fake_quantize` bit for bit.
    """
    opts = nvfp4_options(**options)
    check_input(x, opts.nonfinite)
    if x.is_meta:
        _prepare(x, opts)
        return torch.empty_like(x)
    if opts.foundation_path and opts.hadamard is None:
        gs = None if opts.global_scale == "amax" else _global_scale(x, opts)
        return _nvfp4_fake_quantize(
            x, gs, convention=opts.convention, pad=opts.pad, nonfinite=opts.nonfinite,  # type: ignore[arg-type]
        )
    if opts.hadamard is not None:  # decode in float32, rotate back, one rounding to x.dtype
        return quantize(x, **options).dequantize(x.dtype)
    xp = _prepare(x, opts)
    if opts.foundation_path:
        gs = None if opts.global_scale == "amax" else _global_scale(xp, opts)
        values = _nvfp4_fake_quantize(
            xp, gs, convention=opts.convention, nonfinite=opts.nonfinite,  # type: ignore[arg-type]
        )
    else:
        codes, scales, gs = _encode(xp, opts)
        blocks = codes.reshape(*codes.shape[:-1], codes.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
        values = decode_blocks(blocks, scales, gs).reshape(xp.shape).to(x.dtype)
    return values[..., : x.shape[-1]].to(x.dtype)


@dataclass(repr=False)
class RotatedNVFP4Tensor(NVFP4Tensor):
    """NVFP4 codes and scales of the Hadamard-rotated tensor ``x Q`` (``hadamard`` = the seed).

    :meth:`dequantize` undoes the rotation (it returns an approximation of ``x``);
    :meth:`dequantize_rotated` returns ``x Q`` itself, what a GEMM whose other operand was rotated
    with the same seed consumes (:func:`nvfp4lab.hadamard.rotate_gemm_operands`). ``linear`` and
    ``NVFP4Linear`` refuse it (its :attr:`transform` is set): they would use ``x Q`` as ``x``.
    """

    hadamard: int = 0

    @property
    def transform(self) -> str | None:
        return f"Hadamard-rotated along K (seed {self.hadamard})"

    def dequantize_rotated(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode the rotated tensor ``x Q`` as stored."""
        return super().dequantize(dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode and rotate back: ``dequantize_rotated() Q^T`` (in float32), then ``dtype``."""
        rotated = super().dequantize(torch.float32)
        back = hadamard_transform(rotated, self.hadamard, inverse=True)
        return back.to(dtype or self.dtype)

    def to(self, device: torch.device | str) -> RotatedNVFP4Tensor:
        moved = super().to(device)
        return RotatedNVFP4Tensor(**{**vars(moved), "hadamard": self.hadamard})

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", hadamard={self.hadamard})"


def _rotated(q: NVFP4Tensor, seed: int | None) -> NVFP4Tensor:
    return q if seed is None else RotatedNVFP4Tensor(**vars(q), hadamard=seed)


def quantize(x: torch.Tensor, **options: Any) -> NVFP4Tensor:
    """NVFP4-quantize ``x`` with research options into an :class:`NVFP4Tensor`.

    With ``hadamard=seed`` the result is a :class:`RotatedNVFP4Tensor` holding ``x Q`` (see the
    module docstring) that dequantizes back to ``x``; with ``block_shape=(16, 16)`` each tile
    scale is repeated on its 16 rows.
    """
    opts = nvfp4_options(**options)
    check_input(x, opts.nonfinite)
    if opts.foundation_path and not x.is_meta:
        xp = _prepare(x, opts) if opts.hadamard is not None else x
        gs = None if opts.global_scale == "amax" else _global_scale(xp, opts)
        q = _nvfp4_quantize(
            xp, gs, convention=opts.convention, pad=opts.pad, nonfinite=opts.nonfinite,  # type: ignore[arg-type]
        )
        return _rotated(q, opts.hadamard)
    xp = _prepare(x, opts)
    if x.is_meta:
        lead, kp = xp.shape[:-1], xp.shape[-1]
        return NVFP4Tensor(
            packed=torch.empty((*lead, kp // 2), dtype=torch.uint8, device="meta"),
            scales=torch.empty((*lead, kp // BLOCK_SIZE), dtype=torch.float8_e4m3fn,
                               device="meta"),
            global_scale=torch.ones(1, device="meta"),
            shape=x.shape,
            dtype=x.dtype,
        )
    codes, scales, gs = _encode(xp, opts)
    q = NVFP4Tensor(
        packed=pack_fp4(codes), scales=scales, global_scale=gs, shape=x.shape, dtype=x.dtype
    )
    return _rotated(q, opts.hadamard)


def dequantize(
    q: NVFP4Tensor, dtype: torch.dtype | None = None, *, hadamard: int | None = None
) -> torch.Tensor:
    """Decode ``q``; with ``hadamard=seed`` also undo a rotation of a plain tensor's codes.

    A :class:`RotatedNVFP4Tensor` knows its seed and rotates back by itself (a different
    ``hadamard=`` is an error).
    """
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"dequantize expects an NVFP4Tensor, got {type(q).__name__}")
    out_dtype = dtype or q.dtype
    if isinstance(q, RotatedNVFP4Tensor):
        if hadamard not in (None, q.hadamard):
            raise ValueError(
                f"q was rotated with hadamard={q.hadamard}, not {hadamard}; omit hadamard="
            )
        return q.dequantize(out_dtype)
    if hadamard is None:
        return q.dequantize(out_dtype)
    check_seed(hadamard, "hadamard")
    values = hadamard_transform(q.dequantize(q.dtype), hadamard, inverse=True)
    return values.to(out_dtype)


def options_label(options: Mapping[str, Any]) -> str:
    """Short human label of non-default options, e.g. ``"scale_selection=four_over_six"``."""
    def is_default(key: str, value: Any) -> bool:
        default = OPTION_DEFAULTS.get(key, object())
        if isinstance(value, torch.Tensor | torch.Generator):
            return False
        return bool(value == default) if not isinstance(value, list) else tuple(value) == default

    parts = [f"{k}={v}" for k, v in options.items() if not is_default(k, v)]
    return ", ".join(parts) or "defaults"
