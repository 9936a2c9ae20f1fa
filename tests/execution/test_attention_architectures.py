"""The emulated KV cache on every tested decoder architecture (issue 34, item 2).

For each architecture of ``tests/tiny_decoders.py`` (SmolLM3 with its second layer made NoPE),
in float32 and bfloat16, with sdpa and eager attention (Gemma 2: eager only, transformers has
no sdpa for it), and each KV kind: ``quantize_kv_cache`` gives the logits of an independent
oracle bit for bit, and K / V as attention reads them equal the oracle's per layer. The oracle
is the same model run with an attention function of this file's own that passes the K / V the
model hands attention through the slow KV oracle (``nvfp4lab.oracles.kv_cache``) and calls the
model's inner implementation (transformers' sdpa, or the modeling module's
``eager_attention_forward``: Gemma's with logit softcapping) with every keyword the model gave.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from nvfp4lab.execution import attention as att
from nvfp4lab.oracles import kv_cache as ref_kv
from nvfp4lab.vocab import KVCacheKind
from tests.tiny_decoders import ARCHITECTURES, TINY_VOCAB, tiny_config, tiny_model

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

KINDS = [k.value for k in KVCacheKind]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: 2 sequences of 12 tokens: past the sliding windows (8) of Mistral and Gemma 2 / 3.
IDS = torch.randint(4, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
#: Per-layer DECODE scales by layer_idx: a (k_scale, v_scale) pair and one for both sides.
SCALES = {0: (0.5, 2.0), 1: 0.25}
SCALE_PAIRS = {0: (0.5, 2.0), 1: (0.25, 0.25)}


def model_of(arch: str, dtype: torch.dtype = torch.float32, impl: str | None = None) -> Any:
    """The tiny model of ``arch`` in ``dtype`` with attention ``impl`` (its own when None);
    SmolLM3's layer 1 without RoPE (the tiny default has RoPE in both layers)."""
    if arch == "smollm3":
        config = tiny_config(arch)
        config.no_rope_layers = [1, 0]  # 1: RoPE, 0: NoPE
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model = model.to(dtype).eval()
    else:
        model = tiny_model(arch, dtype=dtype)
    if impl is not None and impl != model.config._attn_implementation:
        model.set_attn_implementation(impl)
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def cases() -> Iterator[Any]:
    for arch in ARCHITECTURES:
        for dtype in DTYPES:
            for impl in ("sdpa", "eager"):
                if arch == "gemma2" and impl == "sdpa":
                    continue  # transformers refuses sdpa for Gemma 2 (softcapping)
                yield pytest.param(arch, dtype, impl, id=f"{arch}-{dtype}-{impl}")


@contextmanager
def oracle_attention(model: nn.Module, kind: str, scales: dict[int, tuple[float, float]],
                     drop: tuple[str, ...] = ()) -> Iterator[dict[int, tuple[torch.Tensor, ...]]]:
    """Inside: ``model`` runs an attention function of this test's own, registered for the
    block: K / V through the slow oracle at the layer's scales (1.0 by default), then the inner
    implementation with the model's keywords (less ``drop``). Yields layer_idx -> (K, V) read."""
    inner = model.config._attn_implementation
    name = f"test_kv_oracle:{inner}"
    read: dict[int, tuple[torch.Tensor, ...]] = {}

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Any, **kwargs: Any) -> Any:
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        key = ref_kv.kv_fake_quantize(key, kind, k_scale)
        value = ref_kv.kv_fake_quantize(value, kind, v_scale)
        read[module.layer_idx] = (key, value)
        fn: Callable[..., Any] = (ALL_ATTENTION_FUNCTIONS["sdpa"] if inner == "sdpa" else
                                  sys.modules[type(module).__module__].eager_attention_forward)
        for key_name in drop:
            kwargs.pop(key_name, None)
        return fn(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    model.config._attn_implementation = name
    try:
        yield read
    finally:
        model.config._attn_implementation = inner
        del ALL_ATTENTION_FUNCTIONS._global_mapping[name]
        del ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name]


def quantized_run(model: nn.Module) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, ...]]]:
    """The logits of ``model`` and, per layer, K / V as its attention reads them."""
    seen: dict[int, tuple[torch.Tensor, ...]] = {}
    with att.observe_attention(model, lambda m, q, k, v: seen.__setitem__(m.layer_idx, (k, v))):
        out = logits(model)
    return out, seen


