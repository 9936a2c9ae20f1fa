"""llama.cpp's own CPU library (llama-cpp-python 0.3.36, llama.cpp@0c1e57098) as the oracle of the
``q8_0`` backend, through ctypes, bit for bit.

``libggml-cpu.so``'s ``ggml_get_type_traits_cpu(GGML_TYPE_NVFP4 = 40)`` gives ``vec_dot``
(``ggml_vec_dot_nvfp4_q8_0``) and ``vec_dot_type`` (Q8_0 = 8), whose ``from_float``
(``quantize_row_q8_0``) is what ``ggml_compute_forward_mul_mat`` converts activation rows with.
The struct (include/ggml-cpu.h ``ggml_type_traits_cpu``): ``from_float``, ``vec_dot`` (function
pointers), ``vec_dot_type`` (enum, int), ``nrows`` (int64). ``ggml_cpu_init()`` fills the UE4M3
table the AVX2 dot reads. The NVFP4 weight blocks come from
:func:`nvfp4lab.ggml_blocks.to_ggml_nvfp4`.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest
import torch

from nvfp4lab.codec import quantize
from nvfp4lab.constants import GGML_Q8_0_BLOCK
from nvfp4lab.execution import ggml_cpu
from nvfp4lab.ggml_blocks import to_ggml_nvfp4
from nvfp4lab.oracles import ggml as ggml_oracle
from tests.execution.test_ggml_cpu import ties_row
from tests.peers.ggml_ctypes import declare_quantize_chunk
from tests.sample_data import KINDS, make

GGML_TYPE_Q8_0 = 8
GGML_TYPE_NVFP4 = 40

_spec = importlib.util.find_spec("llama_cpp")
LIB = Path(_spec.origin).parent / "lib" if _spec and _spec.origin else None
if LIB is None or not (LIB / "libggml-cpu.so").exists():
    pytest.skip(
        "llama-cpp-python 0.3.36 (llama_cpp/lib/libggml-cpu.so) is not importable; run "
        "`make test-peers`, which installs it into ~/.cache/nvfp4lab/peers",
        allow_module_level=True,
    )

pytestmark = pytest.mark.peers


class TypeTraitsCpu(ctypes.Structure):
    """``struct ggml_type_traits_cpu`` (include/ggml-cpu.h)."""

    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


FromFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VecDot = ctypes.CFUNCTYPE(
    None,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
)


@pytest.fixture(scope="module")
def ggml() -> dict[str, object]:
    base = ctypes.CDLL(str(LIB / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(LIB / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init.restype = None
    cpu.ggml_cpu_init()
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraitsCpu)
    nvfp4 = cpu.ggml_get_type_traits_cpu(GGML_TYPE_NVFP4).contents
    q8_0 = cpu.ggml_get_type_traits_cpu(GGML_TYPE_Q8_0).contents
    declare_quantize_chunk(base)
    return {
        "nvfp4": nvfp4,
        "from_float": FromFloat(q8_0.from_float),
        "vec_dot": VecDot(nvfp4.vec_dot),
        "quantize_chunk": base.ggml_quantize_chunk,
    }


def _their_q8_0(ggml: dict[str, object], x: torch.Tensor) -> torch.Tensor:
    """ggml's ``from_float`` of Q8_0 on each row of float32 ``x [M, K]``: block_q8_0 bytes."""
    m, k = x.shape
    out = torch.zeros(m, k // GGML_Q8_0_BLOCK * (GGML_Q8_0_BLOCK + 2), dtype=torch.uint8)
    rows = x.contiguous()
    for i in range(m):
        ggml["from_float"](rows[i].data_ptr(), out[i].data_ptr(), k)  # type: ignore[operator]
    return out


def _their_dots(
    ggml: dict[str, object], blocks: torch.Tensor, q8: torch.Tensor, k: int
) -> torch.Tensor:
    """``vec_dot`` (``nrc = 1``) of every Q8_0 row with every NVFP4 block row: float32 [M, N]."""
    blocks, q8 = blocks.contiguous(), q8.contiguous()
    out = torch.zeros(q8.shape[0], blocks.shape[0], dtype=torch.float32)
    result = ctypes.c_float()
    vec_dot = ggml["vec_dot"]
    for m in range(q8.shape[0]):
        for n in range(blocks.shape[0]):
            w, x = blocks[n].data_ptr(), q8[m].data_ptr()
            vec_dot(k, ctypes.addressof(result), 0, w, 0, x, 0, 1)  # type: ignore[operator]
            out[m, n] = result.value
    return out


def test_nvfp4_dots_with_q8_0(ggml: dict[str, object]) -> None:
    traits = ggml["nvfp4"]
    assert traits.vec_dot_type == GGML_TYPE_Q8_0 and traits.nrows == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", [*KINDS, "ties"])
def test_q8_0_bytes_equal_ggml_from_float(ggml: dict[str, object], kind: str) -> None:
    if kind == "ties":
        x = torch.stack((ties_row(576), -ties_row(576)))
    else:
        x = make(kind, (8, 576), torch.float32, seed=40 + KINDS.index(kind))
    codes, scales = ggml_cpu.quantize_q8_0(x)
    assert torch.equal(ggml_cpu.q8_0_blocks(codes, scales), _their_q8_0(ggml, x))


def test_ggml_quantize_chunk_is_the_other_q8_0(ggml: dict[str, object]) -> None:
    """``ggml_quantize_chunk(Q8_0)`` runs ``quantize_row_q8_0_ref`` (roundf, ``id = 1/d``): the
    oracle's :func:`nvfp4lab.oracles.ggml.quantize_q8_0_ref` matches it, and it differs from the
    ``from_float`` the CPU matmul uses on the ties row."""
    x = torch.stack((ties_row(576), make("student_t", (576,), torch.float32, seed=3)))
    out = torch.zeros(2, 576 // 32 * 34, dtype=torch.uint8)
    ggml["quantize_chunk"](GGML_TYPE_Q8_0, x.data_ptr(), out.data_ptr(), 0, 2, 576, None)  # type: ignore[operator]
    for i in range(2):
        codes, scales = ggml_oracle.quantize_q8_0_ref(x[i].tolist())
        want = ggml_cpu.q8_0_blocks(
            torch.tensor(codes, dtype=torch.int8), torch.tensor(scales, dtype=torch.float16)
        )
        assert torch.equal(out[i], want)
    assert not torch.equal(out[0], _their_q8_0(ggml, x[:1])[0])


@pytest.mark.parametrize("kind", [*KINDS, "ties"])
def test_dot_products_equal_ggml_vec_dot(ggml: dict[str, object], kind: str) -> None:
    """Weights of each kind (nvfp4lab's kernel order, with a tensor scale) against activation
    rows of the same kind: every dot bit for bit."""
    seed = 60 + (KINDS.index(kind) if kind in KINDS else len(KINDS))
    weight_kind = "outliers" if kind == "ties" else kind
    w = quantize(make(weight_kind, (24, 576), torch.float32, seed=seed))
    if kind == "ties":
        x = torch.stack((ties_row(576), -ties_row(576)))
    else:
        x = make(kind, (6, 576), torch.float32, seed=seed + 1)
    q8, d = ggml_cpu.quantize_q8_0(x)
    theirs = _their_dots(ggml, to_ggml_nvfp4(w.packed, w.scales), ggml_cpu.q8_0_blocks(q8, d), 576)
    assert torch.equal(ggml_cpu.vec_dot_nvfp4_q8_0(w.packed, w.scales, q8, d), theirs)
    assert torch.equal(ggml_cpu.mul_mat(x, w.packed, w.scales), theirs)
