"""Which Linears can take which format: per-layer sensitivity of a causal LM, measured.

**Direct sensitivity** (:func:`sensitivity`): for every quantizable Linear
(:func:`~nvfp4lab.execution.mixed.quantizable_linears`) and each format, the mean KL divergence
of the final next-token distribution (nats per token, with its 95 % interval over windows) with
that layer ALONE in the format and every other layer float, against one reference run
(:func:`~nvfp4lab.studies.llm.reference_run`, made once and reused for every pass). ``bf16`` is
the reference itself: 0, not run.

**Only the blocks from the layer's on.** A layer in decoder block ``i`` cannot change what blocks
``0 … i-1`` compute, so each pass runs only blocks ``i …`` and the model's tail (final norm,
head): the outputs of every block on every batch of the run are captured once from the float
model (one pass; their memory is ``blocks x tokens x hidden`` floats, 141 MB for SmolLM2 at
2,048 tokens), and during a pass blocks ``0 … i-1`` return their captured output instead of
computing. The model itself still runs (embeddings, masks, position embeddings, its own tail),
so the logits are those of the whole model with the layer swapped, bit for bit
(tests/studies/test_llm_sensitivity.py checks it). A captured tensor changed in place by a
later block is refused (its version counter is checked after every pass).

**A cheap proxy** beside it: the layer's output error on the calibration inputs,
``tr(ΔW H ΔWᵀ) / 2`` with ``ΔW = Ŵ - W`` and ``H = (2/n) Σ x xᵀ`` its GPTQ Hessian (the mean
squared output error per token; weights only, so FP8's activation rounding is not in it);
:meth:`SensitivityTable.rank_correlation` gives its Spearman rank correlation with the direct
measure, per format.

``nvfp4-gptq`` is GPTQ of the layer alone, on the Hessian of its inputs in the float model (the
calibration inputs), with the global scale its fused unit shares
(:func:`~nvfp4lab.execution.mixed.shared_global_scale`), as RTN.

**Dask** (``client=``: a ``distributed.Client`` or a scheduler address): the per-layer passes run
on the cluster's workers, the float model, the run and the captured outputs sent once to each
(``scatter(broadcast=True)``), each task one layer in one format (its quantized module built
here, GPTQ included, and sent with the task); the numbers are the in-process ones. One line per
layer and format on stderr either way.
"""

from __future__ import annotations

import copy
import csv
import io
import math
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab import settings
from nvfp4lab.execution.gptq import GPTQOptions
from nvfp4lab.execution.gptq_model import collect_hessians
from nvfp4lab.execution.mixed import (
    NVFP4_FORMATS,
    layer_bits,
    quantizable_linears,
    quantize_layer,
    set_layer,
    shared_global_scale,
)
from nvfp4lab.execution.sequential import find_blocks
from nvfp4lab.studies import llm
from nvfp4lab.vocab import LayerFormat, check_choice

__all__ = [
    "DEFAULT_FORMATS",
    "LayerSensitivity",
    "SensitivityTable",
    "TailRunner",
    "plot_sensitivity",
    "proxy_score",
    "sensitivity",
    "spearman",
]

#: The formats :func:`sensitivity` measures unless told.
DEFAULT_FORMATS: tuple[LayerFormat, ...] = (
    LayerFormat.NVFP4_RTN, LayerFormat.NVFP4_GPTQ, LayerFormat.NVFP4_MR_GPTQ, LayerFormat.FP8,
    LayerFormat.FP8_W8A16, LayerFormat.MXFP4)


