"""Q8_0 layers of a mixed model: llama.cpp's 8-bit weight format (ggml type 8) for GGUF mixes.

:class:`Q8_0Linear` holds a Linear's weight as llama.cpp stores a ``Q8_0`` tensor: per 32
values along K (a ``block_q8_0``) one float16 scale ``d`` and 32 int8 codes. Bits per weight:
``8 + 16/32 = 8.5`` (:func:`~nvfp4lab.execution.mixed.layer_bits`).

**Weights** (:func:`quantize_q8_0_weight`), as ``quantize_row_q8_0_ref`` (ggml-quants.c) computes
them, the function ``ggml_quantize_chunk(GGML_TYPE_Q8_0, ...)`` and ``llama-quantize`` call: per
block in float32 ``amax = max |w|``, ``d = amax / 127`` (one float32 division), stored as
float16 (round to nearest even); ``id = 1 / d`` from the float32 ``d`` (0 when ``d`` is 0);
codes ``roundf(w * id)`` (a float32 product, rounded half away from zero). A bfloat16 / float16
weight is widened to float32 first (exact), as ggml takes float32 rows.

**Forward** (:func:`dot_q8_0`), llama.cpp's CPU product of a Q8_0 weight: the activation rows
(float32) become Q8_0 with the CPU's ``from_float`` (:func:`~nvfp4lab.execution.ggml_cpu.
quantize_q8_0`: ``id = 127 / amax``, round half to even, the x86 AVX2 code), then per output
value and block ``b`` the exact integer sum ``s_b = Σ q_w q_x`` (32 products, |s_b| < 2^20) and
``acc = acc + float(s_b) * (d_w[b] * d_x[b])`` in float32, blocks in order from ``acc = 0``:
the order of ``ggml_vec_dot_q8_0_q8_0_generic`` (ggml-cpu/quants.c), each product and sum
rounded once (no fused multiply-add; ``d_w * d_x`` of two float16 values is exact). The bias is
added after the cast to ``x.dtype`` (``bias_mode="output"`` of the NVFP4 ``q8_0`` backend).

What llama.cpp's x86 wheel runs for Q8_0 x Q8_0 differs in the float order only (AVX2
``ggml_vec_dot_q8_0_q8_0`` or ``llamafile_sgemm``'s tinyBLAS kernel: eight float lanes with
fused multiply-adds, then a horizontal sum): the integer sums and scales are the same, the
float32 accumulation rounds differently, so a whole model agrees within the logit tolerance of
tests/peers/test_llama_cpp_model.py, not bit for bit (tests/peers/test_llama_cpp_mixed.py).
"""

from __future__ import annotations

import torch
from torch import nn

from nvfp4lab.constants import GGML_Q8_0_BLOCK
from nvfp4lab.execution.ggml_cpu import quantize_q8_0
from nvfp4lab.vocab import LayerFormat

__all__ = ["Q8_0_BITS", "SCALE_BUFFER", "Q8_0Linear", "dot_q8_0", "quantize_q8_0_weight"]

#: Bits per weight of Q8_0: an int8 code plus a float16 scale per 32 values.
Q8_0_BITS: float = 8.0 + 16.0 / GGML_Q8_0_BLOCK
#: Output values per chunk of the dot product (bounds the [M, N, K/32] intermediates).
_CHUNK_ELEMENTS: int = 1 << 22
#: The buffer (and checkpoint leaf) of a Q8_0 layer's float16 block scales (ggml's ``d``).
SCALE_BUFFER = "weight_d"
_FP16_MAX = float(torch.finfo(torch.float16).max)


def _check_rows(x: torch.Tensor, what: str) -> None:
    if x.ndim != 2 or x.shape[1] % GGML_Q8_0_BLOCK or not x.is_floating_point():
        raise ValueError(f"{what} must be a float [N, K] tensor with K a multiple of "
                         f"{GGML_Q8_0_BLOCK}, got {x.dtype} {list(x.shape)}; keep this layer in "
                         "another format")


