"""Q / K block-Hadamard rotation before the quantized KV cache (``qk_rotation``,
``KVCacheOptions(kind, qk_rotation=b)``; SGLang's ``--qkrot-block``, compressed-tensors'
``q_attn`` / ``k_cache`` transforms of type ``hadamard``).

Oracles: compressed-tensors' own transform factory and its ``apply_transform_config`` on the
tiny Llama (the matrices, and the rotated float attention bit for bit), the slow KV oracle
``oracles.kv_cache`` on the key the model hands attention, and the unrotated float model
(rotation changes float attention only by rounding).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from nvfp4lab.execution import KVCacheOptions, quantize_model
from nvfp4lab.execution import attention as att
from nvfp4lab.execution import attention_modules as am
from nvfp4lab.oracles import kv_cache as ref_kv
from nvfp4lab.vocab import KVCacheKind
from tests.execution.test_attention import IDS, logits, tiny_llama

ct_transform = pytest.importorskip("compressed_tensors.transform")
from compressed_tensors.transform import (  # noqa: E402
    TransformArgs,
    TransformConfig,
    TransformFactory,
    TransformScheme,
    apply_transform_config,
)
from transformers.modeling_utils import AttentionInterface  # noqa: E402

#: (block, head_dim of the tiny Llama it runs on).
BLOCKS = [(16, 32), (32, 32), (64, 64), (128, 128)]


def _scheme(block: int) -> TransformScheme:
    """compressed-tensors' Q / K rotation: ``hadamard`` of ``head_dim = block`` at ``q_attn`` and
    ``k_cache`` of every Llama attention module."""
    targets = ["LlamaAttention"]
    return TransformScheme(type="hadamard", head_dim=block, apply=[
        TransformArgs(targets=targets, location="q_attn"),
        TransformArgs(targets=targets, location="k_cache")])


def _ct_transforms(block: int, module: nn.Module) -> list[Any]:
    """The factory's transforms (q_attn, k_cache) for ``module``, built by compressed-tensors."""
    scheme = _scheme(block)
    factory = TransformFactory.from_scheme(scheme, name="qk")
    return [factory.create_transform(module, args) for args in scheme.apply]


