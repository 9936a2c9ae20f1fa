"""The calls of a model's repeated blocks: the blocks found, block 0's arguments captured per
calibration batch with the chain checked on one row (step 1 and 2 of the sequential pipeline,
:mod:`nvfp4lab.execution.sequential`, whose docstring says why and how)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from nvfp4lab.execution.calibrate import run_batch

__all__ = [
    "BlockCall",
    "Blocks",
    "EndPass",
    "block_call",
    "block_output",
    "capture_block_inputs",
    "find_blocks",
    "first_row",
    "same_value",
]


class EndPass(Exception):
    """Raised by a hook to end a forward pass early; caught by the module whose hook raised it
    (here and in :mod:`~nvfp4lab.execution.sequential`), never reaching the caller."""


@dataclass(frozen=True)
class Blocks:
    """The repeated blocks: ``modules`` is ``model.get_submodule(name)``, an ``nn.ModuleList``."""

    name: str
    modules: nn.ModuleList

    def index(self, layer: str) -> int | None:
        """The block holding the module named ``layer`` (a full name below a block), or None."""
        prefix = f"{self.name}." if self.name else ""
        if not layer.startswith(prefix):
            return None
        head, dot, _ = layer[len(prefix):].partition(".")
        if not dot or not head.isdigit() or int(head) >= len(self.modules):
            return None
        return int(head)


def find_blocks(model: nn.Module, names: Sequence[str]) -> Blocks | None:
    """The ``nn.ModuleList`` (below or equal to ``model``) whose children hold the most of the
    modules named ``names`` (the outermost one on a tie), or None when none holds any."""
    best: Blocks | None = None
    best_count = 0
    for list_name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        blocks = Blocks(list_name, module)
        count = sum(blocks.index(n) is not None for n in names)
        if count > best_count:
            best, best_count = blocks, count
    return best


def block_output(output: Any) -> torch.Tensor | None:
    """The hidden states a block returns: the tensor itself, or the first element of a tuple or
    list (older transformers blocks return ``(hidden_states, ...)``); None otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _is_cache(value: object) -> bool:
    """A key/value cache object (transformers' ``Cache`` classes and look-alikes)."""
    return not isinstance(value, torch.Tensor) and any(
        "Cache" in klass.__name__ for klass in type(value).__mro__
    )


def _no_cache(value: Any) -> Any:
    return None if _is_cache(value) else value


@dataclass(frozen=True)
class BlockCall:
    """One calibration batch at a block's entrance: the block is called as
    ``block(*args, **kwargs)``, the hidden states (a tensor, e.g. float32 ``[B, T, H]``) at
    ``args[0]`` (``key == 0``) or ``kwargs[key]``. ``batch``: the calibration batch it came from
    (its ``attention_mask`` still describes every block's tokens)."""

    batch: Any
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    key: int | str = 0

    @property
    def hidden(self) -> torch.Tensor:
        """The hidden states passed to the block."""
        value = self.args[0] if self.key == 0 else self.kwargs[str(self.key)]
        assert isinstance(value, torch.Tensor)
        return value

    def with_hidden(self, hidden: torch.Tensor) -> BlockCall:
        """The same call with other hidden states (the next block's call)."""
        if self.key == 0:
            return replace(self, args=(hidden, *self.args[1:]))
        return replace(self, kwargs={**self.kwargs, str(self.key): hidden})

    def run(self, block: nn.Module) -> Any:
        """``block(*args, **kwargs)``."""
        return block(*self.args, **self.kwargs)


