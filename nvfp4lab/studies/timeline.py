"""The study behind ``notebooks/06_vllm_timeline.ipynb``: what each vLLM release does with NVFP4.

Rows come from :func:`nvfp4lab.execution.dispatch.select_backend` applying the rules of every
modelled release (:data:`nvfp4lab.execution.vllm_rules.MODELLED_RELEASES`, 0.9.1 to 0.33.0) to
every catalogue GPU (:mod:`nvfp4lab.gpus`) and to the ROCm, XPU and CPU platforms, under a few
scenarios (the switches people set). Nothing is measured: a row says which kernel vLLM's code
would pick (or that it picks none), the numerics class of that kernel, what happens to the
bias, and what nvfp4lab runs in its place. :func:`llama_cpp_rows` puts llama.cpp's path on each
target beside vLLM's latest kernel (``select_backend(engine="llama.cpp")``). The second part
shows the bias bug's modern twin:
:func:`nvfp4lab.execution.shared_scales.merge_error` on seeded q/k/v shards whose global scales
differ.
Figures are returned (matplotlib imported inside the ``plot_*`` functions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nvfp4lab import gpus
from nvfp4lab.codec import quantize
from nvfp4lab.execution import llama_cpp_rules, vllm_rules
from nvfp4lab.execution.dispatch import select_backend
from nvfp4lab.execution.shared_scales import MERGED_FORMATS, merge_error
from nvfp4lab.execution.vllm_select import LINEAR_BACKEND_EMULATION, no_kernel_text
from nvfp4lab.plots import legend_outside, new_figure
from nvfp4lab.settings import BATCH_INVARIANT_ENV, EMULATION_ENV
from nvfp4lab.studies.explorer import Outputs, explorer, table_output, text_output
from nvfp4lab.vocab import BiasMode, Engine, Numerics, Platform, Scheme

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = [
    "NUMERICS_ORDER",
    "SCENARIOS",
    "Scenario",
    "bias_windows",
    "choice_text",
    "kernel_table",
    "llama_cpp_rows",
    "merge_demo",
    "platform_rows",
    "plot_merge_error",
    "plot_timeline",
    "timeline_explorer",
    "timeline_rows",
    "variable_table",
]


@dataclass(frozen=True)
class Scenario:
    """One way of launching vLLM: environment, ``--linear-backend`` and checkpoint scheme."""

    name: str
    env: Mapping[str, str]
    linear_backend: str | None = None
    scheme: str = Scheme.NVFP4

    def flag_for(self, release: str) -> str | None:
        """The flag where the release has ``--linear-backend`` (0.22.0+), else None."""
        has_flag = vllm_rules.version(release) >= vllm_rules.version("0.22.0")
        return self.linear_backend if has_flag else None


#: The scenarios of the notebook: a clean launch, the seed's switch, its replacement flag,
#: batch-invariant mode and a weight-only checkpoint.
SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("default", {}),
        Scenario(f"{EMULATION_ENV}=1", {EMULATION_ENV: "1"}),
        Scenario(f"--linear-backend {LINEAR_BACKEND_EMULATION}", {},
                 linear_backend=LINEAR_BACKEND_EMULATION),
        Scenario(f"{BATCH_INVARIANT_ENV}=1", {BATCH_INVARIANT_ENV: "1"}),
        Scenario(f"{Scheme.NVFP4A16} checkpoint", {}, scheme=Scheme.NVFP4A16),
    )
}

#: Numerics classes in plotting order; "none" = vLLM selects no kernel.
NUMERICS_ORDER: tuple[str, ...] = (
    Numerics.NATIVE, Numerics.EMULATION, Numerics.W4A8, Numerics.W4A16, "none"
)
_COLOURS = {Numerics.NATIVE: "#1b9e77", Numerics.EMULATION: "#d95f02", Numerics.W4A8: "#e6ab02",
            Numerics.W4A16: "#7570b3", "none": "#bbbbbb"}  # fmt: skip


def _row(release: str, scenario: Scenario, **target: Any) -> dict[str, Any]:
    choice = select_backend(
        env=dict(scenario.env), vllm=release, linear_backend=scenario.flag_for(release),
        scheme=scenario.scheme, **target,
    )
    return {
        "release": release,
        "era": choice.era,
        "scenario": scenario.name,
        "platform": choice.platform,
        "kernel": choice.kernel or "none",
        "numerics": choice.numerics or "none",
        "nvfp4lab": choice.name,
        "bias": choice.bias or "",
        "defect": choice.defect or "",
        "ignored": "; ".join(choice.ignored),
        "error": (choice.error or "").strip().split("\n")[0],
    }


def timeline_rows(
    releases: Sequence[str] | None = None,
    gpu_names: Sequence[str] | None = None,
    scenarios: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One row per (release, CUDA GPU, scenario): kernel, numerics, bias, what nvfp4lab runs,
    the variables ignored and vLLM's error where it selects no kernel."""
    rows = []
    for name in gpu_names or list(gpus.CATALOGUE):
        g = gpus.get(name)
        for rel in releases or vllm_rules.MODELLED_RELEASES:
            for sc in scenarios or list(SCENARIOS):
                row = _row(rel, SCENARIOS[sc], capability=g.capability)
                rows.append({"gpu": g.name, "capability": g.capability_str, **row})
    return rows


