"""The mixed-precision search: per-Linear formats that minimise KL divergence under an
effective-bits budget, each chosen mix built and measured.

**Units.** Engines load a fused group (q/k/v, gate/up) as one layer in one format, so the search
sets formats per unit (:func:`~nvfp4lab.execution.mixed.fused_units`); a unit's predicted KLD in
a format is the sum of its members' direct sensitivities (:mod:`nvfp4lab.studies.llm_sensitivity`:
each layer alone in the format), its cost the weight bits of its members
(:func:`~nvfp4lab.execution.mixed.layer_bits` x N·K).

**Search** (:func:`search_path`): the per-layer KLDs taken as additive predictions, a
multiple-choice knapsack solved greedily on each unit's lower convex hull of (bits, predicted
KLD): every unit starts at its cheapest format, and each step takes the hull segment that buys
the most predicted KLD per extra bit, anywhere in the model. The steps form a path from the
cheapest mix up (:func:`cheapest_meeting`: the first whose predicted KLD meets a KLD budget);
under an effective-bits budget (:func:`best_mix`) a step that does not fit is skipped and
cheaper ones elsewhere still taken. Mixes on the path are optimal on the convex hull of the
additive predictions; the predictions are not measurements.

**Measured** (:func:`measure_mix`, :func:`frontier`): each chosen mix is built from the float
model (:func:`~nvfp4lab.execution.mixed.apply_mix`: GPTQ calibrated with every other layer in
place) and scored on the reference run with its 95 % interval; :func:`plot_frontier` draws the
accuracy-bits frontier from these measured points. :func:`fewest_bits` walks the path from the
first mix predicted to meet a KLD budget until one is MEASURED to meet it.
"""

from __future__ import annotations

import copy
import heapq
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from nvfp4lab.execution.gptq import GPTQOptions
from nvfp4lab.execution.mixed import apply_mix, effective_bits, fused_units, layer_bits
from nvfp4lab.plots import new_figure
from nvfp4lab.studies import llm
from nvfp4lab.studies.llm_sensitivity import SensitivityTable
from nvfp4lab.studies.llm_statistics import TokenFidelity, fidelity_of
from nvfp4lab.vocab import LayerFormat, check_choice

__all__ = [
    "DEFAULT_FRONTIER",
    "SEARCH_FORMATS",
    "SENSITIVITY_TOKENS",
    "MeasuredMix",
    "Mix",
    "StudySearch",
    "best_mix",
    "build_mix",
    "cheapest_meeting",
    "check_search_formats",
    "fewest_bits",
    "frontier",
    "measure_mix",
    "plot_frontier",
    "search_path",
    "split_windows",
    "study_search",
    "within_budget",
]

#: The formats the search chooses among unless told: FP8 as the middle step, as ModelOpt's
#: AutoQuantize recommends, weight-only like the NVFP4 layers (measured on SmolLM2 at 5.0
#: bits: 0.0434 mean KLD with MR-GPTQ + FP8 W8A16, 0.0520 with GPTQ + FP8 W8A16, 0.0549 with
#: GPTQ + FP8 W8A8; docs/llm.md).
SEARCH_FORMATS: tuple[LayerFormat, ...] = (LayerFormat.NVFP4_MR_GPTQ, LayerFormat.FP8_W8A16,
                                           LayerFormat.BF16)
#: Effective-bits budgets of the measured frontier (the requested budget is added).
DEFAULT_FRONTIER: tuple[float, ...] = (4.75, 5.0, 5.5, 6.0)


@dataclass(frozen=True)
class Mix:
    """A mix: ``formats`` (layer name -> :class:`~nvfp4lab.vocab.LayerFormat`, every layer
    searched), its effective ``bits`` per weight and ``predicted`` KLD (the sum of the layers'
    sensitivities, nats per token)."""

    formats: Mapping[str, LayerFormat] = field(repr=False)
    bits: float
    predicted: float

    def counts(self) -> dict[str, int]:
        """Layers per format."""
        out: dict[str, int] = {}
        for fmt in self.formats.values():
            out[str(fmt)] = out.get(str(fmt), 0) + 1
        return out

    def describe(self) -> str:
        counts = ", ".join(f"{n} {f}" for f, n in sorted(self.counts().items()))
        return f"{self.bits:.3f} bits/weight, predicted KLD {self.predicted:.4g} ({counts})"


