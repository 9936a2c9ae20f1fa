"""W4A4 recipes (issue 35 item 3): rotations of any block, SmoothQuant / AWQ folded scales, 4over6
block scales and GPTQ on rotated, quantized activations, each against a slow oracle written here.

Bounds stated: a rotation's inverse in float64 returns x within 1e-13 (relative to max |x|); a
rotated (smoothed) float model equals the original within 1e-12 relative in float64 and 2e-5
relative in float32 (float rounding of the reordered products), BEFORE any quantization.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from nvfp4lab.codec import compute_global_scale, fake_quantize, quantize
from nvfp4lab.execution import GPTQOptions, NVFP4Linear, quantize_model
from nvfp4lab.execution.gemm import vllm_dequantize
from nvfp4lab.execution.gptq import gptq_quantize
from nvfp4lab.execution.w4a4_recipes import W4A4Linear, W4A4Options
from nvfp4lab.execution.w4a4_smooth import (
    observing_statistics,
    smooth_groups,
    smooth_model,
    smooth_statistics,
)
from nvfp4lab.hadamard import (
    hadamard_of_order,
    hadamard_transform,
    paley_hadamard,
    random_signs,
    rotate,
)
from tests.tiny_decoders import tiny_model

F64 = torch.float64


# -- oracles --------------------------------------------------------------------------------


def _legendre(a: int, q: int) -> int:
    a %= q
    if a == 0:
        return 0
    return 1 if pow(a, (q - 1) // 2, q) == 1 else -1


def _sylvester(n: int) -> torch.Tensor:
    """±1 Sylvester matrix by its entry rule: H[i, j] = (-1)^popcount(i & j)."""
    return torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)],
                        dtype=F64)


def _dense_rotation(k: int, seed: int, block: int) -> torch.Tensor:
    """Q = diag(signs) · blockdiag(H_b / sqrt(b)) built densely, H_b = H_m ⊗ H_p."""
    m = block
    while m % 2 == 0:
        m //= 2
    p = block // m
    if m > 1:  # the smallest Paley factor: m·2^j
        while True:
            try:
                hm = paley_hadamard(m)
                break
            except ValueError:
                m, p = m * 2, p // 2
    else:
        hm = torch.ones(1, 1, dtype=F64)
    hb = torch.kron(hm, _sylvester(p)) / block**0.5
    q = torch.block_diag(*([hb] * (k // block)))
    return torch.diag(random_signs(k, seed).to(F64)) @ q


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _batches(seed: int = 0, n: int = 2, t: int = 24) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(4, 256, (2, t), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return out


# -- rotations ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [12, 20, 28, 36, 44, 60])
def test_paley_matrix_is_hadamard_by_its_definition(n: int) -> None:
    h = paley_hadamard(n)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=F64))
    if n == 12:  # Paley I from q = 11: H = I + S, S[0, 1:] = 1, S[i, j] = chi(j - i)
        for i, j in itertools.product(range(1, 12), repeat=2):
            want = (1 if i == j else 0) + _legendre((j - 1) - (i - 1), 11)
            assert h[i, j] == want


@pytest.mark.parametrize(("k", "block"), [(64, 16), (128, 64), (576, 576), (576, 36 * 4),
                                          (1536, 1536), (1536, 96)])
def test_rotate_equals_dense_oracle_and_inverts_in_float64(k: int, block: int) -> None:
    x = torch.randn(5, k, dtype=F64, generator=torch.Generator().manual_seed(k + block))
    q = _dense_rotation(k, 7, block)
    got = rotate(x, 7, block=None if block == k else block)
    torch.testing.assert_close(got, x @ q, rtol=0, atol=1e-13 * float(x.abs().max()) * k**0.5)
    back = rotate(got, 7, block=None if block == k else block, inverse=True)
    assert float((back - x).abs().max()) <= 1e-13 * float(x.abs().max())
    assert torch.allclose(q @ q.T, torch.eye(k, dtype=F64), rtol=0, atol=1e-13)


def test_rotate_power_of_two_is_hadamard_transform_bit_for_bit() -> None:
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    for block in (16, 32, 64, 128):
        assert torch.equal(rotate(x, 3, block=block), hadamard_transform(x, 3, block=block))
    h = hadamard_of_order(128, dtype=F64)
    assert torch.equal(h * 128**0.5, _sylvester(128))


def test_unknown_orders_and_bad_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="Paley"):
        paley_hadamard(16)
    with pytest.raises(ValueError, match="power of two times a Paley order"):
        rotate(torch.zeros(2, 18), 0, block=None)
    with pytest.raises(ValueError, match="divisor of K=64"):
        rotate(torch.zeros(2, 64), 0, block=48)


@pytest.mark.parametrize("block", [32, None])
def test_rotated_float_layer_equals_the_original_before_quantization(block: int | None) -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 128, dtype=F64, generator=g), torch.randn(48, 128, dtype=F64, generator=g)
    exact = x @ w.T
    rotated = rotate(x, 5, block=block) @ rotate(w, 5, block=block).T
    assert float((rotated - exact).abs().max()) <= 1e-12 * float(exact.abs().max())
    x32, w32 = x.float(), w.float()
    r32 = rotate(x32, 5, block=block) @ rotate(w32, 5, block=block).T
    assert float((r32 - exact).abs().max()) <= 2e-5 * float(exact.abs().max())


# -- RTN with rotation and 4over6 vs an oracle ---------------------------------------------------


def _oracle_layer(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *, block: int | None,
                  seed: int, selection: str = "amax", inputs: str = "amax",
                  gs: torch.Tensor | None = None) -> torch.Tensor:
    """y = q_a(x Q) · dequant_vllm(NVFP4(W Q))ᵀ + b, everything spelled out."""
    numerator = {"amax": 448.0 * 6, "four_over_six": 256.0 * 6}
    wr = w if block == 0 else (w.to(F64) @ _dense_rotation(w.shape[1], seed, block or w.shape[1])
                               ).to(w.dtype)
    xr = x if block == 0 else (x.to(F64) @ _dense_rotation(x.shape[1], seed, block or x.shape[1])
                               ).to(x.dtype)
    opt_w = {} if selection == "amax" else {"scale_selection": selection}
    opt_x = {} if inputs == "amax" else {"scale_selection": inputs}
    gs_w = gs if gs is not None else compute_global_scale(wr, numerator=numerator[selection])
    wq = quantize(wr, gs_w, **opt_w)
    gs_x = compute_global_scale(xr, numerator=numerator[inputs])
    xq = fake_quantize(xr, gs_x, **opt_x)
    out = xq @ vllm_dequantize(wq, x.dtype).T
    return out if b is None else out + b


def _one_linear(k: int = 128, n: int = 32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n))
    with torch.no_grad():
        model[0].weight[:, 3] *= 20.0  # an outlier input channel
    return model


@pytest.mark.parametrize("options", [W4A4Options(rotation=32), W4A4Options(rotation=128),
                                     W4A4Options(weight_scales="four_over_six"),
                                     W4A4Options(rotation=64, weight_scales="four_over_six",
                                                 input_scales="four_over_six")])
def test_rtn_recipes_equal_the_oracle(options: W4A4Options) -> None:
    model = _one_linear()
    w, b = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3))
    x[:, 3] *= 30.0
    quantize_model(model, backend="emulation", w4a4=options)
    layer = model[0]
    assert isinstance(layer, W4A4Linear) == (options.input_scales == "four_over_six")
    assert layer.hadamard == (None if options.rotation is None else options.seed)
    want = _oracle_layer(x, w, b, block=0 if options.rotation is None else options.block,
                         seed=options.seed, selection=options.weight_scales,
                         inputs=options.input_scales)
    # the oracle rotates through a dense float64 Q; the layer by its fast rotation: a few
    # elements may round to a neighbouring code, so bound the difference, then compare codes
    torch.testing.assert_close(layer(x), want, rtol=0.02, atol=0.02 * float(want.abs().max()))
    wr = rotate(w, options.seed, block=options.block) if options.rotation else w
    opt = {} if options.weight_scales == "amax" else {"scale_selection": "four_over_six"}
    num = 2688.0 if options.weight_scales == "amax" else 1536.0
    exact = quantize(wr, compute_global_scale(wr, numerator=num), **opt)
    assert torch.equal(layer.weight_packed, exact.packed)
    assert torch.equal(layer.weight_scale.view(torch.uint8), exact.scales.view(torch.uint8))


def test_a_block_that_does_not_divide_k_takes_the_largest_power_of_two_that_does() -> None:
    options = W4A4Options(rotation=128)
    assert [options.block_for(k) for k in (576, 1536, 128)] == [64, 128, 128]
    assert W4A4Options(rotation="full").block_for(576) is None
    model = nn.Sequential(nn.Linear(576, 32))
    quantize_model(model, backend="emulation", w4a4=options)
    assert model[0].hadamard_block == 64


def test_rotation_makes_an_outlier_cheaper() -> None:
    """The recipe's point: with one outlier input channel, rotating lowers the W4A4 error."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    x[:, 3] *= 50.0
    errors = {}
    for rot in (None, 128):
        model = _one_linear()
        exact = model(x).detach()
        quantize_model(model, backend="emulation", w4a4=W4A4Options(rotation=rot))
        errors[rot] = float((model(x).detach() - exact).square().mean())
    assert errors[128] < 0.5 * errors[None]


