"""GPTQ for NVFP4: reduces to RTN with an identity Hessian, beats RTN on correlated inputs, equals a
slow column-by-column reference (written independently below), and whole-model sequential GPTQ
gives ordinary NVFP4Linear layers that save and load."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from nvfp4lab import models, number_formats, quantize
from nvfp4lab.codec import compute_global_scale
from nvfp4lab.e2m1 import unpack_fp4
from nvfp4lab.execution import NVFP4Linear, gptq, quantize_model
from nvfp4lab.execution.calibrate import calibration_batches
from nvfp4lab.execution.gptq import (
    GPTQFallbackWarning,
    GPTQOptions,
    Hessian,
    gptq_fake_quantize,
    gptq_quantize,
)
from nvfp4lab.execution.gptq_model import collect_hessians
from nvfp4lab.hadamard import ct_rotation, hadamard_transform, rotation_matrix
from nvfp4lab.oracles import numbers as ref_numbers
from nvfp4lab.oracles import nvfp4 as ref_nvfp4
from nvfp4lab.tensor import RotatedNVFP4Tensor
from nvfp4lab.vocab import OrderName
from tests.conftest import needs_minilm
from tests.execution.reference_gptq import differing, whole_model_gptq
from tests.execution.tiny_models import tiny_model, token_batches


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _layer(n: int = 48, k: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _inputs(tokens: int, k: int, seed: int = 1, outliers: int = 3) -> torch.Tensor:
    """Correlated inputs (a random mixing) with a few outlier channels, float32 [tokens, K]."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / math.sqrt(k) + torch.eye(k)
    x = torch.randn(tokens, k, generator=g) @ mix
    x[:, :outliers] *= 8.0
    return x


def _hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return 2.0 * x.T @ x / x.shape[0]


def _output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    x = x.double()
    error = (x @ (w.double() - w_hat.double()).T).square().sum()
    return float(error / (x @ w.double().T).square().sum())


# -- (a) identity Hessian: GPTQ is RTN -----------------------------------------------------------


@pytest.mark.parametrize("convention", list(OrderName))  # every arithmetic order
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_hessian_is_rtn_bit_for_bit(convention: str, dtype: torch.dtype) -> None:
    w = (_layer(64, 128) * 0.05).to(dtype)
    for h in (torch.eye(128), 7.5 * torch.eye(128, dtype=torch.float64)):  # scale is irrelevant
        got = gptq_quantize(w, h, convention=convention).weight
        want = quantize(w, convention=convention)
        assert got is not None and got.dtype == dtype and got.shape == w.shape
        assert torch.equal(got.packed, want.packed)
        assert torch.equal(_raw(got.scales), _raw(want.scales))
        assert torch.equal(got.global_scale, want.global_scale)
        assert (got.decode_scale is None) == (want.decode_scale is None)
        if want.decode_scale is not None:  # the modelopt order keeps its exact DECODE scale
            assert torch.equal(got.decode_scale, want.decode_scale)


def test_orthogonal_inputs_are_rtn_and_act_order_changes_nothing() -> None:
    """Inputs with orthogonal, equal-norm columns give H = c·I: nothing to feed forward."""
    q, _ = torch.linalg.qr(torch.randn(256, 64, generator=torch.Generator().manual_seed(3)))
    x = (q * 4.0).float()
    w = _layer(32, 64)
    want = quantize(w)
    for options in (GPTQOptions(), GPTQOptions(act_order=True), GPTQOptions(block_size=16)):
        got = gptq_quantize(w, _hessian(x), options=options).weight
        assert got is not None and torch.equal(got.packed, want.packed)


@pytest.mark.parametrize("name", ["mxfp4", "int4_g128"])
def test_identity_hessian_is_the_comparator_format(name: str) -> None:
    w = _layer(32, 256)
    got = gptq_fake_quantize(w, torch.eye(256), name)
    assert torch.equal(got, number_formats.get(name).fake_quantize(w))


def test_global_scale_given_or_from_the_original_weights() -> None:
    w, x = _layer(), _inputs(512, 96)
    result = gptq_quantize(w, _hessian(x))
    assert result.weight is not None
    assert torch.equal(result.weight.global_scale, compute_global_scale(w))
    shared = compute_global_scale(w) * 0.5
    forced = gptq_quantize(w, _hessian(x), global_scale=shared).weight
    assert forced is not None and torch.equal(forced.global_scale, shared)


