"""The ``nvfp4lab bench --peers`` row against llama.cpp's own quantizer: ggml's
``ggml_quantize_chunk(GGML_TYPE_NVFP4 = 40)`` (llama-cpp-python's ``libggml-base.so`` through
``nvfp4lab.bench.peers.ggml_nvfp4_quantizer``) and nvfp4lab's llama.cpp order on the native block
encode give the same bytes, on every vector path, for the rows the bench times and for rows with
ties, tiny and saturating blocks; the note names both timings and says the bytes are equal."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.bench.peers import ggml_nvfp4_quantizer, run_peers
from nvfp4lab.ggml_blocks import to_ggml_nvfp4
from nvfp4lab.kernels import block_encode, native
from nvfp4lab.orders import ORDERS
from nvfp4lab.vocab import OrderName

GGML, WHY = ggml_nvfp4_quantizer()
pytestmark = [
    pytest.mark.peers,
    pytest.mark.skipif(GGML is None, reason=WHY),
    pytest.mark.skipif(not native.available(), reason="the native C++ library is not built"),
]

PATHS = list(block_encode.ISAS[: block_encode.ISAS.index(block_encode.isa() or "scalar") + 1])


def rows() -> torch.Tensor:
    """float32 rows [64, 1024]: normal, ties on the E2M1 midpoints at several scales, blocks that
    vanish (amax < 6 * 2**-10) and blocks saturating at 448 (values up to 1e12)."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(64, 1024, generator=g)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for i, s in enumerate((2.0**-9 * 3, 2.0**-7, 0.375, 1.125, 13.0, 96.0, 448.0)):
        block = torch.cat([torch.tensor([6 * s]), mids * s, torch.tensor([-6 * s]), -mids * s])
        x[i] = block.repeat(64)
    x[8] *= 1e-4
    x[9] *= 1e11
    return x


@pytest.mark.parametrize("path", PATHS)
def test_the_bytes_equal_ggml_quantize_chunk(path: str) -> None:
    x = rows()
    order = ORDERS[OrderName.LLAMA_CPP]
    for threads in (1, 2):
        packed, scales = block_encode.encode(x, torch.ones(1), order, path=path, threads=threads)
        assert torch.equal(to_ggml_nvfp4(packed, scales), GGML(x)), (path, threads)


def test_the_peer_note_says_equal() -> None:
    _, notes = run_peers([(256, 1024)], dtype="bfloat16", warmup=1, repeats=2)
    line = [n for n in notes if n.startswith("llama.cpp order vs ggml_quantize_chunk")]
    assert len(line) == 1 and line[0].endswith("bytes equal"), notes
    assert "ns/element" in line[0] and "ggml / nvfp4lab = " in line[0]


def test_ggml_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match=r"got torch\.bfloat16 \(2, 64\); pass x\.float"):
        GGML(torch.zeros(2, 64, dtype=torch.bfloat16))
