"""Tiny seeded Llama models, compressed-tensors-made checkpoints and file helpers shared by the
checkpoint tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

VOCAB = 128


def tiny_llama(*, bias: bool = False, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A random bf16 Llama: hidden 64, 2 layers, GQA (4 heads, 2 KV heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_bias=bias,
        mlp_bias=bias,
        tie_word_embeddings=tied,
    )
    # from_config(dtype=) as from_pretrained does: rotary frequencies stay float32 buffers
    # (``.to(torch.bfloat16)`` would round them and change every attention output)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def token_batches(n: int = 2, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 9), generator=gen) for _ in range(n)]


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes-comparable view (float8 has no torch.equal on every build)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(raw(a[key]), raw(b[key])), key


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def modelopt_like(model: torch.nn.Module, batches: list[torch.Tensor]) -> torch.nn.Module:
    """Give every NVFP4Linear of ``model`` a static activation scale held as an exact DECODE
    value, amax(x)/2688 in float32, as a ModelOpt export stores it (``input_scale``)."""
    from nvfp4lab.execution import NVFP4Linear, calibrate_inputs

    calibrate_inputs(model, batches)
    for module in model.modules():
        if isinstance(module, NVFP4Linear) and module.input_global_scale is not None:
            module.set_input_decode_scale(torch.reciprocal(module.input_global_scale))
    return model


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> E2M1 codes [..., K]: element 2i from the low nibble (independent of
    nvfp4lab.e2m1)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1)


#: E2M1 value of each 4-bit code, written out from the format's definition.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def decode_decode_order(packed: torch.Tensor, scales: torch.Tensor, decode: float) -> torch.Tensor:
    """float32 weights as ModelOpt / vLLM decode them: value * fl32(scale * decode)."""
    import numpy as np

    codes = unpack_codes(packed).numpy()
    values = np.asarray(E2M1_VALUES, dtype=np.float32)[codes]
    factor = scales.to(torch.float32).numpy() * np.float32(decode)
    out = values.reshape(*factor.shape, 16) * factor[..., None]
    return torch.from_numpy(out.reshape(codes.shape).astype(np.float32))


def saved_checkpoint(path: Path, *, seed: int = 0, share_global_scale: str | None = "llama",
                     w4a4: bool = False) -> Path:
    """Quantize ``tiny_llama(seed=seed)`` (RTN, kernel order) and save it at ``path``
    (compressed-tensors; W4A4 with DECODE-held input scales when ``w4a4``)."""
    import warnings

    from nvfp4lab import checkpoint
    from nvfp4lab.execution import quantize_model

    model = tiny_llama(seed=seed)
    quantize_model(model, backend="w4a16", share_global_scale=share_global_scale)
    if w4a4:
        modelopt_like(model, token_batches())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.UnsharedGlobalScaleWarning)
        checkpoint.save_pretrained(model, path)
    return path
