"""The study behind ``notebooks/03_throughput.ipynb``: modeled and measured throughput.

Three kinds of numbers never mix here; every table has a ``source`` column and every plotted
series says which it is:

- **modeled**: :func:`nvfp4lab.roofline.predict` roofline estimates from published peaks and
  stated efficiency factors (:data:`nvfp4lab.roofline.EFFICIENCY` per path, overridden per GPU
  by :data:`nvfp4lab.roofline.GPU_EFFICIENCY` where a GPU has its own published measurement);
- **measured**: rows of the ``results/*.csv`` shards written by ``nvfp4lab bench``, read
  through the one results store (:func:`nvfp4lab.bench.store.read_shards`);
- **published measured**: figures other people measured and published, each with its source
  and what it includes (:data:`nvfp4lab.roofline.PUBLISHED`), checked against the roofline.

Roofline paths are named after the backends, so a backend choice IS its modeled path; a measured
``linear`` row's backend is its path, and the 16-bit ``matmul`` baseline is the ``bf16`` path.

pandas and matplotlib are imported inside the functions (the ``notebooks`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from nvfp4lab import gpus, roofline
from nvfp4lab.execution.dispatch import select_backend
from nvfp4lab.execution.vllm_rules import SEED_RELEASE
from nvfp4lab.execution.vllm_select import LINEAR_BACKEND_EMULATION
from nvfp4lab.plots import new_figure
from nvfp4lab.roofline import PATHS, NotSupportedError
from nvfp4lab.settings import EMULATION_ENV
from nvfp4lab.studies.explorer import Outputs, explorer, table_output, text_output
from nvfp4lab.vocab import GemmPath, VllmAlias

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "MODELLED_PATHS",
    "REPRESENTATIVE_GPUS",
    "SWITCH_COLUMN",
    "absent_note",
    "absent_reason",
    "backend_frame",
    "block_frame",
    "catalogue_frame",
    "chosen_path_speedup",
    "efficiency_frame",
    "layer_frame",
    "measured_linear_summary",
    "measured_path",
    "measured_vs_modeled",
    "plot_block_times",
    "plot_chosen_speedup",
    "plot_measured",
    "plot_published_vs_modeled",
    "published_frame",
    "published_table",
    "roofline_caption",
    "roofline_explorer",
    "roofline_table",
    "speedup_caption",
]

#: One GPU per generation/segment, for figures that cannot show all fourteen.
REPRESENTATIVE_GPUS: tuple[str, ...] = (
    "A100 SXM 80GB",
    "L4",
    "H100 SXM",
    "B200",
    "B300",
    "RTX 5090",
)

#: The catalogue figure (:class:`nvfp4lab.gpus.GPU` field) whose peak each path runs at.
_PEAK_FIGURE = {GemmPath.BF16: "bf16_tflops", GemmPath.W4A16: "bf16_tflops",
                GemmPath.EMULATION: "bf16_tflops", GemmPath.FP8: "fp8_tflops",
                GemmPath.NATIVE: "nvfp4_tflops"}  # fmt: skip
#: The paths this study models: those whose peak the catalogue holds (not llama.cpp's q8_0,
#: which runs on INT8 math; roofline.predict models it given ``peak_tflops``).
MODELLED_PATHS: tuple[str, ...] = tuple(p for p in PATHS if p in _PEAK_FIGURE)

_EMULATION_ENV = {EMULATION_ENV: "1"}
#: The column of the seed's switch: the seed's rules (vLLM 0.9.2), since 0.24.0 ignores it.
SWITCH_COLUMN = f"with {EMULATION_ENV}=1 (vLLM {SEED_RELEASE}, seed)"


def catalogue_frame(with_sources: bool = False) -> pd.DataFrame:
    """The GPU catalogue as a table (dense peaks, TFLOPS; memory GB; bandwidth TB/s).

    ``with_sources``: one row per (GPU, figure) with its source string instead.
    """
    import pandas as pd

    if with_sources:
        return pd.DataFrame(gpus.sources_table())
    return pd.DataFrame([g.as_dict() for g in gpus.CATALOGUE.values()]).set_index("name")


def efficiency_frame(gpu_names: Iterable[str] | None = None) -> pd.DataFrame:
    """The efficiency factors :func:`nvfp4lab.roofline.predict` uses by default, per GPU and path
    it can model, with their sources; ``own_measurement`` is True where the GPU's own published
    rate replaces the path default (:func:`nvfp4lab.roofline.efficiency_for`)."""
    import pandas as pd

    rows = []
    for g in (gpus.get(n) for n in (gpu_names or gpus.CATALOGUE)):
        for path in roofline.supported_paths(g):
            e = roofline.efficiency_for(g, path)
            rows.append(
                {
                    "source": "modeled",
                    "gpu": g.name,
                    "path": path,
                    "compute": e.compute,
                    "memory": e.memory,
                    "own_measurement": (g.name, path) in roofline.GPU_EFFICIENCY,
                    "compute_source": e.compute_source,
                    "memory_source": e.memory_source,
                }
            )
    return pd.DataFrame(rows)


def backend_frame(gpu_names: Iterable[str] | None = None) -> pd.DataFrame:
    """Which NVFP4 backend :func:`~nvfp4lab.execution.dispatch.select_backend` picks on each GPU
    (by its capability, clean environment, the latest vLLM rules), the vLLM kernel it stands
    for, and why; plus the path with the emulation switch on under the seed's rules
    (:data:`SWITCH_COLUMN`; the latest rules ignore the switch) and with its replacement,
    ``--linear-backend emulation``."""
    import pandas as pd

    rows = []
    for g in (gpus.get(n) for n in (gpu_names or gpus.CATALOGUE)):
        choice = select_backend(capability=g.capability, env={})
        seed = select_backend(capability=g.capability, env=_EMULATION_ENV, vllm=VllmAlias.SEED)
        flag = select_backend(capability=g.capability, env={},
                              linear_backend=LINEAR_BACKEND_EMULATION)
        rows.append(
            {
                "gpu": g.name,
                "capability": g.capability_str,
                "native_fp4": g.native_fp4,
                "backend": choice.name,
                "modeled_path": choice.name,
                "vllm_kernel": choice.kernel,
                SWITCH_COLUMN: seed.name,
                "with --linear-backend emulation": flag.name,
                "reason": choice.reason,
            }
        )
    return pd.DataFrame(rows).set_index("gpu")


def _modeled_rows(
    predict: Callable[[str, int], roofline.Prediction],
    paths: Sequence[str],
    ms: Sequence[int],
    **keys: Any,
) -> list[dict[str, Any]]:
    """One "modeled" row per (path, M) that ``predict(path, M)`` can model, led by ``keys``."""
    rows = []
    for path in paths:
        for m in ms:
            try:
                p = predict(path, m)
            except NotSupportedError:
                continue
            rows.append(
                {
                    "source": "modeled",
                    **keys,
                    "path": path,
                    "M": m,
                    "time_s": p.time_s,
                    "bound": p.bound,
                    "tflops": p.tflops,
                    "bytes": p.bytes_moved,
                }
            )
    return rows


def block_frame(
    models: Sequence[str] = ("Llama-3-8B", "Llama-3-70B"),
    gpu_names: Iterable[str] | None = None,
    ms: Sequence[int] | None = None,
    paths: Sequence[str] = MODELLED_PATHS,
) -> pd.DataFrame:
    """Modeled time of the linear layers of ONE transformer block (q/k/v, o, gate/up, down),
    per GPU, model, path and M (tokens); paths a GPU cannot run are absent."""
    import pandas as pd

    grid = list(ms or roofline.default_m_grid())
    rows = []
    for model in models:
        for g in (gpus.get(n) for n in (gpu_names or gpus.CATALOGUE)):

            def block(path: str, m: int, g: gpus.GPU = g, model: str = model) -> Any:
                return roofline.predict_block(g, model, m, path)

            keys = {"gpu": g.name, "architecture": g.architecture, "model": model}
            rows += _modeled_rows(block, paths, grid, **keys)
    return pd.DataFrame(rows)


def layer_frame(
    model: str, gpu_name: str, ms: Sequence[int] | None = None,
    paths: Sequence[str] = MODELLED_PATHS,
) -> pd.DataFrame:
    """Modeled time per linear layer of ``model`` on one GPU (rows: layer, path, M)."""
    import pandas as pd

    grid = list(ms or roofline.default_m_grid())
    rows = []
    for s in roofline.linear_shapes(model):

        def layer(path: str, m: int, s: roofline.LinearShape = s) -> Any:
            return roofline.predict(gpu_name, m, s.N, s.K, path)

        rows += _modeled_rows(layer, paths, grid, layer=s.layer, N=s.N, K=s.K)
    return pd.DataFrame(rows)




def absent_reason(gpu: str, path: str) -> str | None:
    """Why the roofline cannot model ``path`` on ``gpu`` (None when it can), from the catalogue:
    no FP4 tensor cores, or the peak the path runs at is missing (its source says why)."""
    g = gpus.get(gpu)
    p = GemmPath(path)
    if p == GemmPath.NATIVE and not g.native_fp4:
        return f"no FP4 tensor cores, cc {g.capability_str}"
    if p not in _PEAK_FIGURE:
        return "INT8 dense peak: not in the catalogue"
    figure = _PEAK_FIGURE[p]
    if getattr(g, figure) is not None:
        return None
    source = g.sources.get(figure, "")
    why = source.rsplit(": ", 1)[-1] if ": " in source else "not in the catalogue"
    return f"{figure.split('_')[0].upper()} dense peak: {why}"


def absent_note(gpu_names: Iterable[str], paths: Sequence[str] = MODELLED_PATHS) -> str:
    """One sentence per GPU naming the paths it lacks and why ("" when none lacks any):
    ``"DGX Spark (GB10): no bf16, w4a16, emulation (BF16 dense peak unpublished)"``."""
    parts = []
    for name in gpu_names:
        by_reason: dict[str, list[str]] = {}
        for path in paths:
            why = absent_reason(name, path)
            if why is not None:
                by_reason.setdefault(why, []).append(str(path))
        if by_reason:
            said = "; ".join(f"no {', '.join(ps)} ({why})" for why, ps in by_reason.items())
            parts.append(f"{gpus.get(name).name}: {said}")
    return ". ".join(parts) + ("." if parts else "")


def _caption(fig: Any, text: str) -> None:
    """``text`` under the axes, wrapped to the figure's width (constrained layout makes room)."""
    import textwrap

    if text:
        width = int(fig.get_figwidth() * 14)  # ~14 characters of 7-pt text per inch
        fig.supxlabel(textwrap.fill(text, width), fontsize=7, ha="left", x=0.01)


