"""A model's attention reading K / V from vLLM 0.33's quantized KV cache
(nvfp4lab.execution.attention, quantize_model(kv_cache=...)).

Oracles: a hand-written forward of a tiny seeded Llama (its own RoPE, the slow KV oracle
``oracles.kv_cache`` after it, the same sdpa call) for the logits, bit for bit; a spy
on transformers' sdpa for what attention is handed; the float model's own post-RoPE K / V.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nvfp4lab.execution import NVFP4Linear, QuantizeReport, quantize_model
from nvfp4lab.execution import attention as att
from nvfp4lab.execution.kv_cache import fake_quantize_kv, split_packed
from nvfp4lab.execution.kv_cache import pack as kv_pack
from nvfp4lab.oracles import kv_cache as ref_kv
from nvfp4lab.vocab import SUPPORTED_DTYPES, KVCacheKind
from tests.execution.tiny_models import tiny_model
from tests.sample_data import KINDS as DATA_KINDS
from tests.sample_data import make

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_utils import AttentionInterface  # noqa: E402

KINDS = [k.value for k in KVCacheKind]
VOCAB = 128
#: Seeded inputs: 2 sequences of 12 tokens.
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
#: Explicit per-layer DECODE scales: by name (a pair) and by layer_idx (one for both sides).
SCALES = {"model.layers.0.self_attn": (0.5, 2.0), 1: 0.25}
#: What SCALES gives each layer, as (k_scale, v_scale).
SCALE_PAIRS = [(0.5, 2.0), (0.25, 0.25)]


def _config(cls: type, head_dim: int, attn: str) -> Any:
    return cls(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=64, attention_bias=False, mlp_bias=False,
        initializer_range=0.2,  # K / V of order 1: E4M3-normal block scales, visible effects
        attn_implementation=attn,
    )


def tiny_llama(head_dim: int = 32, attn: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    """A seeded random LlamaForCausalLM: 2 layers, hidden 64, 4 heads, 2 KV heads, no biases."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(_config(LlamaConfig, head_dim, attn)).eval()


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = _config(Qwen3Config, 16, "sdpa")
    del cfg.mlp_bias
    return Qwen3ForCausalLM(cfg).eval()


def logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def oracle_logits(
    model: LlamaForCausalLM, kind: str | None, scales: list[tuple[float, float]] | None = None,
    ids: torch.Tensor = IDS,
) -> torch.Tensor:
    """A hand-written Llama forward: the model's norms, projections and MLP, RoPE written out,
    K / V through the slow oracle after RoPE (per KV head, per token), one sdpa call."""
    cfg, base = model.config, model.model
    b, t = ids.shape
    d = cfg.head_dim
    with torch.no_grad():
        h = base.embed_tokens(ids)
        theta = cfg.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)  # [t, d]
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)

        def rope(x: torch.Tensor) -> torch.Tensor:  # [b, heads, t, d]
            rotated = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
            return x * cos + rotated * sin

        for i, layer in enumerate(base.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = rope(a.q_proj(x).view(b, t, -1, d).transpose(1, 2))
            k = rope(a.k_proj(x).view(b, t, -1, d).transpose(1, 2))
            v = a.v_proj(x).view(b, t, -1, d).transpose(1, 2)
            assert k.shape[1] == cfg.num_key_value_heads  # before any repeat to the query heads
            if kind is not None:
                k_scale, v_scale = scales[i] if scales else (1.0, 1.0)
                k = ref_kv.kv_fake_quantize(k, kind, k_scale)
                v = ref_kv.kv_fake_quantize(v, kind, v_scale)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5,
                                               enable_gqa=True)
            h = h + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.lm_head(base.norm(h))


