"""Check a saved checkpoint where users will run it: load it in transformers, run one forward.

compressed-tensors (installed with nvfp4lab) lets transformers read compressed-tensors NVFP4
checkpoints and decompress their weights on load. :func:`verify` does exactly what a user would
(``from_pretrained`` offline, then a forward pass on a few token ids) and says what failed. A
checkpoint with a compressed-tensors ``transform_config`` (rotated layers) gets its online input
rotations applied after loading (:func:`~nvfp4lab.checkpoint.formats.transforms.
transformers_input_rotations`): transformers 5.25 loads it without them and would run a wrong
model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nvfp4lab.checkpoint.formats.transforms import transformers_input_rotations
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.safetensors_files import CONFIG_NAME
from nvfp4lab.vocab import CheckpointFormat

__all__ = ["Verified", "verify"]


@dataclass(frozen=True)
class Verified:
    """A checkpoint that transformers loaded and ran: the class it built, the dtype of its
    parameters and the shape of the first output of one forward pass on ``tokens`` token ids."""

    path: Path
    model_class: str
    dtype: torch.dtype
    output_shape: tuple[int, ...]
    tokens: int
    input_rotations: int = 0  #: layers whose input rotation was applied after loading


def _model_class(path: Path) -> type:
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls  # type: ignore[no-any-return]
    return transformers.AutoModel  # type: ignore[no-any-return]


def _is_modelopt(folder: Path) -> bool:
    from nvfp4lab.checkpoint.formats import detect_format

    try:
        return detect_format(folder) == CheckpointFormat.MODELOPT
    except Exception:  # not a checkpoint nvfp4lab knows: no format-specific remedy
        return False


def verify(
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, tokens: int = 8
) -> Verified:
    """Load ``path`` with transformers (offline) and run one forward pass on ``tokens`` token ids.

    ``dtype``: passed to ``from_pretrained`` (default: the checkpoint's own). Raises
    :class:`CheckpointError` naming the checkpoint, what failed and, for the dtype mismatch of
    compressed-tensors 0.20 (weights decompressed to bfloat16), the remedy.
    """
    folder = Path(path)
    if not (folder / CONFIG_NAME).is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_NAME}: not a checkpoint folder")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    try:
        cls = _model_class(folder)
        kwargs = {"local_files_only": True, **({"dtype": dtype} if dtype is not None else {})}
        model = cls.from_pretrained(str(folder), **kwargs).eval()
        rotations = transformers_input_rotations(model, folder)
        vocab = int(getattr(model.config, "vocab_size", 0) or 100)
        ids = (torch.arange(tokens) * 7 % vocab).reshape(1, tokens)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    except Exception as exc:
        remedy = ""
        if _is_modelopt(folder):
            remedy = (
                "; transformers has no loader for ModelOpt NVFP4 checkpoints: it reads the packed "
                "uint8 weights as plain tensors, so its hints (ignore_mismatched_sizes) do not "
                "apply. Convert it first, nvfp4lab.checkpoint.convert(path, dst, format="
                f"{CheckpointFormat.COMPRESSED_TENSORS.value!r}), and verify that, or run it in "
                "vLLM / TensorRT-LLM"
            )
        elif "BFloat16" in str(exc) or "dtype" in str(exc):
            remedy = (
                "; compressed-tensors 0.20 decompresses NVFP4 weights to bfloat16: save with "
                "dtype=torch.bfloat16 or verify(path, dtype=torch.bfloat16)"
            )
        raise CheckpointError(
            f"{folder}: transformers cannot run this checkpoint ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}){remedy}"
        ) from exc
    first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
    return Verified(folder, type(model).__name__, model.dtype, tuple(first.shape), tokens,
                    rotations)