def _hull(options: list[tuple[float, float, LayerFormat]]) -> list[tuple[float, float,
                                                                          LayerFormat]]:
    """The lower-left convex hull of (cost, predicted, format) from the cheapest option (the
    lowest prediction among equally cheap ones): each later point costs more, predicts less,
    and the prediction falls less per bit than before."""
    options = sorted(options, key=lambda o: (o[0], o[1]))
    hull = [options[0]]
    for option in options[1:]:
        if option[1] >= hull[-1][1] or option[0] == hull[-1][0]:
            continue
        while len(hull) >= 2:
            (c0, p0, _), (c1, p1, _) = hull[-2], hull[-1]
            if (p1 - p0) * (option[0] - c0) >= (option[1] - p0) * (c1 - c0):
                hull.pop()  # hull[-1] lies on or above the chord: not on the hull
            else:
                break
        hull.append(option)
    return hull


def search_path(
    table: SensitivityTable, model: nn.Module, *, formats: Sequence[str] = SEARCH_FORMATS,
    fused: bool = True, per_channel: bool = True, budget: float | None = None,
) -> list[Mix]:
    """The greedy path of mixes (module docstring), cheapest first: every layer of ``table``
    in one of ``formats`` (each measured in ``table``, or ``bf16``), fused units kept in one
    format unless ``fused`` is False. Bits are :func:`~nvfp4lab.execution.mixed.effective_bits`
    of ``model`` (Linears outside ``table`` counted as float). ``budget``: effective bits per
    weight; a step that would exceed it is skipped (that unit stays where it is) and the path
    goes on with cheaper steps: its last mix is :func:`best_mix`."""
    chosen = [LayerFormat(check_choice("layer format", f, LayerFormat)) for f in formats]
    if not chosen:
        raise ValueError("formats is empty: name at least one LayerFormat")
    missing = [f for f in chosen if f != LayerFormat.BF16 and f not in table.formats]
    if missing:
        raise ValueError(f"the sensitivity table has no {', '.join(missing)} rows: measure them "
                         f"(sensitivity(..., formats=...)) or search over {table.formats}")
    layers = table.layers
    units = fused_units(layers) if fused else [(n,) for n in layers]
    hulls = []
    for unit in units:
        options = []
        for fmt in chosen:
            cost = 0.0
            for name in unit:
                n, k = _shape(model, name)
                cost += layer_bits(fmt, n, k, per_channel=per_channel) * n * k
            options.append((cost, sum(table.kld(n, fmt) for n in unit), fmt))
        hulls.append(_hull(options))
    state = {name: hull[0][2] for unit, hull in zip(units, hulls, strict=True) for name in unit}
    position = [0] * len(units)
    predicted = sum(hull[0][1] for hull in hulls)

    def mix() -> Mix:
        return Mix(dict(state), effective_bits(model, state, per_channel=per_channel), predicted)

    heap: list[tuple[float, int]] = []

    def push(u: int) -> None:
        i, hull = position[u], hulls[u]
        if i + 1 < len(hull):
            slope = (hull[i + 1][1] - hull[i][1]) / (hull[i + 1][0] - hull[i][0])
            heapq.heappush(heap, (slope, u))

    for u in range(len(units)):
        push(u)
    path = [mix()]
    if budget is not None and path[0].bits > budget + 1e-12:
        raise ValueError(f"no mix fits {budget:g} bits per weight: the cheapest takes "
                         f"{path[0].bits:.3f}; raise the budget")
    while heap:
        _, u = heapq.heappop(heap)
        i, hull = position[u], hulls[u]
        trial = {**state, **dict.fromkeys(units[u], hull[i + 1][2])}
        if budget is not None and effective_bits(model, trial, per_channel=per_channel) > (
                budget + 1e-12):
            continue  # this unit's next step does not fit; cheaper steps elsewhere may
        predicted += hull[i + 1][1] - hull[i][1]
        position[u] = i + 1
        state.update(trial)
        path.append(mix())
        push(u)
    return path


def best_mix(table: SensitivityTable, model: nn.Module, bits: float, *,
             formats: Sequence[str] = SEARCH_FORMATS, fused: bool = True) -> Mix:
    """The mix the greedy search chooses under ``bits`` effective bits per weight (the last
    mix of :func:`search_path` with that budget); ValueError when even the cheapest exceeds
    it."""
    if not math.isfinite(bits):
        raise ValueError(f"the bits budget must be a finite number, got {bits!r}")
    return search_path(table, model, formats=formats, fused=fused, budget=bits)[-1]


def _shape(model: nn.Module, name: str) -> tuple[int, int]:
    module = model.get_submodule(name)
    return int(module.out_features), int(module.in_features)


