"""The configurations of the LLM study (notebook 07): what each NVFP4 choice costs SmolLM2 in
perplexity and KL divergence, how it compares with published results, and the explorer.

A configuration (:class:`LLMConfig`) is a call of
:func:`~nvfp4lab.execution.quantize_model` on a copy of the reference model:

* weights only (W4A16: the Marlin numerics) by round to nearest (RTN), by GPTQ, and by GPTQ on
  block-Hadamard-rotated weights (MR-GPTQ style, arXiv 2509.23202); and, beside them, the
  comparator formats MXFP4 and INT4-g128 by RTN (``LLMConfig.weight_format``);
* weights and activations (W4A4, vLLM 0.33's emulation order) with a dynamic per-call
  activation tensor scale or with input scales calibrated on the calibration text, and the
  W4A4 recipes that measured best on SmolLM2 (``execution.w4a4_recipes``: SmoothQuant scales
  of strength 0.5 folded into the stored weights, by RTN and by GPTQ on the quantized inputs'
  Hessian; docs/llm.md "W4A4 recipes");
* the KV cache alone as vLLM 0.33 writes and reads it (``nvfp4``, ``nvfp4_4over6``, and ``fp8``
  as the comparator), with vLLM's default K / V scale 1.0;
* W4A4 with a 4-bit KV cache.

Every Linear of the decoder layers is quantized; ``lm_head`` and the embeddings stay float (as
``quantize_model``'s default and vLLM's NVFP4 checkpoints keep them). Every number is measured
against the float reference, which for SmolLM2 is the Q4_1-dequantized model of the shipped GGUF
file: it is the error NVFP4 adds to that model, not to the original bfloat16 release.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nvfp4lab import number_formats
from nvfp4lab.execution import KVCacheOptions, quantize_model
from nvfp4lab.execution.calibrate import calibration, run_batch
from nvfp4lab.execution.kv_calibration import calibrate_kv_scales
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.execution.mixed import quantizable_linears
from nvfp4lab.execution.w4a4_recipes import W4A4Options
from nvfp4lab.execution.w4a4_smooth import observing_statistics, smooth_statistics
from nvfp4lab.orders import ArithmeticOrder
from nvfp4lab.plots import new_figure
from nvfp4lab.settings import tqdm_class
from nvfp4lab.studies.llm import ReferenceRun, TokenFidelity, token_fidelity
from nvfp4lab.studies.llm_anchors import ANCHORS_PATH, anchor_rows, published_anchors
from nvfp4lab.studies.llm_anchors import row_by_label as _row
from nvfp4lab.studies.peak_memory import PeakRSS as _PeakRSS
from nvfp4lab.studies.peak_memory import rss_bytes as _rss_bytes  # noqa: F401  (tests)
from nvfp4lab.vocab import Backend, KVCacheKind, OrderName, QuantMethod, ScaleSelection

__all__ = [
    "ANCHORS_PATH",
    "CALIBRATED",
    "DYNAMIC",
    "HEADLINE_LABELS",
    "ConfigResult",
    "LLMConfig",
    "anchor_rows",
    "build",
    "config_result",
    "config_results",
    "config_row",
    "config_rows",
    "config_text",
    "configurations",
    "headline_numbers",
    "interval_unit",
    "llm_explorer",
    "plot_configs",
    "published_anchors",
    "scored_row",
    "shared_calibration",
]

#: Activation scales of a W4A4 configuration: computed per call from the input's amax, or
#: fixed from the calibration text's amax (``execution.calibrate.calibration``).
DYNAMIC = "dynamic"
CALIBRATED = "calibrated"


@dataclass(frozen=True)
class LLMConfig:
    """One configuration: ``backend`` of the Linear layers (``None``: none quantized, the KV
    cache only), ``method`` (``rtn`` / ``gptq``), ``rotation`` (GPTQ on block-Hadamard-rotated
    weights), ``input_scales`` (:data:`DYNAMIC` or :data:`CALIBRATED`, W4A4 only), ``kv_cache``
    (a :class:`~nvfp4lab.vocab.KVCacheKind` value or ``None``), ``kv_scales`` (None: vLLM
    0.33's 1.0; :data:`CALIBRATED`: amax / 448 per layer from the calibration text,
    ``execution.kv_calibration``), ``convention`` (the weights'
    arithmetic order: a :class:`~nvfp4lab.vocab.OrderName` name or an
    :class:`~nvfp4lab.orders.ArithmeticOrder`; ``studies.llm_llama_cpp`` compares them),
    ``w4a4`` (the W4A4 recipes of ``quantize_model``, :class:`W4A4Options`, or None),
    ``kv_rotation`` (None, or the block of the Q / K Hadamard rotation before the KV cache,
    ``KVCacheOptions(qk_rotation=...)``),
    ``weight_format`` (None: NVFP4; else a comparator of :mod:`nvfp4lab.number_formats`, e.g.
    ``"mxfp4"`` or ``"int4_g128"``: every Linear ``quantize_model`` would replace keeps its
    float forward on that format's RTN fake-quantized weight, W4A16 with RTN only; see
    :func:`build`)."""

    label: str
    backend: str | None = Backend.W4A16
    method: str = QuantMethod.RTN
    rotation: bool = False
    input_scales: str = DYNAMIC
    kv_cache: str | None = None
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL
    kv_scales: str | None = None
    w4a4: W4A4Options | None = None
    kv_rotation: int | None = None
    weight_format: str | None = None

    def __post_init__(self) -> None:
        if self.weight_format is None:
            return
        name = number_formats.get(self.weight_format).name  # ValueError names the formats
        if name == "nvfp4":
            raise ValueError(f"{self.label!r}: weight_format='nvfp4' is the default path; "
                             "leave weight_format=None")
        if (self.backend != Backend.W4A16 or self.method != QuantMethod.RTN or self.rotation
                or self.w4a4 is not None):
            raise ValueError(f"{self.label!r}: weight_format={name!r} is weight-only RTN; use "
                             "backend='w4a16', method='rtn', no rotation and no w4a4")

    @property
    def weights(self) -> str:
        if self.backend is None:
            return "float"
        return "nvfp4" if self.weight_format is None else \
            number_formats.get(self.weight_format).name

    @property
    def activations(self) -> str:
        if self.backend == Backend.Q8_0:
            return f"{Backend.Q8_0.value} (int8 per 32 values)"
        return f"nvfp4 ({self.input_scales})" if self.backend == Backend.EMULATION else "float"

    @property
    def quant_method(self) -> str:
        """The ``method=`` of ``quantize_model``: GPTQ with ``rotation`` is MR-GPTQ."""
        if self.rotation and self.method == QuantMethod.GPTQ:
            return QuantMethod.MR_GPTQ
        return self.method

    @property
    def kv_options(self) -> str | KVCacheOptions | None:
        """``quantize_model``'s ``kv_cache=``: the kind, or ``KVCacheOptions(kind,
        scales=kv_scales, qk_rotation=kv_rotation)`` when either is set (``kv_rotation``: the
        Q / K Hadamard block before the KV cache, None: none)."""
        if self.kv_cache is None or (self.kv_scales is None and self.kv_rotation is None):
            return self.kv_cache
        return KVCacheOptions(self.kv_cache, scales=self.kv_scales,
                              qk_rotation=self.kv_rotation)

    @property
    def needs_calibration(self) -> bool:
        return self.kv_scales == CALIBRATED or self.method == QuantMethod.GPTQ or (
            self.backend == Backend.EMULATION and self.input_scales == CALIBRATED) or (
            self.w4a4 is not None and self.w4a4.needs_calibration)

    @property
    def method_label(self) -> str:
        """The table's ``method``: ``quant_method``, and the W4A4 recipes when there are."""
        if self.w4a4 is None:
            return self.quant_method
        return f"{self.quant_method} + {self.w4a4.label()}"