# -- (b) GPTQ beats RTN on the calibration data --------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [GPTQOptions(), GPTQOptions(act_order=True), GPTQOptions(scales="updated"),
     GPTQOptions(block_size=32), GPTQOptions(damp=0.1)],
    ids=["default", "act_order", "updated_scales", "block32", "damp0.1"],
)
def test_gptq_output_error_below_rtn(options: GPTQOptions) -> None:
    w, x = _layer(64, 128), _inputs(1024, 128)
    result = gptq_quantize(w, _hessian(x), options=options)
    rtn = _output_error(x, w, quantize(w).dequantize(torch.float32))
    got = _output_error(x, w, result.dequantized)
    assert got < 0.6 * rtn, (got, rtn)  # measured: 0.34-0.46 of RTN's error
    assert result.weight is not None
    assert torch.equal(result.weight.dequantize(torch.float32), result.dequantized)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4_g128"])
@pytest.mark.parametrize("hadamard", [None, 5])
def test_format_gptq_beats_format_rtn(name: str, hadamard: int | None) -> None:
    w, x = _layer(64, 256), _inputs(2048, 256)
    fq = number_formats.get(name).fake_quantize
    if hadamard is None:
        rtn_w = fq(w)
    else:  # RTN in the rotated basis, rotated back
        rtn_w = gptq_fake_quantize(w, torch.eye(256), name, hadamard=hadamard)
    got = gptq_fake_quantize(w, _hessian(x), name, hadamard=hadamard)
    assert got.shape == w.shape and got.dtype == w.dtype
    # measured 0.35-0.44 of the format's RTN error (rotated or not)
    assert _output_error(x, w, got) < 0.6 * _output_error(x, w, rtn_w)


def test_hadamard_with_identity_hessian_is_rotated_rtn() -> None:
    """With H = I the rotated GPTQ is RTN of W·Q rotated back (= fake_quantize(hadamard=seed))."""
    w = _layer(32, 128)
    got = gptq_fake_quantize(w, torch.eye(128), "nvfp4", hadamard=7)
    want = number_formats.get("nvfp4").fake_quantize(w, hadamard=7)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# -- (c) a slow, readable reference: explicit inverse Hessian, one column at a time --------------


def _reference_column(col: list[float], scales: list[float], gs: float) -> list[float]:
    """Kernel-order rounding of one column with fixed block scales, in emulated float32."""
    f32 = ref_numbers.round_f32
    out = []
    for v, s in zip(col, scales, strict=True):
        multiplier = 0.0 if s == 0 else f32(1.0 / f32(s * f32(1.0 / gs)))
        scaled = min(max(f32(f32(v) * multiplier), -6.0), 6.0)
        code = ref_numbers.round_e2m1(scaled)
        out.append(f32(ref_numbers.decode_e2m1_code(code) * f32(s / gs)))
    return out


def reference_gptq(
    w: torch.Tensor, h: torch.Tensor, *, damp: float = 0.01, act_order: bool = False,
    updated: bool = False,
) -> torch.Tensor:
    """Optimal-brain-quantizer form of GPTQ: after each column, the remaining columns move by
    ``err · Hinv[i, rest] / Hinv[i, i]`` and column i is eliminated from ``Hinv``. No Cholesky,
    no lazy batches; scales from the slow oracle :mod:`nvfp4lab.oracles.nvfp4`."""
    n, k = w.shape
    gs = ref_nvfp4.global_scale(w)
    W = w.double().clone()
    H = h.double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * H.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    hinv = torch.linalg.inv(H)
    _, scales = ref_nvfp4.quantize_blocks(W.float(), gs)
    order = sorted(range(k), key=lambda j: -float(H[j, j])) if act_order else list(range(k))
    q = torch.zeros(n, k, dtype=torch.float64)
    remaining = list(order)
    for j in order:
        g = j // 16
        if updated and j % 16 == 0:
            _, fresh = ref_nvfp4.quantize_blocks(W[:, 16 * g : 16 * g + 16].float(), gs)
            scales[:, g] = fresh[:, 0]
        q[:, j] = torch.tensor(_reference_column(W[:, j].tolist(), scales[:, g].tolist(), gs),
                               dtype=torch.float64)
        remaining.remove(j)
        err = (W[:, j] - q[:, j]) / hinv[j, j]
        W[:, remaining] -= torch.outer(err, hinv[j, remaining])
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return q.float()


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"act_order": True}, {"updated": True}, {"damp": 0.1}],
    ids=["default", "act_order", "updated_scales", "damp0.1"],
)
def test_fast_equals_slow_reference(kwargs: dict[str, object]) -> None:
    w, x = _layer(24, 64, seed=4), _inputs(300, 64, seed=5)
    x[:, 9] = 0.0  # one dead input
    options = GPTQOptions(
        damp=float(kwargs.get("damp", 0.01)),  # type: ignore[arg-type]
        act_order=bool(kwargs.get("act_order", False)),
        scales="updated" if kwargs.get("updated") else "original",
        block_size=32,
    )
    got = gptq_quantize(w, _hessian(x), options=options)
    want = reference_gptq(w, _hessian(x), **kwargs)  # type: ignore[arg-type]
    assert got.dead_columns == 1
    assert torch.equal(got.dequantized, want)


