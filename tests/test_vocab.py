"""The one vocabulary: members compare equal to their strings, one error wording."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import vocab
from nvfp4lab.vocab import AUTO, Backend, BiasMode, GemmPath, OrderName, check_choice, check_dtype


def test_members_are_their_strings() -> None:
    assert Backend.EMULATION == "emulation" and str(Backend.NATIVE) == "native"
    assert [str(m) for m in BiasMode] == ["output", "fp32", "dropped"]
    from nvfp4lab.orders import ORDERS

    # every order of the registry is named once, and the published names lead, in this order
    assert list(ORDERS) == list(OrderName)
    assert [str(m) for m in OrderName][:4] == [
        "kernel", "compressed-tensors", "modelopt", "llama.cpp"]


def test_roofline_paths_are_named_after_the_backends() -> None:
    assert {str(b) for b in Backend} <= {str(p) for p in GemmPath}
    assert {str(p) for p in GemmPath} - {str(b) for b in Backend} == {"bf16", "fp8"}


def test_check_choice_returns_the_member() -> None:
    assert check_choice("backend", "w4a16", Backend) is Backend.W4A16
    assert check_choice("backend", Backend.NATIVE, Backend) is Backend.NATIVE
    assert check_choice("backend", AUTO, Backend, extra=(AUTO,)) == "auto"


@pytest.mark.parametrize("bad", ["Native", "", 3, None, ("native",)])
def test_check_choice_error_wording(bad: object) -> None:
    with pytest.raises(ValueError) as err:
        check_choice("backend", bad, Backend, extra=(AUTO,))
    assert str(err.value) == (
        f"unknown backend {bad!r}; accepted values: 'auto', 'native', 'emulation', 'w4a16', "
        "'q8_0'"
    )


def test_check_dtype() -> None:
    assert check_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(TypeError, match=r"x must be float32, bfloat16 or float16.*\.float\(\)"):
        check_dtype(torch.float64, "x")
    with pytest.raises(TypeError, match=r"got torch\.int32$"):
        check_dtype(torch.int32, "x")
    assert vocab.dtype_name(torch.float16) == "float16"


def test_overlapping_vocabularies_share_one_spelling() -> None:
    from nvfp4lab.vocab import CheckpointFormat, Numerics

    assert [str(m) for m in GemmPath] == ["bf16", "fp8", "native", "w4a16", "emulation", "q8_0"]
    assert [str(m) for m in Numerics] == ["native", "emulation", "w4a16", "w4a8", "q8_0", "q8_1"]
    for b in Backend:
        assert GemmPath[b.name] == b and Numerics[b.name] == b
    from nvfp4lab.checkpoint.formats import FORMATS

    assert list(FORMATS) == list(CheckpointFormat)
    assert [str(m) for m in CheckpointFormat][:3] == ["compressed-tensors", "modelopt", "gguf"]
    # a safetensors family takes its value from the convention its producer computes in; GGUF is
    # a container named after its file format (no convention of that name)
    assert all(OrderName[f.name] == f for f in CheckpointFormat
               if f not in (CheckpointFormat.GGUF, CheckpointFormat.FP_QUANT))
    assert CheckpointFormat.FP_QUANT.name not in OrderName.__members__
    assert CheckpointFormat.GGUF.name not in OrderName.__members__
    assert [str(m) for m in vocab.Engine] == ["vllm", "llama.cpp"]
    assert vocab.Engine.LLAMA_CPP == OrderName.LLAMA_CPP