def _call_of(batch: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BlockCall | None:
    """A :class:`BlockCall` from a block's arguments, caches switched off; None when no hidden
    states tensor is found (first positional argument, or keyword ``hidden_states``)."""
    clean_args = tuple(_no_cache(a) for a in args)
    clean_kwargs = {k: _no_cache(v) for k, v in kwargs.items()}
    if "use_cache" in clean_kwargs:
        clean_kwargs["use_cache"] = False
    if clean_args and isinstance(clean_args[0], torch.Tensor):
        return BlockCall(batch, clean_args, clean_kwargs, 0)
    if isinstance(clean_kwargs.get("hidden_states"), torch.Tensor):
        return BlockCall(batch, clean_args, clean_kwargs, "hidden_states")
    return None


def block_call(batch: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BlockCall | None:
    """The :class:`BlockCall` of a block called with ``args`` / ``kwargs`` on ``batch``, caches
    switched off as :func:`capture_block_inputs` does; None when no hidden-states tensor is
    found (first positional argument, or keyword ``hidden_states``)."""
    return _call_of(batch, args, kwargs)


def same_value(a: object, b: object) -> bool:
    """The same object, or equal plain values (None, bool, int, float, str)."""
    if a is b:
        return True
    plain = (bool, int, float, str)
    return type(a) is type(b) and isinstance(a, plain) and a == b


def _same_arguments(first: BlockCall, other: BlockCall) -> bool:
    """``other`` passes its block the very same arguments as ``first``, hidden states aside."""
    if len(first.args) != len(other.args) or first.kwargs.keys() != other.kwargs.keys():
        return False
    if first.key != other.key:
        return False
    skip_arg = 0 if first.key == 0 else -1
    return all(
        same_value(a, b) for i, (a, b) in enumerate(zip(first.args, other.args, strict=True))
        if i != skip_arg
    ) and all(same_value(v, other.kwargs[k]) for k, v in first.kwargs.items() if k != first.key)


def _chain_calls(model: nn.Module, blocks: Blocks, batch: Any,
                 orders: dict[int, list[str]] | None = None,
                 watched: Mapping[str, nn.Module] | None = None) -> BlockCall | None:
    """Run ``batch`` up to the last block; the first block's call if the blocks form a chain
    (each called once, in order, on the previous block's output, with the same other
    arguments), else None. ``orders`` (filled when given): block index -> the names of
    ``watched`` modules in the order that block called them (every block but the last, which
    the pass does not run)."""
    n = len(blocks.modules)
    calls: list[tuple[int, BlockCall | None]] = []
    outputs: dict[int, Any] = {}

    def pre(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls.append((index, _call_of(batch, args, kwargs)))
            if index == n - 1:
                raise EndPass

        return hook

    def post(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            outputs.setdefault(index, output)

        return hook

    handles = [b.register_forward_pre_hook(pre(i), with_kwargs=True)
               for i, b in enumerate(blocks.modules)]
    handles += [b.register_forward_hook(post(i)) for i, b in enumerate(blocks.modules)]
    for name, module in (watched or {}).items() if orders is not None else ():
        index = blocks.index(name)
        if index is not None and index < n - 1:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, name=name, i=index: orders.setdefault(i, []).append(name)))
    try:
        with suppress(EndPass):
            run_batch(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    if [i for i, _ in calls] != list(range(n)) or any(c is None for _, c in calls):
        if orders is not None:
            orders.clear()
        return None
    chain = [c for _, c in calls]
    first = chain[0]
    assert first is not None
    for i in range(1, n):
        call = chain[i]
        assert call is not None
        if call.hidden is not block_output(outputs.get(i - 1)) or not _same_arguments(first, call):
            return None
    return first


def first_row(batch: Any) -> Any | None:
    """``batch`` cut to its first row: a tensor ``[B, ...]`` to ``[1, ...]``, and in a mapping,
    tuple or list every tensor whose first dimension is ``B`` (that of its first tensor; e.g.
    ``input_ids`` and ``attention_mask`` ``[B, T]``), the rest as it is; None when there is
    nothing to cut (no tensor, or ``B`` <= 1). A mapping comes back as a dict."""
    if isinstance(batch, torch.Tensor):
        return batch[:1] if batch.dim() and batch.shape[0] > 1 else None
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, tuple | list):
        values = list(batch)
    else:
        return None
    rows = next((v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim()), 0)
    if rows <= 1:
        return None

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            return value[:1]
        return value

    if isinstance(batch, Mapping):
        return {k: cut(v) for k, v in batch.items()}
    cut_values = [cut(v) for v in values]
    return cut_values if isinstance(batch, list) else tuple(cut_values)


def _drop_partial_orders(orders: dict[int, list[str]], blocks: Blocks,
                         watched: Mapping[str, nn.Module]) -> None:
    """Forget the order of every block whose one-row pass did not call all its ``watched``
    modules (an MoE expert no token of the row was routed to): its :class:`BlockRunner` then
    learns the order from the whole first batch, as it would without one."""
    inside: dict[int, set[str]] = {}
    for name in watched:
        index = blocks.index(name)
        if index is not None:
            inside.setdefault(index, set()).add(name)
    for index in [i for i, names in orders.items() if set(names) != inside.get(i, set())]:
        del orders[index]


def capture_block_inputs(
    model: nn.Module, blocks: Blocks, batches: Sequence[Any], *,
    orders: dict[int, list[str]] | None = None,
    watched: Mapping[str, nn.Module] | None = None,
) -> list[BlockCall] | None:
    """One :class:`BlockCall` per batch: the arguments of block 0, caches switched off.

    The first row of the first batch (:func:`first_row`) runs up to the last block to check
    that the blocks form a chain (module docstring); None when they do not, or when a batch never
    reaches block 0. Every batch then runs only up to block 0. One row tells the chain as well
    as the whole batch (the blocks' calls do not depend on the number of rows) at a fraction of
    the cost: 2 s less in each GPTQ of SmolLM2-135M on 4 batches of 8 rows x 256 tokens
    (2 CPU threads). A model that refuses the one-row batch is checked on the whole first batch.
    Memory: the hidden states of every batch at block 0 (e.g. float32 ``[B, T, H]`` each) and
    what the model built for the blocks (masks, position embeddings).

    ``orders`` (a dict, filled when given): block index -> the names of the ``watched``
    modules (name -> module) in the order that block called them in the one-row pass, for
    every block but the last, and only for blocks that called all their ``watched`` modules
    there (not one whose row missed an MoE expert): a :class:`BlockRunner`'s ``order``, so that
    it need not run its block once more to learn it.
    """
    probe = first_row(batches[0])
    try:
        first = _chain_calls(model, blocks, batches[0] if probe is None else probe, orders,
                             watched)
    except Exception:
        if probe is None:
            raise
        probe = None  # the model refuses one row: the whole first batch instead
        if orders is not None:
            orders.clear()
        first = _chain_calls(model, blocks, batches[0], orders, watched)
    if first is None:
        return None
    if probe is not None and orders is not None and watched is not None:
        _drop_partial_orders(orders, blocks, watched)
    calls: list[BlockCall] = []
    found: list[BlockCall | None] = []

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        found.append(_call_of(None, args, kwargs))
        raise EndPass

    handle = blocks.modules[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for batch in batches:
            found.clear()
            with suppress(EndPass):
                run_batch(model, batch)
            if len(found) != 1 or found[0] is None:
                return None
            calls.append(replace(found[0], batch=batch))
    finally:
        handle.remove()
    return calls
