"""NVFP4 checkpoints on disk: write, read and validate.

=================  ==========================================================================
module             holds
=================  ==========================================================================
``files``          the shared plumbing: names, JSON, safetensors streaming, atomic folders
``config``         the compressed-tensors ``nvfp4-pack-quantized`` quantization config
``modelopt``       the ModelOpt NVFP4 format: detection (:func:`detect_format`), its configs
``writer``         :func:`save_pretrained` (``format="compressed-tensors"`` or ``"modelopt"``)
``reader``         :func:`load` (either format, detected)
``verification``   :func:`verify`: load in transformers, one forward pass
``stream``         checkpoints larger than memory: header inventory, row reads, task runner
``conversion``     :func:`convert`: lossless, streamed format conversion
``auditing``       :func:`audit`: per-layer checks, streamed (``nvfp4lab audit``)
=================  ==========================================================================

Each on-disk format has its own config module (format detection, tensor names) and a branch in
``writer`` / ``reader``; ``files`` serves both.
"""

from __future__ import annotations

from nvfp4lab.checkpoint.auditing import audit, audit_rows
from nvfp4lab.checkpoint.config import (
    CT_FORMAT,
    QUANTIZED_TENSOR_NAMES,
    SCHEMES,
    quantization_config,
    read_quantization_config,
)
from nvfp4lab.checkpoint.conversion import ConvertReport, convert
from nvfp4lab.checkpoint.files import CheckpointError
from nvfp4lab.checkpoint.modelopt import detect_format, read_modelopt_config
from nvfp4lab.checkpoint.reader import load
from nvfp4lab.checkpoint.verification import Verified, verify
from nvfp4lab.checkpoint.writer import (
    TransformersDtypeWarning,
    UnsharedGlobalScaleWarning,
    fused_groups,
    save_pretrained,
)
from nvfp4lab.execution.whole_model import FUSED_GROUPS

__all__ = [
    "CT_FORMAT",
    "FUSED_GROUPS",
    "QUANTIZED_TENSOR_NAMES",
    "SCHEMES",
    "CheckpointError",
    "ConvertReport",
    "TransformersDtypeWarning",
    "UnsharedGlobalScaleWarning",
    "Verified",
    "audit",
    "audit_rows",
    "convert",
    "detect_format",
    "fused_groups",
    "load",
    "quantization_config",
    "read_modelopt_config",
    "read_quantization_config",
    "save_pretrained",
    "verify",
]