def chosen_path_speedup(blocks: pd.DataFrame) -> pd.DataFrame:
    """Modeled speedup over BF16 (t_bf16 / t_path) of the path each GPU's backend choice takes,
    from a :func:`block_frame` table; GPUs without a BF16 figure are dropped."""
    choice = backend_frame(blocks["gpu"].unique())["modeled_path"]
    base = blocks[blocks["path"] == GemmPath.BF16].set_index(["gpu", "model", "M"])["time_s"]
    rows = blocks[blocks["path"] == blocks["gpu"].map(choice)].set_index(["gpu", "model", "M"])
    out = rows.join(base.rename("bf16_time_s"), how="inner")
    out["speedup_vs_bf16"] = out["bf16_time_s"] / out["time_s"]
    return out.reset_index()[
        ["source", "gpu", "model", "M", "path", "time_s", "bf16_time_s", "speedup_vs_bf16", "bound"]
    ]


# --------------------------------------------------------------------------------------------
# measured rows
# --------------------------------------------------------------------------------------------

def published_frame() -> pd.DataFrame:
    """The PUBLISHED measurements (:data:`nvfp4lab.roofline.PUBLISHED`), each beside the
    roofline for the same GPU, path and shape: ``modeled_tflops`` with the default efficiencies
    and ``ideal_tflops`` with every efficiency at 1 (a ceiling; ``beats_ideal`` flags a figure
    above it). Shapeless figures (a model's mix, an mma loop) have no modeled columns."""
    import pandas as pd

    rows = []
    for m in roofline.PUBLISHED:
        row: dict[str, Any] = {
            "source": "published measured",
            "gpu": m.gpu,
            "path": str(m.path),
            "shape": f"{m.M}x{m.N}x{m.K}" if m.M is not None else "",
            "published_tflops": m.tflops,
            "activation_quant": m.activation_quant,
            "sets_efficiency": m.sets_efficiency,
        }
        if m.time_s is not None:
            quant = m.activation_quant == "yes"
            model = roofline.predict(m.gpu, m.M, m.N, m.K, m.path, quantize_activations=quant)
            ideal = roofline.predict(m.gpu, m.M, m.N, m.K, m.path, efficiency=1.0,
                                     mem_efficiency=1.0, quantize_activations=quant)
            row |= {
                "modeled_tflops": model.tflops,
                "published/modeled": m.tflops / model.tflops,
                "ideal_tflops": ideal.tflops,
                "beats_ideal": m.time_s < ideal.time_s,
            }
        rows.append(row | {"reference": m.source, "caveat": m.caveat})
    return pd.DataFrame(rows)


