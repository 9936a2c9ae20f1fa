"""``NVFP4LAB_NATIVE_ISA``: the cap on the vector path of nvfp4lab's C++ kernels (issue 32).

Under each setting the kernels report the path that runs (``lut_decode.isa()``,
``block_encode.isa()``), every library call asks for at most that path and gets it back, and the
bits equal the eager pipeline's (a fresh process with the variable set, as CI runs the suite);
a bad value is one ValueError line naming the variable and the accepted values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from nvfp4lab.kernels import block_encode, lut_decode, native
from nvfp4lab.kernels.linear import EncodedWeight, row_decoder
from nvfp4lab.orders import ORDERS, DecodeRule
from nvfp4lab.settings import NATIVE_ISA_ENV, native_isa
from nvfp4lab.vocab import NativeIsa, OrderName
from tests.processes import child_env

needs_native = pytest.mark.skipif(
    not native.available(), reason="the native C++ library cannot be built here"
)


def best_paths() -> tuple[int, int]:
    """(the LUT decode's, the block encode's) best path on this CPU, as ISAS numbers."""
    lib = native.library()
    return (0, 0) if lib is None else (lib.nvfp4lab_lut_isa(), lib.nvfp4lab_encode_isa())


def test_the_setting_reads_every_value_and_refuses_others() -> None:
    assert native_isa({}) is None
    assert native_isa({NATIVE_ISA_ENV: " "}) is None
    for isa in NativeIsa:
        assert native_isa({NATIVE_ISA_ENV: isa.value.upper()}) is isa
    with pytest.raises(ValueError) as err:
        native_isa({NATIVE_ISA_ENV: "sse9"})
    message = str(err.value)
    assert "\n" not in message
    assert NATIVE_ISA_ENV in message and "'sse9'" in message
    assert all(repr(isa.value) in message for isa in NativeIsa)


def spy(lib: object, name: str, monkeypatch: pytest.MonkeyPatch,
        calls: list[tuple[str, int, int]], isa_arg: int) -> None:
    """Replace ``lib.name`` by a wrapper recording (name, the path asked for, the path used)."""
    original: Callable[..., int] = getattr(lib, name)

    def wrapper(*args: object) -> int:
        used = original(*args)
        calls.append((name, int(args[isa_arg]), int(used)))  # type: ignore[call-overload]
        return used

    monkeypatch.setattr(lib, name, wrapper)


@needs_native
@pytest.mark.parametrize("isa", list(NativeIsa))
def test_every_kernel_call_runs_at_most_the_capped_path(
    isa: NativeIsa, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NATIVE_ISA_ENV, isa.value)
    cap = native.ISAS.index(isa)
    lut_best, encode_best = best_paths()
    assert lut_decode.isa() == native.ISAS[min(cap, lut_best)]
    assert block_encode.isa() == native.ISAS[min(cap, encode_best)]
    lib = native.required()
    calls: list[tuple[str, int, int]] = []
    spy(lib, "nvfp4lab_encode", monkeypatch, calls, 7)
    spy(lib, "nvfp4lab_lut_decode", monkeypatch, calls, 6)
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    t = torch.tensor([2688.0 / 4.0])
    for order in ORDERS.values():
        block_encode.encode(x, t, order)
        block_encode.encode(x, t, order, path=NativeIsa.AVX512)  # a wider request is capped too
    lut_decode.decode(*block_encode.encode(x, t, ORDERS[OrderName.VLLM_KERNEL]), t, torch.float32,
                      rule=DecodeRule.SCALE_OVER_ENCODE)
    packed, scales = block_encode.encode(x, t, ORDERS[OrderName.VLLM_KERNEL])
    decoder = row_decoder(EncodedWeight(packed, scales, t, DecodeRule.SCALE_OVER_ENCODE),
                          torch.bfloat16)
    decoder(0, 8, torch.empty(8, 256, dtype=torch.bfloat16))
    assert {name for name, _, _ in calls} == {"nvfp4lab_encode", "nvfp4lab_lut_decode"}
    for name, asked, used in calls:
        best = lut_best if name == "nvfp4lab_lut_decode" else encode_best
        assert asked <= cap and used == min(cap, best), (name, asked, used)
    # abs_max returns bits, not its path: its request is capped the same way
    asked_abs: list[int] = []
    original = lib.nvfp4lab_abs_max

    def abs_max_spy(*args: object) -> int:
        asked_abs.append(int(args[3]))  # type: ignore[call-overload]
        return original(*args)

    monkeypatch.setattr(lib, "nvfp4lab_abs_max", abs_max_spy)
    block_encode.abs_max(x)
    assert asked_abs == [min(cap, len(native.ISAS) - 1)]


_CHILD = r"""
import json, torch
import nvfp4lab
from nvfp4lab.kernels import block_encode, lut_decode
from nvfp4lab.vocab import OrderName
out = {"lut": lut_decode.isa(), "encode": block_encode.isa(), "same": []}
g = torch.Generator().manual_seed(7)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    x = (torch.randn(96, 512, generator=g) * torch.logspace(-3, 3, 512)).to(dtype)
    for convention in OrderName:
        fused = nvfp4lab.quantize(x, convention=convention, fused=True)
        eager = nvfp4lab.quantize(x, convention=convention, fused=False)
        same = torch.equal(fused.packed, eager.packed) and torch.equal(
            fused.scales.view(torch.uint8), eager.scales.view(torch.uint8))
        fake_fused = nvfp4lab.fake_quantize(x, convention=convention, fused=True)
        fake_eager = nvfp4lab.fake_quantize(x, convention=convention, fused=False)
        same = same and torch.equal(fake_fused, fake_eager)
        for target in (torch.float32, torch.bfloat16, torch.float16):
            same = same and torch.equal(eager.dequantize(target, fused=True),
                                        eager.dequantize(target, fused=False))
        out["same"].append([str(dtype), convention.value, same])
print(json.dumps(out))
"""


@needs_native
@pytest.mark.parametrize("isa", list(NativeIsa))
def test_a_process_under_the_setting_reports_its_path_and_gives_the_eager_bits(
    isa: NativeIsa,
) -> None:
    cap = native.ISAS.index(isa)
    lut_best, encode_best = best_paths()
    env = child_env()
    env.update({NATIVE_ISA_ENV: isa.value, "NVFP4LAB_THREADS": "1"})
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["lut"] == native.ISAS[min(cap, lut_best)]
    assert result["encode"] == native.ISAS[min(cap, encode_best)]
    assert result["same"] and all(same for _, _, same in result["same"]), result["same"]


def test_a_bad_setting_is_one_line_naming_it() -> None:
    env = child_env()
    env[NATIVE_ISA_ENV] = "avx1024"
    code = ("import torch, nvfp4lab\n"
            "try:\n"
            "    nvfp4lab.quantize(torch.randn(4, 64), fused=True)\n"
            "except ValueError as err:\n"
            "    print(err)\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    if not native.available():
        pytest.skip("the native library is not built here: the setting is never read")
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and NATIVE_ISA_ENV in lines[0] and "'avx1024'" in lines[0], lines
