"""merge_error: the max-merge of fused global scales, against an independent float64 computation.

The oracle decodes each shard on its own (a table of E2M1 values times the float32 block
factors, metrics in float64, nothing from nvfp4lab's decode) and applies the merge rule of each
format as written in vLLM 0.33.0: compressed-tensors keeps ``1/max(encode)``
(compressed_tensors_w4a4_nvfp4.py L111-112), ModelOpt ``max(decode)`` (modelopt.py L2093).
"""

from __future__ import annotations

import math

import pytest
import torch

import nvfp4lab
from nvfp4lab.e2m1 import unpack_fp4
from nvfp4lab.execution.gemm import vllm_dequantize
from nvfp4lab.execution.shared_scales import merge_error, merged_decode_scale

AMAX = {"q_proj": 1.0, "k_proj": 2.0, "v_proj": 4.0}


def _shards(amax: dict[str, float], k: int = 128) -> dict[str, nvfp4lab.NVFP4Tensor]:
    out = {}
    for i, (name, a) in enumerate(amax.items()):
        w = torch.randn(32 + 16 * i, k, generator=torch.Generator().manual_seed(i))
        out[name] = nvfp4lab.quantize(w / w.abs().max() * a)  # own global scale 2688/a
    return out


def _oracle_weights(t: nvfp4lab.NVFP4Tensor, decode: float) -> torch.Tensor:
    """float32 value * (scale * decode), from a table (independent of nvfp4lab's decode)."""
    codes = unpack_fp4(t.packed).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    factor = t.scales.float() * torch.tensor(decode, dtype=torch.float32)
    return (values.reshape(*factor.shape, 16) * factor.unsqueeze(-1)).reshape(values.shape)


def _nmse(ref: torch.Tensor, app: torch.Tensor) -> float:
    ref, app = ref.double(), app.double()
    return float(((app - ref) ** 2).sum() / (ref**2).sum())


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_merge_error_matches_independent_computation(fmt: str) -> None:
    shards = _shards(AMAX)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(9))
    rows = {r.shard: r for r in merge_error(shards, fmt, activations=x)}
    encode = {n: float(t.global_scale) for n, t in shards.items()}
    decode = {n: float(torch.tensor(1.0) / t.global_scale) for n, t in shards.items()}
    if fmt == "compressed-tensors":
        merged = float(torch.tensor(1.0) / torch.tensor(max(encode.values())))
        exact = "q_proj"  # the smallest amax has the largest encode scale
    else:
        merged = max(decode.values())
        exact = "v_proj"  # the largest amax has the largest decode scale
    for name, t in shards.items():
        own = _oracle_weights(t, decode[name])
        got = _oracle_weights(t, merged)
        assert torch.equal(own, vllm_dequantize(t, torch.float32))  # same arithmetic as vLLM
        row = rows[name]
        assert row.merged_decode == merged and row.own_decode == decode[name]
        assert row.weight_nmse == _nmse(own, got)
        xo, xg = x.double() @ own.double().T, x.double() @ got.double().T
        assert row.output_nmse == _nmse(xo, xg)
        # the decoded weights are scaled uniformly by merged/own: NMSE = (factor - 1)^2
        assert row.factor == pytest.approx(merged / decode[name], rel=1e-12)
        assert row.weight_nmse == pytest.approx((row.factor - 1) ** 2, rel=1e-5, abs=1e-12)
        assert row.output_nmse == pytest.approx((row.factor - 1) ** 2, rel=1e-5, abs=1e-12)
    assert rows[exact].weight_nmse == 0 and math.isinf(rows[exact].weight_sqnr_db)
    # CT shrinks the larger-amax shards (factor amax_min/amax), ModelOpt inflates the smaller
    want = {"q_proj": 1.0, "k_proj": 0.5, "v_proj": 0.25} if fmt == "compressed-tensors" else {
        "q_proj": 4.0, "k_proj": 2.0, "v_proj": 1.0}
    for name, factor in want.items():
        assert rows[name].factor == pytest.approx(factor, rel=1e-6)


def test_shared_scales_cost_nothing() -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))
    gs = nvfp4lab.compute_global_scale(w)
    shards = {"gate_proj": nvfp4lab.quantize(w[:48], gs), "up_proj": nvfp4lab.quantize(w[48:], gs)}
    for fmt in ("compressed-tensors", "modelopt"):
        for row in merge_error(shards, fmt):
            assert row.weight_nmse == 0 and row.factor == 1.0 and row.output_nmse is None


def test_merged_scale_and_errors() -> None:
    shards = _shards(AMAX)
    ct = merged_decode_scale(shards, "compressed-tensors")
    mo = merged_decode_scale(shards, "modelopt")
    assert float(ct) == pytest.approx(1.0 / 2688, rel=1e-6)  # q_proj's amax 1
    assert float(mo) == pytest.approx(4.0 / 2688, rel=1e-6)  # v_proj's amax 4
    with pytest.raises(ValueError, match="checkpoint format"):
        merge_error(shards, "gguf")
    with pytest.raises(ValueError, match="at least one shard"):
        merge_error({}, "modelopt")
