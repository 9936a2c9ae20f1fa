"""The study's MXFP4 and INT4-g128 rows (``LLMConfig.weight_format``) on a seeded tiny Llama.

Oracles: the registry's ``number_formats.get(name).fake_quantize`` of each original weight, and
a hand-written one from the formats' definitions (E2M1 grid with ties to the even code, E8M0
scale ``2^(floor(log2 amax) - 2)`` per 32; INT4 ``clamp(round(x / s), ±7)`` with
``s = fp16(amax / 7)`` per 128), both compared with ``torch.equal``. The tiny Llama's K = 64
layers give INT4-g128 one short group (the ``pad=True`` rule), its K = 128 layer a full one.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from nvfp4lab import number_formats
from nvfp4lab.execution import quantize_model
from nvfp4lab.studies import llm, llm_study
from nvfp4lab.studies import llm_configs as lc
from nvfp4lab.studies import llm_verdict as lv
from nvfp4lab.vocab import Backend, KVCacheKind, QuantMethod
from tests.execution.test_attention import IDS, tiny_llama

FORMATS = {"W4A16 MXFP4 RTN": "mxfp4", "W4A16 INT4-g128 RTN": "int4_g128"}
_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of each float64 ``v`` (saturating at 6), a tie to the even code."""
    d = (v.abs().clamp(max=6.0).unsqueeze(-1) - _GRID).abs()
    near = d == d.min(-1, keepdim=True).values
    even = near & (torch.arange(8) % 2 == 0)
    index = torch.where(even.any(-1), even.int().argmax(-1), near.int().argmax(-1))
    return torch.sign(v) * _GRID[index]


def _oracle(weight: torch.Tensor, name: str) -> torch.Tensor:
    """``weight [N, K]`` float32 through ``name`` by its definition, one block at a time."""
    block = 32 if name == "mxfp4" else 128
    out = torch.empty_like(weight)
    for start in range(0, weight.shape[1], block):  # the last block may be short
        part = weight[:, start:start + block]
        for row in range(weight.shape[0]):
            x, amax = part[row], float(part[row].abs().max())
            if name == "mxfp4":
                exponent = math.frexp(amax)[1] - 1 if amax > 0 else -127  # floor(log2 amax)
                scale = 2.0 ** (exponent - 2)
                value = _e2m1(x.double() / scale) * scale
            else:
                s = torch.tensor(amax, dtype=torch.float32) / 7  # fp32, then fp16
                s = s.to(torch.float16).to(torch.float32)
                value = (torch.round(x / s).clamp(-7, 7) * s if s > 0
                         else torch.zeros_like(x))
            out[row, start:start + block] = value.to(torch.float32)
    return out


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def test_rows_follow_mr_gptq_as_weights_only_rtn() -> None:
    labels = [c.label for c in lc.configurations()]
    at = labels.index("W4A16 MR-GPTQ")
    assert labels[at + 1:at + 3] == list(FORMATS)
    configs = {c.label: c for c in lc.configurations()}
    for label, name in FORMATS.items():
        config = configs[label]
        assert config.weight_format == name and config.weights == name
        assert config.method_label == QuantMethod.RTN and not config.needs_calibration
        assert config.activations == "float" and lv.family(config) == lv.WEIGHTS_ONLY
    assert configs["W4A16 RTN"].weights == "nvfp4"
    assert lc.LLMConfig("x", Backend.W4A16, weight_format="INT4-g128").weights == "int4_g128"
    assert not set(FORMATS) & {c.label for c in lc.configurations(smoke=True)}