def configurations(*, smoke: bool = False) -> list[LLMConfig]:
    """The study's configurations in table order (``smoke``: the four that need no GPTQ run)."""
    w4a16, w4a4 = Backend.W4A16, Backend.EMULATION
    full = [
        LLMConfig("W4A16 RTN", w4a16),
        LLMConfig("W4A16 GPTQ", w4a16, QuantMethod.GPTQ),
        LLMConfig("W4A16 MR-GPTQ", w4a16, QuantMethod.GPTQ, rotation=True),
        LLMConfig("W4A16 MXFP4 RTN", w4a16, weight_format="mxfp4"),
        LLMConfig("W4A16 INT4-g128 RTN", w4a16, weight_format="int4_g128"),
        LLMConfig("W4A4 RTN, dynamic", w4a4),
        LLMConfig("W4A4 RTN, calibrated", w4a4, input_scales=CALIBRATED),
        LLMConfig("W4A4 RTN + SmoothQuant 0.5", w4a4, w4a4=W4A4Options(smooth_alpha=0.5)),
        LLMConfig("W4A4 GPTQ + SmoothQuant 0.5, calibrated", w4a4, QuantMethod.GPTQ,
                  input_scales=CALIBRATED, w4a4=W4A4Options(smooth_alpha=0.5)),  # vLLM loads it
        LLMConfig("KV nvfp4", None, kv_cache=KVCacheKind.NVFP4),
        LLMConfig("KV nvfp4_4over6", None, kv_cache=KVCacheKind.NVFP4_4OVER6),
        LLMConfig("KV nvfp4 + Q/K rotation 16", None, kv_cache=KVCacheKind.NVFP4,
                  kv_rotation=16),  # block 16 divides every head_dim
        LLMConfig("KV nvfp4_4over6 + Q/K rotation 16", None,
                  kv_cache=KVCacheKind.NVFP4_4OVER6, kv_rotation=16),
        LLMConfig("KV fp8", None, kv_cache=KVCacheKind.FP8),
        LLMConfig("KV nvfp4, calibrated scales", None, kv_cache=KVCacheKind.NVFP4,
                  kv_scales=CALIBRATED),
        LLMConfig("KV fp8, calibrated scales", None, kv_cache=KVCacheKind.FP8,
                  kv_scales=CALIBRATED),
        LLMConfig("W4A4 + KV nvfp4", w4a4, kv_cache=KVCacheKind.NVFP4),
    ]
    if smoke:
        keep = ("W4A16 RTN", "W4A4 RTN, dynamic", "KV nvfp4", "KV fp8")
        return [c for c in full if c.label in keep]
    return full