@dataclass(frozen=True)
class LayerSensitivity:
    """One layer in one format: ``kld`` (mean KL divergence, nats per token) with its 95 %
    interval ``kld_lo`` / ``kld_hi``, ``proxy`` (:func:`proxy_score`), ``weights`` (N·K),
    ``bits`` (:func:`~nvfp4lab.execution.mixed.layer_bits`), ``seconds`` (the pass)."""

    layer: str
    format: str
    kld: float
    kld_lo: float
    kld_hi: float
    proxy: float
    weights: int
    bits: float
    seconds: float = 0.0


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (ties get their mean rank);
    NaN for fewer than two values or a constant sequence."""
    if len(a) != len(b):
        raise ValueError(f"spearman needs sequences of one length, got {len(a)} and {len(b)}")

    def ranks(values: Sequence[float]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float64)
        order = torch.argsort(t, stable=True)
        out = torch.empty_like(t)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and t[order[j + 1]] == t[order[i]]:
                j += 1
            out[order[i : j + 1]] = (i + j) / 2.0
            i = j + 1
        return out

    if len(a) < 2:
        return math.nan
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / denominator if denominator > 0 else math.nan


@dataclass(frozen=True)
class SensitivityTable:
    """:func:`sensitivity`'s result: one :class:`LayerSensitivity` per layer and format, in
    module order; ``tokens``: predicted tokens per pass; ``seconds``: the whole measurement."""

    rows: tuple[LayerSensitivity, ...]
    tokens: int = 0
    seconds: float = 0.0
    _index: dict[tuple[str, str], LayerSensitivity] = field(
        default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index.update({(r.layer, str(r.format)): r for r in self.rows})

    @property
    def layers(self) -> list[str]:
        return list(dict.fromkeys(r.layer for r in self.rows))

    @property
    def formats(self) -> list[str]:
        return list(dict.fromkeys(str(r.format) for r in self.rows))

    def row(self, layer: str, fmt: str) -> LayerSensitivity:
        """The row of ``layer`` in ``fmt`` (KeyError naming both when it was not measured)."""
        try:
            return self._index[(layer, str(fmt))]
        except KeyError:
            raise KeyError(f"{layer!r} in {str(fmt)!r} was not measured") from None

    def kld(self, layer: str, fmt: str) -> float:
        """Mean KLD of ``layer`` alone in ``fmt`` (``bf16``: 0, the reference)."""
        if str(fmt) == LayerFormat.BF16:
            return 0.0
        return self.row(layer, fmt).kld

    def rank_correlation(self, fmt: str | None = None) -> float:
        """Spearman's rank correlation of the proxy with the direct KLD over the layers measured
        in ``fmt`` (None: every row pooled)."""
        rows = [r for r in self.rows if fmt is None or str(r.format) == str(fmt)]
        return spearman([r.proxy for r in rows], [r.kld for r in rows])

    def records(self) -> list[dict[str, Any]]:
        """The rows as plain dicts (the CSV's columns)."""
        return [{**asdict(r), "format": str(r.format)} for r in self.rows]

    def save_csv(self, path: str | Path) -> Path:
        """Write :meth:`records` to ``path`` (CSV, replaced)."""
        path = Path(path)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(LayerSensitivity.__dataclass_fields__))
            writer.writeheader()
            writer.writerows(self.records())
        return path

    @classmethod
    def read_csv(cls, path: str | Path) -> SensitivityTable:
        """A table written by :meth:`save_csv`."""
        with open(path, newline="") as f:
            rows = [LayerSensitivity(
                r["layer"], r["format"], float(r["kld"]), float(r["kld_lo"]),
                float(r["kld_hi"]), float(r["proxy"]), int(r["weights"]), float(r["bits"]),
                float(r["seconds"])) for r in csv.DictReader(f)]
        return cls(tuple(rows))


# ---------------------------------------------------------------------------------------------
# The model from one block on
# ---------------------------------------------------------------------------------------------