def quantize_q8_0_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_row_q8_0_ref`` of every row of a float ``[N, K]`` weight (K a multiple of 32,
    finite): ``(codes int8 [N, K], d float16 [N, K/32])`` (module docstring). ValueError for a
    shape, a non-finite value or a block whose ``d`` overflows float16 (|w| > 127 · 65504)."""
    _check_rows(weight, "a Q8_0 weight")
    w = weight.detach().to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("a Q8_0 weight must be finite; replace NaN/Inf first "
                         "(torch.nan_to_num) or keep the layer in another format")
    n, k = w.shape
    blocks = w.reshape(n, k // GGML_Q8_0_BLOCK, GGML_Q8_0_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    d = torch.div(amax, torch.full_like(amax, 127.0))  # tensor / tensor: one IEEE division
    if bool((d > _FP16_MAX).any()):
        raise ValueError(f"a Q8_0 block scale amax/127 = {float(d.max()):g} exceeds float16's "
                         f"{_FP16_MAX:g}; scale the weight down or keep the layer in another "
                         "format")
    inv = torch.where(d != 0, torch.div(torch.ones_like(d), d), torch.zeros_like(d))
    scaled = (blocks * inv.unsqueeze(-1)).to(torch.float64)  # float32 products, widened
    codes = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf (exact in float64)
    return codes.to(torch.int8).reshape(n, k), d.to(torch.float16)


def dot_q8_0(codes: torch.Tensor, d: torch.Tensor, q8: torch.Tensor,
             q8_d: torch.Tensor) -> torch.Tensor:
    """The Q8_0 x Q8_0 dot (module docstring's order) of every activation row with every weight
    row: weight ``codes`` int8 ``[N, K]``, ``d`` float16 ``[N, K/32]``; activations ``q8``
    int8 ``[M, K]``, ``q8_d`` float16 ``[M, K/32]``. Returns float32 ``[M, N]``."""
    n, k = codes.shape
    m, nb = q8.shape[0], k // GGML_Q8_0_BLOCK
    if q8.shape[1] != k or tuple(d.shape) != (n, nb) or tuple(q8_d.shape) != (m, nb):
        raise ValueError(f"dot_q8_0 needs codes [N, K], d [N, K/32], q8 [M, K], q8_d [M, K/32] "
                         f"with one K; got {list(codes.shape)}, {list(d.shape)}, "
                         f"{list(q8.shape)}, {list(q8_d.shape)}")
    w = codes.to(torch.float64).reshape(n, nb, GGML_Q8_0_BLOCK).permute(1, 2, 0)  # [nb, 32, N]
    dw = d.to(torch.float32).T  # [nb, N]
    rows = max(1, _CHUNK_ELEMENTS // max(1, n * nb))
    parts = []
    for start in range(0, m, rows):
        x = q8[start:start + rows].to(torch.float64)
        count = x.shape[0]
        # exact integer block sums (|s| < 2^20): [nb, M, N], then float32 (exact)
        sums = torch.bmm(x.reshape(count, nb, GGML_Q8_0_BLOCK).transpose(0, 1), w)
        sums = sums.to(torch.float32)
        dx = q8_d[start:start + rows].to(torch.float32).T  # [nb, M]
        acc = torch.zeros(count, n, dtype=torch.float32, device=codes.device)
        for b in range(nb):
            scale = dw[b].unsqueeze(0) * dx[b].unsqueeze(1)  # d_w * d_x: exact in float32
            acc = acc + sums[b] * scale
        parts.append(acc)
    if not parts:
        return torch.zeros(0, n, dtype=torch.float32, device=codes.device)
    return torch.cat(parts)


class Q8_0Linear(nn.Module):
    """A Linear with a llama.cpp Q8_0 weight (module docstring). Buffers: ``weight`` int8
    ``[N, K]`` (the codes), ``weight_d`` float16 ``[N, K/32]`` (each block's ``d``), ``bias``
    in the original dtype or None. ``forward(x [..., K])`` returns ``[..., N]`` in ``x.dtype``:
    Q8_0 activations and :func:`dot_q8_0` in float32, cast, plus the bias."""

    #: The :class:`~nvfp4lab.vocab.LayerFormat` of every such layer.
    layer_format = LayerFormat.Q8_0

    def __init__(self, weight: torch.Tensor, weight_d: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.ndim != 2 or weight.shape[1] % GGML_Q8_0_BLOCK:
            raise ValueError(f"Q8_0Linear needs int8 [N, K] codes with K a multiple of "
                             f"{GGML_Q8_0_BLOCK}, got {weight.dtype} {list(weight.shape)}")
        n, k = weight.shape
        if weight_d.dtype != torch.float16 or tuple(weight_d.shape) != (n, k // GGML_Q8_0_BLOCK):
            raise ValueError(f"Q8_0Linear needs float16 [N, K/32] = [{n}, "
                             f"{k // GGML_Q8_0_BLOCK}] scales, got {weight_d.dtype} "
                             f"{list(weight_d.shape)}")
        self.out_features, self.in_features = n, k
        self.register_buffer("weight", weight)
        self.register_buffer(SCALE_BUFFER, weight_d)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Q8_0Linear:
        """Quantize ``linear``'s weight with :func:`quantize_q8_0_weight` (K a multiple of
        32)."""
        codes, d = quantize_q8_0_weight(linear.weight)
        return cls(codes, d, linear.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """``codes · d`` per block, float32 ``[N, K]`` (exact: ggml's ``dequantize_row_q8_0``)."""
        n, k = self.weight.shape
        w = self.weight.to(torch.float32).reshape(n, k // GGML_Q8_0_BLOCK, GGML_Q8_0_BLOCK)
        return (w * self.weight_d.to(torch.float32).unsqueeze(-1)).reshape(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        q8, q8_d = quantize_q8_0(x.reshape(-1, self.in_features).to(torch.float32))
        out = dot_q8_0(self.weight, self.weight_d, q8, q8_d).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, Q8_0 (llama.cpp, activations Q8_0)")