# --------------------------------------------------------------------------------------------
# bit for bit against the oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "dtype", "impl"), list(cases()))
def test_logits_and_kv_equal_the_oracle(arch: str, dtype: str, impl: str) -> None:
    model = model_of(arch, DTYPES[dtype], impl)
    float_logits = logits(model)
    for kind in KINDS:
        with oracle_attention(model, kind, {}) as oracle_kv:
            expected = logits(model)
        layers = att.quantize_kv_cache(model, kind)
        got, seen = quantized_run(model)
        assert torch.equal(got, expected), kind
        assert sorted(seen) == sorted(oracle_kv) == [0, 1]
        for idx, (k, v) in seen.items():
            assert k.dtype == DTYPES[dtype] and k.shape[:3] == (2, 2, 12)  # KV heads, not query
            assert torch.equal(k, oracle_kv[idx][0]) and torch.equal(v, oracle_kv[idx][1])
        assert not torch.equal(got, float_logits), kind
        assert [(x.layer_idx, x.kind, x.kv_heads, x.attention) for x in layers] == [
            (0, kind, 2, impl), (1, kind, 2, impl)
        ]
        assert att.remove_kv_cache_quantization(model) == [x.name for x in layers]
        assert model.config._attn_implementation == impl
        assert torch.equal(logits(model), float_logits)  # bit-identical once removed


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_kv_scales_by_layer_idx(arch: str) -> None:
    model = model_of(arch)
    with oracle_attention(model, "nvfp4_4over6", SCALE_PAIRS) as oracle_kv:
        expected = logits(model)
    layers = att.quantize_kv_cache(model, "nvfp4_4over6", kv_scales=SCALES)
    assert [(x.k_scale, x.v_scale, x.scales_from) for x in layers] == [
        (0.5, 2.0, "kv_scales"), (0.25, 0.25, "kv_scales")
    ]
    got, seen = quantized_run(model)
    assert torch.equal(got, expected)
    assert all(torch.equal(seen[i][0], oracle_kv[i][0]) for i in (0, 1))
    assert att.kv_cache_settings(model) == {
        x.name: ("nvfp4_4over6", *SCALE_PAIRS[x.layer_idx]) for x in layers
    }


def test_observing_changes_nothing_on_any_architecture() -> None:
    """The KV function without settings passes every keyword through (Gemma 2's softcap and
    sliding window, Granite's scaling, ...): the logits are the model's own, bit for bit."""
    for arch in ARCHITECTURES:
        model = model_of(arch)
        before = logits(model)
        with att.observe_attention(model, lambda *a: None):
            assert torch.equal(logits(model), before), arch


def test_the_oracle_comparison_sees_a_dropped_softcap() -> None:
    """Gemma 2's eager attention caps its scores (softcap 50): an oracle that drops the keyword
    gives other logits, so the equality above would catch a KV function that dropped it."""
    model = model_of("gemma2")
    assert model.config.attn_logit_softcapping == 50.0
    with oracle_attention(model, "nvfp4", {}, drop=("softcap",)):
        without = logits(model)
    att.quantize_kv_cache(model, "nvfp4")
    assert not torch.equal(logits(model), without)


def test_smollm3_nope_layer_hands_k_without_rope() -> None:
    """SmolLM3's NoPE layer: the K that is quantized is the projection as it is (no RoPE);
    its RoPE layer's K is rotated."""
    model = model_of("smollm3")
    assert [m.self_attn.use_rope for m in model.model.layers] == [True, False]
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: inputs.__setitem__(m.layer_idx, kwargs["hidden_states"]),
        with_kwargs=True) for layer in model.model.layers]
    seen: dict[int, torch.Tensor] = {}
    with att.observe_attention(model, lambda m, q, k, v: seen.__setitem__(m.layer_idx, k)):
        logits(model)
    for hook in hooks:
        hook.remove()
    for idx, rotated in ((0, True), (1, False)):
        attn = model.model.layers[idx].self_attn
        with torch.no_grad():
            k_proj = attn.k_proj(inputs[idx]).view(2, 12, 2, -1).transpose(1, 2)
        assert torch.equal(seen[idx], k_proj) is not rotated


# --------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------

TESTED = r"\(tested model types: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, " \
         r"olmo2, smollm3, granite\)$"


def test_supported_model_types_are_the_tested_architectures() -> None:
    assert att.SUPPORTED_MODEL_TYPES == ARCHITECTURES