class TailRunner:
    """``model`` run over ``run``'s batches from one decoder block on (module docstring): the
    outputs of every block captured once (float model, ``run``'s batches), then
    :meth:`fidelity` scores the model as it is now with blocks ``0 … start-1`` answering from
    the capture. ``model`` must be the model ``run`` was made from (checked: the captured pass
    gives the run's logits bit for bit); where the run keeps that model to run it again (a head
    whose output is not the logits, e.g. Gemma 2's soft cap), ``self.model`` is a copy of it,
    the one to change."""

    def __init__(self, model: nn.Module, run: llm.ReferenceRun) -> None:
        names = list(quantizable_linears(model))
        blocks = find_blocks(model, names)
        if blocks is None:
            raise ValueError(f"{type(model).__name__} has no repeated blocks holding its Linears "
                             "(an nn.ModuleList of decoder layers)")
        if run.model is not None:  # the run answers by running the model: work on a copy
            model = copy.deepcopy(model)
            blocks = find_blocks(model, names)
            assert blocks is not None
        self.model, self.run, self.blocks = model, run, blocks
        self.outputs: list[list[Any]] = [[] for _ in blocks.modules]
        self._current = -1
        handles = [block.register_forward_hook(self._keep(i))
                   for i, block in enumerate(blocks.modules)]
        try:
            for b in range(len(run.batches)):
                logits = llm._forward(model, run.input_ids(b))
                if not torch.equal(logits, run.logits(b)):
                    raise ValueError("the model does not give the reference run's logits: pass "
                                     "the model the run was made from, unquantized")
        finally:
            for handle in handles:
                handle.remove()

    def _keep(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self.outputs[index].append(_detached(output))

        return hook

    def _versions(self) -> list[int]:
        return [t._version for outs in self.outputs for out in outs for t in _tensors(out)]

    def block_of(self, layer: str) -> int:
        """The block holding ``layer`` (ValueError when it is outside the blocks)."""
        index = self.blocks.index(layer)
        if index is None:
            raise ValueError(f"{layer!r} is not inside the decoder blocks "
                             f"({self.blocks.name}.N)")
        return index

    @contextmanager
    def starting_at(self, start: int) -> Iterator[None]:
        """Blocks ``0 … start-1`` answer with their captured outputs (the batch found from the
        model's ``input_ids``, in the run's order) while inside."""
        skipped = list(self.blocks.modules)[:start]

        def answer(index: int) -> Any:
            def forward(*args: Any, **kwargs: Any) -> Any:
                return self.outputs[index][self._current]

            return forward

        def batch(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._current += 1
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not isinstance(ids, torch.Tensor) or not torch.equal(
                    ids.cpu(), self.run.input_ids(self._current)):
                raise ValueError("the tail runner saw a batch that is not the run's next one")

        for i, block in enumerate(skipped):
            if "forward" in vars(block):
                raise ValueError(f"block {i} has its own forward already: cannot skip it")
            block.forward = answer(i)  # type: ignore[method-assign]
        handle = self.model.register_forward_pre_hook(batch, with_kwargs=True)
        self._current = -1
        before = self._versions()
        try:
            yield
        finally:
            handle.remove()
            for block in skipped:
                vars(block).pop("forward", None)
            if self._versions() != before:
                raise RuntimeError("a block changed a captured output in place: the tail runner "
                                   "cannot reuse it")

    def logits(self, start: int, batch: int) -> torch.Tensor:
        """The model's logits for the run's batch ``batch`` with blocks before ``start`` skipped
        (for checks; :meth:`fidelity` runs every batch)."""
        with self.starting_at(start):
            self._current = batch - 1
            return llm._forward(self.model, self.run.input_ids(batch))

    def fidelity(self, start: int) -> llm.TokenFidelity:
        """:func:`~nvfp4lab.studies.llm.token_fidelity` of the model as it is now, blocks before
        ``start`` skipped."""
        with self.starting_at(start):
            return llm.token_fidelity(self.run, self.model, progress=False)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple | list):
        return type(value)(_detached(v) for v in value)
    return value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _tensors(item)


# ---------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------


def proxy_score(linear: nn.Linear, quantized: nn.Module, hessian: torch.Tensor) -> float:
    """``tr(ΔW H ΔWᵀ) / 2``: the mean squared output error per calibration token of ``quantized``
    against ``linear`` from the weights alone (``hessian``: ``(2/n) Σ x xᵀ``, float64)."""
    w = linear.weight.detach().to(torch.float64)
    if hasattr(quantized, "dequantized_weight"):
        q = quantized.dequantized_weight()
    elif hasattr(quantized, "weight_nvfp4"):
        q = quantized.weight_nvfp4().dequantize(torch.float32)
    else:
        q = quantized.weight.detach()
    delta = q.to(torch.float64) - w
    return float(((delta @ hessian.to(torch.float64)) * delta).sum() / 2.0)


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


_LOCK = threading.Lock()


def _measure(tail: TailRunner, name: str, module: nn.Module) -> tuple[float, float, float]:
    """Mean KLD and its interval with ``module`` in place of ``name`` (put back after)."""
    with _LOCK:  # one pass at a time on this copy of the model
        original = set_layer(tail.model, name, module)
        try:
            fidelity = tail.fidelity(tail.block_of(name))
        finally:
            set_layer(tail.model, name, original)
    return fidelity.kld_mean, *fidelity.kld_ci95


def _remote_measure(tail: TailRunner, name: str, saved: bytes) -> tuple[float, float, float]:
    """:func:`_measure` on a Dask worker; the module comes as ``torch.save`` bytes (plain pickle
    cannot rebuild float8 tensors: torch 2's ``UntypedStorage`` has no dtype)."""
    settings.use_torch_threads()
    module = torch.load(io.BytesIO(saved), weights_only=False)
    return _measure(tail, name, module)


def _saved(module: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return buffer.getvalue()


def _jobs(model: nn.Module, layers: Sequence[str], formats: Sequence[LayerFormat],
          hessians: Mapping[str, Any], gptq: GPTQOptions | None, per_channel: bool
          ) -> Iterator[tuple[str, LayerFormat, nn.Module, float]]:
    """(layer, format, quantized module, proxy) in module order, built one at a time."""
    linears = quantizable_linears(model)
    for name in layers:
        linear = linears[name]
        h = hessians[name].matrix()
        for fmt in formats:
            scale = (shared_global_scale(linears, name, fmt) if fmt in NVFP4_FORMATS
                     else None)  # only NVFP4 layers have a tensor scale
            module = quantize_layer(linear, fmt, hessian=h, global_scale=scale, gptq=gptq,
                                    per_channel=per_channel)
            yield name, fmt, module, proxy_score(linear, module, h)


def sensitivity(
    model: nn.Module,
    run: llm.ReferenceRun,
    *,
    formats: Sequence[str] = DEFAULT_FORMATS,
    layers: Sequence[str] | None = None,
    calibration: Sequence[Any] | None = None,
    gptq: GPTQOptions | None = None,
    per_channel: bool = True,
    client: Any = None,
    progress: bool = True,
) -> SensitivityTable:
    """Direct sensitivity of ``model``'s Linears (module docstring): one row per layer and
    format, the layer alone in the format, scored on ``run`` (a reference run of ``model``).

    ``formats``: :class:`~nvfp4lab.vocab.LayerFormat` values (``bf16`` gives 0 rows, not run);
    ``layers``: names (default every quantizable Linear inside the blocks); ``calibration``:
    model inputs for the Hessians of GPTQ and of the proxy (default: the run's own windows);
    ``gptq``: :class:`GPTQOptions`; ``per_channel``: FP8 weight scales. ``client``: a
    ``distributed.Client`` or scheduler address to run the passes on (None: here). ``model`` is
    left as it was."""
    start = time.perf_counter()
    chosen = [LayerFormat(check_choice("layer format", f, LayerFormat)) for f in formats]
    if not chosen:
        raise ValueError("formats is empty: name at least one LayerFormat, e.g. 'nvfp4-rtn'")
    tail = TailRunner(model, run)
    linears = quantizable_linears(model)
    inside = [n for n in linears if tail.blocks.index(n) is not None]
    names = inside if layers is None else list(layers)
    for name in names:
        if name not in inside:
            raise ValueError(f"{name!r} is not a quantizable Linear inside the decoder blocks of "
                             f"{type(model).__name__} (e.g. {inside[0]!r})")
    batches = (list(calibration) if calibration is not None
               else [{"input_ids": run.input_ids(b)} for b in range(len(run.batches))])
    hessians = collect_hessians(model, names, batches)
    measured = [f for f in chosen if f != LayerFormat.BF16]
    jobs = _jobs(model, names, measured, hessians, gptq, per_channel)
    total = len(names) * len(measured)
    rows = _run_jobs(tail, jobs, total, client, progress)
    for name in names if LayerFormat.BF16 in chosen else ():
        n, k = linears[name].weight.shape
        rows.append(LayerSensitivity(name, LayerFormat.BF16, 0.0, 0.0, 0.0, 0.0, n * k,
                                     layer_bits(LayerFormat.BF16, n, k)))
    order = {(n, f): i for i, (n, f) in enumerate((n, f) for n in names for f in chosen)}
    rows.sort(key=lambda r: order[(r.layer, r.format)])
    return SensitivityTable(tuple(rows), run.tokens, time.perf_counter() - start)


def _row(name: str, fmt: LayerFormat, module: nn.Module, proxy: float,
         kld: tuple[float, float, float], seconds: float, per_channel: bool = True
         ) -> LayerSensitivity:
    n, k = int(module.out_features), int(module.in_features)
    return LayerSensitivity(name, fmt, kld[0], kld[1], kld[2], proxy, n * k,
                            layer_bits(fmt, n, k, per_channel=per_channel), seconds)


def _line(row: LayerSensitivity, done: int, total: int, where: str = "") -> str:
    interval = ("" if math.isnan(row.kld_lo) else  # one window: no interval
                f" (95 % {row.kld_lo:.4g} to {row.kld_hi:.4g})")
    return (f"[{done}/{total}] {row.layer} {row.format}: mean KLD {row.kld:.4g}{interval}, "
            f"proxy {row.proxy:.4g}, {row.seconds:.1f} s{where}")


def _run_jobs(tail: TailRunner, jobs: Iterator[tuple[str, LayerFormat, nn.Module, float]],
              total: int, client: Any, progress: bool) -> list[LayerSensitivity]:
    rows: list[LayerSensitivity] = []
    if client is None:
        for name, fmt, module, proxy in jobs:
            begin = time.perf_counter()
            kld = _measure(tail, name, module)
            rows.append(_row(name, fmt, module, proxy, kld, time.perf_counter() - begin))
            _say(progress, _line(rows[-1], len(rows), total))
        return rows
    from distributed import Client, as_completed

    own = isinstance(client, str)
    cluster = Client(client, timeout="30s") if own else client
    try:
        workers = max(1, len(cluster.scheduler_info().get("workers", {})))
        shared = cluster.scatter(tail, broadcast=True)
        pending = as_completed()
        info: dict[Any, tuple[str, LayerFormat, nn.Module, float, float]] = {}

        def submit() -> bool:
            job = next(jobs, None)
            if job is None:
                return False
            name, fmt, module, proxy = job
            future = cluster.submit(_remote_measure, shared, name, _saved(module), pure=False)
            info[future] = (name, fmt, module, proxy, time.perf_counter())
            pending.add(future)
            return True

        for _ in range(2 * workers):
            if not submit():
                break
        for future in pending:
            name, fmt, module, proxy, begin = info.pop(future)
            rows.append(_row(name, fmt, module, proxy, future.result(),
                             time.perf_counter() - begin))
            _say(progress, _line(rows[-1], len(rows), total, " (on the cluster)"))
            submit()
    finally:
        if own:
            cluster.close()
    return rows


# ---------------------------------------------------------------------------------------------
# The figure
# ---------------------------------------------------------------------------------------------


def plot_sensitivity(table: SensitivityTable, *, title: str | None = None) -> Any:
    """Layers x formats: the mean KLD of each layer alone in each format (log colour scale),
    layers in module order down, formats across."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    formats = [f for f in table.formats if f != LayerFormat.BF16]
    layers = table.layers
    values = torch.tensor([[max(table.kld(n, f), 1e-9) for f in formats] for n in layers])
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(formats), 1.2 + 0.12 * len(layers)),
                           layout="constrained")  # room for the colorbar, in any style
    image = ax.imshow(values.numpy(), aspect="auto", norm=LogNorm(), cmap="viridis")
    ax.set_xticks(range(len(formats)), formats, fontsize=8)
    step = max(1, len(layers) // 40)
    ax.set_yticks(range(0, len(layers), step),
                  [n.removeprefix("model.") for n in layers[::step]], fontsize=6)
    ax.set_title(title or f"Mean KLD with one layer alone quantized ({table.tokens} tokens)",
                 fontsize=9)
    ax.set_xlabel("format")
    ax.set_ylabel("layer (module order)")
    fig.colorbar(image, ax=ax, label="mean KL(reference ‖ layer quantized), nats/token")
    return fig