def published_table(published: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """:func:`published_frame` as a narrow table (index gpu, path, shape; TFLOPS columns with
    short names; ``flags``: sets an efficiency, above the ideal roofline; a ``note`` number) and
    the numbered caveats that ``note`` points to (the long text moved out of the table)."""
    import pandas as pd

    notes: list[str] = []
    numbers = []
    for caveat in published["caveat"].fillna(""):
        if caveat and caveat not in notes:
            notes.append(caveat)
        numbers.append(notes.index(caveat) + 1 if caveat else "")
    table = pd.DataFrame({
        "gpu": published["gpu"], "path": published["path"], "shape": published["shape"],
        "published": published["published_tflops"],
        "modeled": published.get("modeled_tflops"),
        "ideal": published.get("ideal_tflops"),
        "pub/mod": published.get("published/modeled"),
        "act. quant": published["activation_quant"],
        "flags": [", ".join(f for f, on in (("sets efficiency", se is True),
                                              ("above ideal", bi is True)) if on)
                  for se, bi in zip(published["sets_efficiency"],
                                    published.get("beats_ideal", [None] * len(published)),
                                    strict=True)],
        "note": numbers,
    }).set_index(["gpu", "path", "shape"])
    return table, [f"[{i}] {n}" for i, n in enumerate(notes, 1)]


def plot_published_vs_modeled(published: pd.DataFrame) -> Figure:
    """PUBLISHED measured TFLOPS against the MODELED (roofline) TFLOPS of the same GEMM."""
    fig, ax = new_figure(
        "Published measurements vs the roofline (same GPU, path, shape)",
        "modeled: roofline with default efficiencies (TFLOPS, log scale)",
        "published measured (TFLOPS, log scale)",
        xscale="log",
        yscale="log",
    )
    d = published.dropna(subset=["modeled_tflops"])
    for i, ((gpu, path), g) in enumerate(d.groupby(["gpu", "path"], sort=False)):
        ax.scatter(g["modeled_tflops"], g["published_tflops"], color=f"C{i % 10}",
                   label=f"{gpu} {path} (published)")
    lo = min(d["modeled_tflops"].min(), d["published_tflops"].min()) / 1.5
    hi = max(d["modeled_tflops"].max(), d["published_tflops"].max()) * 1.5
    ax.plot([lo, hi], [lo, hi], color="0.4", linewidth=0.8, label="published = modeled")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the points
    fig.set_layout_engine("constrained")
    return fig


def measured_path(op: str, backend: str) -> str | None:
    """The roofline path a measured row stands for: a ``linear`` row's backend, ``bf16`` for the
    16-bit ``matmul`` baseline, None for the elementwise ops."""
    if op == "linear":
        return backend
    return GemmPath.BF16 if op == "matmul" else None


def measured_linear_summary(measured: pd.DataFrame) -> pd.DataFrame:
    """Measured ``linear``/``matmul`` rows: median time per (machine, dtype, shape, backend),
    TFLOP/s, and time relative to the 16-bit matmul baseline of the same shape (× slower).
    Rows of the fused kernels (``path == "fused"``) and of the default settings (``path ==
    "default"``) count as their own backends, ``"<backend> (fused)"`` / ``"<backend>
    (default)"``, so the pipelines are never merged."""
    import pandas as pd

    if measured.empty or "op" not in measured:
        return pd.DataFrame()
    lin = measured[measured["op"].isin(["linear", "matmul"])].copy()
    if lin.empty:
        return pd.DataFrame()
    lin["backend"] = lin["backend"].where(lin["op"] == "linear", "matmul (16-bit)")
    path = lin["path"] if "path" in lin else pd.Series("", index=lin.index)
    path = path.fillna("").astype(str)
    own = ~path.isin(["", "eager"])
    lin["backend"] = lin["backend"].where(~own, lin["backend"] + " (" + path + ")")
    keys = ["machine", "device_name", "dtype", "shape", "M", "N", "K", "backend"]
    agg = lin.groupby(keys, as_index=False).agg(
        median_s=("median_s", "median"), tflop_s=("tflop_s", "median"), runs=("median_s", "size")
    )
    base = agg[agg["backend"] == "matmul (16-bit)"].set_index(keys[:-1])["median_s"]
    agg = agg.join(base.rename("matmul_s"), on=keys[:-1])
    agg["x_matmul_time"] = agg["median_s"] / agg["matmul_s"]
    agg.insert(0, "source", "measured")
    return agg.drop(columns="matmul_s").sort_values(["machine", "N", "K", "M", "backend"])


def measured_vs_modeled(measured: pd.DataFrame) -> pd.DataFrame:
    """Measured linear/matmul rows next to the roofline prediction for the same GPU, shape and
    path, for shards whose device is a catalogued GPU (CPU shards have no model: excluded).
    Columns ``measured_s`` and ``modeled_s`` are labelled; ``measured/modeled`` is their ratio."""
    import pandas as pd

    if measured.empty or "op" not in measured:
        return pd.DataFrame()
    rows = []
    for _, r in measured[measured["op"].isin(["linear", "matmul"])].iterrows():
        cap = str(r.get("capability", "") or "")
        if not cap:
            continue
        major, _, minor = cap.partition(".")
        g = gpus.match_device_name(str(r["device_name"]), (int(major), int(minor or 0)))
        path = measured_path(str(r["op"]), str(r["backend"]))
        if g is None or path is None:
            continue
        try:
            p = roofline.predict(g, int(r["M"]), int(r["N"]), int(r["K"]), path)
        except NotSupportedError:
            continue
        rows.append(
            {
                "gpu": g.name,
                "shape": r["shape"],
                "dtype": r["dtype"],
                "path": path,
                "measured_s": r["median_s"],
                "modeled_s": p.time_s,
                "measured/modeled": r["median_s"] / p.time_s,
                "modeled_bound": p.bound,
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------


def plot_block_times(
    blocks: pd.DataFrame, model: str, gpu_names: Sequence[str] = REPRESENTATIVE_GPUS
) -> Figure:
    """MODELED time of one transformer block's linear layers vs M, one panel per GPU, one line
    per path (log-log)."""
    import matplotlib.pyplot as plt

    n = len(gpu_names)
    cols = 3 if n > 4 else n
    rows = -(-n // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.0 * cols, 3.2 * rows), squeeze=False, sharex=True
    )
    fig.suptitle(f"Modeled (roofline): linear layers of one {model} block vs tokens M")
    sub = blocks[blocks["model"] == model]
    handles: dict[str, Any] = {}
    for ax, name in zip(axes.flat, gpu_names, strict=False):
        g = sub[sub["gpu"] == gpus.get(name).name]
        for i, path in enumerate(MODELLED_PATHS):
            d = g[g["path"] == path]
            if not d.empty:
                (line,) = ax.plot(d["M"], d["time_s"] * 1e6, color=f"C{i}")
                handles.setdefault(f"{path} (modeled)", line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("tokens M (rows of x)")
        ax.set_ylabel("time per block (µs, modeled)")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    # the legend right of the panels: the footnote of the paths not drawn takes the bottom edge
    fig.legend(list(handles.values()), list(handles), loc="outside right upper")
    note = absent_note(gpu_names)
    _caption(fig, f"Paths not drawn — {note}" if note else "")
    return fig


def plot_chosen_speedup(speedup: pd.DataFrame, model: str) -> Figure:
    """MODELED speedup over BF16 of the path each GPU takes, vs M, one line per GPU."""
    import matplotlib.pyplot as plt

    fig, ax = new_figure(
        f"Modeled speedup over BF16 of each GPU's NVFP4 path, {model} block",
        "tokens M (rows of x, log₂ axis)",
        "speedup vs BF16 (×, modeled; >1 is faster)",
        figsize=(9.0, 4.2),
    )
    sub = speedup[speedup["model"] == model]
    for i, (name, d) in enumerate(sub.groupby("gpu", sort=False)):
        style = "-" if d["path"].iloc[0] == GemmPath.NATIVE else "--"
        ax.plot(
            d["M"],
            d["speedup_vs_bf16"],
            style,
            color=plt.get_cmap("tab20")(i % 20),
            label=f"{name}: {d['path'].iloc[0]}",
        )
    ax.axhline(1.0, color="0.4", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _caption(fig, speedup_caption(speedup, model))
    return fig


def speedup_caption(speedup: pd.DataFrame, model: str) -> str:
    """The GPUs of the catalogue that :func:`plot_chosen_speedup` leaves out, and why."""
    shown = set(speedup[speedup["model"] == model]["gpu"])
    missing = [n for n in gpus.CATALOGUE if gpus.get(n).name not in shown]
    if not missing:
        return ""
    why = "; ".join(
        f"{gpus.get(n).name} ({absent_reason(n, GemmPath.BF16) or 'not in the block table'})"
        for n in missing
    )
    return f"Not shown (a speedup needs a BF16 time): {why}."


def plot_measured(summary: pd.DataFrame) -> Figure:
    """MEASURED time of each linear backend relative to the 16-bit matmul of the same shape."""
    fig, ax = new_figure(
        "Measured: NVFP4 linear time relative to the 16-bit matmul (same shape, same machine)",
        "shape M×N×K",
        "time / matmul time (×, measured; log axis)",
    )
    d = summary[summary["backend"] != "matmul (16-bit)"]
    labels = list(dict.fromkeys(d["shape"]))
    for i, ((machine, backend), g) in enumerate(d.groupby(["machine", "backend"], sort=False)):
        x = [labels.index(s) for s in g["shape"]]
        ax.scatter(x, g["x_matmul_time"], color=f"C{i % 8}", label=f"{backend} on {machine}")
    ax.axhline(1.0, color="0.4", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the points
    fig.set_layout_engine("constrained")
    return fig


# --------------------------------------------------------------------------------------------
# explorer


def roofline_caption(gpu: str, model: str, m: int) -> str:
    """Which path ``gpu``'s backend choice takes, and what the table shows."""
    choice = select_backend(capability=gpus.get(gpu).capability, env={})
    note = absent_note([gpu])
    missing = f" Columns absent: {note.split(': ', 1)[1]}" if note else ""
    return (
        f"{gpu}: backend {choice.name!r} → roofline path {choice.name!r}.{missing} "
        f"Modeled (roofline) time per linear layer of one {model} block at M = {m}, µs:"
    )


def roofline_table(gpu: str, model: str, m: int) -> pd.DataFrame:
    """Modeled time (µs) per linear layer (rows, plus the block total) and path (columns);
    paths ``gpu`` cannot run are absent."""
    frame = layer_frame(model, gpu, ms=[m])
    table = frame.pivot(index="layer", columns="path", values="time_s") * 1e6
    layers = [s.layer for s in roofline.linear_shapes(model)]
    table = table.reindex(index=layers, columns=[p for p in MODELLED_PATHS if p in table.columns])
    counts = {s.layer: s.count for s in roofline.linear_shapes(model)}
    table.loc["block total"] = table.mul(list(counts.values()), axis=0).sum()
    table.columns.name = "path"
    return table


def roofline_explorer(
    models: Sequence[str], m_grid: Sequence[int], *, gpu: str = "B200"
) -> ipywidgets.VBox:
    """GPU, model and tokens M → modeled time of each linear layer per path (notebook 03)."""
    import ipywidgets as widgets

    names = list(gpus.CATALOGUE)
    if not models or not m_grid:
        raise ValueError(f"need at least one model and one M, got {models!r} and {m_grid!r}")
    g = widgets.Dropdown(options=names, value=gpus.get(gpu).name, description="GPU")
    model = widgets.Dropdown(options=list(models), description="model")
    m = widgets.SelectionSlider(
        options=list(m_grid), value=m_grid[len(m_grid) // 2], description="tokens M"
    )

    def render() -> Outputs:
        return (text_output(roofline_caption(g.value, model.value, m.value), f"{g.value}, "
                f"{model.value}, M = {m.value}: modeled time per linear layer and path"),
                table_output(roofline_table(g.value, model.value, m.value), "{:.4g}",
                             "modeled time (µs) per linear layer (rows) and path (columns)"))

    return explorer(widgets, [g, model, m], render)