def test_gpt2_is_refused_in_one_line_naming_the_tested_types() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2,
                                       n_positions=16)).eval()
    before = logits_of(model)
    with pytest.raises(ValueError, match=r"^quantize_kv_cache: GPT2LMHeadModel \(model_type "
                       r"'gpt2'\) is not supported: GPT2Attention projects with Conv1D \(c_attn\), "
                       r"not nn\.Linear; GPT2Attention\.forward reads _attn_implementation outside "
                       r"get_interface .*" + TESTED) as e:
        att.quantize_kv_cache(model, "fp8")
    assert "\n" not in str(e.value)
    assert model.config._attn_implementation == "sdpa" and not att.kv_cache_settings(model)
    assert torch.equal(logits_of(model), before)


def logits_of(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[:, :8] % 64).logits


def test_attention_that_bypasses_the_interface_is_refused() -> None:
    """A layer whose attention computes without the interface (here: a forward replaced on one
    instance) is found by the rule but not seen by the probe."""
    model = model_of("qwen2")
    attn = model.model.layers[1].self_attn

    def bypass(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return attn.o_proj(attn.q_proj(hidden_states)), None

    attn.forward = bypass
    with pytest.raises(ValueError, match=r"^quantize_kv_cache: Qwen2ForCausalLM \(model_type "
                       r"'qwen2'\) is not supported: model\.layers\.1\.self_attn "
                       r"\(Qwen2Attention\) was not called through transformers' "
                       r"AttentionInterface in a one-token forward .*" + TESTED):
        att.quantize_kv_cache(model, "nvfp4")
    assert model.config._attn_implementation == "sdpa" and not att.kv_cache_settings(model)


def test_a_custom_attention_class_is_refused() -> None:
    """An attention module of a class the rule does not know (defined outside
    transformers.models) leaves a layer without a found module: refused, not skipped."""
    model = model_of("llama")

    class MyAttention(type(model.model.layers[0].self_attn)):  # type: ignore[misc]
        pass

    model.model.layers[1].self_attn.__class__ = MyAttention
    with pytest.raises(ValueError, match=r"its 2 decoder layers should have one attention "
                                         r"module each, layer_idx 0 to 1; the rule finds "
                                         r"layer_idx \[0\]"):
        att.observe_attention(model, print).__enter__()


def test_a_module_calling_the_interface_outside_the_rule_is_refused() -> None:
    """A module the rule does not name (its class renamed) that still calls the interface."""
    model = model_of("mistral")
    attn = model.model.layers[0].self_attn
    attn.__class__ = type("Mixer", (type(attn),), {"__module__": type(attn).__module__})
    # one decoder layer (the forward runs layers[:1]) whose attention the rule finds under
    # layer_idx 0 (layers[1]'s, renumbered): only the probe sees Mixer call the interface
    model.config.num_hidden_layers = 1
    model.model.layers[1].self_attn.layer_idx = 0
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn \(Mixer\) calls the "
                                         r"attention interface but is not an attention module"):
        att.quantize_kv_cache(model, "fp8")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_a_meta_skeleton_is_probed_and_quantized(arch: str) -> None:
    """A model built on the meta device with only its embedding loaded (how a block-by-block
    run starts) passes the probe without allocating anything; once its weights are assigned it
    computes what the loaded model quantized the same way computes."""
    loaded = model_of(arch)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(tiny_config(arch))
    skeleton.model.embed_tokens = loaded.model.embed_tokens
    layers = att.quantize_kv_cache(skeleton, "nvfp4")
    assert [(x.layer_idx, x.kv_heads, x.head_dim) for x in layers] == [
        (x.layer_idx, x.kv_heads, x.head_dim) for x in att.quantize_kv_cache(loaded, "nvfp4")
    ]
    assert skeleton.model.layers[0].self_attn.o_proj.weight.is_meta
    assert skeleton.model.embed_tokens.weight is loaded.model.embed_tokens.weight
    skeleton.load_state_dict(loaded.state_dict(), assign=True)
    skeleton.eval()
    for name, buffer in loaded.named_buffers():  # RoPE's inv_freq: not in the state dict
        owner, _, leaf = name.rpartition(".")
        skeleton.get_submodule(owner)._buffers[leaf] = buffer.clone()
    assert torch.equal(logits(skeleton), logits(loaded))


def test_the_probe_leaves_the_random_state_as_it_was() -> None:
    """A model in training mode draws dropout masks in its forward; the probe's forward must not
    move the caller's seeded random stream."""
    model = model_of("llama").train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    state = torch.get_rng_state()
    att.quantize_kv_cache(model, "fp8")
    assert torch.equal(torch.get_rng_state(), state)
    logits(model)  # the same forward outside the probe does draw
    assert not torch.equal(torch.get_rng_state(), state)
