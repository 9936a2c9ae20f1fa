"""vLLM 0.33.0's own code as the oracle for nvfp4lab's KV cache (nvfp4lab.execution.kv_cache).

vLLM is imported from the directory ``make test-peers`` installs it into; nothing of it is copied
here. Used: ``nvfp4_kv_cache_full_dim`` and ``nvfp4_split_data_scale``
(vllm/utils/torch_utils.py@0.33.0: the bytes per row and the [data | scale] split of one page
side that the FlashInfer backend reads, v1/attention/backends/flashinfer.py ``_nvfp4_kv_views``),
and ``ref_nvfp4_quant`` (model_executor/layers/quantization/utils/nvfp4_emulation_utils.py@0.33.0:
vLLM's float32 reference of its CUDA NVFP4 quantizer, whose ``cvt_warp_fp16_to_fp4`` the KV
writer calls with the ENCODE scale ``1 / k_scale``). The wheel has no Python NVFP4 KV read and no
Python 4over6 or FP8 KV write (those are CUDA only), so they are not compared here.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from nvfp4lab.e2m1 import decode_e2m1, pack_fp4
from nvfp4lab.execution import kv_cache as kv
from nvfp4lab.oracles import kv_cache as ref_kv
from nvfp4lab.vocab import SUPPORTED_DTYPES, KVCacheKind
from tests.sample_data import make

try:
    T = importlib.import_module("vllm.utils.torch_utils")
    E = importlib.import_module(
        "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils"
    )
    VLLM_VERSION = importlib.import_module("vllm").__version__
except Exception as exc:  # pragma: no cover - depends on the peer install
    pytest.skip(
        f"vLLM's torch_utils / emulation module does not import ({type(exc).__name__}: {exc}); "
        "run `make test-peers`, which installs vllm==0.33.0 with --no-deps into a cache directory",
        allow_module_level=True,
    )

pytestmark = pytest.mark.peers

NVFP4_KINDS = [KVCacheKind.NVFP4.value, KVCacheKind.NVFP4_4OVER6.value]
DATA = ["normal", "student_t", "outliers", "zero_blocks", "tiny_blocks"]


def test_vllm_version() -> None:
    assert VLLM_VERSION == "0.33.0"


@pytest.mark.parametrize("kind", NVFP4_KINDS)
def test_packed_dim_is_vllms_full_dim(kind: str) -> None:
    for head_size in range(16, 1025, 16):
        assert kv.packed_dim(head_size, kind) == T.nvfp4_kv_cache_full_dim(head_size)


def _sides(k: torch.Tensor, v: torch.Tensor, kind: str, scales: tuple[float, float]):
    return kv.pack(k, kind, scales[0]), kv.pack(v, kind, scales[1])


def _oracle(x: torch.Tensor, kind: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """nvfp4lab's slow oracle: (packed data bytes [..., D/2], scale bytes [..., D/16])."""
    codes, scales = ref_kv.kv_quantize_nvfp4(x, scale, four_over_six=kind != "nvfp4")
    return pack_fp4(codes), scales.to(torch.float8_e4m3fn).view(torch.uint8)


@pytest.mark.parametrize("kind", NVFP4_KINDS)
def test_pages_split_as_vllm_splits_them_nhd(kind: str) -> None:
    """A cache [pages, 2, block_size, heads, full_dim] (NHD) built from pack(K) and pack(V):
    vLLM's nvfp4_split_data_scale of each side finds the oracle's codes and block scales."""
    pages, block, heads, head = 3, 16, 2, 128
    k = make("normal", (pages, block, heads, head), torch.bfloat16, seed=1)
    v = make("student_t", (pages, block, heads, head), torch.bfloat16, seed=2)
    cache = torch.stack(_sides(k, v, kind, (0.05, 1.0)), dim=1)
    assert cache.shape == (pages, 2, block, heads, T.nvfp4_kv_cache_full_dim(head))
    for side, (x, scale) in enumerate([(k, 0.05), (v, 1.0)]):
        data, sf = T.nvfp4_split_data_scale(cache[:, side])
        want_data, want_scales = _oracle(x, kind, scale)
        assert data.shape == (pages, block, heads, head // 2)
        assert torch.equal(data, want_data)
        assert sf.dtype == torch.float8_e4m3fn
        assert torch.equal(sf.view(torch.uint8), want_scales)
        assert data.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()


@pytest.mark.parametrize("kind", NVFP4_KINDS)
def test_pages_split_as_vllm_splits_them_hnd(kind: str) -> None:
    """An HND cache (physical [pages, 2, heads, block_size, full_dim]) seen through vLLM's
    logical NHD view (permuted, as create_kv_caches_with_random_flash does): the split, which
    keeps the strides, finds the oracle's codes and scales of K and V packed as [pages, heads,
    block]."""
    pages, block, heads, head = 2, 8, 4, 64
    k = make("outliers", (pages, heads, block, head), torch.float16, seed=3)
    v = make("normal", (pages, heads, block, head), torch.float16, seed=4)
    physical = torch.stack(_sides(k, v, kind, (2.0, 0.5)), dim=1)
    logical = physical.permute(0, 1, 3, 2, 4)  # [pages, 2, block, heads, full_dim]
    for side, (x, scale) in enumerate([(k, 2.0), (v, 0.5)]):
        data, sf = T.nvfp4_split_data_scale(logical[:, side])
        want_data, want_scales = _oracle(x, kind, scale)
        assert torch.equal(data, want_data.transpose(1, 2))
        assert torch.equal(sf.view(torch.uint8), want_scales.transpose(1, 2))


@pytest.mark.parametrize("scale", [1.0, 0.0071, 3.3])
@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_nvfp4_write_is_vllms_quantizer_at_the_inverse_scale(dtype: torch.dtype, data: str,
                                                             scale: float) -> None:
    """The ``nvfp4`` write is vLLM's NVFP4 quantizer (ref_nvfp4_quant) at ENCODE scale
    ``f32(1 / k_scale)``: the same E2M1 values and block scales, bit for bit."""
    x = make(data, (24, 128), dtype, seed=DATA.index(data))
    # the CUDA writer's 1.0f / k_scale, in float32
    gs = torch.ones(1) / torch.tensor([scale], dtype=torch.float32)
    values, block_scales = E.ref_nvfp4_quant(x, gs, 16)
    codes, scales = kv.split_packed(kv.pack(x, "nvfp4", scale))
    assert torch.equal(decode_e2m1(codes, torch.float32), values)
    assert torch.equal(scales.to(torch.float32), block_scales)