# -- smoothing --------------------------------------------------------------------------------


def _candidates(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules()
            if type(m) is nn.Linear and not n.endswith("lm_head")}


@pytest.mark.parametrize(("dtype", "bound"), [(F64, 1e-12), (torch.float32, 2e-5)])
def test_smoothed_float_model_equals_the_original(dtype: torch.dtype, bound: float) -> None:
    model = tiny_model("llama", dtype=dtype)
    ids = torch.randint(4, 256, (2, 20), generator=torch.Generator().manual_seed(5))
    before = _logits(model, ids)
    norm_before = model.model.layers[0].input_layernorm.weight.clone()
    result = smooth_model(model, _candidates(model), _batches(), W4A4Options(smooth_alpha=0.5),
                          "kernel")
    assert len(result.alphas) == 8 and not result.skipped  # 4 groups x 2 layers
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, norm_before)
    after = _logits(model, ids)
    assert float((after - before).abs().max()) <= bound * float(before.abs().max())
    result.undo()
    assert torch.equal(_logits(model, ids), before)


def test_smoothquant_scales_equal_the_oracle() -> None:
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    batches = _batches()
    seen: dict[str, list[torch.Tensor]] = {"q": [], "o": [], "down": []}
    layer = ref.model.layers[1].requires_grad_(False)
    hooks = [mod.register_forward_pre_hook(lambda m, a, key=key: seen[key].append(a[0]))
             for key, mod in (("q", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                              ("down", layer.mlp.down_proj))]
    with torch.no_grad():
        for b in batches:
            ref(**b)
    for h in hooks:
        h.remove()
    alpha = 0.6
    smooth_model(model, _candidates(model), batches, W4A4Options(smooth_alpha=alpha), "kernel")
    new = model.model.layers[1]

    def scales(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> torch.Tensor:
        k = xs[0].shape[-1]
        s = torch.empty(k, dtype=F64)
        for j in range(k):  # one channel at a time
            xm = max(float(x[..., j].abs().max()) for x in xs)
            wm = max(float(w[:, j].abs().max()) for w in ws)
            s[j] = xm**alpha / wm ** (1 - alpha)
        return s

    a = layer.self_attn
    s = scales(seen["q"], [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    torch.testing.assert_close(new.input_layernorm.weight.to(F64),
                               layer.input_layernorm.weight.to(F64) / s, rtol=1e-6, atol=0)
    torch.testing.assert_close(new.self_attn.q_proj.weight.to(F64),
                               a.q_proj.weight.to(F64) * s, rtol=1e-6, atol=0)
    # o_proj: the query heads sharing a KV head (4 heads, 2 KV heads of 32) share one scale,
    # folded into v_proj's rows (whose columns took the q/k/v group's scale first)
    so_kv = torch.tensor([[max(float(x[..., h * 32 + d].abs().max()) for x in seen["o"]
                               for h in (2 * kv, 2 * kv + 1)) ** alpha
                           / max(float(a.o_proj.weight[:, h * 32 + d].abs().max())
                                 for h in (2 * kv, 2 * kv + 1)) ** (1 - alpha)
                           for d in range(32)] for kv in range(2)], dtype=F64).reshape(-1)
    torch.testing.assert_close(new.self_attn.v_proj.weight.to(F64),
                               a.v_proj.weight.to(F64) * s[None, :] / so_kv[:, None],
                               rtol=1e-5, atol=0)
    so = so_kv.view(2, 1, 32).expand(2, 2, 32).reshape(-1)
    torch.testing.assert_close(new.self_attn.o_proj.weight.to(F64),
                               a.o_proj.weight.to(F64) * so, rtol=1e-6, atol=0)
    sd = scales(seen["down"], [layer.mlp.down_proj.weight])
    torch.testing.assert_close(new.mlp.down_proj.weight.to(F64),
                               layer.mlp.down_proj.weight.to(F64) * sd, rtol=1e-6, atol=0)


def test_awq_picks_the_oracles_best_strength() -> None:
    model = tiny_model("llama")
    batches = _batches()
    ref = copy.deepcopy(model)
    options = W4A4Options(awq=True, rotation=32, awq_grid=(0.0, 0.25, 0.5, 0.75, 1.0),
                          awq_tokens=10_000)
    cands = _candidates(model)
    groups = smooth_groups(model, cands)
    gate = next(g for g in groups if g.kind == "post_norm" and ".layers.0." in g.source)
    xs: list[torch.Tensor] = []
    mlp = ref.model.layers[0].mlp
    h = mlp.gate_proj.register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, 64)))
    with torch.no_grad():
        for b in batches:
            ref(**b)
    h.remove()
    x = torch.cat(xs).to(F64)
    ws = [mlp.gate_proj.weight.detach().to(F64), mlp.up_proj.weight.detach().to(F64)]
    q = _dense_rotation(64, 0, 32)
    errors = {}
    for alpha in options.awq_grid:
        s = torch.tensor([float(x[:, j].abs().max()) ** alpha
                          / max(float(w[:, j].abs().max()) for w in ws) ** (1 - alpha)
                          for j in range(64)], dtype=F64)
        xr = ((x / s) @ q).float()
        xq = fake_quantize(xr, compute_global_scale(xr))
        wr = [((w * s) @ q).float() for w in ws]
        gs = torch.minimum(*[compute_global_scale(w) for w in wr])
        errors[alpha] = sum(float(((xq.to(F64) @ fake_quantize(w, gs).to(F64).T) - x @ w0.T)
                                  .square().sum()) for w, w0 in zip(wr, ws, strict=True))
    result = smooth_model(model, cands, batches, options, "kernel")
    best = min(errors, key=lambda a: errors[a])
    assert result.alphas[gate.members[0]] == best
    assert len(set(result.alphas.values())) > 1 or best != 0.0


def test_smoothing_skips_a_norm_that_does_not_feed_the_group() -> None:
    model = tiny_model("gemma2")  # post_attention_layernorm normalises the attention output
    result = smooth_model(model, _candidates(model), _batches(), W4A4Options(smooth_alpha=0.5),
                          "kernel")
    assert any("not fed the norm" in why or "scale with its weight" in why
               for why in result.skipped.values())


# -- GPTQ on rotated, quantized activations ------------------------------------------------------


def test_w4a4_gptq_uses_the_hessian_of_rotated_quantized_inputs() -> None:
    model = _one_linear(seed=1)
    w = model[0].weight.detach().clone()
    g = torch.Generator().manual_seed(6)
    batches = [torch.randn(2, 40, 128, generator=g) for _ in range(3)]
    for b in batches:
        b[..., 3] *= 25.0
    options = W4A4Options(rotation=64, seed=3)
    quantize_model(model, backend="emulation", method="gptq", calibration=batches, w4a4=options)
    q = _dense_rotation(128, 3, 64)
    h = torch.zeros(128, 128, dtype=F64)
    tokens = 0
    for b in batches:  # the layer's input as it sees it: q_a(x Q), dynamic scale per call
        xr = (b.reshape(-1, 128).to(F64) @ q).float()
        xq = fake_quantize(xr, compute_global_scale(xr)).to(F64)
        h += xq.T @ xq
        tokens += xq.shape[0]
    wr = rotate(w, 3, block=64)
    want = gptq_quantize(wr, h * (2.0 / tokens), options=GPTQOptions())
    assert torch.equal(model[0].weight_packed, want.weight.packed)
    plain = gptq_quantize(wr, q.T @ sum(b.reshape(-1, 128).to(F64).T @ b.reshape(-1, 128).to(F64)
                                        for b in batches) @ q * (2.0 / tokens))
    assert not torch.equal(plain.weight.packed, want.weight.packed)  # the Hessian matters


@pytest.mark.parametrize("options", [
    W4A4Options(smooth_alpha=0.5),
    W4A4Options(awq=True, rotation=32, awq_grid=(0.0, 0.5, 1.0), awq_tokens=30),
], ids=["smoothquant", "awq"])
def test_statistics_made_once_smooth_copies_as_their_own_pass_does(options: W4A4Options) -> None:
    """smooth_statistics of the float model, on its decoder only, then quantize_model of two
    copies with them: every stored tensor equal to quantize_model's own pass (RTN and GPTQ)."""
    reference = tiny_model("llama")
    batches = _batches()
    stats = smooth_statistics(reference, batches, tokens=options.awq_tokens, rows=options.awq,
                              run=reference.model)
    assert stats.rows == options.awq and len(stats.by_group) == 8  # 4 groups x 2 layers
    for method in ("rtn", "gptq"):
        own, reused = copy.deepcopy(reference), copy.deepcopy(reference)
        quantize_model(own, backend="emulation", method=method, calibration=batches, w4a4=options)
        quantize_model(reused, backend="emulation", method=method, calibration=batches,
                       w4a4=options, smooth_statistics=stats)
        want, got = own.state_dict(), reused.state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), method