def more_configurations() -> list[LLMConfig]:
    """The recipes ``docs/llm.md`` measured beside the table that the default study leaves out
    for its time (AWQ alone builds for minutes) or because they lose (online rotations make
    NVFP4 W4A4 worse; 4over6 weights change nothing), and llama.cpp's CPU arithmetic
    (``W4A8 Q8_0, llama.cpp CPU``: ggml's own NVFP4 quantizer, activations quantized to Q8_0,
    the NVFP4 × Q8_0 dot bit for bit, ``execution/ggml_cpu.py``; K a multiple of 64): run when
    named (``nvfp4lab study --configs NAME``, or ``all`` for these and :func:`configurations`
    together)."""
    w4a4 = Backend.EMULATION
    return [
        LLMConfig("W4A4 GPTQ", w4a4, QuantMethod.GPTQ, w4a4=W4A4Options()),
        LLMConfig("W4A4 GPTQ + SmoothQuant 0.5", w4a4, QuantMethod.GPTQ,
                  w4a4=W4A4Options(smooth_alpha=0.5)),
        LLMConfig("W4A4 RTN + SmoothQuant 0.5, calibrated", w4a4, input_scales=CALIBRATED,
                  w4a4=W4A4Options(smooth_alpha=0.5)),
        LLMConfig("W4A4 RTN + AWQ", w4a4, w4a4=W4A4Options(awq=True)),
        LLMConfig("W4A4 RTN + rotation 16", w4a4, w4a4=W4A4Options(rotation=16)),
        LLMConfig("W4A4 RTN + rotation 64", w4a4, w4a4=W4A4Options(rotation=64)),
        LLMConfig("W4A4 RTN + rotation full", w4a4, w4a4=W4A4Options(rotation="full")),
        LLMConfig("W4A4 RTN + 4over6 weights", w4a4,
                  w4a4=W4A4Options(weight_scales=ScaleSelection.FOUR_OVER_SIX)),
        LLMConfig("W4A8 Q8_0, llama.cpp CPU", Backend.Q8_0, convention=OrderName.LLAMA_CPP),
        LLMConfig("KV nvfp4 + Q/K rotation 32", None, kv_cache=KVCacheKind.NVFP4,
                  kv_rotation=32),
        LLMConfig("KV nvfp4 + Q/K rotation 64", None, kv_cache=KVCacheKind.NVFP4,
                  kv_rotation=64),
    ]