def platform_rows(
    releases: Sequence[str] | None = None, scenarios: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """The same for the ROCm (an MI300-class cc 9.4), XPU and CPU platforms."""
    targets = {
        Platform.ROCM: {"capability": (9, 4), "platform": Platform.ROCM},
        Platform.XPU: {"device": "cpu", "platform": Platform.XPU},
        Platform.CPU: {"device": "cpu", "platform": Platform.CPU},
    }
    rows = []
    for plat, target in targets.items():
        for rel in releases or vllm_rules.MODELLED_RELEASES:
            for sc in scenarios or list(SCENARIOS):
                rows.append({"target": plat.value, **_row(rel, SCENARIOS[sc], **target)})
    return rows


def llama_cpp_rows(gpu_names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One row per catalogue GPU (then CPU): vLLM's kernel under its latest modelled release and
    llama.cpp's path (:mod:`nvfp4lab.execution.llama_cpp_rules`), each with its numerics and
    what nvfp4lab runs for it, with a clean environment."""
    targets: list[tuple[str, str, dict[str, Any]]] = [
        (g.name, g.capability_str, {"capability": g.capability})
        for g in (gpus.get(n) for n in (gpu_names or list(gpus.CATALOGUE)))
    ]
    targets.append((Platform.CPU.value, "", {"device": "cpu", "platform": Platform.CPU}))
    rows = []
    for name, capability, where in targets:
        vllm = select_backend(env={}, **where)
        llama = select_backend(env={}, engine=Engine.LLAMA_CPP, **where)
        rows.append({
            "target": name,
            "capability": capability,
            "vLLM kernel": (vllm.kernel or "none").replace("NvFp4LinearKernel", ""),
            "vLLM numerics": vllm.numerics or "none",
            "nvfp4lab for vLLM": vllm.name,
            "llama.cpp path": next(p.title for p in llama_cpp_rules.PATHS
                                   if p.kernel == llama.kernel),
            "llama.cpp numerics": llama.numerics,
            "nvfp4lab for llama.cpp": llama.name,
        })
    return rows


def bias_windows(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Releases whose rows show each defect: ``{"bias dropped": [...], "wrong weights": [...]}``
    (the 0.9.1 fallback; the 0.16-0.19 emulation dividing by the decode scale)."""
    found: dict[str, list[str]] = {"bias dropped": [], "wrong weights": []}
    for r in rows:
        key = "bias dropped" if r["bias"] == BiasMode.DROPPED else (
            "wrong weights" if r["defect"] else None)
        if key and r["release"] not in found[key]:
            found[key].append(r["release"])
    return found


def variable_table() -> list[dict[str, str]]:
    """When each modelled vLLM variable is read, and what replaced it (with sources)."""
    rows = []
    for var in vllm_rules.VARIABLES.values():
        later = [r for r in vllm_rules.MODELLED_RELEASES if var.last and
                 vllm_rules.version(r) > vllm_rules.version(var.last)]
        rows.append({
            "variable": var.name,
            "first read": var.first,
            "last read": var.last or "still read (0.33.0)",
            "ignored from": later[0] if later else "",
            "instead": var.replacement,
            "source": var.source,
        })
    return rows


def _grid(rows: Sequence[Mapping[str, Any]], scenario: str) -> tuple[list[str], list[str], Any]:
    releases = list(dict.fromkeys(r["release"] for r in rows))
    labels = list(dict.fromkeys(f"{r['gpu']} ({r['capability']})" for r in rows))
    grid = [[NUMERICS_ORDER.index("none")] * len(releases) for _ in labels]
    for r in rows:
        if r["scenario"] == scenario:
            y = labels.index(f"{r['gpu']} ({r['capability']})")
            grid[y][releases.index(r["release"])] = NUMERICS_ORDER.index(r["numerics"])
    return releases, labels, grid


def _span(releases: Sequence[str]) -> str:
    if not releases:
        return "not in this scenario"
    return releases[0] if len(releases) == 1 else f"{releases[0]}..{releases[-1]}"


def plot_timeline(rows: Sequence[Mapping[str, Any]], scenario: str = "default") -> Figure:
    """Release (x) by GPU (y), coloured by the numerics class of vLLM's kernel under
    ``scenario``; the bias-dropping window and the wrong-weights window are shaded."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    releases, labels, grid = _grid(rows, scenario)
    fig, ax = new_figure(f"vLLM's NVFP4 kernel class per release — {scenario}",
                         "vLLM release (PyPI order)", "GPU (compute capability)",
                         figsize=(12, 5))
    cmap = ListedColormap([_COLOURS[n] for n in NUMERICS_ORDER])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(NUMERICS_ORDER) - 1, aspect="auto",
              interpolation="nearest")
    hatches = {"bias dropped": "////", "wrong weights": "xx"}
    for r in rows:  # hatch exactly the cells hit by a defect
        if r["scenario"] != scenario or not (r["bias"] == BiasMode.DROPPED or r["defect"]):
            continue
        hatch = hatches["bias dropped" if r["bias"] == BiasMode.DROPPED else "wrong weights"]
        x = releases.index(r["release"])
        y = labels.index(f"{r['gpu']} ({r['capability']})")
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch=hatch, lw=0))
    windows = bias_windows([r for r in rows if r["scenario"] == scenario])
    ax.set_xticks(range(len(releases)), releases, rotation=90, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    handles = [Patch(color=_COLOURS[n], label=str(n)) for n in NUMERICS_ORDER]
    handles += [Patch(fill=False, hatch=hatches[k], label=f"{k}: {_span(v)}")
                for k, v in windows.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.set_layout_engine("constrained")  # not tight_layout: the style starts constrained
    return fig


def merge_demo(
    seed: int = 0,
    amax: Mapping[str, float] | None = None,
    n: int = 64,
    k: int = 256,
    m: int = 16,
) -> list[dict[str, Any]]:
    """Seeded q/k/v shards (``[n, k]`` each, N(0,1) rescaled to the given ``amax``, each
    quantized with its own global scale) and activations ``[m, k]``: the exact cost of vLLM's
    max-merge per shard, for both checkpoint formats vLLM merges (rows of :func:`merge_error`)."""
    amax = dict(amax or {"q_proj": 1.0, "k_proj": 2.0, "v_proj": 4.0})
    g = torch.Generator().manual_seed(seed)
    shards = {}
    for name, a in amax.items():
        w = torch.randn(n, k, generator=g)
        shards[name] = quantize(w / w.abs().max() * a)
    x = torch.randn(m, k, generator=g)
    rows = []
    for fmt in MERGED_FORMATS:
        for r in merge_error(shards, fmt, activations=x):
            rows.append({"format": fmt.value, "amax": amax[r.shard], **r.as_dict()})
    return rows


def plot_merge_error(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Output SQNR (dB) per shard after the merge, one bar group per checkpoint format."""
    fig, ax = new_figure("Fused q/k/v with unshared global scales: vLLM's max-merge",
                         "shard (its weight amax)",
                         "output SQNR vs own scale (dB, higher = better)")
    formats = list(dict.fromkeys(r["format"] for r in rows))
    shards = list(dict.fromkeys(r["shard"] for r in rows))
    width = 0.8 / len(formats)
    finite = [r["output_sqnr_db"] for r in rows if r["output_sqnr_db"] not in (None, float("inf"))]
    cap = (max(finite) if finite else 0.0) + 10.0
    for j, fmt in enumerate(formats):
        values = []
        for s in shards:
            v = next(r["output_sqnr_db"] for r in rows if r["format"] == fmt and r["shard"] == s)
            values.append(cap if v == float("inf") else v)
        xs = [i + (j - (len(formats) - 1) / 2) * width for i in range(len(shards))]
        ax.bar(xs, values, width, label=f"{fmt} (exact shard drawn at {cap:.0f} dB)")
    amax = {r["shard"]: r["amax"] for r in rows}
    ax.set_xticks(range(len(shards)), [f"{s} ({amax[s]:g})" for s in shards])
    legend_outside(ax, fontsize=8)
    return fig


def choice_text(release: str, target: str, scenario: str, width: int = 100) -> str:
    """The full reason of one decision: ``target`` is a catalogue GPU name or a platform.
    Lines are wrapped at ``width`` characters, one rule step or clause per line."""
    import textwrap

    sc = SCENARIOS[scenario]
    where: dict[str, Any] = {"device": "cpu", "platform": target}
    if target in gpus.CATALOGUE:
        where = {"capability": gpus.get(target).capability}
    elif target == Platform.ROCM:
        where = {"capability": (9, 4), "platform": Platform.ROCM}
    choice = select_backend(env=dict(sc.env), vllm=release, linear_backend=sc.flag_for(release),
                            scheme=sc.scheme, **where)
    kernel = choice.kernel or (
        f"no kernel — {no_kernel_text(choice.error or '', choice.platform)}")
    lines = [f"vLLM {choice.vllm} ({choice.era}) on {target}, {scenario}:"]
    lines += textwrap.wrap(f"kernel: {kernel}", width, initial_indent="  ",
                           subsequent_indent="      ")
    lines.append(f"  numerics: {choice.numerics}, bias: {choice.bias}, "
                 f"nvfp4lab runs: {choice.name}")
    clauses = choice.reason.split("; ")
    for i, clause in enumerate(clauses):
        first = "  reason: " if i == 0 else "    "
        lines += textwrap.wrap(clause + (";" if i < len(clauses) - 1 else ""), width,
                               initial_indent=first, subsequent_indent="      ")
    return "\n".join(lines)


def kernel_table(rows: Sequence[Mapping[str, Any]], column: str = "gpu") -> Any:
    """A narrow table of vLLM's kernel: one column per ``column`` value (``"gpu"`` for
    :func:`timeline_rows`, ``"target"`` for :func:`platform_rows`), one row per scenario and
    run of consecutive releases with the same kernels (``"0.9.1–0.9.2"``); kernel class names
    without their ``NvFp4LinearKernel``/``LinearKernel`` suffix."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    wide = frame.pivot_table(index=["scenario", "release"], columns=column, values="kernel",
                             aggfunc="first")
    wide = wide.replace(regex="NvFp4LinearKernel|LinearKernel", value="")
    order = list(dict.fromkeys(frame["release"]))
    out, index = [], []
    for scenario in dict.fromkeys(frame["scenario"]):
        part = wide.loc[scenario].reindex(order)
        start = 0
        for i in range(1, len(order) + 1):
            if i == len(order) or not part.iloc[i].equals(part.iloc[start]):
                span = order[start] if i - 1 == start else f"{order[start]}–{order[i - 1]}"
                index.append((scenario, span))
                out.append(part.iloc[start])
                start = i
    table = pd.DataFrame(out, columns=list(dict.fromkeys(frame[column])))
    table.index = pd.MultiIndex.from_tuples(index, names=["scenario", "releases"])
    table.columns.name = column
    return table


def timeline_explorer(releases: Sequence[str] | None = None) -> ipywidgets.VBox:
    """Release, target (GPU or platform) and scenario → vLLM's choice and the rule steps."""
    import ipywidgets as widgets
    import pandas as pd

    rels = list(releases or vllm_rules.MODELLED_RELEASES)
    # starts at the first release, so dragging right walks forward in time
    rel = widgets.SelectionSlider(options=rels, value=rels[0], description="vLLM")
    targets = [*gpus.CATALOGUE, *(p.value for p in (Platform.ROCM, Platform.XPU, Platform.CPU))]
    target = widgets.Dropdown(options=targets, value="H100 SXM", description="target")
    scenario = widgets.Dropdown(options=list(SCENARIOS), description="scenario")

    def render() -> Outputs:
        gpu_rows = [r for r in timeline_rows([rel.value], None, [scenario.value])]
        table = pd.DataFrame(gpu_rows)[["gpu", "capability", "kernel", "numerics", "nvfp4lab"]]
        return (text_output(choice_text(rel.value, target.value, scenario.value),
                            f"vLLM {rel.value} on {target.value}, {scenario.value}: its pick and "
                            "every rule step"),
                table_output(table.set_index("gpu"), title=f"vLLM {rel.value}, "
                             f"{scenario.value}: the pick on every catalogued GPU"))

    return explorer(widgets, [rel, target, scenario], render)
