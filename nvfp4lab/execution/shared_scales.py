"""The bias bug's modern twin: vLLM merges the global scales of fused shards with ``max``.

A fused linear (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) has ONE global scale in
vLLM. When a checkpoint's shards carry different global scales, the loader keeps one:

* compressed-tensors stores ENCODE scales (2688/amax); vLLM keeps ``1 / max(encode)``
  (compressed_tensors_w4a4_nvfp4.py@0.33.0 L111-112): the decode scale of the shard with the
  SMALLEST amax; every other shard is decoded too small by ``encode_own / encode_max``.
* ModelOpt stores DECODE scales (amax/2688, ``weight_scale_2``); vLLM keeps their ``max``
  (modelopt.py@0.33.0 L2093): the shard with the LARGEST amax; every other shard is decoded too
  large by ``decode_max / decode_own``.

Both warn ("the weight global scale is different for parallel layers") and go on. This module
computes, exactly, what that costs each shard: the weights decoded as vLLM decodes them with
the merged scale against the same shard decoded with its own scale (both with vLLM's
``value * (scale * decode)`` float32 arithmetic, :func:`nvfp4lab.execution.gemm.vllm_dequantize`),
and optionally the output error on given activations. A shared-scale checkpoint costs nothing.
For ModelOpt the decode scale of an :class:`NVFP4Tensor` is taken as ``1 / global_scale`` in
float32 (an exporter that computed ``amax/2688`` itself may differ by an ulp).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nvfp4lab import metrics
from nvfp4lab.execution.gemm import vllm_dequantize
from nvfp4lab.tensor import NVFP4Tensor
from nvfp4lab.vocab import TENSOR_SCALE_STORAGE, CheckpointFormat, check_choice

__all__ = [
    "MERGED_FORMATS",
    "ShardMergeError",
    "decode_with",
    "fused_decode_from_stored",
    "merge_error",
    "merged_decode_scale",
]


@dataclass(frozen=True)
class ShardMergeError:
    """What the max-merge does to one shard.

    ``own_decode`` / ``merged_decode``: the float32 decode multipliers (amax/2688-like) the shard
    should use and the one vLLM uses; ``factor`` = merged/own (every decoded weight is scaled by
    it, up to float32 rounding); ``weight_nmse`` / ``weight_sqnr_db``: merged-decoded weights
    against own-decoded ones (0 / inf when unaffected); ``output_nmse`` / ``output_sqnr_db``:
    the same for ``x @ W.T`` on the given activations (None without activations).
    """

    shard: str
    own_decode: float
    merged_decode: float
    factor: float
    weight_nmse: float
    weight_sqnr_db: float
    output_nmse: float | None = None
    output_sqnr_db: float | None = None

    def as_dict(self) -> dict[str, object]:
        return dict(vars(self))


def _decode_scale(t: NVFP4Tensor) -> torch.Tensor:
    """The float32 DECODE scale of ``t`` (the reciprocal of its ENCODE global scale)."""
    return torch.reciprocal(t.global_scale.to(torch.float32).reshape(1))


#: The checkpoint formats whose fused q/k/v and gate/up shards vLLM merges into one scale, read
#: from :data:`nvfp4lab.vocab.TENSOR_SCALE_STORAGE` (GGUF is run by llama.cpp, which keeps one
#: tensor scale per tensor).
MERGED_FORMATS: tuple[CheckpointFormat, ...] = tuple(
    fmt for fmt, storage in TENSOR_SCALE_STORAGE.items() if storage.shared_in_fused_groups
)


def fused_decode_from_stored(stored: Sequence[float] | torch.Tensor, decode: bool) -> torch.Tensor:
    """The one DECODE scale (float32 ``[1]``) vLLM keeps for a fused group whose shards store
    the tensor scales ``stored``: the ``max`` of the stored values, as a DECODE scale. ``decode``:
    the stored form (:attr:`nvfp4lab.vocab.TensorScaleStorage.decode`): DECODE ``max(decode)``,
    ENCODE ``1 / max(encode)``; the one rule every format's ``fused_decode_scale`` uses."""
    values = torch.as_tensor(stored, dtype=torch.float32).reshape(-1)
    if values.numel() == 0:
        raise ValueError("merge needs at least one shard; got none")
    top = values.max()
    return (top if decode else torch.reciprocal(top)).reshape(1)


def merged_decode_scale(shards: Mapping[str, NVFP4Tensor], fmt: str) -> torch.Tensor:
    """The one decode scale vLLM keeps for fused ``shards`` of checkpoint format ``fmt``
    (float32 ``[1]``): :func:`fused_decode_from_stored` on the scales the format stores
    (compressed-tensors ``1 / max(encode)``, ModelOpt ``max(decode)``)."""
    form = CheckpointFormat(check_choice("checkpoint format", fmt, CheckpointFormat))
    if form not in MERGED_FORMATS:
        merged = " and ".join(repr(f.value) for f in MERGED_FORMATS)
        raise ValueError(
            f"checkpoint format {form.value!r} is not merged: the engine that runs it keeps "
            f"one tensor scale per tensor; vLLM's merge applies to {merged}"
        )
    if not shards:
        raise ValueError("merge needs at least one shard; got none")
    decode = TENSOR_SCALE_STORAGE[form].decode
    stored = [(_decode_scale(t) if decode else t.global_scale.to(torch.float32)).reshape(())
              for t in shards.values()]
    return fused_decode_from_stored(torch.stack(stored), decode)


def decode_with(t: NVFP4Tensor, decode: torch.Tensor) -> torch.Tensor:
    """``t`` decoded as vLLM's ``dequantize_to_dtype`` does with the decode multiplier
    ``decode``: ``value * (scale * decode)`` in float32, shape ``t.shape``."""
    return vllm_dequantize(t, torch.float32, decode=decode)


def merge_error(
    shards: Mapping[str, NVFP4Tensor],
    fmt: str = CheckpointFormat.COMPRESSED_TENSORS,
    activations: torch.Tensor | None = None,
) -> list[ShardMergeError]:
    """Per shard, the extra error vLLM's max-merge of unshared global scales causes.

    ``shards``: name -> the shard's :class:`NVFP4Tensor` (``[N_i, K]``, its own ENCODE global
    scale); ``fmt``: a format of :data:`MERGED_FORMATS` (which ``max`` vLLM takes);
    ``activations``: optional ``[..., K]`` input, then the output error of ``x @ W.T`` too
    (float64 products of the float32 decoded weights, so only the weights differ). Exact: no
    estimate, the decoded tensors themselves are compared (:mod:`nvfp4lab.metrics`).
    """
    merged = merged_decode_scale(shards, fmt)
    x = None if activations is None else activations.reshape(-1, activations.shape[-1]).double()
    rows = []
    for name, t in shards.items():
        own_decode = _decode_scale(t)
        own = decode_with(t, own_decode)
        got = decode_with(t, merged)
        out_nmse = out_sqnr = None
        if x is not None:
            ref, app = x @ own.double().T, x @ got.double().T
            out_nmse, out_sqnr = metrics.nmse(ref, app), metrics.sqnr_db(ref, app)
        nmse = metrics.nmse(own, got)
        rows.append(
            ShardMergeError(
                shard=str(name),
                own_decode=float(own_decode),
                merged_decode=float(merged),
                factor=float(merged.double() / own_decode.double()),
                weight_nmse=nmse,
                weight_sqnr_db=math.inf if nmse == 0 else metrics.sqnr_db(own, got),
                output_nmse=out_nmse,
                output_sqnr_db=out_sqnr,
            )
        )
    return rows