def build(reference: nn.Module, config: LLMConfig,
          calibration_batches: Sequence[Any] = (), *,
          shared: dict[str, Any] | None = None) -> tuple[nn.Module, float]:
    """A quantized copy of ``reference`` for ``config`` and the seconds it took (GPTQ and the
    input-scale calibration included). ``calibration_batches``: model inputs from the calibration
    text (``corpus.calibration_batches``), used by GPTQ and by calibrated input scales.
    ``shared``: a dict kept across the builds of one reference and calibration text
    (:func:`config_results` passes one): calibrated K / V scales are then computed once for
    every configuration that uses them (the rule, amax / 448, is the same for every cache kind;
    the same values as each build's own calibration), each such build counting their seconds;
    so are SmoothQuant's / AWQ's statistics of the float model (``smooth_statistics``, run on
    the decoder without its output head), for every configuration that smooths.
    A ``weight_format`` configuration sets its KV cache (if any) by ``quantize_model`` with
    ``backend=None`` and then fake-quantizes the weights (:func:`_fake_quantize_weights`)."""
    if config.needs_calibration and not calibration_batches:
        raise ValueError(f"configuration {config.label!r} needs calibration_batches "
                         "(corpus.calibration_batches(tokenizer))")
    kv, kv_seconds = config.kv_options, 0.0
    if (shared is not None and config.kv_scales == CALIBRATED and config.kv_cache is not None
            and config.kv_rotation is None):  # with a rotation, quantize_model says why not
        if "kv_scales" not in shared:
            begin = time.perf_counter()
            scales = calibrate_kv_scales(_trunk(reference, nn.Module), calibration_batches,
                                         config.kv_cache)
            shared["kv_scales"] = (scales, time.perf_counter() - begin)
        scales, kv_seconds = shared["kv_scales"]
        kv = KVCacheOptions(config.kv_cache, scales=scales)
    extra: dict[str, Any] = {} if config.w4a4 is None else {"w4a4": config.w4a4}
    smooth_seconds = 0.0
    if shared is not None and config.w4a4 is not None and config.w4a4.smooths:
        key = _smooth_key(config.w4a4)
        if key not in shared:
            begin = time.perf_counter()
            statistics = smooth_statistics(reference, calibration_batches,
                                           tokens=config.w4a4.awq_tokens, rows=config.w4a4.awq,
                                           run=_trunk(reference, nn.Module))
            shared[key] = (statistics, time.perf_counter() - begin)
        extra["smooth_statistics"], smooth_seconds = shared[key]
        if kv_seconds and shared.get(_ONE_PASS):  # the K / V scales came from that same pass
            smooth_seconds = 0.0
    kv_data = isinstance(kv, KVCacheOptions) and kv.calibrated  # calibrated in quantize_model
    start = time.perf_counter()
    model = copy.deepcopy(reference)
    gptq = config.method == QuantMethod.GPTQ
    data = gptq or (config.w4a4 is not None and config.w4a4.needs_calibration) or kv_data
    if config.backend is None or config.weight_format is not None:
        if kv is not None:
            quantize_model(model, backend=None, kv_cache=kv,
                           calibration=list(calibration_batches) if kv_data else None)
        if config.weight_format is not None:
            _fake_quantize_weights(model, config.weight_format)
    else:
        quantize_model(model, backend=config.backend, method=config.quant_method,
                       calibration=list(calibration_batches) if data else None,
                       kv_cache=kv, convention=config.convention, **extra)
    if config.backend == Backend.EMULATION and config.input_scales == CALIBRATED:
        trunk = _trunk(model, NVFP4Linear)
        with torch.no_grad(), calibration(model):
            for batch in calibration_batches:
                run_batch(trunk, batch)
    return model, time.perf_counter() - start + kv_seconds + smooth_seconds