@pytest.mark.parametrize("k", [48, 1040])  # one tile; three tiles of 512, the last short
def test_in_place_factor_equals_the_out_of_place_steps(k: int) -> None:
    """The handed-over Hessian is factored in its own storage (memory) and the factor is bit
    for bit torch.linalg's out-of-place steps, which read H's lower triangle only: the sum is
    made asymmetric on purpose, as a float sum of outer products may be."""
    x = _inputs(k + 64, k, seed=11).double()
    h = x.T @ x
    h += torch.triu(h, 1) * 1e-6  # the upper triangle differs from the lower
    damped = h + 0.01 * float(h.diagonal().mean()) * torch.eye(k, dtype=torch.float64)
    lower, _ = torch.linalg.cholesky_ex(damped)
    want, _ = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    symmetric = damped.tril() + damped.tril(-1).T  # what torch.linalg read: the lower triangle
    assert torch.equal(lower, torch.linalg.cholesky_ex(symmetric)[0])
    kept = h.clone()
    assert torch.equal(gptq._inverse_factor(h, 0.01), want)
    assert torch.equal(h, kept)  # a given H stays as it is
    owned = [h]
    got = gptq._inverse_factor(owned, 0.01)
    assert got is not None and torch.equal(got, want) and got.is_contiguous()
    assert got.data_ptr() == h.data_ptr() and not owned  # made in the handed-over storage


def test_handed_over_hessian_gives_the_same_bits() -> None:
    w, x = _layer(32, 1040, seed=12), _inputs(2000, 1040, seed=13)
    hessian = Hessian(1040)
    hessian.add(x)
    h = hessian.matrix()
    kept = h.clone()
    want = gptq_quantize(w, h)
    assert torch.equal(h, kept)  # gptq_quantize never overwrites the caller's H
    taken = hessian.take_matrix()
    assert torch.equal(taken, kept) and hessian.tokens == 0
    got = gptq.gptq_nvfp4(w, taken, None, OrderName.VLLM_KERNEL, GPTQOptions(), owned=True)
    assert torch.equal(got.dequantized, want.dequantized)
    assert torch.equal(got.weight.packed, want.weight.packed)
    assert torch.equal(got.weight.scales, want.weight.scales)


# -- (d) act order, dead columns, damping, fallback ----------------------------------------------


def test_act_order_keeps_static_groups() -> None:
    w, x = _layer(64, 128), _inputs(1024, 128)
    plain = gptq_quantize(w, _hessian(x)).weight
    ordered = gptq_quantize(w, _hessian(x), options=GPTQOptions(act_order=True)).weight
    assert plain is not None and ordered is not None
    # same contiguous 16-column groups, same scales as RTN: only the processing order changed
    assert torch.equal(_raw(ordered.scales), _raw(quantize(w).scales))
    assert not torch.equal(ordered.packed, plain.packed)


def test_updated_scales_follow_the_error_updated_weights() -> None:
    w, x = _layer(64, 128), _inputs(1024, 128)
    result = gptq_quantize(w, _hessian(x), options=GPTQOptions(scales="updated"))
    assert result.weight is not None
    rtn_scales = _raw(quantize(w).scales)
    got = _raw(result.weight.scales)
    assert torch.equal(got[:, 0], rtn_scales[:, 0])  # the first group sees no feedback
    assert not torch.equal(got, rtn_scales)
    # every block's max code reaches the grid's top or one step below (scale from its own values)
    codes = unpack_fp4(result.weight.packed).reshape(64, 8, 16) & 7
    assert bool((codes.amax(-1) >= 6).all())


def test_dead_columns_are_zero_and_do_not_widen_the_scale() -> None:
    w, x = _layer(32, 64), _inputs(512, 64)
    w[:, 5] = 50.0  # a huge weight on an input that never fires
    x[:, 5] = 0.0
    result = gptq_quantize(w, _hessian(x))
    assert result.dead_columns == 1 and result.weight is not None
    assert bool((result.dequantized[:, 5] == 0).all())
    w_clean = w.clone()
    w_clean[:, 5] = 0.0
    rtn_clean = quantize(w_clean, compute_global_scale(w))
    assert torch.equal(_raw(result.weight.scales), _raw(rtn_clean.scales))
    assert _output_error(x, w, result.dequantized) < _output_error(x, w, quantize(w).dequantize())


