"""llama.cpp itself (llama-cpp-python 0.3.36, CPU) runs the NVFP4 GGUF nvfp4lab writes for SmolLM2.

SmolLM2-135M-Instruct is quantized by nvfp4lab (RTN, every decoder Linear, a tensor scale per
layer, weight-only) and written with ``save_pretrained(format="gguf")``; nvfp4lab's emulation
is that file read back with ``checkpoint.load(backend="q8_0")``: every quantized Linear runs
llama.cpp's CPU arithmetic (Q8_0 activations, ``ggml_vec_dot_nvfp4_q8_0``'s order, the
``.scale`` sidecar).

(b) llama.cpp loads the file and generates. (c) Inside llama.cpp's own graph every quantized
Linear, given llama.cpp's own input tensor (read with the scheduler's eval callback), equals
nvfp4lab's ``q8_0`` linear bit for bit; the whole model's logits agree within the tolerance
measured for the rest of ggml's graph (RMSNorm, RoPE, softmax, SiLU, the F32 matmuls of
attention and the tied output, the F16 KV cache, each in ggml's float order, and the Q8_0 codes
those small differences flip): see docs/llama_cpp.md. (d) ``nvfp4lab bench --llama-cpp`` prints
both tokens/s and their ratio.
"""

from __future__ import annotations

import ctypes
import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nvfp4lab import checkpoint, corpus
from nvfp4lab.bench import command as bench
from nvfp4lab.bench import llama_cpp as lb
from nvfp4lab.checkpoint.formats.gguf import gguf_order
from nvfp4lab.vocab import Backend, CorpusPart

try:
    llama_cpp = importlib.import_module("llama_cpp")
except Exception as exc:  # pragma: no cover - depends on the peer install
    pytest.skip(
        f"llama-cpp-python does not import ({type(exc).__name__}: {exc}); run `make test-peers`",
        allow_module_level=True,
    )

pytestmark = pytest.mark.peers

#: Tolerances for the whole model's logits (docs/llama_cpp.md, measured on six 32-token windows
#: of the evaluation text, F16 and F32 KV cache: max |diff| 0.83..1.32, mean KLD 0.0016..0.0040
#: nats, top-1 30..32 of 32, every disagreement at a near-tie of top-2 margin <= 0.24).
MAX_LOGIT_DIFF = 2.0
MEAN_KLD = 0.01
NEAR_TIE = 0.5
PROMPT_TOKENS = 32


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return lb.smollm2_gguf(tmp_path_factory.mktemp("smollm2") / "nvfp4")
    except ImportError as exc:
        pytest.skip(f"SmolLM2 needs the [llm] extra: {exc}")


@pytest.fixture(scope="module")
def emulation(gguf: Path) -> torch.nn.Module:
    return checkpoint.load(gguf, backend=Backend.Q8_0)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    from nvfp4lab import models

    text = corpus.pydoc_text(CorpusPart.EVALUATION)
    return corpus.token_ids(models.smollm2_tokenizer(), text)[:PROMPT_TOKENS].tolist()


def test_llama_cpp_loads_and_generates(gguf: Path, prompt: list[int]) -> None:
    llm = llama_cpp.Llama(model_path=str(gguf), n_threads=1, logits_all=True, verbose=False)
    tokens = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == 8:
            break
    assert len(tokens) == 8 and all(0 <= t < llm.n_vocab() for t in tokens)
    out = llm("Assignment statements are used to", max_tokens=8, temperature=0.0)
    assert out["choices"][0]["text"].strip()


class _Graph:
    """llama.cpp's intermediate tensors of one decode, by name, through ``cb_eval``."""

    def __init__(self, path: Path, names: set[str]) -> None:
        base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
        for fn, restype in (
            ("ggml_get_name", ctypes.c_char_p),
            ("ggml_nelements", ctypes.c_int64),
            ("ggml_nrows", ctypes.c_int64),
            ("ggml_is_contiguous", ctypes.c_bool),
            ("ggml_get_data_f32", ctypes.POINTER(ctypes.c_float)),
        ):
            getattr(base, fn).restype = restype
            getattr(base, fn).argtypes = [ctypes.c_void_p]
        self.base, self.names, self.tensors = base, names, {}
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._seen)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params()
        )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = 64
        params.n_threads = params.n_threads_batch = 1
        params.cb_eval = self.callback
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)

    def _seen(self, tensor: Any, ask: bool, _: Any) -> bool:
        name = self.base.ggml_get_name(tensor).decode()
        if ask:
            return name in self.names
        if name in self.names and name not in self.tensors:  # the first tensor of that name
            assert self.base.ggml_is_contiguous(tensor), name
            n, rows = self.base.ggml_nelements(tensor), self.base.ggml_nrows(tensor)
            data = np.ctypeslib.as_array(self.base.ggml_get_data_f32(tensor), shape=(n,))
            self.tensors[name] = torch.from_numpy(data.copy()).reshape(rows, n // rows)
        return True

    def decode(self, tokens: list[int]) -> None:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        assert (
            llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(arr, len(tokens))) == 0
        )

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


