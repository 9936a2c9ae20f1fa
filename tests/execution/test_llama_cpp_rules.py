"""llama.cpp's NVFP4 matmul paths as data: one row per rule, each with its source file."""

from __future__ import annotations

import re

import pytest

from nvfp4lab.execution import llama_cpp_rules as rules
from nvfp4lab.settings import LLAMA_MMQ_PREC_ENV
from nvfp4lab.vocab import Numerics, Platform

#: (platform, capability, GGML_CUDA_MMQ_PREC or None) -> (path, ignored variables)
ROWS = [
    (Platform.CPU, None, None, rules.CPU, 0),
    (Platform.CPU, None, "q4", rules.CPU, 0),  # a CUDA variable means nothing to the CPU path
    (Platform.CUDA, (8, 0), None, rules.CUDA_MMQ, 0),
    (Platform.CUDA, (9, 0), "q4", rules.CUDA_MMQ, 1),  # q4 needs the FP4 MMA
    (Platform.CUDA, (10, 0), None, rules.CUDA_MMQ, 0),  # B200: cc 1000 < 1200
    (Platform.CUDA, (10, 3), "auto", rules.CUDA_MMQ, 0),
    (Platform.CUDA, (12, 0), None, rules.BLACKWELL, 0),
    (Platform.CUDA, (12, 0), "AUTO", rules.BLACKWELL, 0),
    (Platform.CUDA, (12, 0), "q8", rules.CUDA_MMQ, 0),
    (Platform.CUDA, (12, 1), "bogus", rules.BLACKWELL, 1),  # warns, keeps auto
    (Platform.CUDA, (13, 0), None, rules.CUDA_MMQ, 0),  # GGML_CUDA_CC_RUBIN: outside the range
    (Platform.ROCM, (12, 0), None, rules.CUDA_MMQ, 0),  # not NVIDIA
]


@pytest.mark.parametrize(("platform", "cap", "prec", "path", "ignored"), ROWS)
def test_rows(
    platform: Platform,
    cap: tuple[int, int] | None,
    prec: str | None,
    path: rules.LlamaCppPath,
    ignored: int,
) -> None:
    env = {} if prec is None else {LLAMA_MMQ_PREC_ENV: prec}
    outcome = rules.select(platform, cap, env)
    assert outcome.path is path and len(outcome.ignored) == ignored
    assert outcome.steps[-len(path.sources) :] == path.sources


def test_every_path_names_its_sources() -> None:
    assert {p.numerics for p in rules.PATHS} == {Numerics.Q8_0, Numerics.Q8_1, Numerics.NATIVE}
    for path in rules.PATHS:
        assert path.sources and path.kernel and path.activations
        for source in path.sources:
            assert re.match(r"ggml-(cpu|cuda)/[\w/-]+\.(c|cu|cuh) \w+", source), source
    assert rules.RELEASE.startswith("llama.cpp@0c1e57098")


def test_ggml_cc_and_errors() -> None:
    assert rules.ggml_cc((12, 1)) == 1210 and rules.ggml_cc((8, 9)) == 890
    assert rules.BLACKWELL_CC == (1200, 1300)
    with pytest.raises(ValueError, match="ggml-sycl"):
        rules.select(Platform.XPU, None, {})
    with pytest.raises(ValueError, match="needs a compute capability"):
        rules.select(Platform.CUDA, None, {})