def test_statistics_of_another_model_or_without_awq_rows_are_refused() -> None:
    model = tiny_model("llama")
    batches = _batches()
    stats = smooth_statistics(model, batches)  # no rows kept
    with pytest.raises(ValueError, match="rows=True"):
        quantize_model(copy.deepcopy(model), backend="emulation", calibration=batches,
                       w4a4=W4A4Options(awq=True), smooth_statistics=stats)
    with pytest.raises(ValueError, match="read only by w4a4"):
        quantize_model(copy.deepcopy(model), backend="emulation", smooth_statistics=stats)
    other = smooth_statistics(model.model, batches)  # names without the "model." prefix
    before = _logits(model, batches[0]["input_ids"])
    with pytest.raises(ValueError, match="computed on another model"):
        quantize_model(model, backend="emulation", calibration=batches,
                       w4a4=W4A4Options(smooth_alpha=0.5), smooth_statistics=other)
    assert torch.equal(_logits(model, batches[0]["input_ids"]), before)  # nothing changed
    with pytest.raises(ValueError, match="no Llama-style decoder layer"):
        smooth_statistics(_one_linear(), [torch.zeros(1, 128)])
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        smooth_statistics(model, batches, tokens=0)
    with pytest.raises(ValueError, match="with a backend"):  # refused before any KV pass
        quantize_model(copy.deepcopy(model), backend=None, kv_cache="nvfp4",
                       smooth_statistics=stats)
    unseen, other = observing_statistics(model, batches), tiny_model("llama")
    with unseen, torch.no_grad():  # the pass runs another model: nothing reaches its hooks
        other(**batches[0])
    with pytest.raises(ValueError, match="saw no input"):
        quantize_model(copy.deepcopy(model), backend="emulation", calibration=batches,
                       w4a4=W4A4Options(smooth_alpha=0.5), smooth_statistics=unseen.statistics)