def within_budget(path: Sequence[Mix], bits: float) -> Mix:
    """The last mix of ``path`` with at most ``bits`` effective bits per weight (ValueError
    naming the cheapest mix's bits when even that one exceeds the budget)."""
    if not math.isfinite(bits):
        raise ValueError(f"the bits budget must be a finite number, got {bits!r}")
    fits = [m for m in path if m.bits <= bits + 1e-12]
    if not fits:
        raise ValueError(f"no mix fits {bits:g} bits per weight: the cheapest takes "
                         f"{path[0].bits:.3f}; raise the budget")
    return fits[-1]


def cheapest_meeting(path: Sequence[Mix], kld: float) -> Mix | None:
    """The first (fewest-bits) mix of ``path`` whose predicted KLD is at most ``kld``; None
    when no mix is predicted to meet it."""
    return next((m for m in path if m.predicted <= kld), None)


# ---------------------------------------------------------------------------------------------
# Built and measured
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredMix:
    """A mix built and scored: ``label``, the ``mix``, its ``fidelity`` on the run (a
    :class:`~nvfp4lab.studies.llm_statistics.TokenFidelity`, 95 % intervals), the seconds to
    build it (GPTQ included)."""

    label: str
    mix: Mix
    fidelity: TokenFidelity
    build_seconds: float

    def row(self) -> dict[str, Any]:
        return {"label": self.label, "bits": self.mix.bits, "predicted_kld": self.mix.predicted,
                **{f"layers_{f}": n for f, n in sorted(self.mix.counts().items())},
                "build_seconds": self.build_seconds, **self.fidelity.row()}


def build_mix(reference: nn.Module, mix: Mix | Mapping[str, str], calibration: Sequence[Any] = (),
              gptq: GPTQOptions | None = None) -> tuple[nn.Module, float]:
    """A copy of ``reference`` in ``mix`` (:func:`~nvfp4lab.execution.mixed.apply_mix`) and the
    seconds it took."""
    formats = mix.formats if isinstance(mix, Mix) else mix
    start = time.perf_counter()
    model = copy.deepcopy(reference)
    apply_mix(model, formats, calibration=list(calibration) or None, gptq=gptq)
    return model, time.perf_counter() - start


def measure_mix(reference: nn.Module, run: llm.ReferenceRun, mix: Mix,
                calibration: Sequence[Any] = (), *, label: str | None = None,
                gptq: GPTQOptions | None = None) -> MeasuredMix:
    """Build ``mix`` from ``reference`` and score it on ``run`` (the model freed after)."""
    model, seconds = build_mix(reference, mix, calibration, gptq)
    fidelity = llm.token_fidelity(run, model, progress=False)
    del model
    return MeasuredMix(label or f"mixed ({mix.bits:.2f} bits)", mix, fidelity, seconds)


def frontier(reference: nn.Module, run: llm.ReferenceRun, table: SensitivityTable,
             budgets: Sequence[float] = DEFAULT_FRONTIER, calibration: Sequence[Any] = (), *,
             formats: Sequence[str] = SEARCH_FORMATS,
             say: Callable[[str], None] | None = None) -> list[MeasuredMix]:
    """The accuracy-bits frontier from measured points: for each budget (ascending, those no
    mix fits left out) the mix :func:`best_mix` chooses, built and scored once (a mix two
    budgets share is measured once)."""
    out: list[MeasuredMix] = []
    cheapest = search_path(table, reference, formats=formats, budget=None)[0].bits
    for bits in sorted(set(budgets)):
        if bits < cheapest:
            continue
        mix = best_mix(table, reference, bits, formats=formats)
        if out and dict(out[-1].mix.formats) == dict(mix.formats):
            continue
        out.append(measure_mix(reference, run, mix, calibration,
                               label=f"mixed (search, {bits:g} bits)"))
        if say is not None:
            f = out[-1].fidelity
            say(f"frontier {bits:g} bits: {mix.describe()}; measured mean KLD {f.kld_mean:.4g} "
                f"(95 % {f.kld_ci95[0]:.4g} to {f.kld_ci95[1]:.4g})")
    return out


def fewest_bits(reference: nn.Module, run: llm.ReferenceRun, path: Sequence[Mix], kld: float,
                calibration: Sequence[Any] = (), *, tries: int = 4) -> MeasuredMix | None:
    """The fewest-bits mix of ``path`` MEASURED to meet mean KLD ``kld``: from the first mix
    predicted to meet it, each next mix of the path in turn (at most ``tries`` builds); None
    when none of them does."""
    first = cheapest_meeting(path, kld)
    if first is None:
        return None
    start = list(path).index(first)
    for mix in list(path)[start : start + tries]:
        measured = measure_mix(reference, run, mix, calibration,
                               label=f"mixed (search, KLD {kld:g})")
        if measured.fidelity.kld_mean <= kld:
            return measured
    return None