def _sylvester(n: int) -> torch.Tensor:
    """Sylvester's ±1 Hadamard matrix by Kronecker products, float64 (the test's own)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h


class _Calls:
    """Records (layer_idx, query, key, value) of every call of one registered attention
    function, then runs it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        real = AttentionInterface._global_mapping[name]

        def spy(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *args: Any, **kwargs: Any) -> Any:
            self.calls.append((module.layer_idx, query.detach().clone(), key.detach().clone(),
                               value.detach().clone()))
            return real(module, query, key, value, *args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, name, spy)

    def take(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        calls, self.calls = self.calls, []
        return calls


def _no_kv_quantization(monkeypatch: pytest.MonkeyPatch) -> None:
    """An identity quantizer in the KV attention: only the rotation acts."""
    monkeypatch.setattr(am, "fake_quantize_kv", lambda x, kind, scale: x)


# -- the matrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block", att.QK_ROTATION_BLOCKS)
def test_the_matrix_is_compressed_tensors_hadamard_and_orthogonal(block: int) -> None:
    rotation = att.qk_rotation_matrix(block)
    model = tiny_llama(head_dim=128)
    for transform in _ct_transforms(block, model.model.layers[0].self_attn):
        assert torch.equal(transform.weight, rotation.matrix(torch.float32))
        assert transform.weight.dtype == torch.float32  # online: the scheme's precision
    assert torch.equal(rotation.matrix(torch.float64), _sylvester(block))
    dense = rotation.dense(128, torch.float64)  # blockdiag(H, ..., H) / sqrt(b), [128, 128]
    assert (dense @ dense.T - torch.eye(128, dtype=torch.float64)).abs().max() < 1e-13
    expected = torch.block_diag(*[_sylvester(block)] * (128 // block)) / block**0.5
    assert (dense - expected).abs().max() < 1e-15
    x = torch.randn(3, 2, 5, 128, generator=torch.Generator().manual_seed(block))
    for transform in _ct_transforms(block, model.model.layers[0].self_attn):
        assert torch.equal(transform(x), rotation.apply(x))  # same arithmetic, bit for bit


# -- (a) the float attention is unchanged ---------------------------------------------------------


@pytest.mark.parametrize(("block", "head_dim"), BLOCKS)
def test_rotation_alone_leaves_the_float_logits(block: int, head_dim: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With an identity quantizer, the rotated model's logits are the float model's within
    float32 rounding (float64: 1e-12); rotating only the key would move them by far more."""
    _no_kv_quantization(monkeypatch)
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-12)):
        model = tiny_llama(head_dim=head_dim).to(dtype)
        reference = logits(model)
        layers = att.quantize_kv_cache(model, "nvfp4", qk_rotation=block)
        assert [x.qk_rotation for x in layers] == [block, block]
        got = logits(model)
        scale = reference.abs().max()
        assert (got - reference).abs().max() <= tol * scale, dtype


def test_rotating_only_the_key_would_change_the_float_logits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with the query left unrotated the logits move by far more
    than rounding."""
    _no_kv_quantization(monkeypatch)
    model = tiny_llama(head_dim=32)
    reference = logits(model)
    real = am.BlockRotation.apply
    heads = model.config.num_attention_heads

    def key_only(self: Any, x: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        return x if x.shape[1] == heads else real(self, x, inverse=inverse)

    monkeypatch.setattr(am.BlockRotation, "apply", key_only)
    att.quantize_kv_cache(model, "nvfp4", qk_rotation=16)
    assert (logits(model) - reference).abs().max() > 1e-3 * reference.abs().max()


@pytest.mark.parametrize(("block", "head_dim"), BLOCKS[:2])
def test_compressed_tensors_apply_rotates_the_query_as_nvfp4lab_does(
        block: int, head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """compressed-tensors' ``apply_transform_config`` with the q_attn / k_cache scheme on a copy
    of the tiny Llama hands sdpa the query nvfp4lab's rotated attention hands it (identity
    quantizer), bit for bit: the same transform, after RoPE, in the same arithmetic. Its key:
    compressed-tensors 0.20.1's k_cache hook swaps the attention's ``past_key_values`` argument,
    which transformers 5.25's Llama attention no longer has (it takes ``cache``), so the key
    stays unrotated there (a broken model, logits far off); were it rotated, it must be ours."""
    _no_kv_quantization(monkeypatch)
    model = tiny_llama(head_dim=head_dim)
    hooked = copy.deepcopy(model)
    sdpa = _Calls(monkeypatch, "sdpa")
    logits(model)
    plain = sdpa.take()
    apply_transform_config(hooked, TransformConfig(config_groups={"qk": _scheme(block)}))
    logits(hooked)
    theirs = sdpa.take()
    att.quantize_kv_cache(model, "nvfp4", qk_rotation=block)
    sdpa.take()  # the probe
    logits(model)
    ours = sdpa.take()
    # layer 0 gets the same hidden states in all three models
    assert torch.equal(theirs[0][1], ours[0][1]) and not torch.equal(ours[0][1], plain[0][1])
    if torch.equal(theirs[0][2], plain[0][2]):  # the k_cache hook did not reach the cache
        assert not torch.equal(ours[0][2], plain[0][2])
    else:
        assert torch.equal(theirs[0][2], ours[0][2])


# -- (b) the rotated K is what is quantized -------------------------------------------------------


@pytest.mark.parametrize(("block", "head_dim"), BLOCKS[:3])
@pytest.mark.parametrize("kind", [KVCacheKind.NVFP4, KVCacheKind.NVFP4_4OVER6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sees_the_rotated_quantized_key(
        block: int, head_dim: int, kind: KVCacheKind, dtype: torch.dtype,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """sdpa gets q R, the slow oracle's fake quantization of k R per KV head and token, and V
    quantized unrotated; R applied by compressed-tensors' own transform to what the model hands
    attention (layer 0: the float model's own post-RoPE q / k)."""
    model = tiny_llama(head_dim=head_dim).to(dtype)
    sdpa = _Calls(monkeypatch, "sdpa")
    logits(model)
    float_calls = sdpa.take()
    att.quantize_kv_cache(model, kind, kv_scales={0: (0.5, 2.0)}, qk_rotation=block)
    sdpa.take()  # the probe
    handed = _Calls(monkeypatch, att.kv_attention_name("sdpa"))
    logits(model)
    seen = sdpa.take()
    assert [c[0] for c in seen] == [c[0] for c in handed.calls] == [0, 1]
    assert torch.equal(handed.calls[0][2], float_calls[0][2])  # layer 0: the float model's K
    for (idx, q_in, k_in, v_in), (_, q_seen, k_seen, v_seen) in zip(handed.calls, seen,
                                                                    strict=True):
        q_rot, k_rot = _ct_transforms(block, model.model.layers[idx].self_attn)
        k_scale, v_scale = (0.5, 2.0) if idx == 0 else (1.0, 1.0)
        assert k_seen.shape == (2, 2, 12, head_dim) and q_seen.shape == (2, 4, 12, head_dim)
        assert torch.equal(q_seen, q_rot(q_in))
        assert torch.equal(k_seen, ref_kv.kv_fake_quantize(k_rot(k_in), kind, k_scale))
        assert torch.equal(v_seen, ref_kv.kv_fake_quantize(v_in, kind, v_scale))
        assert not torch.equal(k_seen, ref_kv.kv_fake_quantize(k_in, kind, k_scale))


def test_quantize_model_passes_the_rotation_on() -> None:
    """``quantize_model(kv_cache=KVCacheOptions(kind, qk_rotation=b))`` is
    ``quantize_kv_cache(..., qk_rotation=b)``, alone and beside quantized Linear layers; the
    report and ``kv_cache_rotations`` say so; without the rotation the logits differ."""
    for backend in (None, "w4a16"):
        direct, via, unrotated = tiny_llama(), tiny_llama(), tiny_llama()
        if backend is not None:
            quantize_model(direct, backend=backend)
        att.quantize_kv_cache(direct, "nvfp4", qk_rotation=16)
        report = quantize_model(via, backend=backend,
                                kv_cache=KVCacheOptions("nvfp4", qk_rotation=16))
        quantize_model(unrotated, backend=backend, kv_cache=KVCacheOptions("nvfp4"))
        assert [x.qk_rotation for x in report.kv_cache] == [16, 16]
        assert "Q/K Hadamard 16" in str(report.kv_cache[0])
        assert att.kv_cache_rotations(via) == {f"model.layers.{i}.self_attn": 16
                                               for i in range(2)}
        assert att.kv_cache_rotations(unrotated) == {}
        assert torch.equal(logits(via), logits(direct))
        assert not torch.equal(logits(via), logits(unrotated))
        att.remove_kv_cache_quantization(via)
        assert att.kv_cache_rotations(via) == {}


def test_generation_with_a_cache_equals_the_full_forward() -> None:
    """Rotation and quantization are row-wise: decoding token by token with a DynamicCache
    reads the same rotated, quantized rows as one full forward."""
    model = tiny_llama()
    att.quantize_kv_cache(model, "nvfp4", qk_rotation=32)
    with torch.no_grad():
        full = model(IDS[:1], use_cache=False).logits
        out = model(IDS[:1, :6], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for j in range(6, IDS.shape[1]):
            out = model(IDS[:1, j:j + 1], cache=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


# -- (d) bad blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [8, 12, 256, 0, -16, True, 16.0, "16"])
def test_a_bad_block_is_refused_in_one_line(block: Any) -> None:
    with pytest.raises(ValueError, match=r"qk_rotation=.*pass None or a Hadamard block of "
                                         r"16, 32, 64, 128$"):
        KVCacheOptions("nvfp4", qk_rotation=block)
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"quantize_kv_cache qk_rotation="):
        att.quantize_kv_cache(model, "nvfp4", qk_rotation=block)
    assert att.kv_cache_settings(model) == {}


def test_a_block_that_does_not_divide_head_dim_names_both() -> None:
    model = tiny_llama(head_dim=32)
    before = logits(model)
    message = (r"quantize_kv_cache qk_rotation=64 does not divide model.layers.0.self_attn "
               r"head_dim 32: pass a block of 16, 32, 64, 128 that divides 32, or None")
    with pytest.raises(ValueError, match=message):
        att.quantize_kv_cache(model, "fp8", qk_rotation=64)
    with pytest.raises(ValueError, match=message):
        quantize_model(model, backend="w4a16", kv_cache=KVCacheOptions("nvfp4", qk_rotation=64))
    assert att.kv_cache_settings(model) == {} and model.config._attn_implementation == "sdpa"
    assert not any(type(m).__name__ == "NVFP4Linear" for m in model.modules())
    assert torch.equal(logits(model), before)


def test_rotation_with_calibrated_scales_is_refused() -> None:
    with pytest.raises(ValueError, match=r"qk_rotation=16 with scales='calibrated': the scales "
                                         r"would be calibrated on K unrotated"):
        KVCacheOptions("nvfp4", scales="calibrated", qk_rotation=16)
    with pytest.raises(ValueError, match=r"qk_rotation_matrix\(None\)"):
        att.qk_rotation_matrix(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_saving_a_rotated_kv_cache_is_refused_and_writes_nothing(fmt: str, tmp_path: Any) -> None:
    """No engine runs a saved Q/K rotation (vLLM 0.33 applies no q_attn / k_cache transform):
    save_pretrained refuses it in one line, before writing anything; unrotated, it saves."""
    from nvfp4lab.checkpoint import save_pretrained

    model = tiny_llama()
    quantize_model(model, backend="w4a16", kv_cache=KVCacheOptions("fp8", qk_rotation=16))
    with pytest.raises(ValueError, match=r"rotates Q and K \(a 16-point.*without qk_rotation"):
        save_pretrained(model, tmp_path / "rotated", format=fmt)
    assert not (tmp_path / "rotated").exists()
    plain = tiny_llama()
    quantize_model(plain, backend="w4a16", kv_cache=KVCacheOptions("fp8"))
    save_pretrained(plain, tmp_path / "plain", format=fmt, dtype=torch.bfloat16)
    assert (tmp_path / "plain" / "config.json").is_file()
