"""The refusal wording every checkpoint path shares: one error type, one sentence per fault.

:class:`CheckpointError` (a ValueError whose message names the file and tensor), JSON read with
bounded nesting (:func:`parse_json`, :func:`read_json`), pickles refused (:func:`refuse_pickle`),
and the one refusal of an invalid stored tensor scale (:func:`tensor_scale_error`) or of invalid
E4M3 block scales (:func:`block_scale_error`) that ``load``, ``convert`` and ``audit`` all word
the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nvfp4lab.checkpoint.records import LayerNames
from nvfp4lab.checkpoint.validation import scale_value_problem
from nvfp4lab.tensor import invalid_block_scales

__all__ = [
    "MAX_JSON_DEPTH",
    "CheckpointError",
    "block_scale_error",
    "parse_json",
    "read_json",
    "refuse_pickle",
    "tensor_scale_error",
]

class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message names the file and tensor."""


#: JSON nesting accepted in a checkpoint's JSON (configs, safetensors headers, GGUF's config
#: key): real ones nest under 10 levels; Python's parser and the code walking the result
#: (transformers' configs, ``copy.deepcopy``) recurse once or more per level.
MAX_JSON_DEPTH = 64


def _json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                stack.extend((v, depth) for v in (item.values() if isinstance(item, dict)
                                                  else item))
    return deepest


def parse_json(text: str | bytes, file: Path | str, what: str = "") -> Any:
    """``json.loads(text)`` of ``file`` (``what``: the part of the file it is, for the
    message); CheckpointError naming the file for text that is not JSON or nests deeper than
    :data:`MAX_JSON_DEPTH` (Python's parser raises RecursionError near 1,000 levels)."""
    where = f"{file}: {what}" if what else f"{file}:"
    try:
        data = json.loads(text)
    except RecursionError:
        data = None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{where} not valid JSON ({exc})") from None
    else:
        if _json_depth(data) <= MAX_JSON_DEPTH:
            return data
    raise CheckpointError(f"{where} JSON nested more than {MAX_JSON_DEPTH} levels deep (no "
                          "checkpoint's JSON nests that deep); the file is corrupt or hostile")


def read_json(file: Path) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise CheckpointError(f"{file} not found: not a checkpoint directory") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                              f"offset {exc.start}); save it as UTF-8 JSON") from None
    data = parse_json(text, file)
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def refuse_pickle(file: Path) -> CheckpointError:
    return CheckpointError(
        f"{file} is a pickle file ({file.suffix}); nvfp4lab never unpickles checkpoints "
        "(unpickling runs arbitrary code). Convert it to safetensors with a trusted tool first"
    )


def tensor_scale_error(file: Path | None, key: str, value: float,
                       names: LayerNames) -> CheckpointError | None:
    """The one refusal of a stored tensor (or input) scale ``value`` of tensor ``key``
    (``load`` raises it, ``convert`` too, before writing anything; ``audit`` flags the layer
    in the same words): not finite and > 0, or a float32 reciprocal that overflows
    (:func:`~nvfp4lab.checkpoint.validation.scale_value_problem`), naming the file, the tensor
    and the format's convention; None for a valid one."""
    problem = scale_value_problem(value, names.decode_form)
    return None if problem is None else CheckpointError(f"{file}: tensor {key!r} {problem}")


def block_scale_error(file: Path | None, key: str, scales: torch.Tensor,
                      first_row: int = 0) -> CheckpointError | None:
    """The one refusal of stored E4M3 block ``scales`` of tensor ``key`` (rows from
    ``first_row`` on: a part of it may be checked at a time) holding NaN codes or negative values
    (``load`` and ``convert`` raise it; ``audit`` flags the layer), naming the file, the tensor,
    the first bad byte and how many there are; None when all are valid."""
    nan, negative, first = invalid_block_scales(scales)
    if first is None:
        return None
    byte = int(scales.view(torch.uint8)[first])
    where = (first[0] + first_row, *first[1:])
    return CheckpointError(
        f"{file}: tensor {key!r} holds {nan} NaN and {negative} negative E4M3 block scale(s) "
        f"(first at {where}, byte 0x{byte:02x}); NVFP4 block scales are non-negative and finite, "
        "so this checkpoint is corrupt or not NVFP4"
    )