#: (input tensor, output tensor, module under model.layers.<i>, heads whose rows are permuted):
#: llama.cpp's graph names (src/llama-graph.cpp build_qkv / build_attn / build_ffn, and
#: src/models/llama.cpp, which renames the FFN's last tensor "ffn_out"); each output is the
#: product already multiplied by the ``.scale`` sidecar.
LINEARS = (
    ("attn_norm", "Qcur", "self_attn.q_proj", "num_attention_heads"),
    ("attn_norm", "Kcur", "self_attn.k_proj", "num_key_value_heads"),
    ("attn_norm", "Vcur", "self_attn.v_proj", None),
    ("kqv_out", "attn_out", "self_attn.o_proj", None),
    ("ffn_norm", "ffn_gate_s", "mlp.gate_proj", None),
    ("ffn_norm", "ffn_up_s", "mlp.up_proj", None),
    ("ffn_swiglu", "ffn_out", "mlp.down_proj", None),
)


def test_every_linear_in_llama_cpps_graph_is_bit_exact(
    gguf: Path, emulation: torch.nn.Module, prompt: list[int]
) -> None:
    config = emulation.config
    layers = range(config.num_hidden_layers)
    names = {f"{t}-{i}" for i in layers for inp, out, _, _ in LINEARS for t in (inp, out)}
    graph = _Graph(gguf, names)
    try:
        graph.decode(prompt[:20])
    finally:
        graph.close()
    checked = 0
    for i in layers:
        for inp, out, module, heads in LINEARS:
            x, want = graph.tensors[f"{inp}-{i}"], graph.tensors[f"{out}-{i}"]
            with torch.no_grad():
                got = emulation.get_submodule(f"model.layers.{i}.{module}")(x)
            if heads is not None:  # llama.cpp's q/k rows are in its rotary order
                got = got[:, gguf_order(got.shape[1], getattr(config, heads))]
            assert torch.equal(got, want), f"{module} of layer {i}"
            checked += 1
    assert checked == 7 * config.num_hidden_layers


def _compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, Any]:
    lp, lq = torch.log_softmax(ours.double(), -1), torch.log_softmax(theirs.double(), -1)
    top2 = ours.topk(2, dim=-1).values
    return {
        "max_diff": (ours - theirs).abs().max().item(),
        "kld": (lp.exp() * (lp - lq)).sum(-1),
        "same_top1": ours.argmax(-1) == theirs.argmax(-1),
        "margin": top2[:, 0] - top2[:, 1],
    }


@pytest.mark.parametrize("kv_f32", [False, True], ids=["f16-kv", "f32-kv"])
def test_logits_agree_with_the_cpu_emulation(
    gguf: Path, emulation: torch.nn.Module, prompt: list[int], kv_f32: bool
) -> None:
    extra = {"type_k": 0, "type_v": 0} if kv_f32 else {}  # GGML_TYPE_F32 = 0
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_threads=1, logits_all=True, verbose=False, **extra
    )
    llm.reset()
    llm.eval(prompt)
    theirs = torch.from_numpy(np.array(llm.scores[: len(prompt)], dtype=np.float32))
    with torch.no_grad():
        ours = emulation(torch.tensor([prompt])).logits[0].float()
    c = _compare(ours, theirs)
    report = (
        f"max |diff| {c['max_diff']:.3f}, mean KLD {c['kld'].mean().item():.5f}, top-1 "
        f"{int(c['same_top1'].sum())}/{len(prompt)}, margins where they differ "
        f"{[round(m, 3) for m in c['margin'][~c['same_top1']].tolist()]}"
    )
    print(report)
    assert c["max_diff"] <= MAX_LOGIT_DIFF, report
    assert c["kld"].mean().item() <= MEAN_KLD, report
    # the top-1 token is the same wherever it is not a near-tie of the two top logits
    assert bool(c["same_top1"][c["margin"] > NEAR_TIE].all()), report
    assert int(c["same_top1"].sum()) >= len(prompt) - 3, report


def test_bench_prints_both_tokens_per_second(
    gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(["--llama-cpp", "--tiny", "--gguf", str(gguf), "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp " in out and "nvfp4lab[q8_0]" in out
    assert "ratio: tokens/s llama.cpp / nvfp4lab[q8_0] = " in out