def test_damping_moves_gptq_towards_rtn() -> None:
    w, x = _layer(64, 128), _inputs(1024, 128)
    rtn = quantize(w).dequantize(torch.float32)

    def changed(damp: float) -> float:
        got = gptq_quantize(w, _hessian(x), options=GPTQOptions(damp=damp)).dequantized
        return float((got != rtn).float().mean())

    fractions = [changed(d) for d in (0.001, 0.1, 1e4)]
    assert fractions[0] > fractions[1] > fractions[2]
    assert fractions[2] < 0.01  # H dominated by λI: nearly RTN


def test_singular_hessian_without_damping_falls_back_to_rtn() -> None:
    w = _layer(16, 32)
    x = _inputs(4, 32)  # rank 4 < 32
    with pytest.warns(GPTQFallbackWarning, match="not positive definite"):
        result = gptq_quantize(w, _hessian(x), options=GPTQOptions(damp=0.0))
    assert result.fallback and result.weight is not None
    assert torch.equal(result.weight.packed, quantize(w).packed)


# -- Hessians and whole models -------------------------------------------------------------------


def test_hessian_accumulation_leaves_out_padding() -> None:
    lin = nn.Linear(32, 8)
    model = nn.Sequential(lin)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 5, 32, generator=g) for _ in range(2)]
    masks = [torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), torch.ones(2, 5, dtype=torch.long)]

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    batches = [{"x": x, "attention_mask": m} for x, m in zip(xs, masks, strict=True)]
    h = collect_hessians(Wrapped(), ["inner.0"], batches)["inner.0"]
    rows = torch.cat([x[m.bool()] for x, m in zip(xs, masks, strict=True)]).double()
    assert h.tokens == 18
    torch.testing.assert_close(h.matrix(), 2.0 * rows.T @ rows / 18, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="no tokens"):
        Hessian(4).matrix()


def test_quantize_model_gptq_is_sequential() -> None:
    """Layer 2's Hessian comes from the outputs of the already-GPTQ-quantized layer 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32)).eval()
    batches = [_inputs(40, 64, seed=s) for s in range(3)]
    w1, b1, w2 = model[0].weight.detach(), model[0].bias.detach(), model[2].weight.detach()
    x = torch.cat(batches)
    first = gptq_quantize(w1, _hessian(x)).weight
    assert first is not None
    h2 = _hessian(torch.relu(x @ first.dequantize(torch.float32).T + b1))
    second = gptq_quantize(w2, h2).weight
    report = quantize_model(model, backend="w4a16", method="gptq", calibration=batches)
    assert [r.method for r in report.replaced] == ["gptq", "gptq"]
    assert torch.equal(model[0].weight_packed, first.packed)
    assert second is not None and torch.equal(model[2].weight_packed, second.packed)
    assert not model[0].cache_dequantized and not model[0]._dq_cache


# -- block by block: the same bits as the whole-model passes ----------------------------------


def _padded_llama_batches(n: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of 2 sequences of 9 tokens, the second padded (right, then left)."""
    from tests.checkpoint.builders import VOCAB

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (2, 9), generator=g)
        mask = torch.ones(2, 9, dtype=torch.long)
        if i % 2:
            mask[1, :3] = 0
        else:
            mask[1, 6:] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [GPTQOptions(), GPTQOptions(act_order=True)],
                         ids=["default", "act_order"])