def _fake_quantize_weights(model: nn.Module, name: str) -> None:
    """Replace, in place, the weight of every Linear ``quantize_model`` would quantize
    (``execution.mixed.quantizable_linears``: exactly nn.Linear, K a multiple of 16, not
    ``lm_head``) by ``number_formats.get(name).fake_quantize`` of it (RTN, in the weight's dtype;
    a K not a multiple of the format's block gets a short last block, ``pad=True``, as
    compressed-tensors' ``ceil(K / group)`` groups do). Biases and activations stay float."""
    fmt = number_formats.get(name)
    options = {"pad": True} if "pad" in fmt.options else {}
    with torch.no_grad():
        for linear in quantizable_linears(model).values():
            linear.weight.copy_(fmt.fake_quantize(linear.weight.detach(), **options))


def _trunk(model: nn.Module, kind: type[nn.Module]) -> nn.Module:
    """What a calibration pass needs to run: the decoder without the output head (a
    transformers CausalLM's ``get_decoder()``; the head's ``[tokens, vocabulary]`` product
    observes nothing) when every module of ``kind`` other than the head lies in it (``kind``
    nn.Module: the attention modules are there by construction), else ``model``."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if not isinstance(decoder, nn.Module) or decoder is model:
        return model
    inside = {id(m) for m in decoder.modules()}
    if kind is not nn.Module and any(isinstance(m, kind) and id(m) not in inside
                                     for m in model.modules()):
        return model
    return decoder


@dataclass(frozen=True)
class ConfigResult:
    """One configuration scored on a reference run (:func:`config_result`): ``config``, its
    ``fidelity`` (:class:`~nvfp4lab.studies.llm.TokenFidelity`, per-token values kept for
    :func:`~nvfp4lab.studies.llm.paired_difference`), ``build_seconds`` (GPTQ and calibration
    included) and ``peak_rss_mb``: the process's peak resident memory while building and scoring
    it, in MiB (the reference model and run included; None when not measured)."""

    config: LLMConfig
    fidelity: TokenFidelity
    build_seconds: float
    peak_rss_mb: float | None = None

    @property
    def label(self) -> str:
        return self.config.label

    def row(self) -> dict[str, Any]:
        """The table row of :func:`config_row`: settings, ``build_seconds``, ``peak_rss_mb``
        when measured, then :meth:`TokenFidelity.row`."""
        config = self.config
        memory = {} if self.peak_rss_mb is None else {"peak_rss_mb": self.peak_rss_mb}
        return {"label": config.label, "weights": config.weights,
                "activations": config.activations, "kv_cache": config.kv_cache or "float",
                "method": config.method_label if config.backend is not None else "-",
                "build_seconds": self.build_seconds, **memory, **self.fidelity.row()}


def config_result(reference: nn.Module, run: ReferenceRun, config: LLMConfig,
                  calibration_batches: Sequence[Any] = (), *,
                  shared: dict[str, Any] | None = None) -> ConfigResult:
    """Build ``config`` from ``reference`` (:func:`build`, ``shared`` passed on) and score it on
    ``run`` (the reference's pass over the evaluation text) with
    :func:`~nvfp4lab.studies.llm.token_fidelity`, measuring the build's seconds and the peak
    resident memory of both steps. The model is freed after use."""
    with _PeakRSS() as peak:
        model, seconds = build(reference, config, calibration_batches, shared=shared)
        with torch.no_grad():
            fidelity = token_fidelity(run, model, progress=False)
        del model
    return ConfigResult(config, fidelity, seconds, peak.mb)


def config_results(reference: nn.Module, run: ReferenceRun, configs: Sequence[LLMConfig],
                   calibration_batches: Sequence[Any] = (), *, progress: bool = True
                   ) -> list[ConfigResult]:
    """:func:`config_result` of every configuration, in order, with a progress bar over the
    configurations unless ``progress`` is False; calibrated K / V scales computed once for all
    (:func:`build`'s ``shared``)."""
    bar = tqdm_class()(configs, desc="configurations", unit="config", disable=not progress)
    shared = shared_calibration(reference, configs, calibration_batches)
    return [config_result(reference, run, config, calibration_batches, shared=shared)
            for config in bar]


def shared_calibration(reference: nn.Module, configs: Sequence[LLMConfig],
                       calibration_batches: Sequence[Any]) -> dict[str, Any]:
    """:func:`build`'s ``shared`` dict for ``configs``: when some calibrate K / V scales and
    some smooth, both read the float model on the same batches, so one pass (on its decoder)
    records both (``calibrate_kv_scales(..., alongside=observing_statistics(...))``), its seconds
    counted by each of those builds; else empty (each is computed when first needed)."""
    kv = next((c.kv_cache for c in configs
               if c.kv_scales == CALIBRATED and c.kv_cache is not None), None)
    smooth = next((c.w4a4 for c in configs if c.w4a4 is not None and c.w4a4.smooths), None)
    if kv is None or smooth is None or not calibration_batches:
        return {}
    trunk = _trunk(reference, nn.Module)
    begin = time.perf_counter()
    observer = observing_statistics(reference, calibration_batches, tokens=smooth.awq_tokens,
                                    rows=smooth.awq)
    scales = calibrate_kv_scales(trunk, calibration_batches, kv, alongside=observer)
    statistics = observer.statistics
    seconds = time.perf_counter() - begin
    return {"kv_scales": (scales, seconds), _smooth_key(smooth): (statistics, seconds),
            _ONE_PASS: True}


#: ``shared`` key: the K / V scales and the smoothing statistics come from one pass.
_ONE_PASS = "one_pass"


def _smooth_key(options: W4A4Options) -> str:
    """The ``shared`` key of the smoothing statistics ``options`` read (AWQ's rows or none)."""
    return f"smooth_statistics:{options.awq_tokens if options.awq else 0}"


def config_row(reference: nn.Module, run: ReferenceRun, config: LLMConfig,
               calibration_batches: Sequence[Any] = ()) -> dict[str, Any]:
    """One configuration's row, :meth:`ConfigResult.row` of :func:`config_result`: its
    settings, the seconds to build it, its peak memory, and
    :meth:`~nvfp4lab.studies.llm.TokenFidelity.row` on ``run``: perplexity and its ratio to the
    reference's, mean and p99 KL divergence (nats per token), top-1 agreement, with 95 %
    intervals. The model is freed after use."""
    return config_result(reference, run, config, calibration_batches).row()


def scored_row(model: nn.Module, seconds: float, run: ReferenceRun,
               config: LLMConfig) -> dict[str, Any]:
    """:func:`config_row` of an already built ``model`` (``build``'s pair) of ``config``
    (no memory measured)."""
    with torch.no_grad():
        fidelity = token_fidelity(run, model, progress=False)
    return ConfigResult(config, fidelity, seconds).row()


def config_rows(reference: nn.Module, run: ReferenceRun, configs: Sequence[LLMConfig],
                calibration_batches: Sequence[Any] = (), *, progress: bool = True
                ) -> list[dict[str, Any]]:
    """:func:`config_row` of every configuration, in order, with a progress bar."""
    return [result.row() for result in config_results(reference, run, configs,
                                                      calibration_batches, progress=progress)]


def interval_unit(unit: str, row: dict[str, Any], stem: str, digits: int = 4) -> str:
    """``unit`` with the row's 95 % interval of ``stem`` (``{stem}_lo`` / ``{stem}_hi``) and its
    window count, e.g. ``nats/token (95 % interval 0.1001 to 0.1150, 8 windows)``."""
    lo, hi = row.get(f"{stem}_lo"), row.get(f"{stem}_hi")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{unit} (no interval)"
    windows = row.get("windows")
    over = f", {windows} windows" if windows is not None else ""
    return f"{unit} (95 % interval {lo:.{digits}f} to {hi:.{digits}f}{over})"


#: The configurations whose mean KLD is a headline, in order.
HEADLINE_LABELS = ("W4A16 RTN", "W4A16 GPTQ", "W4A16 MR-GPTQ", "W4A4 RTN, dynamic", "KV nvfp4",
                   "KV nvfp4_4over6", "KV fp8", "W4A4 + KV nvfp4")


def headline_numbers(rows: Sequence[dict[str, Any]],
                     results: Sequence[ConfigResult] = ()) -> list[dict[str, Any]]:
    """The notebook's headlines: mean KLD of W4A16 RTN, GPTQ, MR-GPTQ, W4A4 and the KV caches,
    each with its 95 % interval and window count in the unit; GPTQ's and MR-GPTQ's cut of RTN's
    mean KLD (%), with the paired KLD difference and its 95 % interval in the unit when
    ``results`` (the rows' :class:`ConfigResult`, scored on one run) are given; every one
    measured against the Q4_1-dequantized reference."""
    out = []
    for label in HEADLINE_LABELS:
        row = _row(rows, label)
        if row is not None:
            out.append({"name": f"SmolLM2 {label}: mean KLD vs Q4_1-dequantized reference",
                        "value": round(row["kld_mean"], 4),
                        "unit": interval_unit("nats/token", row, "kld")})
    rtn = _row(rows, "W4A16 RTN")
    for label, name in (("W4A16 GPTQ", "GPTQ"), ("W4A16 MR-GPTQ", "MR-GPTQ")):
        other = _row(rows, label)
        if rtn is not None and other is not None and rtn["kld_mean"] > 0:
            out.append({"name": f"SmolLM2 W4A16: {name}'s cut of RTN's mean KLD",
                        "value": round(100.0 * (1.0 - other["kld_mean"] / rtn["kld_mean"]), 1),
                        "unit": _paired_unit(results, label, "W4A16 RTN")})
    return out


def _paired_unit(results: Sequence[ConfigResult], label: str, baseline: str) -> str:
    """``%`` with ``label``'s KLD minus ``baseline``'s, paired token by token, and its 95 %
    interval over the windows (:func:`~nvfp4lab.studies.llm_statistics.paired_difference`);
    ``% (point estimate)`` without both results."""
    from nvfp4lab.studies.llm_statistics import paired_difference

    by_label = {r.config.label: r for r in results}
    if label not in by_label or baseline not in by_label:
        return "% (point estimate)"
    d = paired_difference(by_label[label].fidelity, by_label[baseline].fidelity, "kld")
    lo, hi = d.ci95
    return (f"% (paired KLD difference {d.difference:.4f} nats/token, 95 % interval {lo:.4f} "
            f"to {hi:.4f}, {d.windows} windows)")


def plot_configs(rows: Sequence[dict[str, Any]], *, title: str | None = None) -> Any:
    """Mean KL divergence per configuration with its 95 % interval (log scale), top-1
    agreement written at each bar's end. ``title``: the figure's (default: SmolLM2's)."""
    fig, ax = new_figure(
        title or "SmolLM2-135M: next-token KL divergence per configuration (lower is better)",
        "mean KL(reference ‖ quantized), nats per token (log scale; bars: 95 % interval)",
        "configuration", figsize=(9.0, 0.4 * len(rows) + 1.6), xscale="log")
    means = [max(r["kld_mean"], 1e-9) for r in rows]
    lo = [m - max(r["kld_lo"], 1e-9) for m, r in zip(means, rows, strict=True)]
    hi = [max(r["kld_hi"], 1e-9) - m for m, r in zip(means, rows, strict=True)]
    colours = ["C2" if r["weights"] == "float" else
               ("C3" if r["activations"] != "float" else "C0") for r in rows]
    ax.barh(range(len(rows)), means, xerr=[lo, hi], color=colours, capsize=3)
    for i, r in enumerate(rows):
        ax.text(means[i] + hi[i], i, f"  top-1 {r['top1_agreement']:.3f}", va="center",
                fontsize=7)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    if all(math.isfinite(m) for m in means):
        ax.set_xlim(min(means) / 3, max(m + h for m, h in zip(means, hi, strict=True)) * 4)
    return fig


def config_text(row: dict[str, Any]) -> str:
    """One line for one :func:`config_rows` row, 95 % intervals in brackets."""
    def interval(stem: str, digits: int) -> str:
        lo, hi = row.get(f"{stem}_lo"), row.get(f"{stem}_hi")
        return "" if lo is None or hi is None else f" [{lo:.{digits}f}, {hi:.{digits}f}]"

    return (f"{row['label']} (weights {row['weights']}, activations {row['activations']}, KV "
            f"cache {row['kv_cache']}): mean KLD {row['kld_mean']:.4f} nats/token"
            f"{interval('kld', 4)}, p99 {row['kld_p99']:.3f} | perplexity "
            f"{row['perplexity']:.3f} = {row['perplexity_ratio']:.3f}"
            f"{interval('perplexity_ratio', 3)} x the reference's | top-1 agreement "
            f"{row['top1_agreement']:.3f}{interval('top1', 3)} | {row['tokens']} tokens in "
            f"{row.get('windows', '?')} windows")


def llm_explorer(
    reference: nn.Module,
    ids: torch.Tensor,
    run: ReferenceRun,
    configs: Sequence[LLMConfig],
    calibration_batches: Sequence[Any] = (),
    *,
    linear: Sequence[dict[str, Any]] = (),
    kv: Sequence[dict[str, Any]] = (),
    rows: Sequence[dict[str, Any]] = (),
) -> Any:
    """Pick a decoder layer and a configuration (notebook 07): the layer's Linear errors and
    outlier channels, its K and V NMSE and attention effect per KV head and cache kind, and the
    configuration's next-token fidelity on ``run``; each output titled with what it shows.

    Needs only the notebook's setup cell: ``linear`` / ``kv`` (:func:`llm_layers.linear_rows` /
    :func:`llm_layers.kv_rows` over ``ids``) and ``rows`` (:func:`config_rows`) are used when
    given, else computed on first use and kept (the layer rows in one forward pass each; a
    configuration in 10-60 s: its build, GPTQ included, and its pass over ``run``)."""
    import ipywidgets as widgets
    import pandas as pd

    from nvfp4lab.studies import llm_layers
    from nvfp4lab.studies.explorer import explorer, table_output, text_output

    if not configs:
        raise ValueError("llm_explorer needs at least one configuration")
    layers = int(reference.config.num_hidden_layers)
    cache: dict[str, list[dict[str, Any]]] = {"linear": list(linear), "kv": list(kv)}
    by_label = {r["label"]: r for r in rows}
    by_config = {c.label: c for c in configs}
    layer = widgets.Dropdown(options=list(range(layers)), description="decoder layer")
    config = widgets.Dropdown(options=list(by_config), description="configuration")

    def layer_rows(which: str) -> list[dict[str, Any]]:
        if not cache[which]:
            rows_of = llm_layers.linear_rows if which == "linear" else llm_layers.kv_rows
            cache[which] = rows_of(reference, ids)
        return cache[which]

    def row_of(label: str) -> dict[str, Any]:
        if label not in by_label:
            by_label[label] = config_row(reference, run, by_config[label], calibration_batches)
        return by_label[label]

    def render() -> tuple[dict[str, Any], ...]:
        prefix = f"{layer.value}."
        mine = [r for r in layer_rows("linear") if r["short"].startswith(prefix)]
        lin = pd.DataFrame(mine).set_index("short")[
            ["weight_nmse", "activation_nmse", "activation_crest", "top_channel",
             "channel_ratio"]]
        kv_mine = pd.DataFrame([r for r in layer_rows("kv") if r["layer"] == layer.value])
        kv_table = kv_mine.pivot_table(index="kv_head", columns="kind",
                                       values=["k_nmse", "v_nmse", "score_kl"])
        n = layer.value
        return (table_output(lin, "{:.3g}", f"Decoder layer {n}: NVFP4 error of each Linear "
                             "(weights RTN, inputs dynamic) and its loudest input channel"),
                table_output(kv_table, "{:.3g}", f"Decoder layer {n}: K and V NMSE and the "
                             "attention KL per KV head, per cache kind"),
                text_output(config_text(row_of(config.value)),
                            f"Configuration {config.value}: next-token fidelity"))

    return explorer(widgets, [layer, config], render)