def split_windows(fidelity: TokenFidelity, first: int) -> tuple[TokenFidelity, TokenFidelity]:
    """``fidelity`` over a run's windows as (its first ``first`` windows, the rest)."""
    counts = fidelity.window_tokens
    cut = sum(counts[:first])
    parts = []
    for part, windows in ((slice(0, cut), counts[:first]), (slice(cut, None), counts[first:])):
        parts.append(fidelity_of(fidelity.kld[part], fidelity.nll[part],
                                 fidelity.reference_nll[part], fidelity.top1[part], windows,
                                 fidelity.context))
    return parts[0], parts[1]


def plot_frontier(points: Sequence[MeasuredMix | Mapping[str, Any]], *,
                  uniform: Sequence[tuple[str, float, TokenFidelity | Mapping[str, Any]]] = (),
                  title: str | None = None) -> Any:
    """Measured mean KLD (log scale, bars: 95 % interval) against effective bits per weight:
    the mixes (a line; :class:`MeasuredMix` or its :meth:`~MeasuredMix.row`, e.g. read back
    from ``frontier.csv``) and uniform recipes (``(label, bits, fidelity or its row)``)."""
    fig, ax = new_figure(title or "Accuracy against bits: measured mixed-precision frontier",
                         "effective bits per weight (quantized Linears, scales included)",
                         "mean KL(reference ‖ quantized), nats/token (log scale)",
                         figsize=(7.0, 4.2), yscale="log")

    def bars(row: Mapping[str, Any]) -> tuple[float, list[list[float]]]:
        m = max(float(row["kld_mean"]), 1e-9)
        return m, [[m - max(float(row["kld_lo"]), 1e-9)], [max(float(row["kld_hi"]), 1e-9) - m]]

    rows = [p.row() if isinstance(p, MeasuredMix) else p for p in points]
    ax.plot([float(r["bits"]) for r in rows], [bars(r)[0] for r in rows], "-", color="C0",
            label="mixed (search)")
    for r in rows:
        m, err = bars(r)
        ax.errorbar([float(r["bits"])], [m], yerr=err, fmt="o", color="C0", capsize=3)
    for i, (label, bits, f) in enumerate(uniform):
        m, err = bars(f.row() if isinstance(f, TokenFidelity) else f)
        ax.errorbar([bits], [m], yerr=err, fmt="s", color=f"C{i + 1}", capsize=3, label=label)
    ax.legend(fontsize=8)
    return fig


def save_search(folder: str | Path, table: SensitivityTable, points: Sequence[MeasuredMix],
                chosen: MeasuredMix | None, first_windows: int | None = None) -> list[Path]:
    """Write ``sensitivity.csv`` (the table), ``frontier.csv`` (one row per measured mix: over
    the first ``first_windows`` windows when given, the evaluation part of a study) and
    ``mix.json`` (the chosen mix's formats) into ``folder``."""
    import pandas as pd

    folder = Path(folder)
    written = [table.save_csv(folder / "sensitivity.csv")]
    rows = []
    for p in points:
        f = p.fidelity if first_windows is None else split_windows(p.fidelity, first_windows)[0]
        rows.append(MeasuredMix(p.label, p.mix, f, p.build_seconds).row())
    pd.DataFrame(rows).to_csv(folder / "frontier.csv", index=False)
    written.append(folder / "frontier.csv")
    if chosen is not None:
        (folder / "mix.json").write_text(json.dumps(
            {"label": chosen.label, "bits": chosen.mix.bits, "predicted_kld": chosen.mix.predicted,
             "formats": {k: str(v) for k, v in chosen.mix.formats.items()}}, indent=1) + "\n")
        written.append(folder / "mix.json")
    return written


# ---------------------------------------------------------------------------------------------
# In the study (``nvfp4lab study MODEL --search bits=5.0``)
# ---------------------------------------------------------------------------------------------

#: Tokens of the calibration windows the study's sensitivity is measured on (one window).
SENSITIVITY_TOKENS = 256


