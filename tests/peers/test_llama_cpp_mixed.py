"""llama.cpp (llama-cpp-python 0.3.36, CPU) runs a mixed GGUF nvfp4lab writes (issue 36 item 3):
NVFP4 (ggml type 40), Q8_0 (type 8) and F32 Linears in one SmolLM2 file.

(a) ggml's own ``ggml_quantize_chunk(GGML_TYPE_Q8_0, ...)`` (``quantize_row_q8_0_ref``, what
``llama-quantize`` runs) gives the bytes of nvfp4lab's Q8_0 weight codes and scales laid out as
``block_q8_0``, bit for bit. (b) SmolLM2-135M-Instruct mixed by ``apply_mix`` (a third of the
blocks Q8_0, a third NVFP4 RTN, a third NVFP4 attention with float MLPs) and saved as GGUF loads
and generates in llama.cpp, and its logits agree with nvfp4lab's run of the file read back
(``checkpoint.load(backend="q8_0")``: NVFP4 layers in llama.cpp's CPU arithmetic bit for bit,
Q8_0 layers in ``ggml_vec_dot_q8_0_q8_0_generic``'s order, which the x86 wheel sums in another
float order) within the tolerance test_llama_cpp_model.py states.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from nvfp4lab import checkpoint
from nvfp4lab.execution.ggml_cpu import q8_0_blocks
from nvfp4lab.execution.mixed import apply_mix, quantizable_linears
from nvfp4lab.execution.mixed_q8_0 import Q8_0Linear, quantize_q8_0_weight
from nvfp4lab.vocab import Backend, CheckpointFormat, LayerFormat
from tests.peers.ggml_ctypes import declare_quantize_chunk
from tests.peers.test_llama_cpp_model import (
    MAX_LOGIT_DIFF,
    MEAN_KLD,
    NEAR_TIE,
    _compare,
    llama_cpp,
)

pytestmark = pytest.mark.peers

#: ggml/include/ggml.h: ``GGML_TYPE_Q8_0 = 8``.
GGML_TYPE_Q8_0 = 8


def _ggml_q8_0(x: torch.Tensor) -> np.ndarray:
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    declare_quantize_chunk(lib)
    src = np.ascontiguousarray(x.to(torch.float32).numpy())
    rows, k = src.shape
    dst = np.zeros((rows, k // 32 * 34), dtype=np.uint8)
    written = lib.ggml_quantize_chunk(GGML_TYPE_Q8_0, src.ctypes.data, dst.ctypes.data, 0, rows,
                                      k, None)
    assert written == dst.size
    return dst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_weight_bytes_equal_ggml_quantize_chunk(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-6, 2, 64).unsqueeze(1)
    w[0, :32] = 0.0  # d = 0
    w[1, :32] = torch.arange(-16, 16, dtype=torch.float32) + 0.5  # roundf ties at d = 1
    w[1, 31] = 127.0
    w[2, :32] = 1e-9  # d below float16's subnormals: stored 0, codes still 127
    w = w.to(dtype)
    codes, d = quantize_q8_0_weight(w)
    ours = q8_0_blocks(codes, d).numpy()
    assert np.array_equal(ours, _ggml_q8_0(w.float()))


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nvfp4lab import models

    try:
        model, _ = models.smollm2()
    except ImportError as exc:
        pytest.skip(f"SmolLM2 needs the [llm] extra: {exc}")
    mix: dict[str, str] = {}
    for name in quantizable_linears(model):
        block = int(name.split(".")[2])
        if block % 3 == 0:
            mix[name] = LayerFormat.Q8_0
        elif block % 3 == 1 or ".self_attn." in name:
            mix[name] = LayerFormat.NVFP4_RTN
    apply_mix(model, mix)
    assert sum(isinstance(m, Q8_0Linear) for m in model.modules()) == 7 * 10
    out = checkpoint.save_pretrained(model, tmp_path_factory.mktemp("mixed") / "gguf",
                                     format=CheckpointFormat.GGUF)
    return next(Path(out).glob("*.gguf"))


def test_llama_cpp_runs_the_mix_within_the_stated_tolerance(mixed_gguf: Path) -> None:
    from nvfp4lab import corpus, models
    from nvfp4lab.vocab import CorpusPart

    text = corpus.pydoc_text(CorpusPart.EVALUATION)
    prompt = corpus.token_ids(models.smollm2_tokenizer(), text)[:32].tolist()
    llm = llama_cpp.Llama(model_path=str(mixed_gguf), n_threads=1, logits_all=True,
                          verbose=False)
    out = llm("Assignment statements are used to", max_tokens=8, temperature=0.0)
    assert out["choices"][0]["text"].strip()
    llm.reset()
    llm.eval(prompt)
    theirs = torch.from_numpy(np.array(llm.scores[: len(prompt)], dtype=np.float32))
    emulation = checkpoint.load(mixed_gguf, backend=Backend.Q8_0)
    assert sum(isinstance(m, Q8_0Linear) for m in emulation.modules()) == 7 * 10
    with torch.no_grad():
        ours = emulation(torch.tensor([prompt])).logits[0].float()
    c = _compare(ours, theirs)
    report = (f"max |diff| {c['max_diff']:.3f}, mean KLD {c['kld'].mean().item():.5f}, top-1 "
              f"{int(c['same_top1'].sum())}/{len(prompt)}")
    print(report)
    assert c["max_diff"] <= MAX_LOGIT_DIFF, report
    assert c["kld"].mean().item() <= MEAN_KLD, report
    assert bool(c["same_top1"][c["margin"] > NEAR_TIE].all()), report