class Spy:
    """Records (layer_idx, key, value) of every call of one registered attention function
    (transformers' sdpa by default), then runs it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str = "sdpa") -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        real = AttentionInterface._global_mapping[name]

        def spy(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *args: Any, **kwargs: Any) -> Any:
            self.calls.append((module.layer_idx, key.detach().clone(), value.detach().clone()))
            return real(module, query, key, value, *args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, name, spy)

    def take(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        calls, self.calls = self.calls, []
        return calls


def _settings_left(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "_nvfp4lab_kv_cache" in m.__dict__]


# --------------------------------------------------------------------------------------------
# the logits against the hand-written oracle
# --------------------------------------------------------------------------------------------


def test_the_oracle_forward_is_the_float_model() -> None:
    model = tiny_llama()
    assert torch.equal(oracle_logits(model, None), logits(model))


@pytest.mark.parametrize("explicit", [False, True], ids=["scales-1.0", "kv_scales"])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_the_oracle(kind: str, explicit: bool) -> None:
    model = tiny_llama()
    float_logits = logits(model)
    layers = att.quantize_kv_cache(model, kind, kv_scales=SCALES if explicit else None)
    got = logits(model)
    assert torch.equal(got, oracle_logits(model, kind, SCALE_PAIRS if explicit else None))
    assert not torch.equal(got, float_logits)
    assert [(x.k_scale, x.v_scale) for x in layers] == (
        SCALE_PAIRS if explicit else [(1.0, 1.0)] * 2
    )
    assert {x.scales_from for x in layers} == {"kv_scales" if explicit else "default"}
    assert [(x.name, x.layer_idx, x.kind, x.kv_heads, x.head_dim, x.attention) for x in layers] == [
        (f"model.layers.{i}.self_attn", i, kind, 2, 32, "sdpa") for i in range(2)
    ]


def test_head_dim_16_and_a_callable_for_the_scales() -> None:
    model = tiny_llama(head_dim=16)
    pairs = [(0.75, 1.5), (1.0, 1.0)]
    layers = att.quantize_kv_cache(
        model, KVCacheKind.NVFP4_4OVER6,
        kv_scales=lambda name, module: pairs[0] if module.layer_idx == 0 else None,
    )
    assert [(x.k_scale, x.v_scale, x.scales_from) for x in layers] == [
        (0.75, 1.5, "kv_scales"), (1.0, 1.0, "default")
    ]
    assert torch.equal(logits(model), oracle_logits(model, KVCacheKind.NVFP4_4OVER6, pairs))


def test_eager_attention_is_wrapped_too() -> None:
    model = tiny_llama(attn="eager")
    float_logits = logits(model)
    layers = att.quantize_kv_cache(model, KVCacheKind.NVFP4)
    assert model.config._attn_implementation == att.kv_attention_name("eager")
    assert {x.attention for x in layers} == {"eager"}
    # eager's matmul / softmax differ from sdpa's in the last bits: a stated tolerance
    torch.testing.assert_close(logits(model), oracle_logits(model, KVCacheKind.NVFP4),
                               rtol=1e-5, atol=1e-5)
    assert att.remove_kv_cache_quantization(model) == [f"model.layers.{i}.self_attn"
                                                       for i in range(2)]
    assert model.config._attn_implementation == "eager"
    assert torch.equal(logits(model), float_logits)


# --------------------------------------------------------------------------------------------
# what attention is handed
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_attention_sees_fake_quantized_post_rope_kv(
    make_model: Any, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sdpa gets fake_quantize_kv of the post-RoPE K / V that the model hands attention: in
    layer 0 the float model's own; in every layer what the KV attention was handed (a second
    spy in front of it: later layers' K depends on the quantized layers before)."""
    spy = Spy(monkeypatch)
    model = make_model()
    logits(model)
    float_kv = spy.take()  # the float model's post-RoPE K and V, as its attention got them
    att.quantize_kv_cache(model, kind)
    spy.take()  # the one-token probe forward of quantize_kv_cache
    handed = Spy(monkeypatch, att.kv_attention_name("sdpa"))
    logits(model)
    seen = spy.take()
    assert [c[0] for c in seen] == [c[0] for c in handed.calls] == [c[0] for c in float_kv]
    assert [c[0] for c in seen] == [0, 1]
    assert torch.equal(handed.calls[0][1], float_kv[0][1])
    assert torch.equal(handed.calls[0][2], float_kv[0][2])
    for (_, k_in, v_in), (_, k_seen, v_seen) in zip(handed.calls, seen, strict=True):
        assert k_seen.shape == (2, 2, 12, model.config.head_dim)  # KV heads, not query heads
        assert torch.equal(k_seen, fake_quantize_kv(k_in, kind, 1.0))
        assert torch.equal(v_seen, fake_quantize_kv(v_in, kind, 1.0))
        assert not torch.equal(k_seen, k_in)


