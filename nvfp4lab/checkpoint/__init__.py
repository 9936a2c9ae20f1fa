"""NVFP4 checkpoints on disk: write, read and validate.

=================  ==========================================================================
module             holds
=================  ==========================================================================
``files``          the shared plumbing: names, JSON, safetensors streaming, atomic folders
``config``         the compressed-tensors ``nvfp4-pack-quantized`` quantization config
``writer``         :func:`save_pretrained`
``reader``         :func:`load`
``verification``   :func:`verify`: load in transformers, one forward pass
=================  ==========================================================================

A second on-disk format adds its own config module (format detection, tensor names) beside
``config`` and a branch in ``writer`` / ``reader``; ``files`` serves both.
"""

from __future__ import annotations

from nvfp4lab.checkpoint.config import (
    CT_FORMAT,
    QUANTIZED_TENSOR_NAMES,
    SCHEMES,
    quantization_config,
    read_quantization_config,
)
from nvfp4lab.checkpoint.files import CheckpointError
from nvfp4lab.checkpoint.reader import load
from nvfp4lab.checkpoint.verification import Verified, verify
from nvfp4lab.checkpoint.writer import (
    TransformersDtypeWarning,
    UnsharedGlobalScaleWarning,
    fused_groups,
    save_pretrained,
)
from nvfp4lab.execution.model import FUSED_GROUPS

__all__ = [
    "CT_FORMAT",
    "FUSED_GROUPS",
    "QUANTIZED_TENSOR_NAMES",
    "SCHEMES",
    "CheckpointError",
    "TransformersDtypeWarning",
    "UnsharedGlobalScaleWarning",
    "Verified",
    "fused_groups",
    "load",
    "quantization_config",
    "read_quantization_config",
    "save_pretrained",
    "verify",
]
