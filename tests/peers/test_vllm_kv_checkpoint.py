"""vLLM 0.33.0's own loading code reads the KV cache nvfp4lab saves (CPU-importable parts only):
the compressed-tensors ``kv_cache_scheme`` passes ``CompressedTensorsKVCacheMethod.
validate_kv_cache_scheme`` (an NVFP4 one does not: why nvfp4lab refuses it), the ModelOpt
configurations resolve to the cache dtype of the kind written (``get_kv_cache_quant_algo_string``,
what ``--kv-cache-dtype auto`` becomes), ``ModelOptNvFp4Config.from_config`` accepts
``hf_quant_config.json``, and both formats' scale names map to the attention layer's
``k_scale`` / ``v_scale`` (``maybe_remap_kv_scale_name``). vLLM is imported from the directory
``make test-peers`` installs it into; nothing of it is copied."""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import pytest

from nvfp4lab import checkpoint
from nvfp4lab.execution import KVCacheOptions, quantize_model
from tests.execution.test_attention import tiny_llama

try:
    CT = importlib.import_module(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    MO = importlib.import_module("vllm.model_executor.layers.quantization.modelopt")
    TU = importlib.import_module("vllm.utils.torch_utils")
    WU = importlib.import_module("vllm.model_executor.model_loader.weight_utils")
except Exception as exc:  # pragma: no cover - depends on the peer install
    pytest.skip(f"vLLM's quantization config modules do not import ({type(exc).__name__}: "
                f"{exc}); run `make test-peers`", allow_module_level=True)

pytestmark = pytest.mark.peers


def _saved(tmp_path: Path, kind: str, fmt: str) -> Path:
    model = tiny_llama(seed=1)
    quantize_model(model, backend="w4a16", kv_cache=KVCacheOptions(kind, scales={0: (0.5, 2.0)}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.save_pretrained(model, tmp_path / f"{fmt}-{kind}", format=fmt)


def _block(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def test_compressed_tensors_scheme_is_one_vllm_accepts(tmp_path: Path) -> None:
    scheme = _block(_saved(tmp_path, "fp8", "compressed-tensors"))["kv_cache_scheme"]
    CT.CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(scheme)
    nvfp4 = {**scheme, "num_bits": 4, "strategy": "tensor_group", "group_size": 16}
    with pytest.raises(NotImplementedError, match="num_bits=8, type=float"):
        CT.CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(nvfp4)


@pytest.mark.parametrize(("kind", "dtype"), [("fp8", "fp8_e4m3"), ("nvfp4", "nvfp4"),
                                             ("nvfp4_4over6", "nvfp4")])
def test_modelopt_configs_resolve_to_the_cache_dtype(tmp_path: Path, kind: str,
                                                     dtype: str) -> None:
    path = _saved(tmp_path, kind, "modelopt")
    hf = json.loads((path / "hf_quant_config.json").read_text())
    assert TU.get_kv_cache_quant_algo_string(_block(path)) == dtype
    assert TU.get_kv_cache_quant_algo_string({**hf, "quant_method": "modelopt"}) == dtype
    config = MO.ModelOptNvFp4Config.from_config(hf)
    assert config.kv_cache_quant_algo == ("FP8" if kind == "fp8" else "NVFP4")


def test_scale_names_map_to_the_attention_layer() -> None:
    params = {f"model.layers.0.self_attn.attn.{s}_scale": 0 for s in "kv"}
    for k, v in (("k_scale", "v_scale"), ("k_proj.k_scale", "v_proj.v_scale")):
        assert WU.maybe_remap_kv_scale_name(f"model.layers.0.self_attn.{k}", params) == \
            "model.layers.0.self_attn.attn.k_scale"
        assert WU.maybe_remap_kv_scale_name(f"model.layers.0.self_attn.{v}", params) == \
            "model.layers.0.self_attn.attn.v_scale"
