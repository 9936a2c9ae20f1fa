"""NVFP4 checkpoints on disk: write, read and validate.

=================  ==========================================================================
module             holds
=================  ==========================================================================
``files``          the shared plumbing: names, JSON, safetensors streaming, atomic folders
``formats``        one module per checkpoint format (``compressed_tensors``, ``modelopt``,
                   ``gguf``): detection, tensor names, configs, the tensor-scale form
                   on disk, the container (reading and writing the files); the interface and
                   the registry :data:`FORMATS` (:func:`detect_format`)
``writer``         :func:`save_pretrained` (any format, ``format=``)
``reader``         :func:`load` (any format, detected)
``verification``   :func:`verify`: load in transformers, one forward pass
``stream``         checkpoints larger than memory: header inventory, row reads, task runner
``conversion``     :func:`convert`: lossless, streamed format conversion
``auditing``       :func:`audit`: per-layer checks, streamed (``nvfp4lab audit``)
=================  ==========================================================================

``writer``, ``reader``, ``stream``, ``conversion`` and ``auditing`` look the format up in
:data:`FORMATS` and call its spec; ``files`` serves every format.
"""

from __future__ import annotations

from nvfp4lab.checkpoint.auditing import audit, audit_rows
from nvfp4lab.checkpoint.conversion import ConvertReport, convert
from nvfp4lab.checkpoint.formats import (
    FORMATS,
    CheckpointFormatSpec,
    FormatConfig,
    detect_format,
    format_spec,
)
from nvfp4lab.checkpoint.formats.compressed_tensors import (
    CT_FORMAT,
    QUANTIZED_TENSOR_NAMES,
    SCHEMES,
    quantization_config,
    read_quantization_config,
)
from nvfp4lab.checkpoint.formats.modelopt import read_modelopt_config
from nvfp4lab.checkpoint.formats.transforms import transformers_input_rotations
from nvfp4lab.checkpoint.reader import load
from nvfp4lab.checkpoint.refusals import CheckpointError
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
    "FORMATS",
    "FUSED_GROUPS",
    "QUANTIZED_TENSOR_NAMES",
    "SCHEMES",
    "CheckpointError",
    "CheckpointFormatSpec",
    "ConvertReport",
    "FormatConfig",
    "TransformersDtypeWarning",
    "UnsharedGlobalScaleWarning",
    "Verified",
    "audit",
    "audit_rows",
    "convert",
    "detect_format",
    "format_spec",
    "fused_groups",
    "load",
    "quantization_config",
    "read_modelopt_config",
    "read_quantization_config",
    "save_pretrained",
    "transformers_input_rotations",
    "verify",
]
