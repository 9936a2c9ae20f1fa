"""NVIDIA ModelOpt 0.47.0 as the peer tests import it, from the directory ``make test-peers``
installs it into (``--no-deps``; nothing of it is copied here): the package, ``mtq``
(``modelopt.torch.quantization``), ``NVFP4QTensor`` and ``export_hf_checkpoint``. Importing this
module where ModelOpt does not import skips the importing test module, with the reason."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        MODELOPT = importlib.import_module("modelopt")
        mtq = importlib.import_module("modelopt.torch.quantization")
        NVFP4QTensor = importlib.import_module(
            "modelopt.torch.quantization.qtensor.nvfp4_tensor").NVFP4QTensor
        export_hf_checkpoint = importlib.import_module("modelopt.torch.export").export_hf_checkpoint
except Exception as exc:  # pragma: no cover - depends on the peer install
    pytest.skip(
        f"ModelOpt does not import ({type(exc).__name__}: {exc}); run `make test-peers`, which "
        "installs nvidia-modelopt==0.47.0 with --no-deps into a cache directory",
        allow_module_level=True,
    )


def tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    """The seeded tiny Llama the ModelOpt peer tests quantize (hidden 64, 2 layers, GQA 4/2,
    vocabulary 256, untied head), in ``dtype``, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    return LlamaForCausalLM(config).to(dtype).eval()