@dataclass(frozen=True, eq=False)
class StudySearch:
    """The study's search step: the ``bits`` budget, the sensitivity ``table`` (measured on the
    calibration text), the search ``path``, the measured frontier ``points`` (on the study's
    run: both texts' windows), the ``chosen`` mix at the budget and its ``result`` (a
    :class:`~nvfp4lab.studies.llm_configs.ConfigResult`, one more row of the study's table)."""

    bits: float
    table: SensitivityTable
    path: tuple[Mix, ...] = field(repr=False)
    points: tuple[MeasuredMix, ...]
    chosen: MeasuredMix
    result: Any

    def save(self, folder: str | Path, eval_windows: int | None = None) -> list[Path]:
        """:func:`save_search` into ``folder`` (the frontier over the evaluation part)."""
        return save_search(folder, self.table, self.points, self.chosen, eval_windows)


def check_search_formats(search: float | None, formats: Sequence[str] | None) -> tuple[str, ...]:
    """The study's search formats, checked (default :data:`SEARCH_FORMATS`); ValueError
    for formats without a search or a name not a LayerFormat."""
    if formats is None:
        chosen = tuple(SEARCH_FORMATS)
    else:
        if search is None:
            raise ValueError("--search-formats needs --search bits=B (the budget to search "
                             "under)")
        if isinstance(formats, str):
            formats = [f.strip() for f in formats.split(",") if f.strip()]
        chosen = tuple(str(check_choice("--search-formats entry", f, LayerFormat))
                       for f in formats)
        if not chosen or all(f == LayerFormat.BF16 for f in chosen):
            raise ValueError(f"--search-formats {','.join(formats)!r}: name at least one "
                             "quantized format, e.g. nvfp4-mr-gptq,fp8-w8a16,bf16")
    # the cheapest a mix can be: every layer in the cheapest format (per-tensor terms aside)
    floor = min(layer_bits(f, 1 << 16, 1 << 16) for f in chosen)
    if search is not None and search < floor:
        raise ValueError(f"--search bits={search:g} is below what the formats "
                         f"{','.join(chosen)} can reach ({floor:.2f} bits per weight, every "
                         "layer in the cheapest): raise the budget or add a cheaper format")
    return chosen


def study_search(
    reference: nn.Module, run: llm.ReferenceRun, batches: Sequence[Any], bits: float, *,
    dask: str | None = None, progress: bool = True,
    budgets: Sequence[float] = DEFAULT_FRONTIER, tokens: int = SENSITIVITY_TOKENS,
    formats: Sequence[str] = SEARCH_FORMATS,
) -> StudySearch:
    """The search as the study runs it: sensitivity of ``reference``'s Linears in ``formats``
    on the first ``tokens`` tokens of the calibration ``batches`` (their windows; the Hessians
    from all of them; on the Dask cluster at ``dask`` when given), the path, and the frontier at
    ``budgets`` and ``bits`` built and scored on ``run``. The mix at ``bits`` becomes the row
    ``mixed (search, <bits> bits)``."""
    import sys

    import torch

    from nvfp4lab.studies.llm_configs import ConfigResult, LLMConfig
    from nvfp4lab.studies.llm_sensitivity import sensitivity
    from nvfp4lab.vocab import Backend, QuantMethod

    def say(line: str) -> None:
        if progress:
            print(line, file=sys.stderr, flush=True)

    if not batches:
        raise ValueError("the search needs calibration batches (the study's calibration text)")
    ids = torch.cat([b["input_ids"].reshape(-1) for b in batches])[:tokens]
    context = int(batches[0]["input_ids"].shape[-1])
    say(f"search: sensitivity of every Linear in {', '.join(map(str, formats))} on "
        f"{ids.numel()} calibration tokens")
    sens_run = llm.reference_run(reference, ids, context=min(context, ids.numel()),
                                 progress=False)
    measured = [f for f in formats if f != LayerFormat.BF16]
    table = sensitivity(reference, sens_run, formats=measured, calibration=batches,
                        client=dask, progress=progress)
    path = tuple(search_path(table, reference, formats=formats))
    points = frontier(reference, run, table, (*budgets, bits), batches, formats=formats, say=say)
    mine = best_mix(table, reference, bits, formats=formats)
    chosen = next(p for p in points if dict(p.mix.formats) == dict(mine.formats))
    label = f"mixed (search, {bits:g} bits)"
    chosen = MeasuredMix(label, chosen.mix, chosen.fidelity, chosen.build_seconds)
    rotated = LayerFormat.NVFP4_MR_GPTQ in set(chosen.mix.formats.values())
    config = LLMConfig(label, Backend.W4A16, QuantMethod.GPTQ, rotation=rotated)
    result = ConfigResult(config, chosen.fidelity, chosen.build_seconds)
    return StudySearch(bits, table, path, points, chosen, result)
