"""Inside a decoder LLM under NVFP4: per-layer weight, activation and K/V error, where the
outlier channels sit, and what a quantized KV cache does to the attention scores (notebook 07).

Everything is measured on one forward pass of the float model over ``ids`` (token ids
``[1, T]``, e.g. the first 512 tokens of the evaluation text), against that float model. For
SmolLM2 the float model is the one dequantized from the shipped Q4_1 GGUF: every error here is
relative to those Q4_1-dequantized weights, not to the original bfloat16 release.

* :func:`linear_rows`: per Linear layer, the weight's NMSE under NVFP4 (round to nearest, its own
  tensor scale), its input activations' NMSE under NVFP4 with a dynamic per-tensor scale (the
  W4A4 emulation's activation quantizer), the inputs' crest factor (amax / RMS) and their
  loudest channel (index, and its RMS over the median channel's RMS).
* :func:`kv_rows`: per layer, KV head and KV cache kind, the NMSE of K and of V as the cache
  gives them back (:func:`~nvfp4lab.execution.kv_cache.fake_quantize_kv`, vLLM 0.33's default
  DECODE scale 1.0), and their effect on attention: the mean KL divergence (nats) between each
  query's attention distribution with the float K and with the cached K (causal, the query
  heads of the group), and the NMSE of the attention output ``softmax(q Kᵀ/√d) V``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nvfp4lab import metrics
from nvfp4lab.codec import fake_quantize
from nvfp4lab.execution.attention import observe_attention
from nvfp4lab.execution.kv_cache import fake_quantize_kv
from nvfp4lab.vocab import KVCacheKind

__all__ = ["attention_effect", "channel_outliers", "kv_rows", "linear_rows", "plot_kv",
           "plot_linear", "short_name"]


def short_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``3.q_proj``; other names unchanged."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts):
            return f"{parts[i + 1]}.{parts[-1]}"
    return name


def channel_outliers(x: torch.Tensor) -> tuple[int, float, float]:
    """``x [..., K]``: (index of the channel with the largest RMS, that RMS over the median
    channel's RMS, crest factor amax / RMS of the whole tensor)."""
    flat = x.detach().reshape(-1, x.shape[-1]).double()
    rms = flat.pow(2).mean(dim=0).sqrt()
    top = int(rms.argmax())
    median = float(rms.median())
    whole = float(flat.pow(2).mean().sqrt())
    return (top, float(rms[top]) / median if median > 0 else math.inf,
            float(flat.abs().max()) / whole if whole > 0 else math.inf)


@torch.no_grad()
def linear_rows(model: nn.Module, ids: torch.Tensor, *, skip: Sequence[str] = ("lm_head",)
                ) -> list[dict[str, Any]]:
    """One row per ``nn.Linear`` of ``model`` (module order; names ending in ``skip`` left out),
    from one forward pass over ``ids [1, T]``: ``weight_nmse`` (NVFP4 RTN, kernel order, the
    weight's own tensor scale), ``activation_nmse`` (NVFP4 of the layer's input with a dynamic
    per-tensor scale), ``activation_crest`` and ``weight_crest`` (amax / RMS), the input's
    loudest channel ``top_channel`` and ``channel_ratio`` (its RMS / the median channel's)."""
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and not any(n.endswith(s) for s in skip)]
    inputs: dict[str, dict[str, Any]] = {}

    def hook_for(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            top, ratio, crest = channel_outliers(x)
            inputs[name] = {"activation_nmse": metrics.nmse(x, fake_quantize(x)),
                            "activation_crest": crest, "top_channel": top,
                            "channel_ratio": ratio}
        return hook

    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    rows = []
    for index, name in enumerate(names):
        w = modules[name].weight.detach()
        _, _, w_crest = channel_outliers(w)
        rows.append({"index": index, "layer": name, "short": short_name(name),
                     "k": w.shape[1], "n": w.shape[0],
                     "weight_nmse": metrics.nmse(w, fake_quantize(w)), "weight_crest": w_crest,
                     **inputs[name]})
    return rows


def attention_effect(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor,
                     v_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q [heads, T, d]`` over ``k, v [kv_heads, T, d]`` (each KV head
    serving ``heads / kv_heads`` consecutive query heads) against the same with ``k_hat`` /
    ``v_hat``, in float64: per query head, (mean over queries of KL(p ‖ p̂) in nats, NMSE of the
    attention output), where p = softmax(q kᵀ / √d) over the keys at or before the query."""
    heads, t, d = q.shape
    group = heads // k.shape[0]

    def expand(z: torch.Tensor) -> torch.Tensor:
        return z.double().repeat_interleave(group, dim=0)

    causal = torch.ones(t, t, dtype=torch.bool).tril()
    qd = q.double()

    def attend(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (qd @ expand(keys).transpose(1, 2)) / math.sqrt(d)
        logp = scores.masked_fill(~causal, -math.inf).log_softmax(dim=-1)
        return logp, logp.exp() @ expand(values)

    logp, out = attend(k, v)
    logp_hat, out_hat = attend(k_hat, v_hat)
    kl = (logp.exp() * (logp - logp_hat)).masked_fill(~causal, 0.0).sum(dim=-1).mean(dim=-1)
    err = (out - out_hat).pow(2).sum(dim=(1, 2)) / out.pow(2).sum(dim=(1, 2))
    return kl, err


@torch.no_grad()
def kv_rows(model: nn.Module, ids: torch.Tensor,
            kinds: Sequence[str] = tuple(k.value for k in KVCacheKind),
            scale: float = 1.0) -> list[dict[str, Any]]:
    """One row per (layer, KV head, kind) from one forward pass of the float ``model`` over
    ``ids [1, T]`` (post-RoPE Q, K, V captured with
    :func:`~nvfp4lab.execution.attention.observe_attention`): ``k_nmse``, ``v_nmse`` of the
    cache's read-back (``scale``: the DECODE scale of both sides, vLLM 0.33's default 1.0),
    ``k_amax``, and from :func:`attention_effect` averaged over the group's query heads:
    ``score_kl`` (nats per query) and ``output_nmse``."""
    captured: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def keep(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        captured.append((int(module.layer_idx), q[0].detach(), k[0].detach(), v[0].detach()))

    with observe_attention(model, keep):
        model(ids, use_cache=False)
    rows = []
    for layer, q, k, v in captured:
        kv_heads = k.shape[0]
        group = q.shape[0] // kv_heads
        for kind in kinds:
            k_hat = fake_quantize_kv(k, kind, scale)
            v_hat = fake_quantize_kv(v, kind, scale)
            kl, err = attention_effect(q, k, v, k_hat, v_hat)
            for head in range(kv_heads):
                mine = slice(head * group, (head + 1) * group)
                rows.append({"layer": layer, "kv_head": head, "kind": str(kind),
                             "k_nmse": metrics.nmse(k[head], k_hat[head]),
                             "v_nmse": metrics.nmse(v[head], v_hat[head]),
                             "k_amax": float(k[head].abs().max()),
                             "score_kl": float(kl[mine].mean()),
                             "output_nmse": float(err[mine].mean())})
    return rows


def plot_linear(rows: Sequence[dict[str, Any]]) -> Any:
    """Per decoder layer, the NVFP4 NMSE of each projection's weight and input activations
    (top), and the loudest input channel's RMS over the median channel's (bottom, log)."""
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10.0, 6.5), sharex=True)
    fig.suptitle("SmolLM2: NVFP4 error per Linear layer, and where the outlier channels sit")
    top.set(ylabel="NMSE vs float (unitless)")
    bottom.set(xlabel="decoder layer")
    # one line per distinct input: projections fed the same tensor (q/k/v, gate/up) share it
    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in rows:
        layer, kind = r["short"].split(".", 1)
        series.setdefault(kind, []).append((int(layer), r["activation_nmse"], r["channel_ratio"]))
    groups: dict[str, list[str]] = {}
    for kind, points in series.items():
        same = next((g for g in groups if series[g] == points), None)
        groups.setdefault(same or kind, []).append(kind)
    for i, (kind, members) in enumerate(groups.items()):
        xs, nmse, ratio = zip(*series[kind], strict=True)
        label = "/".join(members)
        top.plot(xs, nmse, marker=".", color=f"C{i}", label=f"{label} input")
        bottom.plot(xs, ratio, marker=".", color=f"C{i}", label=label)
    weights = {}
    for r in rows:
        weights.setdefault(int(r["short"].split(".")[0]), []).append(r["weight_nmse"])
    top.plot(list(weights), [sum(v) / len(v) for v in weights.values()], color="black", lw=2,
             ls="--", label="weights (mean)")
    top.legend(fontsize=7, ncols=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    # two short lines: one long label ran past the panel onto the top panel's tick labels
    bottom.set(yscale="log", ylabel="loudest / median input\nchannel RMS (ratio, log)")
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_kv(rows: Sequence[dict[str, Any]], quantity: str = "score_kl") -> Any:
    """``quantity`` of :func:`kv_rows` per layer (rows) and KV head (columns), one panel per
    cache kind, one colour scale (log) for all."""
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    layers = max(r["layer"] for r in rows) + 1
    heads = max(r["kv_head"] for r in rows) + 1
    values = [r[quantity] for r in rows if r[quantity] > 0]
    norm = mcolors.LogNorm(vmin=min(values), vmax=max(values))
    units = {"score_kl": "attention KL (nats per query)", "k_nmse": "K NMSE",
             "v_nmse": "V NMSE", "output_nmse": "attention output NMSE"}
    fig, grid_axes = plt.subplots(1, len(kinds), figsize=(3.0 * len(kinds) + 1.5, 6.0),
                                  sharey=True, squeeze=False)
    axes = list(grid_axes.flat)
    fig.suptitle(f"SmolLM2 KV cache: {units.get(quantity, quantity)} per layer and KV head")
    axes[0].set_ylabel("decoder layer")
    image = None
    for ax, kind in zip(axes, kinds, strict=True):
        grid = torch.full((layers, heads), float("nan"))
        for r in rows:
            if r["kind"] == kind:
                grid[r["layer"], r["kv_head"]] = r[quantity]
        image = ax.imshow(grid.numpy(), aspect="auto", norm=norm, cmap="viridis")
        ax.set(title=kind, xticks=range(heads), xlabel="KV head")
    fig.colorbar(image, ax=axes, label=units.get(quantity, quantity))
    return fig
