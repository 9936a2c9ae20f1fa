"""One job: a quantized layer's tensor scale between nvfp4lab's in-memory form and a format's.

nvfp4lab holds a layer's tensor (global) scale as the float32 ``[1]`` ENCODE scale
(2688/amax), with the exact DECODE scale (amax/2688) beside it when a checkpoint stored one. A
format stores one of the two forms (:class:`~nvfp4lab.checkpoint.records.LayerNames` ``decode``,
set from :data:`nvfp4lab.vocab.TENSOR_SCALE_STORAGE`); :class:`TensorScaleForm` derives the
spec members ``to_disk``, ``from_disk`` and ``fused_decode_scale`` from that one flag, so no
format writes them again. The fused-group rule itself is
:func:`nvfp4lab.execution.shared_scales.fused_decode_from_stored`, which the audit's merge
measurement uses too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nvfp4lab.checkpoint.records import LayerNames
from nvfp4lab.execution.shared_scales import fused_decode_from_stored

__all__ = ["TensorScaleForm"]


class TensorScaleForm:
    """A format spec's tensor-scale conversions, keyed on ``names.decode_form`` (a mixin: the spec
    sets ``names``)."""

    names: LayerNames

    def to_disk(self, encode: torch.Tensor, decode: torch.Tensor | None) -> torch.Tensor:
        """The stored tensor scale. ENCODE formats: ``encode`` as nvfp4lab holds it. DECODE
        formats: the layer's exact DECODE buffer when it has one, else the float32 reciprocal of
        the ENCODE scale, shaped ``names.scalar_shape`` (anything but a ``[1]`` ENCODE scale is
        returned as it is, for the caller's shape check to name)."""
        if not self.names.decode_form or encode.shape != (1,):
            return encode
        value = decode if decode is not None else torch.reciprocal(encode)
        return value.reshape(self.names.scalar_shape)

    def from_disk(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ENCODE scale, exact DECODE scale or None) of a stored float32 ``[1]`` scale: ENCODE
        formats ``(stored, None)``; DECODE formats ``(1 / stored, stored)``, the DECODE scale
        kept exactly."""
        if not self.names.decode_form:
            return stored, None
        return torch.reciprocal(stored), stored

    def fused_decode_scale(self, stored: Sequence[float]) -> torch.Tensor:
        """The one DECODE scale (float32 ``[1]``) vLLM keeps for a fused group whose shards store
        ``stored``: DECODE ``max(stored)``, ENCODE ``1 / max(stored)`` (an engine that merges
        no group never asks: the spec's ``shares_fused_scales``)."""
        return fused_decode_from_stored(list(stored), self.names.decode_form)
