"""A throw-away checkpoint format, written by the recipe of docs/architecture.md ("How to add a
checkpoint format") and registered at run time: :func:`registered` for a test, ``python -c
"import tests.checkpoint.throwaway_format as t; t.main()" ARGV`` for the CLI in a subprocess.

Per quantized Linear ``<name>``: ``<name>.weight_fp4`` (uint8 ``[N, K/2]``),
``<name>.weight_block_scale`` (float8_e4m3fn ``[N, K/16]``), ``<name>.weight_tensor_scale`` and
``<name>.input_tensor_scale`` (float32 ``[1]``, ENCODE ``2688/amax``). The quantization config is
``nvfp4_config.json``: ``{"format": "throwaway", "scheme": ..., "unquantized": [...]}``.

Its vocabulary member is of its own ``StrEnum``: :class:`~nvfp4lab.vocab.CheckpointFormat` cannot
grow at run time (the recipe's step 1 edits ``vocab.py``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch
from torch import nn

from nvfp4lab.checkpoint.records import LayerNames, Unquantized
from nvfp4lab.checkpoint.refusals import CheckpointError, read_json
from nvfp4lab.checkpoint.safetensors_files import SafetensorsContainer
from nvfp4lab.vocab import Scheme

CONFIG_FILE = "nvfp4_config.json"
NAMES = LayerNames("weight_fp4", "weight_block_scale", "weight_tensor_scale",
                   "input_tensor_scale", (1,), False)


class ThrowawayFormat(StrEnum):
    """The throw-away format's vocabulary member (stands for a new ``CheckpointFormat``)."""

    THROWAWAY = "throwaway"


@dataclass(frozen=True)
class ThrowawayConfig:
    """``nvfp4_config.json``, validated (``file``: where it was read)."""

    scheme: Scheme
    unquantized: tuple[str, ...]
    file: Path

    def checkpoint_scheme(self) -> Scheme:
        return self.scheme

    def quantized_modules(self, model: nn.Module) -> dict[str, bool]:
        """Every Linear not listed as unquantized; W4A4 layers store an input scale."""
        out = {name: self.scheme == Scheme.NVFP4 for name, module in model.named_modules()
               if isinstance(module, nn.Linear)
               and not any(fnmatch.fnmatchcase(name, p) for p in self.unquantized)}
        if not out:
            raise CheckpointError(f"{self.file}: every Linear is unquantized")
        return out


class Throwaway(SafetensorsContainer):
    """The throw-away format: safetensors shards plus ``nvfp4_config.json``."""

    format = ThrowawayFormat.THROWAWAY
    title = "Throwaway NVFP4"
    description = "'throwaway' (NVFP4, nvfp4_config.json)"
    names = NAMES
    config_files: tuple[str, ...] = (CONFIG_FILE,)
    weight_files: tuple[str, ...] = ()
    transformers_needs_bfloat16 = False
    optional_tensor_scale: str | None = None
    shares_fused_scales = False
    writes_in_tasks = True

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / CONFIG_FILE).is_file()

    def read_config(self, path: Path) -> ThrowawayConfig:
        file = path / CONFIG_FILE
        data = read_json(file)
        if data.get("format") != ThrowawayFormat.THROWAWAY.value:
            raise CheckpointError(f"{file}: format is {data.get('format')!r}, not 'throwaway'")
        try:
            scheme = Scheme(data.get("scheme"))
        except ValueError:
            raise CheckpointError(f"{file}: scheme {data.get('scheme')!r} is not NVFP4") from None
        return ThrowawayConfig(scheme, tuple(data.get("unquantized", ())), file)

    def write_config(self, folder: Path, scheme: Scheme, unquantized: Unquantized) -> None:
        config = {"format": ThrowawayFormat.THROWAWAY.value, "scheme": str(scheme),
                  "unquantized": list(unquantized.weights)}
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")

    def to_disk(self, encode: torch.Tensor, decode: torch.Tensor | None) -> torch.Tensor:
        return encode

    def from_disk(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return stored, None

    def fused_decode_scale(self, stored: Sequence[float]) -> torch.Tensor:
        return torch.tensor([max(stored)], dtype=torch.float32)


SPEC = Throwaway()


@contextlib.contextmanager
def registered() -> Iterator[Throwaway]:
    """``FORMATS`` with the throw-away format added last, for the ``with`` block only."""
    from nvfp4lab.checkpoint.formats import FORMATS, LAYER_NAMES

    FORMATS[SPEC.format] = SPEC  # type: ignore[index]
    LAYER_NAMES[SPEC.format] = NAMES  # type: ignore[index]
    try:
        yield SPEC
    finally:
        del FORMATS[SPEC.format]  # type: ignore[arg-type]
        del LAYER_NAMES[SPEC.format]  # type: ignore[arg-type]


def main() -> None:
    """``nvfp4lab`` with the throw-away format registered: ``sys.argv[1:]`` as its arguments."""
    from nvfp4lab import cli

    with registered():
        code = cli.main(sys.argv[1:])
    sys.exit(code)