@pytest.mark.parametrize("label", list(FORMATS))
def test_built_weights_equal_both_oracles(label: str) -> None:
    name = FORMATS[label]
    config = next(c for c in lc.configurations() if c.label == label)
    reference = tiny_llama()
    original = copy.deepcopy(reference)
    built, seconds = lc.build(reference, config)
    assert seconds > 0
    before, after = _linears(original), _linears(built)
    assert set(before) == set(after) and "lm_head" in after  # still plain Linears
    fmt = number_formats.get(name)
    for layer, linear in after.items():
        w = before[layer].weight.detach()
        if layer == "lm_head":  # left float, as quantize_model leaves it
            assert torch.equal(linear.weight, w)
            continue
        assert torch.equal(linear.weight, fmt.fake_quantize(w, pad=True)), layer
        assert torch.equal(linear.weight, _oracle(w, name)), layer
        assert not torch.equal(linear.weight, w), layer
    assert torch.equal(built.model.embed_tokens.weight, original.model.embed_tokens.weight)
    for a, b in zip(reference.parameters(), original.parameters(), strict=True):
        assert torch.equal(a, b)  # the reference untouched


def test_rows_score_a_positive_finite_kld_and_differ() -> None:
    reference = tiny_llama()
    run = llm.reference_run(reference, IDS[0], context=8, progress=False)
    configs = [c for c in lc.configurations() if c.label in (*FORMATS, "W4A16 RTN")]
    rows = {r["label"]: r for r in lc.config_rows(reference, run, configs, progress=False)}
    for label, name in FORMATS.items():
        row = rows[label]
        assert row["weights"] == name and row["method"] == "rtn"
        assert row["kld_mean"] > 0 and math.isfinite(row["kld_mean"])
    klds = {r["kld_mean"] for r in rows.values()}
    assert len(klds) == 3  # three different weight grids, three different models


def test_a_kv_cache_goes_with_a_comparator_format() -> None:
    config = lc.LLMConfig("W4A16 MXFP4 + KV fp8", Backend.W4A16, kv_cache=KVCacheKind.FP8,
                          weight_format="mxfp4")
    reference = tiny_llama()
    built, _ = lc.build(reference, config)
    direct = copy.deepcopy(reference)
    quantize_model(direct, backend=None, kv_cache=KVCacheKind.FP8)
    with torch.no_grad():
        for layer, linear in _linears(direct).items():
            if layer != "lm_head":
                linear.weight.copy_(_oracle(linear.weight.detach(), "mxfp4"))
    assert torch.equal(_logits(built), _logits(direct))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"backend": Backend.EMULATION}, "weight-only RTN; use backend='w4a16'"),
    ({"method": QuantMethod.GPTQ}, "weight-only RTN"),
    ({"weight_format": "nvfp4"}, "leave weight_format=None"),
    ({"weight_format": "int3"}, "unknown format 'int3'; available formats"),
])
def test_bad_configurations_are_refused_in_one_line(kwargs: dict[str, str], match: str) -> None:
    settings = {"backend": Backend.W4A16, "weight_format": "mxfp4", **kwargs}
    with pytest.raises(ValueError, match=match) as info:
        lc.LLMConfig("bad", **settings)
    assert "\n" not in str(info.value)


def test_the_streamed_study_drops_them_and_refuses_them_by_name() -> None:
    configs = lc.configurations()
    kept = {c.label for c in llm_study._streamable(configs, True, asked=False)}
    assert not kept & set(FORMATS) and "W4A16 RTN" in kept
    assert {c.label for c in llm_study._streamable(configs, False, asked=True)} >= set(FORMATS)
    asked = [c for c in configs if c.label in ("W4A16 RTN", "W4A16 MXFP4 RTN")]
    with pytest.raises(ValueError, match=r"^W4A16 MXFP4 RTN: .*MXFP4 / INT4-g128 weights"):
        llm_study._streamable(asked, True, asked=True)


def test_the_hand_oracle_follows_the_definitions() -> None:
    ties = torch.tensor([[0.75, 1.25, 2.5, 5.0, -3.5, 7.0] + [0.0] * 26])  # amax 7: scale 1
    assert _oracle(ties, "mxfp4")[0, :6].tolist() == [1.0, 1.0, 2.0, 4.0, -4.0, 6.0]
    x = torch.tensor([[7.0, 3.5, -2.5, 0.1] + [0.0] * 60])  # one short group, s = 1
    assert _oracle(x, "int4_g128")[0, :4].tolist() == [7.0, 4.0, -2.0, 0.0]
    assert torch.equal(_oracle(ties, "mxfp4"), number_formats.get("mxfp4").fake_quantize(ties))
