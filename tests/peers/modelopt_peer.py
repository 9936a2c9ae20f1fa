"""NVIDIA ModelOpt 0.47.0 as the peer tests import it, from the directory ``make test-peers``
installs it into (``--no-deps``; nothing of it is copied here): the package, ``mtq``
(``modelopt.torch.quantization``), ``NVFP4QTensor`` and ``export_hf_checkpoint``. Importing this
module where ModelOpt does not import skips the importing test module, with the reason."""

from __future__ import annotations

import importlib
import warnings

import pytest

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