def test_w4a4_recipes_on_a_tiny_decoder_all_together() -> None:
    model = tiny_model("llama")
    ids = torch.randint(4, 256, (2, 20), generator=torch.Generator().manual_seed(8))
    ref = _logits(model, ids)
    report = quantize_model(model, backend="emulation", method="gptq", calibration=_batches(),
                            w4a4=W4A4Options(rotation="full", awq=True,
                                             awq_grid=(0.0, 0.5, 1.0)))
    assert len(report.replaced) == 14
    assert all(isinstance(m, NVFP4Linear) and m.hadamard_block is None
               for m in (model.get_submodule(r.name) for r in report.replaced))
    assert "gptq (w4a4: rotation full, AWQ)" in {r.method for r in report.replaced}
    out = _logits(model, ids)
    kl = torch.nn.functional.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert 0.0 < float(kl) < 0.05


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rotation": 0}, "rotation must be"),
    ({"rotation": "half"}, "rotation must be"),
    ({"smooth_alpha": 1.5}, "smooth_alpha must be"),
    ({"awq": True, "smooth_alpha": 0.5}, "drop smooth_alpha"),
    ({"weight_scales": "mse"}, "weight_scales must be"),
    ({"awq_grid": ()}, "awq_grid"),
])
def test_bad_options_say_what_and_how(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        W4A4Options(**kwargs)


def test_bad_calls_are_refused_and_leave_the_model_as_it_was() -> None:
    model = tiny_model("llama")
    ids = torch.randint(4, 256, (1, 8), generator=torch.Generator().manual_seed(9))
    before = _logits(model, ids)
    with pytest.raises(ValueError, match="pass calibration="):
        quantize_model(model, backend="emulation", w4a4=W4A4Options(awq=True))
    with pytest.raises(ValueError, match="drop hadamard="):
        quantize_model(model, backend="emulation", hadamard=1, w4a4=W4A4Options(rotation=16))
    with pytest.raises(ValueError, match="method='rtn' only"):
        quantize_model(model, backend="emulation", method="gptq", calibration=_batches(),
                       w4a4=W4A4Options(weight_scales="four_over_six"))
    with pytest.raises(ValueError, match="cannot rotate layer"):
        quantize_model(model, backend="emulation", calibration=_batches(),
                       w4a4=W4A4Options(rotation=24, smooth_alpha=0.5))
    with pytest.raises(TypeError, match="W4A4Options"):
        quantize_model(model, backend="emulation", w4a4={"rotation": 16})  # type: ignore[arg-type]
    assert torch.equal(_logits(model, ids), before)
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