@pytest.mark.parametrize("kind", KINDS)
def test_generation_cache_rows_are_quantized_as_once_at_write(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache keeps the float K / V and attention gets all of it each step: the rows of a
    token read the same at every later step, and equal its float row quantized once."""
    spy = Spy(monkeypatch)
    model = tiny_llama()
    att.quantize_kv_cache(model, kind)
    spy.take()  # the one-token probe forward of quantize_kv_cache
    cache = DynamicCache(config=model.config)
    ids = IDS[:1, :5]
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        for _ in range(3):
            ids = out.logits[:, -1:].argmax(-1)
            out = model(ids, cache=cache, use_cache=True)
    steps = [c for c in spy.take() if c[0] == 0]
    assert [c[1].shape[2] for c in steps] == [5, 6, 7, 8]
    final_k, final_v = steps[-1][1], steps[-1][2]
    for _, k, v in steps:
        n = k.shape[2]
        assert torch.equal(final_k[:, :, :n], k) and torch.equal(final_v[:, :, :n], v)
    stored = cache.layers[0]
    assert torch.equal(final_k, fake_quantize_kv(stored.keys, kind, 1.0))
    assert torch.equal(final_v, fake_quantize_kv(stored.values, kind, 1.0))
    rows = [fake_quantize_kv(stored.keys[:, :, j:j + 1], kind, 1.0) for j in range(8)]
    assert torch.equal(final_k, torch.cat(rows, dim=2))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS)
def test_idempotence_of_fake_quantize_kv(kind: str, dtype: torch.dtype) -> None:
    """Finding: fp8 is idempotent on every input here; the NVFP4 kinds are not, but only in
    blocks whose E4M3 block scale is subnormal (< 2**-6). The KV attention does not rely on it
    (it quantizes the float values the cache keeps)."""
    changed_blocks = 0
    for data in DATA_KINDS:
        for scale in (1.0, 0.0071, 3.3):
            x = make(data, (8, 4, 64), dtype, seed=DATA_KINDS.index(data))
            once = fake_quantize_kv(x, kind, scale)
            twice = fake_quantize_kv(once, kind, scale)
            if kind == KVCacheKind.FP8 or (data == "normal" and scale == 1.0):
                assert torch.equal(twice, once), (data, scale)
                continue
            diff = (twice != once).reshape(8, 4, 4, 16).any(-1)
            _, block_scales = split_packed(kv_pack(x, kind, scale), kind)
            assert not (diff & (block_scales.float() >= 2.0**-6)).any(), (data, scale)
            changed_blocks += int(diff.sum())
    if kind != KVCacheKind.FP8:
        assert changed_blocks > 0  # the limitation is real, not vacuous


# --------------------------------------------------------------------------------------------
# quantize_model(kv_cache=...)
# --------------------------------------------------------------------------------------------


def test_kv_cache_none_changes_nothing() -> None:
    plain, with_none = tiny_llama(), tiny_llama()
    quantize_model(plain, backend="w4a16")
    report = quantize_model(with_none, backend="w4a16", kv_cache=None)
    assert report.kv_cache == [] and "KV cache" not in str(report)
    assert with_none.config._attn_implementation == "sdpa" and not _settings_left(with_none)
    assert torch.equal(logits(with_none), logits(plain))


@pytest.mark.parametrize("backend", ["w4a16", "emulation"])
def test_combined_with_linear_quantization(backend: str) -> None:
    model = tiny_llama()
    report = quantize_model(model, backend=backend, kv_cache=KVCacheKind.FP8, kv_scales=SCALES)
    assert isinstance(model.model.layers[0].self_attn.k_proj, NVFP4Linear)
    assert len(report.replaced) == 2 * 7  # q, k, v, o, gate, up, down; lm_head ignored
    assert [(x.k_scale, x.v_scale) for x in report.kv_cache] == SCALE_PAIRS
    # the oracle runs the model's own (NVFP4) projections, and K / V through the slow oracle
    assert torch.equal(logits(model), oracle_logits(model, KVCacheKind.FP8, SCALE_PAIRS))
    text = str(report)
    assert "KV cache fp8 on 2 attention layer(s)" in text and "k_scale=0.5 v_scale=2" in text
    kv_rows = [r for r in report.rows() if r["action"] == "kv cache"]
    assert [r["name"] for r in kv_rows] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert kv_rows[1]["detail"] == "fp8, k_scale=0.25 v_scale=0.25 (DECODE, kv_scales)"


def test_gptq_calibrates_with_the_kv_cache_quantized(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    model = tiny_llama()
    logits(model, IDS[:1])
    k_float = spy.take()[0][1]
    report = quantize_model(model, backend="w4a16", method="gptq", calibration=[IDS[:1]],
                            kv_cache=KVCacheKind.NVFP4)
    assert report.kv_cache and {r.method for r in report.replaced} == {"gptq"}
    calls = [c for c in spy.take() if c[1].shape[2] > 1]  # not the one-token probe's
    k_seen = calls[0][1]  # the first calibration pass (float Linears), layer 0
    assert torch.equal(k_seen, fake_quantize_kv(k_float, KVCacheKind.NVFP4, 1.0))


@pytest.mark.parametrize("kind", KINDS)
def test_kv_cache_alone(kind: str) -> None:
    model, reference = tiny_llama(), tiny_llama()
    report = quantize_model(model, backend=None, kv_cache=kind)
    assert isinstance(report, QuantizeReport) and report.replaced == [] and report.skipped == []
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    assert [x.kind for x in report.kv_cache] == [kind] * 2
    att.quantize_kv_cache(reference, kind)
    assert torch.equal(logits(model), logits(reference))


# --------------------------------------------------------------------------------------------
# errors and undo
# --------------------------------------------------------------------------------------------


def tiny_bert() -> BertModel:
    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=64))


def test_a_bad_kind_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match="unknown kv_cache 'int8'; accepted values: 'nvfp4', "
                                         "'nvfp4_4over6', 'fp8'"):
        quantize_model(tiny_llama(), kv_cache="int8")
    with pytest.raises(ValueError, match="unknown KV cache kind 'fp4'"):
        att.quantize_kv_cache(tiny_llama(), "fp4")


@pytest.mark.parametrize("make_model", [tiny_bert, tiny_model], ids=["bert", "plain-module"])
def test_an_unsupported_model_is_refused_in_one_line_and_left_as_it_was(make_model: Any) -> None:
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"is not supported: .*\(tested model types: llama, "
                                         r"mistral, .*, granite\)$") as e:
        quantize_model(model, backend="w4a16", kv_cache=KVCacheKind.NVFP4)
    assert "\n" not in str(e.value) and not getattr(e.value, "__notes__", None)
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    config = getattr(model, "config", None)
    assert config is None or config._attn_implementation in ("sdpa", "eager")


def test_other_refusals() -> None:
    with pytest.raises(ValueError, match=r"head_dim a multiple of 16, model\.layers\.0\.self_attn "
                                         "has 8"):
        att.quantize_kv_cache(tiny_llama(head_dim=8), KVCacheKind.NVFP4)
    att.quantize_kv_cache(tiny_llama(head_dim=8), KVCacheKind.FP8)  # fp8 takes any head_dim
    flex = tiny_llama()
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="runs attn_implementation 'flex_attention'"):
        att.quantize_kv_cache(flex, KVCacheKind.FP8)
    assert not _settings_left(flex)
    done = tiny_llama()
    quantize_model(done, backend=None, kv_cache=KVCacheKind.FP8)
    with pytest.raises(ValueError, match=r"quantized KV cache already \(fp8\); call remove_kv"):
        quantize_model(done, backend=None, kv_cache=KVCacheKind.NVFP4)
    with pytest.raises(ValueError, match=r"kv_scales keys 'layers.0', 7 match no attention"):
        att.quantize_kv_cache(tiny_llama(), KVCacheKind.FP8, kv_scales={"layers.0": 1.0, 7: 2})
    with pytest.raises(ValueError, match=r"gives model\.layers\.1\.self_attn twice"):
        att.quantize_kv_cache(tiny_llama(), KVCacheKind.FP8,
                              kv_scales={"model.layers.1.self_attn": 1.0, 1: 2.0})
    with pytest.raises(ValueError, match=r"a \(k_scale, v_scale\) pair, got \(1.0, 2.0, 3.0\)"):
        att.quantize_kv_cache(tiny_llama(), KVCacheKind.FP8, kv_scales={0: (1.0, 2.0, 3.0)})
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        att.quantize_kv_cache(tiny_llama(), KVCacheKind.FP8, kv_scales={0: (0.0, 1.0)})
    with pytest.raises(TypeError, match="kv_scales must be a mapping"):
        att.quantize_kv_cache(tiny_llama(), KVCacheKind.FP8, kv_scales=[1.0, 2.0])
    with pytest.raises(ValueError, match="pass kv_cache= too"):
        quantize_model(tiny_llama(), kv_scales={0: 1.0})
    with pytest.raises(ValueError, match=r"backend=None\) quantizes only the KV cache"):
        quantize_model(tiny_llama(), backend=None)
    with pytest.raises(ValueError, match="method=, calibration=, gptq= and ignore= do not apply"):
        quantize_model(tiny_llama(), backend=None, kv_cache=KVCacheKind.FP8, method="gptq",
                       calibration=[IDS])
    assert att.remove_kv_cache_quantization(tiny_llama()) == []


def test_a_failure_after_the_kv_cache_is_set_undoes_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_llama()
    float_logits = logits(model)
    real = NVFP4Linear.from_linear
    calls = []

    def failing(*args: Any, **kwargs: Any) -> NVFP4Linear:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(NVFP4Linear, "from_linear", failing)
    with pytest.raises(RuntimeError, match="boom") as e:
        quantize_model(model, backend="w4a16", kv_cache=KVCacheKind.NVFP4)
    assert "removed the KV cache quantization" in "".join(e.value.__notes__)
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    assert model.config._attn_implementation == "sdpa" and not _settings_left(model)
    assert torch.equal(logits(model), float_logits)


# --------------------------------------------------------------------------------------------
# a real model
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_logits_move_but_stay_close(smollm2: tuple[Any, Any]) -> None:
    """64 seeded random tokens through SmolLM2-135M (3 KV heads, 9 query heads, head_dim 64),
    k_scale = v_scale = 1.0, per kind: the logits change, the next-token distributions stay
    close. Mean KL(float || kv) per token when written: fp8 0.016, nvfp4_4over6 0.115, nvfp4
    0.145 nats; the bounds leave room and pin the order (4over6 picks the lower-error scale
    per block)."""
    smollm2 = smollm2[0]  # (model, tokenizer) from tests/conftest.py; restored below
    ids = torch.randint(0, smollm2.config.vocab_size, (1, 64),
                        generator=torch.Generator().manual_seed(0))
    reference = torch.log_softmax(logits(smollm2, ids), dim=-1)
    kl = {}
    for kind in KINDS:
        layers = att.quantize_kv_cache(smollm2, kind)
        try:
            got = torch.log_softmax(logits(smollm2, ids), dim=-1)
        finally:
            att.remove_kv_cache_quantization(smollm2)
        assert len(layers) == smollm2.config.num_hidden_layers
        assert {(x.kv_heads, x.head_dim) for x in layers} == {(3, 64)}
        assert not torch.equal(got, reference)
        kl[kind] = float(F.kl_div(got, reference, log_target=True, reduction="none")
                         .sum(-1).mean())
    assert smollm2.config._attn_implementation == "sdpa" and not _settings_left(smollm2)
    assert 0 < kl[KVCacheKind.FP8] < 0.05, kl
    assert kl[KVCacheKind.FP8] < kl[KVCacheKind.NVFP4_4OVER6] < kl[KVCacheKind.NVFP4] < 0.3, kl


# --------------------------------------------------------------------------------------------
# observe_attention: the studies' window on post-RoPE Q / K / V (and K / V read back)


def _post_rope_qkv(model: LlamaForCausalLM, ids: torch.Tensor = IDS) -> list[tuple[torch.Tensor,
                                                                                 ...]]:
    """Per layer, (q, k, v) after RoPE computed by hand from the float model (the oracle)."""
    cfg, base = model.config, model.model
    b, t = ids.shape
    d = cfg.head_dim
    out = []
    with torch.no_grad():
        h = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(h, torch.arange(t)[None])
        for layer in base.layers:
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = (p(x).view(b, t, -1, d).transpose(1, 2) for p in (a.q_proj, a.k_proj,
                                                                         a.v_proj))

            def rope(z: torch.Tensor) -> torch.Tensor:
                rotated = torch.cat((-z[..., d // 2:], z[..., : d // 2]), dim=-1)
                return z * cos[:, None] + rotated * sin[:, None]

            out.append((rope(q), rope(k), v))
            h = layer(h, position_embeddings=(cos, sin), attention_mask=None)
            h = h[0] if isinstance(h, tuple) else h
    return out


@pytest.mark.parametrize("kind", [None, "nvfp4"])
def test_observe_attention_sees_post_rope_qkv_and_changes_nothing(kind: str | None) -> None:
    model = tiny_llama()
    expected = _post_rope_qkv(model)
    if kind is not None:
        att.quantize_kv_cache(model, kind)
    before = logits(model)
    seen: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with att.observe_attention(model, lambda m, q, k, v: seen.append((m.layer_idx, q, k, v))):
        during = logits(model)
    assert torch.equal(during, before) and torch.equal(logits(model), before)
    assert [s[0] for s in seen] == [0, 1]
    q0, k0, v0 = expected[0]
    assert torch.allclose(seen[0][1], q0, atol=1e-6)  # the hand-written RoPE: fp rounding only
    if kind is None:
        assert torch.allclose(seen[0][2], k0, atol=1e-6) and torch.equal(seen[0][3], v0)
    else:  # read back from the cache
        assert torch.equal(seen[0][3], fake_quantize_kv(v0, kind, 1.0))
    impl = model.config._attn_implementation
    assert impl == ("sdpa" if kind is None else "nvfp4lab_kv:sdpa")


def test_observe_attention_refuses_an_unsupported_model() -> None:
    with pytest.raises(ValueError, match="not supported"), att.observe_attention(tiny_bert(),
                                                                            print):
        pass


# --------------------------------------------------------------------------------------------
# Issue 32: kv_scales={0: 1e-40} was accepted and failed at the first forward without naming
# the layer; vLLM's fp8_e4m3 was refused. Every scale is now checked up front, by layer.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "kv_scales", "match"),
    [
        (KVCacheKind.NVFP4, {0: 1e-40},
         r"^kv_scales for model\.layers\.0\.self_attn \(layer_idx 0\): k_scale 1e-40 is too "
         r"small: its reciprocal .* overflows float32; pass a DECODE scale >= 2\*\*-127$"),
        (KVCacheKind.FP8, {"model.layers.1.self_attn": (1.0, 1e-40)},
         r"^kv_scales for model\.layers\.1\.self_attn \(layer_idx 1\): v_scale 1e-40 is too small"),
        (KVCacheKind.NVFP4_4OVER6, {1: (2.0, 1e-37)},
         r"^kv_scales for model\.layers\.1\.self_attn \(layer_idx 1\): v_scale 1e-37 is too small "
         r"for an nvfp4_4over6 KV cache: its ENCODE scale 1/1e-37 exceeds 2\*\*116"),
        (KVCacheKind.NVFP4, {0: float("nan")},
         r"^kv_scales for model\.layers\.0\.self_attn \(layer_idx 0\): k_scale must be finite"),
        (KVCacheKind.FP8, lambda name, module: -1.0,
         r"^kv_scales for model\.layers\.0\.self_attn \(layer_idx 0\): k_scale must be finite and "
         r"> 0, got -1\.0"),
    ],
)
def test_kv_scales_are_checked_up_front_naming_the_layer(kind: KVCacheKind, kv_scales: Any,
                                                         match: str) -> None:
    model = tiny_llama()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        quantize_model(model, backend=None, kv_cache=kind, kv_scales=kv_scales)
    with pytest.raises(ValueError, match=match):
        att.quantize_kv_cache(model, kind, kv_scales=kv_scales)
    assert not _settings_left(model) and model.config._attn_implementation == implementation
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    model(IDS)  # still the float model


def test_a_small_fp8_scale_with_a_finite_reciprocal_runs() -> None:
    """1e-37 cannot write NVFP4 (ENCODE scale past 2**116) but FP8 divides by it fine: the
    layer saturates to ±448 * 1e-37, a finite read."""
    model = tiny_llama()
    layers = att.quantize_kv_cache(model, "fp8", kv_scales={0: 1e-37})
    assert layers[0].k_scale == pytest.approx(1e-37, rel=1e-6)
    assert torch.isfinite(model(IDS).logits).all()


def test_fp8_e4m3_is_fp8() -> None:
    """vLLM's --kv-cache-dtype fp8_e4m3 (docs/kv_cache.md) is the fp8 cache."""
    named, aliased = tiny_llama(), tiny_llama()
    report = quantize_model(aliased, backend=None, kv_cache="fp8_e4m3", kv_scales={1: 0.5})
    quantize_model(named, backend=None, kv_cache="fp8", kv_scales={1: 0.5})
    assert [layer.kind for layer in report.kv_cache] == ["fp8", "fp8"]
    assert torch.equal(aliased(IDS).logits, named(IDS).logits)
    assert [layer.kind for layer in att.quantize_kv_cache(tiny_llama(), "fp8_e4m3")] == (
        ["fp8", "fp8"])