def test_block_pipeline_equals_whole_model_on_llama(
    dtype: torch.dtype, options: GPTQOptions
) -> None:
    """A 2-layer Llama (GQA, no biases, KV cache on by default) with padded batches: every code,
    scale and output is the whole-model path's, and the whole model never runs (lm_head is not
    reached: only the blocks do)."""
    pytest.importorskip("transformers")
    from tests.checkpoint.builders import tiny_llama

    batches = _padded_llama_batches(3)
    reference, model = tiny_llama().to(dtype), tiny_llama().to(dtype)
    assert model.config.use_cache
    whole_model_gptq(reference, batches, options=options)
    heads: list[int] = []
    handle = model.lm_head.register_forward_pre_hook(lambda m, a: heads.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = quantize_model(model, backend="w4a16", method="gptq", calibration=batches,
                                gptq=options)
    handle.remove()
    assert not heads  # block by block: the model's head never ran
    assert len(report.replaced) == 14 and differing(reference, model) == []
    with torch.no_grad():
        for batch in _padded_llama_batches(2, seed=8):
            assert torch.equal(model(**batch).logits, reference(**batch).logits)


def test_block_pipeline_equals_whole_model_outside_and_off_the_chain() -> None:
    """Layers after the blocks (TinyLM's ``odd``) run the whole model after the blocks; a model
    whose blocks are not a chain (hidden states changed between blocks) runs the whole model
    for every stage: both the reference's bits."""

    class Scaled(nn.Module):  # 2 * h between the blocks: not a chain
        def __init__(self) -> None:
            super().__init__()
            self.inner = tiny_model()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.inner.embed(ids)
            for block in self.inner.blocks:
                x = block(x) * 2.0
            return self.inner.lm_head(x)

    batches = token_batches(3)
    for make in (tiny_model, Scaled):
        reference, model = make(), make()
        whole_model_gptq(reference, batches, share="llama")
        with warnings.catch_warnings():  # Scaled never calls odd: RTN, warned
            warnings.simplefilter("ignore", GPTQFallbackWarning)
            quantize_model(model, backend="w4a16", share_global_scale="llama", method="gptq",
                           calibration=batches)
        assert differing(reference, model) == [], make


@needs_minilm
def test_block_pipeline_equals_whole_model_on_minilm(encoder: models.SentenceEncoder) -> None:
    """MiniLM (BERT blocks, padded sentences, the pooler after the blocks), two calibration
    batches: bit for bit the whole-model path's codes, scales and embeddings."""
    from nvfp4lab.studies import model_fidelity as study

    batches = study.calibration_batches(encoder)[:2]
    reference, model = copy.deepcopy(encoder.model), copy.deepcopy(encoder.model)
    whole_model_gptq(reference, batches, share="bert")
    quantize_model(model, backend="w4a16", share_global_scale="bert", method="gptq",
                   calibration=batches)
    assert differing(reference, model) == []
    held_out = encoder.tokenize(list(study.SENTENCES[:8]))
    with torch.no_grad():
        assert torch.equal(model(**held_out).last_hidden_state,
                           reference(**held_out).last_hidden_state)


def test_same_input_layers_share_one_hessian() -> None:
    """q/k/v (one input tensor) share one Hessian object, equal to separate accumulation; a
    layer fed another tensor keeps its own."""
    model = tiny_model()
    names = ["blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj",
             "blocks.0.attn.o_proj"]
    batches = token_batches(2)
    shared = collect_hessians(model, names, batches)
    q, k, v, o = (shared[n] for n in names)
    assert q is k is v and o is not q
    alone = collect_hessians(model, names[:1], batches)[names[0]]
    assert torch.equal(q.sum, alone.sum) and q.tokens == alone.tokens == 2 * 2 * 12


def test_quantize_model_gptq_shares_scales_and_beats_rtn() -> None:
    calib, held_out = token_batches(8, seed=1), token_batches(4, seed=2)
    fp = tiny_model()
    rtn, gptq = tiny_model(), tiny_model()
    r_rtn = quantize_model(rtn, backend="w4a16", share_global_scale="llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer is reached: no fallback warning
        r_gptq = quantize_model(gptq, backend="w4a16", share_global_scale="llama",
                                method="gptq", calibration=calib)
    assert r_gptq.replaced_names == r_rtn.replaced_names
    assert r_gptq.shared_groups == r_rtn.shared_groups
    for a, b in zip(r_rtn.replaced, r_gptq.replaced, strict=True):
        assert a.weight_global_scale == b.weight_global_scale and b.method == "gptq"
    assert all(isinstance(gptq.get_submodule(n), NVFP4Linear) for n in r_gptq.replaced_names)

    def err(model: nn.Module) -> float:
        with torch.no_grad():
            return sum(float((model(t) - fp(t)).square().mean()) for t in held_out)

    assert err(gptq) < err(rtn)


def test_layer_without_calibration_input_falls_back() -> None:
    model = nn.ModuleDict({"used": nn.Linear(32, 32), "unused": nn.Linear(32, 32)})
    model.forward = lambda x: model["used"](x)  # type: ignore[method-assign]
    with pytest.warns(GPTQFallbackWarning, match="unused"):
        report = quantize_model(model, method="gptq", calibration=[torch.randn(8, 32)])
    methods = {r.name: r.method for r in report.replaced}
    assert methods["used"] == "gptq" and methods["unused"].startswith("rtn (gptq fallback")


def test_gptq_checkpoint_round_trip(tmp_path: object) -> None:
    pytest.importorskip("transformers")
    from nvfp4lab import checkpoint
    from tests.checkpoint.builders import tiny_llama
    from tests.checkpoint.builders import token_batches as llama_batches

    model = tiny_llama()
    quantize_model(model, backend="w4a16", share_global_scale="llama", method="gptq",
                   calibration=llama_batches(4))
    path = checkpoint.save_pretrained(model, tmp_path / "ckpt",  # type: ignore[operator]
                                      require_shared_global_scale=True)
    loaded = checkpoint.load(path, backend="w4a16")
    ours = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    theirs = {n: m for n, m in loaded.named_modules() if isinstance(m, NVFP4Linear)}
    assert ours.keys() == theirs.keys() and ours
    for name, layer in ours.items():
        for buf in ("weight_packed", "weight_scale", "weight_global_scale"):
            assert torch.equal(_raw(getattr(layer, buf)), _raw(getattr(theirs[name], buf))), name
    ids = llama_batches(1, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


# -- MR-GPTQ: GPTQ on the rotated weight and Hessian, in a layer that rotates its inputs --------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_gptq_is_gptq_of_the_rotated_weight_and_hessian(dtype: torch.dtype) -> None:
    w, x = _layer(48, 96).to(dtype), _inputs(400, 96)
    h = _hessian(x)
    result = gptq_quantize(w, h, hadamard=4)
    rot = rotation_matrix(96, 4, dtype=torch.float64)
    plain = gptq_quantize(hadamard_transform(w, 4), rot.T @ h @ rot).weight
    got = result.weight
    assert isinstance(got, RotatedNVFP4Tensor) and got.hadamard == 4 and got.dtype == dtype
    assert plain is not None and not isinstance(plain, RotatedNVFP4Tensor)
    assert torch.equal(got.packed, plain.packed)
    assert torch.equal(_raw(got.scales), _raw(plain.scales))
    assert torch.equal(got.global_scale, plain.global_scale)
    torch.testing.assert_close(result.dequantized, got.dequantize(torch.float32))
    layer = NVFP4Linear.from_quantized(got)
    assert layer.hadamard == 4 and torch.equal(layer.weight_packed, plain.packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotated_rtn_is_rotated_gptq_with_identity_hessian(dtype: torch.dtype) -> None:
    w = _layer(32, 128).to(dtype)
    rtn = quantize(w, hadamard=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gptq = gptq_quantize(w, torch.eye(128), hadamard=9).weight
    assert gptq is not None and gptq == rtn  # bytes, global scale, shape, dtype, seed


def test_quantize_model_mr_gptq_and_rotated_rtn() -> None:
    """method="mr-gptq" (default rotation: compressed-tensors' random-hadamard 16) is the
    reference MR-GPTQ with that rotation bit for bit (block pipeline), its fused groups share
    the scale of the ROTATED weights, and it beats rotated RTN held out; hadamard=0 is the old
    seeded default, still the reference with seed 0; method="rtn" with hadamard gives
    from_linear(hadamard=...) layers."""
    calib, held_out = token_batches(8, seed=1), token_batches(4, seed=2)
    fp, reference, mr, rtn = tiny_model(), tiny_model(), tiny_model(), tiny_model()
    rot = ct_rotation()  # checked equal to compressed-tensors' factory in test_transforms
    qkv = [f"blocks.0.attn.{p}_proj" for p in "qkv"]
    weights = {n: fp.get_submodule(n).weight.detach() for n in qkv}
    whole_model_gptq(reference, calib, share="llama", hadamard=rot)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = quantize_model(mr, backend="w4a16", share_global_scale="llama",
                                method="mr-gptq", calibration=calib)
    assert {r.method for r in report.replaced} == {"mr-gptq"}
    assert {r.hadamard for r in report.replaced} == {rot} and f"hadamard={rot!r}" in str(report)
    assert {m.hadamard for m in mr.modules() if isinstance(m, NVFP4Linear)} == {rot}
    assert differing(reference, mr) == []
    expected = min(compute_global_scale(rot.apply(w)) for w in weights.values())
    assert {float(mr.get_submodule(n).weight_global_scale) for n in qkv} == {float(expected)}
    # the explicit rotation gives the same bits and outputs as the default
    explicit = tiny_model()
    quantize_model(explicit, backend="w4a16", share_global_scale="llama", method="mr-gptq",
                   hadamard=ct_rotation(), calibration=calib)
    assert differing(explicit, mr) == []
    # hadamard=0: the seeded rotation of the old default, unchanged
    seed0, reference0 = tiny_model(), tiny_model()
    whole_model_gptq(reference0, calib, share="llama", hadamard=0)
    report0 = quantize_model(seed0, backend="w4a16", share_global_scale="llama",
                             method="mr-gptq", hadamard=0, calibration=calib)
    assert {r.hadamard for r in report0.replaced} == {0} and "hadamard=0" in str(report0)
    def rotations(rep: object) -> set[str]:
        return {row["detail"].split("; ")[-1] for row in rep.rows()  # type: ignore[attr-defined]
                if row["action"] == "replaced"}

    assert rotations(report) == {"random-hadamard rotation, block 16 (compressed-tensors)"}
    assert rotations(report0) == {"hadamard seed 0"}
    assert differing(reference0, seed0) == [] and differing(seed0, mr) != []
    expected0 = min(compute_global_scale(hadamard_transform(w, 0)) for w in weights.values())
    assert {float(seed0.get_submodule(n).weight_global_scale) for n in qkv} == {float(expected0)}
    with torch.no_grad():
        for t in held_out:
            assert torch.equal(mr(t), explicit(t)) and torch.equal(seed0(t), reference0(t))
    r_rtn = quantize_model(rtn, backend="w4a16", share_global_scale="llama", hadamard=rot)
    assert {r.method for r in r_rtn.replaced} == {"rtn"}
    assert {r.hadamard for r in r_rtn.replaced} == {rot}
    one = NVFP4Linear.from_linear(fp.odd, hadamard=rot)
    assert torch.equal(rtn.odd.weight_packed, one.weight_packed) and rtn.odd.hadamard == rot
    rtn0 = tiny_model()
    quantize_model(rtn0, backend="w4a16", share_global_scale="llama", hadamard=0)
    assert torch.equal(rtn0.odd.weight_packed,
                       NVFP4Linear.from_linear(fp.odd, hadamard=0).weight_packed)

    def err(model: nn.Module) -> float:
        with torch.no_grad():
            return sum(float((model(t) - fp(t)).square().mean()) for t in held_out)

    assert err(mr) < err(rtn)
    seeded = tiny_model()
    quantize_model(seeded, backend="w4a16", method="gptq", hadamard=5,
                   calibration=calib[:2])
    assert seeded.blocks[0].attn.q_proj.hadamard == 5
    with pytest.raises(ValueError, match="non-negative integer seed"):
        quantize_model(tiny_model(), hadamard=-2)
    with pytest.raises(ValueError, match="needs calibration="):
        quantize_model(tiny_model(), method="mr-gptq")


# -- (e) bad inputs ------------------------------------------------------------------------------


def test_bad_method_and_calibration() -> None:
    with pytest.raises(ValueError, match=r"unknown method 'gptqq'; accepted values: 'rtn', 'gptq'"):
        quantize_model(tiny_model(), method="gptqq")
    with pytest.raises(ValueError, match="needs calibration="):
        quantize_model(tiny_model(), method="gptq")
    with pytest.raises(ValueError, match="calibration is empty"):
        quantize_model(tiny_model(), method="gptq", calibration=[])
    with pytest.raises(ValueError, match="only used by method='gptq'"):
        quantize_model(tiny_model(), calibration=token_batches(1))
    with pytest.raises(TypeError, match=r"batch 0 is a str.*tokenize sentences first"):
        quantize_model(tiny_model(), method="gptq", calibration=["a sentence"])
    with pytest.raises(TypeError, match="single Tensor; wrap it in a list"):
        calibration_batches(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="iterable of model inputs, got int"):
        calibration_batches(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gptq must be a GPTQOptions"):
        quantize_model(tiny_model(), method="gptq", calibration=token_batches(1),
                       gptq={"damp": 0.1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"damp": -1.0}, "damp must be a finite number >= 0"),
        ({"damp": float("nan")}, "damp must be a finite number >= 0"),
        ({"block_size": 100}, "block_size must be a positive multiple of 16"),
        ({"act_order": 1}, "act_order must be True or False"),
        ({"scales": "later"}, "unknown GPTQ scales 'later'; accepted values: 'original'"),
        ({"act_order": True, "scales": "updated"}, "act_order=True needs scales='original'"),
    ],
)
def test_bad_options(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTQOptions(**kwargs)  # type: ignore[arg-type]


def test_bad_weight_and_hessian() -> None:
    w = _layer(8, 32)
    with pytest.raises(ValueError, match=r"hessian must be a float \[K, K\] = \[32, 32\]"):
        gptq_quantize(w, torch.eye(16))
    with pytest.raises(ValueError, match="K a multiple of 16"):
        gptq_quantize(_layer(8, 20), torch.eye(20))
    with pytest.raises(ValueError, match="NaN/Inf"):
        gptq_quantize(w, torch.full((32, 32), math.nan))
    with pytest.raises(TypeError, match="must be float32, bfloat16 or float16"):
        gptq_quantize(w.double(), torch.eye(32))
    with pytest.raises(TypeError, match=r"must be torch\.Tensors"):
        gptq_quantize(w.tolist(), torch.eye(32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"scaled block format.*'fp8_e4m3'"):
        gptq_fake_quantize(w, torch.eye(32), "fp8_e4m3")


# -- issue 19 case 8: an all-zero Hessian falls back to RTN, warned and reported ----------------


def test_all_zero_hessian_falls_back_to_rtn() -> None:
    w = _layer(32, 64)
    with pytest.warns(GPTQFallbackWarning, match="Hessian is all zero"):
        result = gptq_quantize(w, torch.zeros(64, 64, dtype=torch.float64))
    rtn = quantize(w)
    assert result.fallback and "all zero" in result.reason and result.dead_columns == 0
    assert result.weight is not None
    assert torch.equal(result.weight.packed, rtn.packed)
    assert torch.equal(_raw(result.weight.scales), _raw(rtn.scales))


def test_quantize_model_zero_calibration_reports_the_rtn_fallback() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    w0 = model[0].weight.detach().clone()
    with pytest.warns(GPTQFallbackWarning, match=r"layer '0' is rounded with RTN.*all zero"):
        report = quantize_model(model, method="gptq", calibration=[torch.zeros(8, 64)])
    first, second = report.replaced
    assert first.method.startswith("rtn (gptq fallback: the Hessian is all zero")
    assert second.method == "gptq"  # layer 2 sees the bias: a rank-one Hessian, damped
    assert "rtn (gptq fallback" in str(report)
    q, rtn = model[0].weight_nvfp4(), quantize(w0)
    assert torch.equal(q.packed, rtn.packed) and torch.equal(_raw(q.scales), _raw(rtn.scales))
    nmse = float((q.dequantize(torch.float32) - w0).square().sum() / w0.square().sum())
    assert nmse < 0.02  # not the zero weight (NMSE 1.0) GPTQ's dead-column rule gave


# -- issue 19 case 4: a failing layer leaves the model exactly as it was ------------------------


def test_gptq_nan_hessian_at_layer_2_restores_the_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)  # x @ W.T = 64 · 2000 = 128000 > 65504: fp16 overflows
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = [type(m) for m in model]
    batch = torch.full((4, 64), 2000.0, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"Hessian of layer '2' holds NaN/Inf.*fp16") as info:
        quantize_model(model, method="gptq", calibration=[batch])
    assert [type(m) for m in model] == types  # layer 0 was replaced, and is put back
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert any("put back the 1 layer(s) it had already replaced ('0')" in n
               for n in info.value.__notes__)


@pytest.mark.parametrize("where", ["hessian", "caller"])
def test_block_pipeline_failure_restores_the_model(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure inside GPTQ (an infinite Hessian in block 1: its input norm scales by inf) or in
    the caller while block 1 is half done (building its 6th layer): the model has its own
    layers back, and no hook and no replaced forward are left behind."""
    pytest.importorskip("transformers")
    from nvfp4lab.execution import whole_model
    from tests.checkpoint.builders import tiny_llama, token_batches

    model = tiny_llama()
    if where == "hessian":
        with torch.no_grad():
            model.model.layers[1].input_layernorm.weight.fill_(math.inf)
        error, match = ValueError, r"Hessian of layer 'model\.layers\.1\.self_attn\.q_proj"
    else:
        built = whole_model.NVFP4Linear.from_quantized
        calls: list[int] = []

        def failing(*args: object, **kwargs: object) -> NVFP4Linear:
            calls.append(1)
            if len(calls) == 7 + 5:  # block 1's gate_proj: q/k/v and o_proj are final
                raise RuntimeError("disk full")
            return built(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(whole_model.NVFP4Linear, "from_quantized", failing)
        error, match = RuntimeError, "disk full"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(error, match=match) as info:
        quantize_model(model, method="gptq", calibration=token_batches(2))
    assert {n: type(m) for n, m in model.named_modules()} == types
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    for module in model.modules():  # while the error (and its frames) is still held
        assert "forward" not in vars(module)
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert info.value is not None
