"""SmoothQuant-style scale migration and AWQ-style scale search, folded into stored weights.

A group is a set of Linear layers fed the same input ``x [..., K]`` and the module ``x`` comes
from. Per input channel ``j`` a scale ``s_j > 0`` moves range from the activations to the
weights, ``x W^T = (x / s) (W · s)^T``, and ``1/s`` is folded into the module before, so that
the float model computes the same function (up to float rounding) and only stored weights
change (:func:`smooth_groups` finds the groups of a Llama-style decoder layer):

=================  ==========================  ===========================================
group              scaled inputs of            ``1/s`` folded into
=================  ==========================  ===========================================
``input_norm``     q_proj, k_proj, v_proj      ``input_layernorm.weight``
``post_norm``      gate_proj, up_proj          ``post_attention_layernorm.weight``
``v_proj``         o_proj                      v_proj's output rows (one scale per KV head
                                               channel: the query heads sharing a KV head
                                               share it)
``up_proj``        down_proj                   up_proj's output rows (``act(gate) · up``)
=================  ==========================  ===========================================

A norm group is used only when every member receives the norm's very output tensor in the
calibration pass and the norm's output scales with its weight (Gemma's ``1 + weight`` norm, or
a norm that feeds something else, is skipped and listed in :attr:`SmoothResult.skipped`).

SmoothQuant (``alpha``): ``s_j = max|X_j|^α / max_i |W_ij|^(1-α)`` (``X``: the calibration
inputs, ``W``: the group's weights stacked along N; a channel never seen or all-zero keeps 1).
AWQ-style search: per group the ``α`` of a grid whose scales give the smallest squared error of
the group's outputs, ``Σ_i ||q(x/s Q) q(W_i s Q)ᵀ − x W_iᵀ||²`` on a subsample of calibration
tokens, with the W4A4 options' rotation and block scales (``q``: NVFP4 fake quantization, the
activations only when the backend quantizes them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nvfp4lab.codec import compute_global_scale, fake_quantize
from nvfp4lab.execution.calibrate import run_batch
from nvfp4lab.execution.w4a4_recipes import (
    W4A4Options,
    activation_quantizer,
    global_scale_numerator,
)
from nvfp4lab.hadamard import rotate
from nvfp4lab.orders import ArithmeticOrder
from nvfp4lab.vocab import ScaleSelection

__all__ = ["SmoothGroup", "SmoothResult", "SmoothStatistics", "StatisticsObserver", "group_error",
           "observing_statistics", "smooth_groups", "smooth_model", "smooth_scales",
           "smooth_statistics"]


@dataclass(frozen=True)
class SmoothGroup:
    """``members``: the Linear names whose inputs are scaled (input columns ``· s``);
    ``source``: the module name ``1/s`` folds into; ``kind``: the table's first column;
    ``heads``: ``(n_rep, head_dim)`` of a ``v_proj`` group."""

    kind: str
    source: str
    members: tuple[str, ...]
    heads: tuple[int, int] | None = None


@dataclass
class SmoothResult:
    """What :func:`smooth_model` did: ``alphas`` (first member -> the strength used),
    ``skipped`` (first member -> why), and :meth:`undo` (restores every changed tensor)."""

    alphas: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def keep(self, tensor: torch.Tensor) -> None:
        self.saved.setdefault(id(tensor), (tensor, tensor.detach().clone()))

    def undo(self) -> None:
        """Put every tensor smoothing changed back as it was."""
        with torch.no_grad():
            for tensor, original in self.saved.values():
                tensor.copy_(original)
        self.saved.clear()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def smooth_groups(model: nn.Module, candidates: Mapping[str, nn.Linear]) -> list[SmoothGroup]:
    """The groups of every Llama-style decoder layer (a module with ``input_layernorm``,
    ``self_attn`` and ``post_attention_layernorm``, ``mlp``) whose Linears are all
    ``candidates``, in module order."""
    groups: list[SmoothGroup] = []
    for name, layer in model.named_modules():
        if not all(hasattr(layer, a) for a in ("input_layernorm", "self_attn",
                                                "post_attention_layernorm", "mlp")):
            continue
        attn = _join(name, "self_attn")
        mlp = _join(name, "mlp")
        qkv = tuple(_join(attn, f"{p}_proj") for p in "qkv")
        gate_up = (_join(mlp, "gate_proj"), _join(mlp, "up_proj"))
        o, down = _join(attn, "o_proj"), _join(mlp, "down_proj")
        if all(n in candidates for n in qkv):
            groups.append(SmoothGroup("input_norm", _join(name, "input_layernorm"), qkv))
        if all(n in candidates for n in gate_up):
            groups.append(SmoothGroup("post_norm", _join(name, "post_attention_layernorm"),
                                      gate_up))
        v = qkv[2]
        head_dim = getattr(layer.self_attn, "head_dim", None)
        if (o in candidates and v in candidates and not hasattr(layer.self_attn, "v_norm")
                and isinstance(head_dim, int) and head_dim > 0):
            n_in, n_v = candidates[o].in_features, candidates[v].out_features
            if n_in % n_v == 0 and n_v % head_dim == 0:
                groups.append(SmoothGroup("v_proj", v, (o,), (n_in // n_v, head_dim)))
        if down in candidates and gate_up[1] in candidates and hasattr(layer.mlp, "act_fn"):
            groups.append(SmoothGroup("up_proj", gate_up[1], (down,)))
    return groups


@dataclass
class _Stats:
    amax: torch.Tensor | None = None
    rows: list[torch.Tensor] = field(default_factory=list)
    kept: int = 0
    fed: bool = True


@dataclass(frozen=True)
class SmoothStatistics:
    """One calibration pass over a float model (:func:`smooth_statistics`), per group (by its
    first member's name): the channel max ``|x|`` of the group's input, whether a norm group's
    members received the norm's very output, and, when ``rows``, up to ``tokens`` evenly spaced
    input rows (what AWQ's search reads). ``quantize_model(smooth_statistics=...)`` smooths a
    copy of that model, with the same calibration batches, from them without another pass."""

    by_group: Mapping[str, _Stats] = field(repr=False)
    tokens: int
    rows: bool


def smooth_statistics(model: nn.Module, batches: Sequence[Any], *, tokens: int = 512,
                      rows: bool = False, run: nn.Module | None = None) -> SmoothStatistics:
    """:class:`SmoothStatistics` of every smoothing group of ``model`` (float, not yet
    smoothed or quantized) on ``batches`` (``calibration_batches`` of the calibration text).
    ``tokens`` / ``rows``: keep the rows AWQ needs (``W4A4Options.awq_tokens``). ``run``: the
    module the batches are fed to, if not ``model`` (its decoder, when the batches suit it: the
    output head observes nothing). ValueError when ``model`` has no group."""
    tokens = _check_tokens(tokens)
    return SmoothStatistics(_statistics(model, _groups_of(model), batches, tokens,
                                        keep_rows=rows, run=run), tokens, rows)


class StatisticsObserver:
    """:func:`smooth_statistics` recorded from whatever runs the model (or a part of it, e.g.
    its decoder) over the batches inside ``with observer:`` (which gives the statistics; they
    are complete on exit and stay in :attr:`statistics`), so that another calibration pass on
    the same float model and batches gathers them too (``calibrate_kv_scales(...,
    alongside=observer)``). Made by :func:`observing_statistics`."""

    def __init__(self, model: nn.Module, batches: Sequence[Any], tokens: int, rows: bool) -> None:
        self._setup = (model, _groups_of(model), batches, _check_tokens(tokens), rows)
        self._context: contextlib.AbstractContextManager[dict[str, _Stats]] | None = None
        self.statistics: SmoothStatistics | None = None

    def __enter__(self) -> SmoothStatistics:
        if self._context is not None:
            raise RuntimeError("a StatisticsObserver observes one pass: make another")
        model, groups, batches, tokens, rows = self._setup
        self._context = _observing(model, groups, batches, tokens, rows)
        self.statistics = SmoothStatistics(self._context.__enter__(), tokens, rows)
        return self.statistics

    def __exit__(self, *exc: Any) -> bool | None:
        assert self._context is not None
        return self._context.__exit__(*exc)


def observing_statistics(model: nn.Module, batches: Sequence[Any], *, tokens: int = 512,
                         rows: bool = False) -> StatisticsObserver:
    """A :class:`StatisticsObserver` of ``model`` (float, not yet smoothed or quantized) for
    ``batches``, with :func:`smooth_statistics`' ``tokens`` / ``rows``. ValueError when
    ``model`` has no group."""
    return StatisticsObserver(model, batches, tokens, rows)


def _check_tokens(tokens: object) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"smooth_statistics tokens must be a positive int (rows kept for AWQ, "
                         f"as W4A4Options.awq_tokens), got {tokens!r}")
    return tokens


def _groups_of(model: nn.Module) -> list[SmoothGroup]:
    groups = smooth_groups(model, {n: m for n, m in model.named_modules()
                                   if isinstance(m, nn.Linear)})
    if not groups:
        raise _no_groups(model)
    return groups


def _no_groups(model: nn.Module) -> ValueError:
    return ValueError(
        f"W4A4Options smoothing found no Llama-style decoder layer in {type(model).__name__} "
        "(input_layernorm -> q/k/v_proj, post_attention_layernorm -> gate/up_proj): drop "
        "smooth_alpha / awq for this model")


def _given(statistics: SmoothStatistics, groups: Sequence[SmoothGroup],
           options: W4A4Options) -> Mapping[str, _Stats]:
    """``statistics`` checked against the groups and options of one :func:`smooth_model`."""
    if not isinstance(statistics, SmoothStatistics):
        raise TypeError(f"smooth_statistics must be a SmoothStatistics, got "
                        f"{type(statistics).__name__}")
    if options.awq and (not statistics.rows or statistics.tokens != options.awq_tokens):
        raise ValueError(
            f"AWQ searches on {options.awq_tokens} calibration rows, these statistics keep "
            f"{statistics.tokens if statistics.rows else 'no'} rows: compute them with "
            f"smooth_statistics(model, batches, tokens={options.awq_tokens}, rows=True)")
    if not any(st.amax is not None for st in statistics.by_group.values()):
        raise ValueError(
            "these smooth_statistics saw no input: the pass they observed did not run this "
            "model's layers (observe the model the batches run through, or its decoder)")
    missing = [g.members[0] for g in groups if g.members[0] not in statistics.by_group]
    if missing:
        raise ValueError(
            f"smooth_statistics hold nothing for {missing[0]!r} ({len(missing)} group(s) "
            "missing): they were computed on another model; compute them on this model's float "
            "original with smooth_statistics(model, batches)")
    return statistics.by_group


def _statistics(model: nn.Module, groups: Sequence[SmoothGroup], batches: Sequence[Any],
                tokens: int, *, keep_rows: bool = True, run: nn.Module | None = None
                ) -> dict[str, _Stats]:
    """One pass over ``batches`` (fed to ``run``, default ``model``) under :func:`_observing`."""
    with _observing(model, groups, batches, tokens, keep_rows) as stats, torch.no_grad():
        for batch in batches:
            run_batch(model if run is None else run, batch)
    return stats


@contextlib.contextmanager
def _observing(model: nn.Module, groups: Sequence[SmoothGroup], batches: Sequence[Any],
               tokens: int, keep_rows: bool) -> Iterator[dict[str, _Stats]]:
    """While inside, every forward of ``model``'s groups records, per group: the channel max
    ``|x|`` of its input, up to ``tokens`` input rows evenly spaced over ``batches``' tokens
    (when ``keep_rows``), and whether every member of a norm group received the norm's very
    output. The hooks go on exit."""
    total = sum(int(b["input_ids"].numel()) for b in batches
                if isinstance(b, Mapping) and isinstance(b.get("input_ids"), torch.Tensor))
    step = max(1, total // tokens) if total else 1
    stats = {g.members[0]: _Stats() for g in groups}
    outputs: dict[str, torch.Tensor] = {}  # each norm's latest output
    handles = []

    def norm_hook(source: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if isinstance(out, torch.Tensor):
                outputs[source] = out
        return hook

    def member_hook(group: SmoothGroup, first: bool) -> Callable[..., None]:
        st = stats[group.members[0]]

        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor):
                return
            if group.kind.endswith("norm") and x is not outputs.get(group.source):
                st.fed = False
            if not first:
                return
            x2d = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
            amax = x2d.abs().amax(dim=0)
            st.amax = amax if st.amax is None else torch.maximum(st.amax, amax)
            if keep_rows and st.kept < tokens:
                rows = x2d[::step][: tokens - st.kept]
                st.rows.append(rows.clone())
                st.kept += rows.shape[0]
        return hook

    try:
        for g in groups:
            if g.kind.endswith("norm"):
                handles.append(model.get_submodule(g.source).register_forward_hook(
                    norm_hook(g.source)))
            for i, m in enumerate(g.members):
                handles.append(model.get_submodule(m).register_forward_pre_hook(
                    member_hook(g, i == 0)))
        yield stats
    finally:
        for h in handles:
            h.remove()
        outputs.clear()


def smooth_scales(xmax: torch.Tensor, wmax: torch.Tensor, alpha: float,
                  heads: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 ``[K]`` scales ``xmax^α / wmax^(1-α)`` (1 where either is 0); with ``heads``
    ``(n_rep, head_dim)`` the channels of the query heads sharing a KV head take one scale
    (their maxima first)."""
    xmax, wmax = xmax.to(torch.float32), wmax.to(torch.float32)
    if heads is not None:
        n_rep, hd = heads
        xmax = xmax.view(-1, n_rep, hd).amax(dim=1)
        wmax = wmax.view(-1, n_rep, hd).amax(dim=1)
    ok = (xmax > 0) & (wmax > 0)
    s = xmax.clamp(min=1e-12) ** alpha / wmax.clamp(min=1e-12) ** (1.0 - alpha)
    s = torch.where(ok & torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    if heads is not None:
        s = s[:, None, :].expand(-1, heads[0], -1).reshape(-1)
    return s


def group_error(x: torch.Tensor, weights: Sequence[torch.Tensor], s: torch.Tensor,
                options: W4A4Options, order: str | ArithmeticOrder, quantize_inputs: bool
                ) -> float:
    """``Σ_i ||q(x/s Q) q(W_i s Q)ᵀ − x W_iᵀ||²`` (float32): the group's output error with
    scales ``s`` (module docstring). ``x``: ``[T, K]``; ``weights``: ``[N_i, K]``."""
    xs = x / s
    ws = [w.to(torch.float32) * s for w in weights]
    if options.rotation is not None:
        block = options.block_for(x.shape[-1])
        xs = rotate(xs, options.seed, block=block)
        ws = [rotate(w, options.seed, block=block) for w in ws]
    if quantize_inputs:
        xs = activation_quantizer(options, order)(xs)
    numerator = global_scale_numerator(options.weight_scales)
    gs = torch.stack([compute_global_scale(w, order=order, numerator=numerator)
                      for w in ws]).min(dim=0).values
    extra = ({} if options.weight_scales == ScaleSelection.AMAX
             else {"scale_selection": options.weight_scales})
    err = 0.0
    for w, wq in zip(weights, ws, strict=True):
        ref = x @ w.to(torch.float32).T
        err += float(((xs @ fake_quantize(wq, gs, order=order, **extra).T) - ref).square().sum())
    return err


def _work(t: torch.Tensor) -> torch.dtype:
    """The arithmetic dtype of a fold: float64 for float64 tensors, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _fold(model: nn.Module, group: SmoothGroup, s: torch.Tensor, result: SmoothResult) -> str:
    """Scale the members' input columns by ``s`` and fold ``1/s`` into the source; returns ''
    or why the group was left as it was."""
    source = model.get_submodule(group.source)
    with torch.no_grad():
        if group.kind.endswith("norm"):
            weight = getattr(source, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.shape != s.shape:
                return "the norm has no weight of one value per channel"
            probe = torch.randn(2, s.numel(), generator=torch.Generator().manual_seed(0))
            probe = probe.to(device=weight.device, dtype=weight.dtype)
            before = source(probe).to(torch.float32)
            result.keep(weight)
            weight.copy_((weight.to(_work(weight)) / s.to(weight.device)).to(weight.dtype))
            after = source(probe).to(torch.float32) * s.to(weight.device)
            tol = 1e-3 if weight.dtype == torch.float32 else 3e-2
            if not torch.allclose(after, before, rtol=tol, atol=tol * float(before.abs().max())):
                weight.copy_(result.saved.pop(id(weight))[1])
                return "the norm's output does not scale with its weight"
        else:
            rows = s if group.heads is None else s.view(-1, *group.heads)[:, 0, :].reshape(-1)
            for t in (source.weight, source.bias):
                if t is None:
                    continue
                result.keep(t)
                r = rows.to(t.device)
                t.copy_((t.to(_work(t)) / (r[:, None] if t.ndim == 2 else r)).to(t.dtype))
        for m in group.members:
            w = model.get_submodule(m).weight
            result.keep(w)
            w.copy_((w.to(_work(w)) * s.to(w.device)).to(w.dtype))
    return ""


def smooth_model(model: nn.Module, candidates: Mapping[str, nn.Linear], batches: Sequence[Any],
                 options: W4A4Options, order: str | ArithmeticOrder, *,
                 quantize_inputs: bool = True,
                 statistics: SmoothStatistics | None = None) -> SmoothResult:
    """Fold SmoothQuant (``options.smooth_alpha``) or AWQ-searched (``options.awq``) scales into
    ``model`` in place (module docstring); ValueError when the model has no group. On any
    error the model is put back as it was. ``statistics``: :func:`smooth_statistics` of the
    float model this one copies, on ``batches``, used instead of a pass over them."""
    groups = smooth_groups(model, candidates)
    if not groups:
        raise _no_groups(model)
    stats = (_statistics(model, groups, batches, options.awq_tokens, keep_rows=options.awq)
             if statistics is None else _given(statistics, groups, options))
    result = SmoothResult()
    try:
        for group in groups:
            st = stats[group.members[0]]
            key = group.members[0]
            if st.amax is None:
                result.skipped[key] = "no calibration input reached it"
                continue
            if group.kind.endswith("norm") and not st.fed:
                result.skipped[key] = "its layers are not fed the norm's output"
                continue
            weights = [candidates[m].weight.detach().to(torch.float32) for m in group.members]
            wmax = torch.cat(weights).abs().amax(dim=0)
            if options.awq:
                x = torch.cat(st.rows)
                errors = {a: group_error(x, weights, smooth_scales(st.amax, wmax, a, group.heads),
                                         options, order, quantize_inputs)
                          for a in options.awq_grid}
                alpha = min(errors, key=lambda a: errors[a])
            else:
                assert options.smooth_alpha is not None
                alpha = float(options.smooth_alpha)
            why = _fold(model, group, smooth_scales(st.amax, wmax, alpha, group.heads), result)
            if why:
                result.skipped[key] = why
            else:
                result.alphas[key] = alpha
    except BaseException:
        result.undo()
        raise
    return result
